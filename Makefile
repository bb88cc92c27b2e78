# `make run` and `make test` each create .venv if absent, install torch==2.13.0 (a CPU build is
# on local disk) and then the project (building its native CPU kernels), and run.
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

$(STAMP): $(BIN)/python pyproject.toml setup.py dsv4/_kernels.c
	$(BIN)/python -m pip install -q torch==2.13.0 -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/dsv4 run --prompt "Hello, DeepSeek" --max-new-tokens 16

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# Lint, then the tests on two workers (pytest-xdist; tests sharing a module fixture stay
# together, the 15 slowest shown) while mypy runs beside them: it is single-threaded and takes
# about 40 s, which the workers would otherwise wait out. Its report follows the tests'; the
# target fails if either fails.
test: $(STAMP) lint
	@types=$$(mktemp); $(BIN)/mypy >"$$types" 2>&1 & mypy=$$!; \
	HYPOTHESIS_PROFILE=$(HYPOTHESIS_PROFILE) $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) \
		--dist loadgroup --durations=15 $(PYTEST_ARGS); tests=$$?; \
	wait $$mypy; typed=$$?; echo "mypy:"; cat "$$types"; rm -f "$$types"; \
	[ $$tests -eq 0 ] && [ $$typed -eq 0 ]

bench: $(STAMP)
	$(BIN)/dsv4 bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
