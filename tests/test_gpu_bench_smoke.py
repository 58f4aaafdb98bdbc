"""``scripts/gpu_bench.py --smoke``: the GPU benchmark script runs end to end on the CPU.

A session lent a GPU has minutes of device time; a bug in the script must show
here, not there.  Slow tier (~21 s on 2 cores): docs/gpu.md's runbook runs it
before any device time is spent; the kernels it drives are checked in the default
tier by tests/test_triton_kernels.py and tests/test_gpu_engine.py.  The timings of a smoke run mean nothing; what is checked is
that every section produced its rows, that the kernels agreed with the PyTorch
ops, and that the roofline arithmetic gave numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_bench_smoke_runs_every_section(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "gpu_bench.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_bench.py"), "--smoke", "--stack",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = {(r["case"], r["shape"]): r for r in res["rows"]}
    cases = [r["case"] for r in res["rows"]]
    assert res["info"]["smoke"] is True
    assert res["info"]["ceilings"]["bw"] > 0 and res["info"]["ceilings"]["flops"] > 0
    assert "ceiling: memory copy (read + write)" in cases and "ceiling: bf16 matmul" in cases
    assert cases.count("engine prefill") == 1
    decode = [r for r in res["rows"] if r["case"] == "engine decode (eager)"]
    assert [r["shape"].split()[0] for r in decode] == ["B=1", "B=4", "B=8"]
    for r in decode + [rows[next(k for k in rows if k[0] == "engine prefill")]]:
        assert r["ms"] > 0 and r["ref_ms"] > 0 and r["vs_ceiling"].endswith("%")
        assert "tok/s" in r["throughput"]
    kernels = [r for r in res["rows"] if r["max_abs_diff"] is not None]
    names = {r["case"].split(" (")[0] for r in kernels}
    assert {"reshape_and_cache", "prefill attn", "decode attn", "rms_norm + residual",
            "rotary_embedding", "stack decode step"} <= names
    assert all(r["max_abs_diff"] < 1e-5 for r in kernels), kernels  # float32 in the smoke run
    quantized = [r["case"].split(";")[0] for r in kernels if " KV;" in r["case"]]
    assert sorted(quantized) == sorted(f"{a} ({b}, {k} KV" for k in ("int8", "fp8")
                                       for a, b in [("prefill attn", "chunk")] + [("decode attn", "auto")] * 2)
    assert "engine rows NOT RUN" not in proc.stdout
