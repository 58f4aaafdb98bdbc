#!/usr/bin/env bash
# GPU check for tinyvllm's GPU path.  Run on a CUDA machine (not in CI):
#   bash scripts/gpu_check.sh            # kernel tests, engine tests, then the timing table
#   PYTHON=/path/to/python bash scripts/gpu_check.sh
# Needs a Python with CUDA torch + triton (the repo's .venv is CPU-only, so the
# system python3 is the default).  Whole run: ~5-7 minutes on an H100/H200 (an estimate: never run),
# dominated by Triton JIT compilation; each stage has its own timeout.
# The table is also written as JSON to $OUT/gpu_bench.json (the device tool's
# output folder) or bench_results/gpu_bench.json.
# Stages: (1) Triton kernels vs PyTorch references (tests/test_triton_kernels.py);
# (2) the whole engine on CUDA - eager, with CUDA graphs of the decode step, and
# graphs for small batches only - against the CPU float32 greedy tokens on a
# tiny random Llama, plus the graph runner's padding (tests/test_gpu_engine.py);
# (3) one table (scripts/gpu_bench.py): the measured bandwidth and matmul
# ceilings, the whole engine on a random-weight Llama-3.2-1B shape (prefill
# tokens/s; decode tokens/s at batch 1/32/256, CUDA graphs and eager) against
# its roofline, and each Triton kernel against the PyTorch op.
# The engine needs msgspec, which a bare GPU image may lack: wheels found in
# ./.whl (e.g. `pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux2014_x86_64 -d .whl msgspec==0.22.0` on a machine with
# PyPI, folder git-ignored) are installed into a temporary directory first.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export TRITON_INTERPRET=0            # compile the kernels for the GPU, not the interpreter
export TRITON_DEFAULT_FP_FUSION=1    # silence triton 3.9's default-change warning
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
    site="${TMPDIR:-/tmp}/tinyvllm_gpu_check_site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

"$PY" - <<'PYEOF' || exit 1
import sys, torch, triton
if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: torch sees no CUDA device")
print(f"python {sys.version.split()[0]}  torch {torch.__version__}  triton {triton.__version__}  "
      f"gpu {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
PYEOF

# Logs of each stage go to $OUT (the device tool's output folder) or bench_results/, so they come back
# even if the run is cut off; the stage timeouts add up to under 10 minutes.
log_dir="${OUT:-bench_results}"
mkdir -p "$log_dir"
status=0
echo "== kernel tests on CUDA =="
timeout 200 "$PY" -m pytest -q -rs tests/test_triton_kernels.py 2>&1 | tee "$log_dir/kernel_tests.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
echo "== engine on CUDA: eager / CUDA graphs vs CPU float32 greedy tokens =="
if "$PY" -c "import msgspec, transformers, tokenizers, safetensors" 2>/dev/null; then
    # TINYVLLM_ATTENTION=torch: the CPU reference uses the pure-PyTorch path (no C++ build on this machine).
    TINYVLLM_ATTENTION=torch TINYVLLM_NUM_THREADS=4 timeout 150 "$PY" -m pytest -q -rs tests/test_gpu_engine.py \
        2>&1 | tee "$log_dir/engine_tests.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
else
    echo "engine tests NOT RUN: missing Python packages:"
    "$PY" -c "import msgspec, transformers, tokenizers, safetensors" 2>&1 | tail -1
    echo "(carry wheels in ./.whl, see the top of this script)"
    status=1
fi
echo "== benchmark =="
timeout 220 "$PY" scripts/gpu_bench.py --json "$log_dir/gpu_bench.json" 2>&1 | tee "$log_dir/gpu_bench.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
echo "gpu_check: exit status $status"
exit $status
