"""``python -m tinyvllm.model [MODEL] [--dtype D ...]``: convert MODEL (a GGUF: once, into ``$TINYVLLM_CACHE``)
and prepare its weights in each dtype, and a GGUF's native repack, now, with timed log lines, instead of on the
first engine start.
``make test`` runs it for the embedded default model before pytest (as it builds the C++ kernels), so the test
run's clock measures tests: on a fresh checkout the first engine starts spent ~8 s here (this Xeon, 2 cores).
Exits 1 with one line if the model cannot be resolved or loaded."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from tinyvllm.config import DEFAULT_MODEL


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tinyvllm.model", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="as tinyvllm serve's --model")
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float16", "float32"],
                    help="the dtypes to prepare the weights in")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    from tinyvllm.model.loader import resolve_model
    from tinyvllm.model.weights import load_model

    t0 = time.monotonic()
    try:
        resolved = resolve_model(args.model)
        for name in args.dtype:
            load_model(resolved.model_dir, getattr(torch, name))
    except (OSError, ValueError) as e:  # ModelNotFoundError and UnsupportedArchitectureError are ValueErrors
        print(f"cannot prepare {args.model!r}: {e}", file=sys.stderr)
        return 1
    done = list(args.dtype)
    if resolved.source != "hf":  # a GGUF: its native repack too (--quantization gguf; auto without AVX512-BF16)
        try:
            load_model(resolved.model_dir, torch.bfloat16, quantization="gguf")
            done.append("native GGUF")
        except ValueError as e:  # not a quantized GGUF, or no C++ kernels: that path cannot run here anyway
            print(f"no native GGUF repack: {e}")
    print(f"model {args.model} ready ({', '.join(done)}, {time.monotonic() - t0:.1f} s): {resolved.model_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
