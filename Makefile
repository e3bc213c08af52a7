# The two commands a newcomer needs: `make run` and `make test`.
# Both create .venv on first use and install the project into it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
CONFIG ?= experiments/ANDREA-tiny-TRAIN.json

.PHONY: run test lint nvcc-check gpu-check bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/andrea-prep $(CONFIG)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

nvcc-check:
	scripts/nvcc-check

clean:
	rm -rf $(VENV) build *.egg-info
