# The two set-up commands (README quick start):  make tutorial   |   make test
# PYTHON: the interpreter to build .venv with (3.12 or 3.13); empty = tools/find-python searches.
PYTHON ?=
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Extra arguments for the series runner, e.g. make tutorial ARGS="--profile cpu -p train_iters=500"
ARGS   ?=
PYTEST_ARGS ?=

.PHONY: install tutorial test test-quick test-gpu lab clean-runs install-ngc venv-python gpu-check gpu-smoke check wheelhouse book solutions pack unpack container-check

# NGC: the route of make install. Empty = detected (tools/ngc_requirements.py route: NVIDIA_PYTORCH_VERSION,
# which NVIDIA's NGC PyTorch containers set); NGC=1 forces the container's packages, NGC=0 PyPI's.
NGC ?=

# Runs every time, before anything is installed: an existing .venv must be Python 3.12/3.13
# (one left from the 3.11 series is refused, not touched) and fit the route (made over the container's
# site-packages inside NGC, not outside); a missing one is created with the interpreter tools/find-python
# picks, or make stops with its message and creates nothing. Inside the NGC container the venv sees the
# container's torch, Transformer Engine and Apex (--system-site-packages) and uses its pip (--without-pip).
venv-python:
	@if [ -e $(VENV) ]; then \
	    v=$$($(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null); \
	    case "$$v" in 3.12|3.13) ;; *) \
	        if [ -n "$$v" ]; then made="Python $$v"; else made="an interpreter that no longer runs ($(PY))"; fi; \
	        echo "$(VENV) was made with $$made; the series needs 3.12 or 3.13 (megatron-core 0.19.2)." >&2; \
	        echo "Remove it and rerun: rm -rf $(VENV) && make $(MAKECMDGOALS)" >&2; exit 1;; esac; \
	    NGC="$(NGC)" $(PY) tools/ngc_requirements.py route --venv $(VENV) >/dev/null || exit 1; \
	else \
	    py=$$(PYTHON="$(PYTHON)" tools/find-python) || exit 1; \
	    route=$$(NGC="$(NGC)" $$py tools/ngc_requirements.py route) || exit 1; \
	    if [ "$$route" = ngc ]; then \
	        echo "Creating $(VENV) with $$py ($$($$py --version)) over the container's site-packages"; \
	        $$py -m venv --system-site-packages --without-pip $(VENV) || exit 1; \
	    else \
	        echo "Creating $(VENV) with $$py ($$($$py --version))"; \
	        $$py -m venv $(VENV) || exit 1; \
	    fi; \
	fi

# WHEELHOUSE: a folder of every pinned wheel (make wheelhouse); when it exists, or with OFFLINE=1,
# make install reads only it (pip --no-index), so a room of laptops installs from a USB stick.
WHEELHOUSE ?= wheelhouse
OFFLINE ?=
# PLATFORMS: other machines' pip platform tags to add to the wheelhouse, e.g. "manylinux_2_28_aarch64"
# (torch's and megatron-core's Linux wheels are manylinux_2_28; megatron-core has no macOS wheel)
PLATFORMS ?=

# The NGC route installs only the pins the container lacks (tools/ngc_requirements.py plan): never torch nor
# anything its PIP_CONSTRAINT file pins, with its torch / Transformer Engine / Apex held at their versions (pip -c).
$(VENV)/.installed: requirements.txt pyproject.toml | venv-python
	@if [ "$$(NGC="$(NGC)" $(PY) tools/ngc_requirements.py route 2>/dev/null)" = ngc ]; then \
	    $(PY) tools/ngc_requirements.py plan requirements.txt --out-dir $(VENV) || exit 1; \
	    if [ -d $(WHEELHOUSE) ] || [ -n "$(OFFLINE)" ]; then links="--no-index --find-links $(WHEELHOUSE)"; else links=; fi; \
	    $(PY) -m pip install --disable-pip-version-check -q $$links -c $(VENV)/constraints-ngc.txt \
	        -r $(VENV)/requirements-ngc.txt || exit 1; \
	    $(PY) -m pip install --disable-pip-version-check -q --no-deps -e . || exit 1; \
	elif [ -d $(WHEELHOUSE) ] || [ -n "$(OFFLINE)" ]; then \
	    echo "Installing from $(WHEELHOUSE)/ without a network (pip --no-index)"; \
	    $(PY) tools/wheelhouse.py install --python $(PY) --wheelhouse $(WHEELHOUSE) || exit 1; \
	else \
	    $(PY) -m pip install --disable-pip-version-check -q -r requirements.txt || exit 1; \
	    $(PY) -m pip install --disable-pip-version-check -q --no-deps -e . || exit 1; \
	fi
	@touch $@

