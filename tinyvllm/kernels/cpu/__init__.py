"""The C++ CPU kernels (``cpu_kernel.cpp``: paged attention, fused RoPE + KV write + attention, RMSNorm,
SiLU-and-mul; ``cpu_gemm.cpp``: the batch-invariant bf16 GEMM on packed weights; ``cpu_gemm_amx.cpp``: its AMX
path; ``cpu_gemm_gguf.cpp``: linears on GGUF blocks; ``cpu_sample.cpp``: the grammar bitmask applied
to logits), built on first use.

:func:`cpu_kernels` compiles both sources once with ``torch.utils.cpp_extension`` into
``$TINYVLLM_CACHE/torch_extensions`` and returns the extension module, or None if it cannot be built.
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
HEADERS = (Path(__file__).with_name("cpu_pool.h"), Path(__file__).with_name("cpu_gemm_out.h"),
           Path(__file__).with_name("attention_int8.h"))  # included by the sources: part of the build key


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


def cpu_kernels():
    """The compiled C++ kernels module, or None if it cannot be built (no compiler, no ninja...).

    Built once per process; the build directory is keyed by the sources, flags, CPU and paths. A build
    that exists is imported directly (:func:`_load_built`).
    """
    global _KERNEL, _KERNEL_TRIED
    if _KERNEL_TRIED:
        return _KERNEL
    _KERNEL_TRIED = True
    try:
        cflags = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]
        # -march=native: the build is only valid on this kind of CPU, so its flags are part of the key.
        cpu = ""
        try:
            cpu = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
        except OSError:
            pass
        # The build records absolute paths (sources, the venv's torch headers): checkouts or venvs sharing
        # one cache would otherwise overwrite each other's build and recompile (~30 s) on every switch.
        where = f"{Path(__file__).resolve().parent}|{Path(torch.__file__).resolve().parent}"
        tag = hashlib.sha256(b"".join(f.read_bytes() for f in SOURCES + HEADERS) + " ".join(cflags).encode()
                             + cpu.encode() + where.encode()).hexdigest()[:10]
        build = envs.TINYVLLM_CACHE / "torch_extensions" / f"cpu_kernels-torch{torch.__version__.split('+')[0]}-{tag}"
        build.mkdir(parents=True, exist_ok=True)
        name = f"tinyvllm_cpu_kernels_{tag}"
        _KERNEL = _load_built(build, name)
        if _KERNEL is None:
            def build_it():
                from torch.utils.cpp_extension import load  # imports setuptools: only to build

                import time

                t0 = time.monotonic()
                logger.info("building CPU kernels (first run, ~60-180 s) in %s ...", build)
                module = load(name=name, sources=[str(f) for f in SOURCES], extra_cflags=cflags,
                            extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
                logger.info("built CPU kernels in %.1fs", time.monotonic() - t0)
                return module

            _KERNEL = _build_locked(build, name, build_it)
    except Exception as e:  # no compiler, no ninja...
        logger.warning("C++ CPU kernels unavailable (%s); using the PyTorch float64 reference backend", e)
        _KERNEL = None
    return _KERNEL
