# `make demo` and `make test` each build .venv first when it is missing (pip, Python 3.11).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-fast lint format bench clean

# Byte-compiled here, never with --no-compile: where PYTHONDONTWRITEBYTECODE is set (as on the dev and
# CI machines) nothing caches bytecode later, so every process (each Ray worker, job driver, CLI run)
# compiled torch afresh: `import torch` took 7.5 s of CPU instead of 3 s (CI once: 3,474 s, 2,554 before).
$(BIN)/argus: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $@

demo: $(BIN)/argus
	$(BIN)/python -m app demo

# Every test: lint first (seconds), then unit and integration tests (real broker, Ray, MLflow, HTTP)
# in two workers, a file to each at a time, in the order tests/conftest.py gives (unit tests, then
# the longest files first). Much of the suite waits (Flower's 3 s polls, group joins, rollouts), so
# two workers on 2 cores took 0.71-0.84x the pytest time of one (clean-clone runs hours apart on the
# same machine, see the README). The durations report closes the log.
TEST_WORKERS ?= 2
test: lint
	$(BIN)/python -m pytest -v --durations=40 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Unit tests only: no broker, no Ray, no network; under a minute.
test-fast: lint
	$(BIN)/python -m pytest tests/unit

lint: $(BIN)/argus
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(BIN)/argus
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(BIN)/argus
	@for script in bench/*.py; do echo "== $$script"; $(BIN)/python $$script || exit 1; done

clean:
	rm -rf $(VENV) argus-data .pytest_cache
