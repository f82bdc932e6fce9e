# syntax=docker/dockerfile:1
# spectune's image: the built-in server (`tuner serve`, the manifests of deploy=builtin) and the
# tuner workers on the built-in engine (`tuner optimize --worker`, `tuner render-tuner`).
# `make image` builds it twice: VARIANT=cpu (torch's CPU wheel) and VARIANT=cuda (PyPI's CUDA
# torch, which carries its own CUDA runtime; the node's driver comes in through the NVIDIA runtime).
# The install is scripts/setup.sh, the same script `make setup` runs.
ARG PYTHON_BASE=python:3.11.11-slim-bookworm

FROM ${PYTHON_BASE} AS build
ARG VARIANT=cpu
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
COPY --from=build /opt/spectune /opt/spectune
# HF_HOME: the model volume the manifests mount at /models (models and hub drafters live there).
ENV PATH=/opt/spectune/bin:$PATH \
    HF_HOME=/models/hf \
    PYTHONUNBUFFERED=1
USER 1000:1000
WORKDIR /home/spectune
EXPOSE 8000
CMD ["tuner", "--help"]