# Every pinned wheel (and their dependencies) for this machine and PLATFORMS into WHEELHOUSE (3.3 GB for
# Linux x86-64). WHEELHOUSE_PYTHON: the Python of the PLATFORMS' laptops (this machine's: the .venv's).
WHEELHOUSE_PYTHON ?= 3.12
wheelhouse: venv-python
	$(PY) tools/wheelhouse.py download --dest $(WHEELHOUSE) --python-version $(WHEELHOUSE_PYTHON) $(foreach p,$(PLATFORMS),--platform $(p))

install: venv-python $(VENV)/.installed

tutorial: install
	$(PY) -m helpers.runner.series run $(ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

# The contributors' quick tier: the unit tests, without the notebooks end to end and the training jobs.
test-quick: install
	$(PY) -m pytest -m "not slow and not trains" $(PYTEST_ARGS)

# The GPU tests alone, with the GPUs visible (every other session hides them: tests/conftest.py).
test-gpu: install
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

lab: install
	$(PY) -m jupyter lab notebooks/

RUN ?= runs/latest
# The exercises' solutions (notebooks/solutions/) against a run (default runs/latest), executed into
# RUN/executed/solutions/; each solution asserts its answer. ONLY="01 03" for some notebooks only;
# WORKERS: notebooks at a time (2 overlaps the kernels' start-up on 2 cores).
ONLY ?=
WORKERS ?= 2
solutions: install
	$(PY) -m helpers.runner.series solutions --run-dir $(RUN) --workers $(WORKERS) $(if $(ONLY),--only $(ONLY))

# The executed notebooks of a run (default runs/latest) as a static HTML site: RUN/book/index.html.
book: install
	$(PY) -m helpers.runner.book $(RUN)

# A finished run folder (default runs/latest) as one archive for other clones: an instructor packs the run
# once, slow laptops unpack it and the notebooks skip training (helpers/runner/run_pack.py; no packages needed).
#   make pack [RUN=runs/<name>] [PACK=/media/usb/run.tar.gz]   -> runs/<name>.tar.gz, prints its size
#   make unpack PACK=<file.tar.gz> [AS=<folder>]   -> runs/<name>/ (or runs/<folder>/), + runs/latest when there is none
PACK ?=
# AS, not NAME: WSL sets NAME to the machine's name in every shell
AS ?=
pack: venv-python
	$(PY) -m helpers.runner.run_pack pack $(RUN) $(if $(PACK),--out $(PACK))

unpack: venv-python
	@test -n "$(PACK)" || { echo "make unpack PACK=<file.tar.gz>: name the archive made by make pack" >&2; exit 2; }
	$(PY) -m helpers.runner.run_pack unpack $(PACK) $(if $(AS),--name $(AS))

# The CPU container's install (docker/cpu.Dockerfile runs tools/container-install.sh) resolved for linux/amd64
# and linux/arm64 without installing anything (pip --dry-run against the index); a network is needed.
container-check: venv-python
	$(PY) tools/container_check.py

# Is this machine ready for the series? Under 30 s, before or after install (helpers/runner/readiness.py):
# Python, disk, memory, cores, packages or a wheelhouse, JupyterLab's port, an estimated series time.
check:
	@py=$$( [ -x $(PY) ] && echo $(PY) || PYTHON="$(PYTHON)" tools/find-python 2>/dev/null || echo python3 ); \
	$$py -m helpers.runner.readiness

# On a machine with an NVIDIA GPU, a few minutes: the gpu profile's throughput and MFU in bf16,
# TP=2 against TP=1 (two GPUs), conversion exactness on the GPU; one table (bench/gpu_check.py).
# Inside the NGC container the same command uses its torch, TE and Apex (make install keeps them).
gpu-check: install
	$(PY) -m bench.gpu_check $(ARGS)

# The GPU path in one prepared script of at most 5 minutes on one GPU (bench/gpu_smoke.py): the stack, notebook 00,
# the gpu profile's launch (tokens/s, MFU), conversion with 06's proofs, the way back, a 2-process layout; writes
# data/measured_gpu_run.json. DRY_RUN=1 prints the plan on any machine (nothing is installed or started).
DRY_RUN ?=
gpu-smoke: $(if $(DRY_RUN),venv-python,install)
	$(PY) -m bench.gpu_smoke $(if $(DRY_RUN),--dry-run) $(ARGS)

# Inside NVIDIA's NGC PyTorch container (26.09: Python 3.12) make install already takes the NGC route
# (.venv over the container's torch, Apex and Transformer Engine); install-ngc forces it (NGC=1).
install-ngc:
	@$(MAKE) --no-print-directory install NGC=1

clean-runs:
	rm -rf runs/
