#!/bin/sh
# The install step of the CPU container (docker/cpu.Dockerfile runs this, and only this, to install):
# the project's own pins into a virtual environment, as `make install` does, from a wheelhouse
# folder when it holds wheels (a room without a network), else from the package index.
# Run from the repository root. Settings (environment variables):
#   VENV        where the environment goes (default /opt/venv; the image sets it for make too)
#   WHEELHOUSE  a folder of wheels (make wheelhouse); with *.whl in it the install never reaches
#               an index (pip --no-index, tools/wheelhouse.py install), else it is ignored
#   PYTHON      the interpreter to make VENV with (default: what tools/find-python picks: 3.12/3.13)
# tests/test_container.py runs the same file outside a container (a copy of the repository, a
# fresh VENV) with pip's --dry-run; docs/container.md gives its measured time.
set -eu
VENV=${VENV:-/opt/venv}
WHEELHOUSE=${WHEELHOUSE:-}
start=$(date +%s)

py=$(PYTHON="${PYTHON:-}" tools/find-python)  # stops with its message on a Python the series cannot use
echo "container-install: $($py --version) -> $VENV"
"$py" -m venv "$VENV"
pip="$VENV/bin/python -m pip --disable-pip-version-check"
q=-q; [ -n "${PIP_EXTRA:-}" ] && q=""  # a dry run shows what it would install

if [ -n "$WHEELHOUSE" ] && ls "$WHEELHOUSE"/*.whl >/dev/null 2>&1; then
    echo "container-install: from the wheelhouse $WHEELHOUSE, without a network (pip --no-index)"
    "$VENV/bin/python" tools/wheelhouse.py install --python "$VENV/bin/python" --wheelhouse "$WHEELHOUSE"
else
    echo "container-install: from the package index (no wheels in '${WHEELHOUSE:-no WHEELHOUSE given}')"
    $pip install $q ${PIP_EXTRA:-} -r requirements.txt
    $pip install $q ${PIP_EXTRA:-} --no-deps -e .
fi
[ -n "${PIP_EXTRA:-}" ] && exit 0  # a dry run (PIP_EXTRA=--dry-run): nothing was installed to check

# What the image promises: the series' packages import, the runner and JupyterLab are there.
"$VENV/bin/python" -c 'import torch, megatron.core, transformers, helpers.runner.series; print("container-install: torch", torch.__version__, "megatron-core", megatron.core.__version__)'
test -x "$VENV/bin/jupyter-lab"
touch "$VENV/.installed"  # make's install target: done (the image sets VENV for make)
echo "container-install: done in $(( $(date +%s) - start )) s"
