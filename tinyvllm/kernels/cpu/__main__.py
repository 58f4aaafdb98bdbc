"""``python -m tinyvllm.kernels.cpu``: build (or find built) the C++ CPU kernels now, with a timed log line,
instead of on the first engine start. ``make test`` runs it before pytest, as vLLM builds its kernels at
install time, so the test run's clock measures tests. Exits 1 if the kernels cannot be built (the engine
would then run the PyTorch reference backend)."""

from __future__ import annotations

import logging
import sys
import time

from tinyvllm import envs
from tinyvllm.kernels.cpu import build_cpu_kernels


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.monotonic()
    try:
        module = build_cpu_kernels(envs.TINYVLLM_KERNEL_ISA)
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja: one line, and the exit code says it
        print(f"C++ CPU kernels could not be built: {e}", file=sys.stderr)
        return 1
    print(f"C++ CPU kernels ready ({envs.TINYVLLM_KERNEL_ISA}, {time.monotonic() - t0:.1f} s): {module.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
