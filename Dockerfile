# The series inside NVIDIA's NGC PyTorch container, which brings CUDA, cuDNN, NCCL, Apex and
# Transformer Engine with a matched torch build. `make install-ngc` installs the project's pins
# except torch and whatever the container's pip constraint file pins, so its own builds stay.
ARG NGC_TAG=26.09-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}
WORKDIR /workspace/megatron-gpt-notebooks
COPY requirements.txt pyproject.toml Makefile README.md ./
COPY helpers/ helpers/
COPY tools/ tools/
RUN make install-ngc
COPY . .
EXPOSE 8888
CMD ["jupyter", "lab", "--ip=0.0.0.0", "--port=8888", "--allow-root", "--no-browser", "notebooks/"]
