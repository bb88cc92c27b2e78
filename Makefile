# `make run` and `make test` each create .venv if absent, install torch==2.13.0 (a CPU build is
# on local disk) and then the project, and run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HYPOTHESIS_PROFILE ?= ci
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?=

.PHONY: run test lint typecheck bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/dsv4 run --prompt "Hello, DeepSeek" --max-new-tokens 16

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# Two workers (pytest-xdist; tests sharing a module fixture stay together), the 15 slowest shown.
test: $(STAMP) lint typecheck
	HYPOTHESIS_PROFILE=$(HYPOTHESIS_PROFILE) $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) \
		--dist loadgroup --durations=15 $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/dsv4 bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
