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
    assert kern.gemm_has_bf16_kernel() == ("avx512_bf16" in flags)
