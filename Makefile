PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv serve demo test bench clean

venv: $(STAMP)

# Torch goes in first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test,load]"
	touch $(STAMP)

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
