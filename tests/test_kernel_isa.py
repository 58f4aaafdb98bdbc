"""The C++ kernels built for AVX2 only (``TINYVLLM_KERNEL_ISA=avx2``, ``-march=haswell``): the AVX2 paths that
an AVX-512 machine's native build never compiles, checked against the portable scalar loops and a float64
reference on the same inputs as the native tests (issue 42: kernels written once over ``cpu_vec.h``).

Expected values come from the scalar reference loops of the same build (``gemm_gguf_ref``,
``gemm_gguf_q8_ref``, ``set_vector_kernels(False)``), which the AVX2 kernels equal bit for bit where the
kernels' headers say so (GGUF linears, RMSNorm), and from float64 attention otherwise (the row kernel's sums
are ordered for 8 lanes, the scalar loop's for 16). The before/after bit comparison of every entry point on
both ISAs is ``scripts/kernel_bits.py``. Building the AVX2 extension takes minutes: slow tier.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinyvllm.kernels.cpu import ISA_CFLAGS, build_cpu_kernels


def test_unknown_isa_is_refused():
    with pytest.raises(ValueError, match="TINYVLLM_KERNEL_ISA must be one of"):
        build_cpu_kernels("avx9000")
    assert set(ISA_CFLAGS) == {"native", "avx2"}


def _has_avx2() -> bool:
    try:
        flags = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return {"avx2", "fma", "f16c"} <= set(flags)


@pytest.fixture(scope="module")
def avx2():
    if not _has_avx2():
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    kern = build_cpu_kernels("avx2")
    assert kern.vector_kernels_isa() == "avx2" and not kern.has_avx512() and not kern.has_tiled_attention()
    assert kern.gemm_gguf_isa() == "avx2"
    return kern


@pytest.mark.slow
@pytest.mark.parametrize("qtype,n,k", [("Q8_0", 250, 160), ("Q4_0", 232, 160), ("Q4_1", 250, 160),
                                       ("Q4_K", 250, 512), ("Q6_K", 232, 512)])
def test_avx2_gguf_kernels_equal_their_scalar_loops(avx2, qtype, n, k):
    from tinyvllm.benchmarks.random_gguf import random_blocks
    from tinyvllm.model.gguf_quant import repack

    raw = random_blocks(np.random.default_rng(5), n, k, qtype, k ** -0.5)
    w = repack(raw, qtype, n, k, "t")
    g = torch.Generator().manual_seed(n + k)
    bias = torch.randn(n, generator=g)
    for m in (1, 2, 3, 9, 63):
        x = torch.randn(m, k, generator=g)
        for xx in (x.to(torch.bfloat16), x):
            assert torch.equal(avx2.gemm_gguf(xx, w.qs, w.scales, w.fmt, n, k, bias),
                               avx2.gemm_gguf_ref(xx, w.qs, w.scales, w.fmt, n, k, bias)), (qtype, m, xx.dtype)
            if qtype != "Q6_K":
                assert torch.equal(avx2.gemm_gguf_q8(xx, w.qs, w.scales, w.fmt, n, k, bias),
                                   avx2.gemm_gguf_q8_ref(xx, w.qs, w.scales, w.fmt, n, k, bias)), (qtype, m, xx.dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_rms_norm_equals_the_scalar_loop_and_silu_matches_reference(avx2, dtype):
    g = torch.Generator().manual_seed(1)
    for hidden in (64, 1000):
        x = torch.randn(37, hidden, generator=g).to(dtype)
        r = torch.randn(37, hidden, generator=g).to(dtype)
        w = torch.randn(hidden, generator=g).to(dtype)
        try:
            avx2.set_vector_kernels(True)
            vec = [avx2.rms_norm(x, res, w, 1e-6) for res in (None, r)]
            act = avx2.silu_and_mul(torch.randn(37, 2 * hidden, generator=g).mul(4).to(dtype))
            avx2.set_vector_kernels(False)
            ref = [avx2.rms_norm(x, res, w, 1e-6) for res in (None, r)]
        finally:
            avx2.set_vector_kernels(True)
        for a, b in zip(vec, ref):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    xg = torch.randn(5, 2 * 24, generator=g).mul(4).to(dtype)
    want = torch.nn.functional.silu(xg[:, :24].double()) * xg[:, 24:].double()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(avx2.silu_and_mul(xg).double(), want, **tol)
    assert act.dtype == dtype


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,d,block_size", [(4, 4, 16, 4), (4, 2, 32, 16), (9, 3, 64, 4), (2, 1, 128, 16),
                                                (6, 2, 96, 16)])
def test_avx2_row_attention_matches_reference_and_is_batch_invariant(avx2, dtype, hq, hk, d, block_size):
    from test_cpu_kernels import SEQS, make_batch

    args, ref = make_batch(SEQS, hq, hk, d, block_size, dtype)
    out = avx2.paged_attention(*args, d ** -0.5)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    # each sequence alone gives its rows' bits in the batch
    q, kc, vc, bt, seq, pos = args
    for i in range(len(SEQS)):
        rows = (seq == i).nonzero().flatten()
        alone = avx2.paged_attention(q[rows], kc, vc, bt[i:i + 1], torch.zeros_like(seq[rows]), pos[rows], d ** -0.5)
        assert torch.equal(alone, out[rows]), i
