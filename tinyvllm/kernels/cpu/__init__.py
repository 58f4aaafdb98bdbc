"""The C++ CPU kernels (``cpu_kernel.cpp``: paged attention, fused RoPE + KV write + attention, RMSNorm,
SiLU-and-mul; ``cpu_gemm.cpp``: the batch-invariant bf16 GEMM on packed weights; ``cpu_gemm_amx.cpp``: its AMX
path; ``cpu_gemm_gguf.cpp``: linears on GGUF blocks; ``cpu_sample.cpp``: the grammar bitmask applied
to logits), built on first use. Shared by the sources: ``cpu_common.h`` (bf16 rounding, the GEMM tile
epilogue, the AMX permission request) and ``cpu_vec.h`` (the vector layer the per-ISA loops are written once
over: AVX-512 or AVX2, chosen at build time).

:func:`cpu_kernels` compiles the sources once with ``torch.utils.cpp_extension`` into
``$TINYVLLM_CACHE/torch_extensions`` (``-march=native``, or ``-march=haswell`` with
``TINYVLLM_KERNEL_ISA=avx2``) and returns the extension module, or None if it cannot be built.
Which attention backend uses them is decided elsewhere (:func:`tinyvllm.attention.selector.get_attn_backend`).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from tinyvllm import envs

logger = logging.getLogger("tinyvllm")
_KERNEL: object | None = None
_KERNEL_TRIED = False
SOURCES = (Path(__file__).with_name("cpu_kernel.cpp"), Path(__file__).with_name("cpu_gemm.cpp"),
           Path(__file__).with_name("cpu_sample.cpp"), Path(__file__).with_name("cpu_gemm_gguf.cpp"),
           Path(__file__).with_name("cpu_gemm_amx.cpp"))
HEADERS = (Path(__file__).with_name("cpu_pool.h"), Path(__file__).with_name("cpu_common.h"),
           Path(__file__).with_name("cpu_vec.h"), Path(__file__).with_name("attention_int8.h"))  # included by the sources: part of the build key


_BUILT_MARKER = "tinyvllm_built"


def _load_built(build: Path, name: str):
    """The module ``name`` already built in ``build`` (the directory is keyed by everything the build
    depends on), imported directly, or None. Skips ``cpp_extension.load``'s ninja up-to-date check
    (a subprocess, ~0.1 s of every start). The marker is written only after a build that loaded."""
    so = build / f"{name}.so"
    try:
        if (build / _BUILT_MARKER).read_text() != name or not so.is_file():
            return None
        import importlib.util

        spec = importlib.util.spec_from_file_location(name, so)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception:  # noqa: BLE001 - no marker, or a stale or broken .so: build it with ninja
        return None


_FLOCK = "tinyvllm_build.flock"
_TORCH_BATON = "lock"  # torch.utils.cpp_extension's FileBaton in the build directory


def _build_locked(build: Path, name: str, build_it):
    """Run ``build_it()`` (the ``cpp_extension.load`` call) under an exclusive ``fcntl.flock`` on
    ``build/tinyvllm_build.flock``, write the built marker and return the module.

    torch's own guard is a *file* baton (``build/lock``) with no owner: a build killed part way (Ctrl-C,
    OOM, a CI timeout) leaves it behind, and every later ``load`` then waits on it forever, so the
    engine hangs at start with no message. The flock is released by the kernel when its holder dies,
    so a baton found while holding it belongs to a dead build and is removed. Processes that start
    together serialize on the flock; the ones that waited find the finished build and import it.
    """
    import fcntl

    with open(build / _FLOCK, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            module = _load_built(build, name)  # built by the process we waited for
            if module is not None:
                return module
            baton = build / _TORCH_BATON
            if baton.exists():
                logger.warning("removing a stale kernel build lock left by a killed build: %s", baton)
                baton.unlink(missing_ok=True)
            module = build_it()
            (build / _BUILT_MARKER).write_text(name)
            return module
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# Compiler flags per TINYVLLM_KERNEL_ISA. -ffp-contract=off: no fused multiply-adds but the ones the
# kernels write (their bits are specified per instruction).
ISA_CFLAGS = {
    "native": ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
    # AVX2 + FMA + F16C and nothing newer (Intel Haswell; what AMD Zen 1-3 run): the kernels' AVX2
    # paths, which an AVX-512 machine's native build never compiles, built for tests and A/B.
    "avx2": ["-O3", "-march=haswell", "-ffp-contract=off", "-fopenmp"],
}


def build_cpu_kernels(isa: str = "native", src: Path | None = None):
    """Build (or import the build of) the kernels in directory ``src`` (default: this package's) for
    ``isa`` (a key of :data:`ISA_CFLAGS`) and return the module. Raises on a failed build (no compiler,
    no ninja...) or an unknown ``isa`` (ValueError). The build directory is keyed by the sources and
    headers, the flags, the CPU and the paths; a build that exists is imported directly (:func:`_load_built`).
    ``src`` other than this package's: ``scripts/kernel_bits.py`` builds another checkout's kernels
    (before/after a change) with the same flags."""
    if isa not in ISA_CFLAGS:
        raise ValueError(f"TINYVLLM_KERNEL_ISA must be one of {sorted(ISA_CFLAGS)}, got {isa!r}")
    cflags = ISA_CFLAGS[isa]
    here = Path(__file__).resolve().parent
    src = Path(src).resolve() if src is not None else here
    sources, headers = SOURCES, HEADERS
    if src != here:  # in this package's order where the names match: the key that checkout computes itself
        sources, headers = (tuple(src / f.name for f in own if (src / f.name).is_file())
                            + tuple(f for f in sorted(src.glob(pat)) if f.name not in {o.name for o in own})
                            for own, pat in ((SOURCES, "*.cpp"), (HEADERS, "*.h")))
    # -march=native: the build is only valid on this kind of CPU, so its flags are part of the key.
    cpu = ""
    try:
        cpu = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        pass
    # The build records absolute paths (sources, the venv's torch headers): checkouts or venvs sharing
    # one cache would otherwise overwrite each other's build and recompile (~30 s) on every switch.
    where = f"{src}|{Path(torch.__file__).resolve().parent}"
    tag = hashlib.sha256(b"".join(f.read_bytes() for f in sources + headers) + " ".join(cflags).encode()
                         + cpu.encode() + where.encode()).hexdigest()[:10]
    suffix = "" if isa == "native" else f"_{isa}"
    build = envs.TINYVLLM_CACHE / "torch_extensions" / f"cpu_kernels{suffix}-torch{torch.__version__.split('+')[0]}-{tag}"
    build.mkdir(parents=True, exist_ok=True)
    name = f"tinyvllm_cpu_kernels{suffix}_{tag}"
    module = _load_built(build, name)
    if module is not None:
        return module

    def build_it():
        from torch.utils.cpp_extension import load  # imports setuptools: only to build

        import time

        t0 = time.monotonic()
        logger.info("building CPU kernels (%s, first run, ~60-180 s) in %s ...", isa, build)
        module = load(name=name, sources=[str(f) for f in sources], extra_cflags=cflags,
                      extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
        logger.info("built CPU kernels in %.1fs", time.monotonic() - t0)
        return module

    return _build_locked(build, name, build_it)


def cpu_kernels():
    """The compiled C++ kernels module, or None if it cannot be built (no compiler, no ninja...).

    Built once per process for ``TINYVLLM_KERNEL_ISA`` (``native`` by default; ``avx2``: the AVX2
    paths on any x86 CPU that has AVX2) by :func:`build_cpu_kernels`.
    """
    global _KERNEL, _KERNEL_TRIED
    if _KERNEL_TRIED:
        return _KERNEL
    _KERNEL_TRIED = True
    try:
        _KERNEL = build_cpu_kernels(envs.TINYVLLM_KERNEL_ISA)
    except Exception as e:  # no compiler, no ninja...
        logger.warning("C++ CPU kernels unavailable (%s); using the PyTorch float64 reference backend", e)
        _KERNEL = None
    return _KERNEL
