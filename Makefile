# `make demo` and `make test` each build .venv first when it is missing (pip, Python 3.11).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-fast bench clean

$(BIN)/argus: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $@

demo: $(BIN)/argus
	$(BIN)/python -m app demo

test: $(BIN)/argus
	$(BIN)/python -m pytest -v

test-fast: $(BIN)/argus
	$(BIN)/python -m pytest -m "not slow"

bench: $(BIN)/argus
	@for script in bench/*.py; do echo "== $$script"; $(BIN)/python $$script || exit 1; done

clean:
	rm -rf $(VENV) argus-data .pytest_cache
