# rrfp's image: the README's install step (./install.sh into a virtual environment), nothing
# else, so what runs in a pod is what the README sets up. deploy/base/kustomization.yaml names
# it (images: rrfp); tests/test_deploy_ops.py lints this file (hadolint) and checks that its
# install step is the README's.
#
#   CPU (torch's CPU build):  docker build -t rrfp:0.1.0 .
#   CUDA 12.8:                docker build -t rrfp:0.1.0-cu128 \
#                               --build-arg TORCH_SPEC=torch==2.13.0+cu128 \
#                               --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#
# The CUDA wheels of torch carry their CUDA libraries, so both variants start from the same
# Python image; the node needs only the NVIDIA driver (the device plugin mounts it).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

# Which torch ./install.sh installs first (its TORCH_SPEC), and from which extra index.
ARG TORCH_SPEC=torch==2.13.0+cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

LABEL org.opencontainers.image.title="rrfp" \
      org.opencontainers.image.description="readiness-driven pipeline-parallel training: rrfp train, rrfp node" \
      org.opencontainers.image.source="README.md, Set up and run"

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_EXTRA_INDEX_URL=${TORCH_INDEX} \
    TORCH_SPEC=${TORCH_SPEC}

WORKDIR /opt/rrfp
COPY . .
# The README's step 1 without its last command (`rrfp train`), as one layer.
RUN python3 -m venv .venv && . .venv/bin/activate && ./install.sh

# What `. .venv/bin/activate` does, for every later command and the container's.
ENV VIRTUAL_ENV=/opt/rrfp/.venv \
    PATH=/opt/rrfp/.venv/bin:$PATH

# Not root: the pod runs as this user (deploy/base/jobset.yaml, securityContext).
RUN useradd --create-home --uid 1000 --user-group rrfp
USER 1000:1000

# The pod's command (`rrfp node ...`) comes from the manifests; alone, the image says what it has.
CMD ["rrfp", "--help"]
