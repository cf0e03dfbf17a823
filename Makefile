# Two commands on a fresh machine with python3 and make: `make demo`, `make test`.
# Each bootstraps .venv from the project's own files.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit soak bench pilot protos clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gpu-fraction-plugin demo

test: lint typecheck unit

lint: $(STAMP)
	$(BIN)/ruff check deviceplugin tests hack
	$(BIN)/ruff format --check deviceplugin tests hack
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest -q

soak: $(STAMP)
	$(BIN)/pytest -q -m soak -p no:cacheprovider -o addopts=''

bench: $(STAMP)
	$(BIN)/python hack/bench.py

pilot: $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,pilot]'
	$(BIN)/python hack/pilot/run.py

protos: $(STAMP)
	PYTHON=$(BIN)/python hack/gen-protos.sh

clean:
	rm -rf $(VENV) build *.egg-info
