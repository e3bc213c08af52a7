# The two commands a newcomer needs: `make run` and `make test`.
# Both create .venv on first use and install the project into it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TEST_STAMP := $(VENV)/.installed-test-stamp
CONFIG ?= experiments/ANDREA-tiny-TRAIN.json

.PHONY: run test nvcc-check gpu-check clean

# `make run` installs what the demo needs (the project and its dependencies); `make test` adds
# the test extra (pytest, hypothesis, ruff, import-linter, playwright, matplotlib, ...).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(TEST_STAMP)

run: $(STAMP)
	$(BIN)/andrea-tui $(CONFIG) --resume

test: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q --numprocesses=auto --maxprocesses=4

nvcc-check:
	scripts/nvcc-check

# On a GPU machine: install pycuda from .whl/, run `pytest -m gpu` and the GPU benchmark
# (dev/bench_gpu.py; dev/README.md lists the other benchmarks and probes).
gpu-check:
	scripts/gpu-check

clean:
	rm -rf $(VENV) build *.egg-info
