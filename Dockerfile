# The series inside NVIDIA's NGC PyTorch container, which brings CUDA, cuDNN, NCCL, Apex and
# Transformer Engine with a matched torch build. `make install` sees the container (NVIDIA_PYTORCH_VERSION)
# and builds /opt/venv over its site-packages, installing only the pins the container lacks: never torch,
# nor anything its pip constraint file (PIP_CONSTRAINT) pins (tools/ngc_requirements.py).
#   docker build -t <registry>/megatron-gpt-notebooks . && docker push <registry>/megatron-gpt-notebooks
# The venv lives outside the work folder, so a clone mounted over it (docker run -v) keeps the packages.
ARG NGC_TAG=26.09-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}
ENV VENV=/opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /workspace/megatron-gpt-notebooks
COPY requirements.txt pyproject.toml Makefile README.md ./
COPY helpers/ helpers/
COPY tools/ tools/
RUN make install
COPY . .
EXPOSE 8888
CMD ["python", "-m", "jupyter", "lab", "--ip=0.0.0.0", "--port=8888", "--allow-root", "--no-browser", "notebooks/"]
