"""A machine that can build the C++ kernels must build them: a failed build is a test failure here,
not the silent skip of tests/test_cpu_kernels.py plus one log line (the engine would quietly run the
slower PyTorch reference path)."""

from __future__ import annotations

import platform
import shutil
import sysconfig
from pathlib import Path

import pytest


def _cpu_flags() -> set[str]:
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


def test_cpu_kernels_build_where_they_can():
    cxx = shutil.which("c++") or shutil.which("g++")
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if platform.machine() not in ("x86_64", "AMD64") or cxx is None or not headers.exists():
        pytest.skip(f"cannot build here: machine {platform.machine()}, compiler {cxx}, Python.h {headers.exists()}")
    from tinyvllm.kernels.cpu import cpu_kernels

    kern = cpu_kernels()
    assert kern is not None, "the C++ kernels failed to build on a machine with a compiler (see the warning log)"
    flags = _cpu_flags()
    assert kern.has_avx512() == ("avx512f" in flags)
    assert kern.vector_kernels_isa() == ("avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "none")
    assert kern.gemm_has_bf16_kernel() == ("avx512_bf16" in flags)
    # the GGUF linear's vector kernel: AVX512-BF16, else AVX2 + FMA + F16C (AMD Zen 1-3, older Intel)
    want = ("avx512_bf16" if {"avx512_bf16", "avx512bw", "avx512vl", "f16c"} <= flags
            else "avx2" if {"avx2", "fma", "f16c"} <= flags else "scalar")
    assert kern.gemm_gguf_isa() == want
    # gemm_gguf_q8's VPDPBUSD kernel: AVX512-VNNI on top of the AVX512-BF16 kernel (AMD Zen 4, Sapphire
    # Rapids); else its AVX2 kernel (VPMADDUBSW); without either it is its own scalar loop and the
    # bit-for-bit tests compare it with itself
    avx2 = {"avx2", "fma", "f16c"} <= flags
    assert kern.gemm_gguf_q8_isa() == ("avx512_vnni" if want == "avx512_bf16" and "avx512_vnni" in flags
                                       else "avx2" if avx2 else "scalar")


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_start(tmp_path):
    """torch's ``cpp_extension.load`` guards a build with a plain file (``lock``) that a killed build
    leaves behind; every later ``load`` then waits on it forever (seen: a test run hung at its first
    kernel use after an interrupted run). ``_build_locked`` removes it while holding its own flock."""
    from tinyvllm.kernels.cpu import _BUILT_MARKER, _build_locked

    (tmp_path / "lock").write_text("")  # what a killed build leaves
    seen = []

    def build_it():
        seen.append((tmp_path / "lock").exists())
        return "module"

    assert _build_locked(tmp_path, "tinyvllm_cpu_kernels_x", build_it) == "module"
    assert seen == [False]
    assert (tmp_path / _BUILT_MARKER).read_text() == "tinyvllm_cpu_kernels_x"


def test_builds_that_start_together_do_not_overlap(tmp_path):
    """Two builders of one directory (two engine processes starting at once) run one after the other:
    the second must not see the first's lock as stale while the first is still building."""
    import threading
    import time

    from tinyvllm.kernels.cpu import _build_locked

    spans = []

    def build_it():
        t0 = time.monotonic()
        time.sleep(0.3)
        spans.append((t0, time.monotonic()))
        return "module"

    threads = [threading.Thread(target=_build_locked, args=(tmp_path, "m", build_it)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(spans) == 2
    (a0, a1), (b0, b1) = sorted(spans)
    assert b0 >= a1, f"the builds overlapped: {spans}"
