# Every target creates .venv on first use. Without an NVIDIA GPU the CPU build of torch is
# installed first, so resolving torch>=2.4 never pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
STAMP := $(VENV)/.attnsdk-installed

.PHONY: setup demo test check lint typecheck format bench clean

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

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy

check: lint typecheck test

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
