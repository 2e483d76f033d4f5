# Every target creates .venv on first use. Without an NVIDIA GPU the CPU build of torch is
# installed first, so resolving torch>=2.4 never pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
STAMP := $(VENV)/.attnsdk-installed
DOCS_STAMP := $(VENV)/.attnsdk-docs-installed

.PHONY: setup demo test test-engines check lint typecheck format docs bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "NVIDIA GPU found: torch comes from the package index"; \
	else \
		echo "no NVIDIA GPU: installing the CPU build ($(TORCH_CPU)) first"; \
		$(PY) -m pip install -q "$(TORCH_CPU)"; \
	fi
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(PY) -m attnsdk demo

test: setup
	$(PY) -m pytest

# The engine tier: the adapters inside each supported engine release's own code, on the CPU.
# Each release is built once into .engines/ (tests/engines/setup.sh) and reused.
ENGINES ?= sglang:0.5.12.post1 sglang:0.5.23 vllm:0.33.0 vllm:0.34.0

test-engines: setup
	@set -e; for e in $(ENGINES); do \
		engine=$${e%%:*}; version=$${e#*:}; dest=.engines/$$engine-$$version; \
		PYTHON=$(PY) tests/engines/setup.sh $$engine $$version; \
		echo "== $$engine $$version"; \
		PYTHONPATH=$$dest:$$dest/site:tests/engines $(PY) -m pytest \
			-c tests/engines/pytest.ini tests/engines/$${engine}_engine -q; \
	done

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy

check: lint typecheck test

# The API reference (from the docstrings) and docs/*.md as HTML in docs/_build/html. Every
# warning and every unresolved cross-reference fails the build. Not part of check: it adds
# Sphinx to the venv (the docs extra).
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[dev,docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	rm -rf docs/_build
	$(VENV)/bin/sphinx-build -W --keep-going -n -q -b html docs docs/_build/html
	@echo "docs/_build/html/index.html"

# The benchmarks. With a CUDA GPU: every GPU benchmark (benchmarks/run_gpu.sh: each backend
# next to its raw kernel, JSON + PNG + logs in $(BENCH_OUT)); without one: `attnsdk bench`,
# a CPU benchmark of the backends that run on a CPU (seconds).
BENCH_OUT ?= benchmarks/results

bench: setup
	@if $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		PATH="$(abspath $(VENV))/bin:$$PATH" benchmarks/run_gpu.sh $(BENCH_OUT); \
	else \
		$(PY) -m attnsdk bench; \
	fi

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .engines .mypy_cache .ruff_cache .pytest_cache .hypothesis docs/_build
