# The two set-up commands (README quick start):  make tutorial   |   make test
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Extra arguments for the series runner, e.g. make tutorial ARGS="--profile cpu -p train_iters=500"
ARGS   ?=
PYTEST_ARGS ?=

.PHONY: install tutorial test lab clean-runs install-ngc

$(VENV)/.installed: requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -r requirements.txt
	$(PY) -m pip install --disable-pip-version-check -q --no-deps -e .
	@touch $@

install: $(VENV)/.installed

tutorial: install
	$(PY) -m helpers.series run $(ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

lab: install
	$(VENV)/bin/jupyter lab notebooks/

# Inside NVIDIA's NGC PyTorch container: keep the container's torch (and its Apex / Transformer
# Engine builds); install everything else from the same pins, into the container's Python.
install-ngc:
	grep -v '^torch==' requirements.txt > /tmp/requirements-ngc.txt
	pip install -r /tmp/requirements-ngc.txt
	pip install --no-deps -e .

clean-runs:
	rm -rf runs/
