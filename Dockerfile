# syntax=docker/dockerfile:1
# spectune's image: the built-in server (`tuner serve`, the manifests of deploy=builtin) and the
# tuner workers on the built-in engine (`tuner optimize --worker`, `tuner render-tuner`).
# `make image` builds it twice: VARIANT=cpu (torch's CPU wheel) and VARIANT=cuda (PyPI's CUDA
# torch, which carries its own CUDA runtime; the node's driver comes in through the NVIDIA runtime).
# The install is scripts/setup.sh, the same script `make setup` runs.
# PYTHON_BASE: any Debian-like image with python3 (3.11+, venv) and useradd; `make image-check`
# gives it the base scripts/image_base.sh builds from Debian's packages when no registry is reachable.
ARG PYTHON_BASE=python:3.11.11-slim-bookworm

FROM ${PYTHON_BASE} AS build
ARG VARIANT=cpu
# Build stage only (the runtime stage copies the venv, not these): pip's CA bundle (a network behind
# a TLS-intercepting proxy), its wheel directories, and where torch's CPU wheel comes from (an index
# URL, or a directory holding it); empty: pip's own defaults. `make image-check` mounts the files.
ARG PIP_CERT=
ARG PIP_FIND_LINKS=
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
# A C compiler for the dependencies PyPI ships as sources only (pycosat, through reasoning-gym), and
# Python's headers where the base lacks them (Debian's python3 keeps them in python3-dev); build stage only.
RUN apt-get update -q \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends gcc libc6-dev \
       $(python3 -c 'import os, sysconfig; print("" if os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else "python3-dev")') \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY scripts/setup.sh scripts/setup.sh
COPY conf conf
COPY deploy deploy
COPY engine engine
COPY tuner tuner
RUN scripts/setup.sh /opt/spectune --torch "${VARIANT}" \
    && find /opt/spectune -name __pycache__ -type d -prune -exec rm -rf {} +

FROM ${PYTHON_BASE}
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="spectune" \
      org.opencontainers.image.description="spectune built-in engine and tuner (${VARIANT})" \
      org.opencontainers.image.licenses="Apache-2.0"
# uid/gid 1000: the non-root user the rendered manifests run as (runAsUser, fsGroup).
RUN groupadd --gid 1000 spectune \
    && useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin spectune
# A C++ compiler and Python's headers at run time too: inductor compiles the lean forward's decode
# step for the serving machine's CPU (engine.builtin.compile, on for fp32 models from 0.1B
# parameters; its kernels include Python.h), and engine.models.smallm builds its few-row linear
# kernel there (-march=native: built where it runs).
RUN apt-get update -q \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends g++ libc6-dev \
       $(python3 -c 'import os, sysconfig; print("" if os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else "python3-dev")') \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/spectune /opt/spectune
# HF_HOME: the model volume the manifests mount at /models (models and hub drafters live there).
ENV PATH=/opt/spectune/bin:$PATH \
    HF_HOME=/models/hf \
    PYTHONUNBUFFERED=1
USER 1000:1000
WORKDIR /home/spectune
EXPOSE 8000
CMD ["tuner", "--help"]
