# The series on a laptop's CPU in a container, for macOS (Apple Silicon: linux/arm64; Intel: linux/amd64),
# Windows (WSL2) and Linux: megatron-core publishes Linux wheels only, so a Mac or a Windows laptop cannot
# `make install`, but its container engine runs Linux. docs/container.md: build, run, hand out offline.
# (The GPU image is ../Dockerfile, NVIDIA's NGC container; this one never needs a GPU.)
#
#   docker build -f docker/cpu.Dockerfile -t megatron-gpt-notebooks:cpu .
#   docker run --rm -it -p 8888:8888 --shm-size=1g \
#       -v "$PWD":/workspace/megatron-gpt-notebooks megatron-gpt-notebooks:cpu
#
# Offline (a room without a network): put every wheel in docker/wheels/ first (docker/wheels/README.md);
# the install then reads only them. The install is tools/container-install.sh, the one RUN that installs:
# tests/test_container.py runs it outside a container and checks this file's COPY sources and CMD.
ARG BASE=python:3.12-slim-bookworm
FROM ${BASE}

# make: `make tutorial` and the other targets inside; git: notebook 00's environment report, a learner's clone.
RUN apt-get update && apt-get install -y --no-install-recommends make git \
    && rm -rf /var/lib/apt/lists/*

# VENV is also make's: `make tutorial` in the container uses this environment, not a .venv in the mounted clone.
# HOME is writable by any user, so `docker run --user "$(id -u):$(id -g)"` (Linux) works with JupyterLab too.
ENV VENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/home/learner \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false
RUN mkdir -p "$HOME" && chmod 1777 "$HOME"

WORKDIR /workspace/megatron-gpt-notebooks
COPY requirements.txt pyproject.toml Makefile README.md ./
COPY helpers/ helpers/
COPY tools/ tools/
# docker/wheels/ is bound for this step only: its wheels never become a layer of the image.
RUN --mount=type=bind,source=docker/wheels,target=/wheelhouse \
    WHEELHOUSE=/wheelhouse sh tools/container-install.sh

# The rest of the repository (the clone a learner mounts over it with -v takes its place at run time).
COPY notebooks/ notebooks/
COPY data/ data/
COPY bench/ bench/
COPY tests/ tests/
COPY docs/ docs/
COPY environment.yml Dockerfile ./
COPY docker/cpu.Dockerfile docker/cpu.Dockerfile.dockerignore docker/

EXPOSE 8888
# JupyterLab on every interface of the container (the host publishes it with -p 8888:8888), with its token.
CMD ["jupyter", "lab", "--ip=0.0.0.0", "--port=8888", "--no-browser", "--allow-root", "notebooks/"]
