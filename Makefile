# Two commands set up a fresh machine: `make demo` and `make test`.
# TORCH_SPEC pins the CPU build by default; override it to keep your own torch
# (e.g. `make test TORCH_SPEC='torch>=2.3'`).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test demo bench calibrate docs lint clean

$(STAMP): pyproject.toml setup.py tracedump/compare/kernel.c Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	$(BIN)/python examples/demo.py

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py --out benchmarks/results.json

calibrate: $(STAMP)
	$(BIN)/python benchmarks/calibrate.py --markdown --out benchmarks/calibration.json
	$(BIN)/python benchmarks/calibrate_graft.py --markdown --out benchmarks/calibration_graft.json

# docs/settings.md is generated from tracedump.settings.DumpSettings (tests/test_docs.py checks it).
docs: $(STAMP)
	$(BIN)/python tools/docs_gen.py

lint: $(STAMP)
	$(BIN)/python tools/docs_gen.py --check
	$(BIN)/ruff check tracedump tests benchmarks examples tools setup.py
	$(BIN)/ruff format --check tracedump tests benchmarks examples tools setup.py

clean:
	rm -rf $(VENV) build *.egg-info tracedump/compare/*.so
