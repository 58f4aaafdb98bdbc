#!/usr/bin/env bash
# GPU check for tinyvllm's Triton kernels.  Run on a CUDA machine (not in CI):
#   bash scripts/gpu_check.sh            # tests natively on CUDA, then the timing table
#   PYTHON=/path/to/python bash scripts/gpu_check.sh
# Needs a Python with CUDA torch + triton (the repo's .venv is CPU-only, so the
# system python3 is the default).  Whole run: ~3-5 minutes on an H100/H200,
# dominated by Triton JIT compilation; each stage has its own timeout.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export TRITON_INTERPRET=0            # compile the kernels for the GPU, not the interpreter
export TRITON_DEFAULT_FP_FUSION=1    # silence triton 3.9's default-change warning
export PYTHONUNBUFFERED=1

"$PY" - <<'PYEOF' || exit 1
import sys, torch, triton
if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: torch sees no CUDA device")
print(f"python {sys.version.split()[0]}  torch {torch.__version__}  triton {triton.__version__}  "
      f"gpu {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
PYEOF

status=0
echo "== kernel tests on CUDA =="
timeout 360 "$PY" -m pytest -q -x -rs tests/test_triton_kernels.py || status=$?
echo "== benchmark =="
timeout 240 "$PY" scripts/gpu_bench.py || status=$?
echo "gpu_check: exit status $status"
exit $status
