// Batch-invariant bf16 linear layer for the CPU: y = x @ W^T (+ bias), on pre-packed weights.
//
// Interface (bound by the pybind module in cpu_kernel.cpp; no PYBIND11_MODULE here):
//
//   // w: [N, K] bfloat16 -> packed weight, bf16 tensor [ceil(N/64), Kp/2, 64, 2], Kp = K rounded
//   // up to even; zero-padded in N and K.
//   torch::Tensor gemm_pack_bf16(torch::Tensor w);
//
//   // x: [..., K] bfloat16 (last-dim stride 1; a 2-D x may have row stride > K), packed from
//   // gemm_pack_bf16(w), N, K. Returns [..., N] bfloat16: every element is the fp32 sum over k of
//   // x*w (+ bias[n], added in fp32) rounded to bf16 once, round-to-nearest-even (same bits as
//   // torch's float -> bfloat16 conversion); with out_float, [..., N] float32: the same sums, not
//   // rounded (cpu_common.h; for the LM head's logits).
//   torch::Tensor gemm_bf16(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t K,
//                           c10::optional<torch::Tensor> bias, bool out_float);
//
// Batch invariance, by construction. Output element (m, n) is always produced by the same
// instruction sequence: one fp32 accumulator lane (lane n % 16 of a zmm), zeroed, then one
// VDPBF16PS per k-pair for kp = 0, 1, ..., Kp/2 - 1 in that order, then "+ bias" and the RNE
// rounding. The register-tile variants (1..6 rows x 1..4 zmm columns) differ only in how many
// independent accumulators run side by side, never in the per-element sequence, and K is never
// split (no split-K, no K-blocking with M-dependent grouping). So row m of y is bit-identical
// whatever M is, wherever the row sits in x, and whichever thread/tile computes it.
//
// Techniques:
//  * VNNI-style weight packing (as used by oneDNN / Intel AMX-BF16 & AVX512-BF16 GEMMs): W is
//    stored as [N/64 blocks][K/2 pairs][64 cols][2], so one 64-byte aligned load gives 16 columns
//    x one k-pair, exactly the B operand of _mm512_dpbf16_ps, and the weights of one column block
//    are a single contiguous stream (hardware prefetch friendly).
//  * Outer-product register blocking (Goto & van de Geijn, "Anatomy of high-performance matrix
//    multiplication", TOMS 2008; BLIS micro-kernels): a 6 x 64 tile of C lives in 24 zmm
//    accumulators; per k-pair: 4 weight loads, 6 broadcasts of an x pair (vpbroadcastd), 24 dpbf16.
//  * Cache blocking: a 64-column weight panel (64 x K bf16 <= 192 KiB for K = 1536) stays in
//    L1/L2 while all M tiles sweep over it, so every weight byte comes from DRAM once per call
//    and the small-M (decode, GEMV-like) case is a pure weight stream at memory bandwidth.
//  * Threads (tv_pool::parallel_for, cpu_pool.h): for small M the N dimension is split at 16-column granularity
//    (so e.g. N = 576 splits 18/18 over 2 threads); for larger M the work items are
//    (64-column block, 6-row tile) pairs in block-major order, so each thread keeps re-using a
//    panel across consecutive tiles. Neither split touches the K reduction.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "cpu_pool.h"
#include "cpu_common.h"
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#include <optional>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TINYVLLM_GEMM_AVX512BF16 1
#endif

// cpu_gemm_amx.cpp: the same GEMM on AMX tiles (TDPBF16PS), used when available and switched on.
bool gemm_amx_active();
void gemm_amx(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* packed, int64_t N,
              int64_t Kp, tv_cpu::GemmOut out, const float* bias);

namespace {

using tv_cpu::GemmOut;
using tv_cpu::bf16_bits_to_f;
using tv_cpu::ceil_div;

constexpr int64_t kBlockN = 64;   // columns per packed block (4 zmm of 16 fp32 lanes)
constexpr int kMaxRows = 6;       // rows per register tile
constexpr int64_t kSmallM = 12;   // up to this M, split N at 16-column granularity
constexpr int64_t kMBlockTiles = 32;  // M block (Goto "mc") for large M: 32 tiles, <= 192 rows



#if defined(TINYVLLM_GEMM_AVX512BF16)


// One register tile: R rows of x (row stride ldx elements) times C zmm columns (16 output
// columns each) of a packed block. `b` points at k-pair 0 of the first of those columns inside
// its block; consecutive k-pairs are kBlockN*2 elements apart. Writes R x ncols outputs (ncols
// <= 16*C; the rest are padding columns) to `out` (row stride ldo). `bias` (fp32, padded with
// zeros to the block) may be null. [pf, pf_end): bytes to prefetch into L2 meanwhile, pf_per_kp
// cache lines per k-pair (prefetching only, no effect on results).
template <int R, int C>
void tile_kernel(const uint16_t* __restrict x, int64_t ldx, const uint16_t* __restrict b,
                 int64_t kpairs, GemmOut out, int64_t ldo, int64_t ncols,
                 const float* __restrict bias, const char* pf, const char* pf_end,
                 int64_t pf_per_kp) {
  constexpr int64_t kStride = kBlockN * 2;   // elements per k-pair row of a block
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();

  const uint16_t* xr[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) xr[r] = x + r * ldx;

  for (int64_t kp = 0; kp < kpairs; ++kp) {
    const uint16_t* bk = b + kp * kStride;
    // Panel prefetch: bring the thread's next weight panel into L2 while this tile computes on
    // a cached one (overlaps the DRAM stream with compute when several tiles share a panel).
    for (int64_t j = 0; j < pf_per_kp && pf < pf_end; ++j, pf += 64)
      _mm_prefetch(pf, _MM_HINT_T1);
    __m512i bv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) bv[c] = _mm512_load_si512(reinterpret_cast<const void*>(bk + c * 32));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, xr[r] + 2 * kp, sizeof(pair));
      const __m512i xb = _mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)xb, (__m512bh)bv[c]);
    }
  }

  // Epilogue: + bias (fp32), RNE to bf16 (or float32 as it is), (masked) store.
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c)
    if (!tv_cpu::store_cols16(out, ldo, R, ncols, c, bias, [&](int64_t r) { return acc[r][c]; })) break;
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, GemmOut, int64_t,
                        int64_t, const float*, const char*, const char*, int64_t);

struct TileTable {
  using Table = TileFn[kMaxRows][4];
  Table fn;
  TileTable() {
    fill<1>();
  }
  template <int R>
  void fill() {
    fn[R - 1][0] = &tile_kernel<R, 1>;
    fn[R - 1][1] = &tile_kernel<R, 2>;
    fn[R - 1][2] = &tile_kernel<R, 3>;
    fn[R - 1][3] = &tile_kernel<R, 4>;
    if constexpr (R < kMaxRows) fill<R + 1>();
  }
};

// Rows of tile mt when M rows are cut into mtiles near-equal tiles (<= kMaxRows each), so that
// e.g. M = 8 runs as 4 + 4 rather than 6 + 2 (short tiles have too few accumulator chains to
// hide the dpbf16 latency). Which tile a row lands in does not change its result.
inline int64_t tile_start(int64_t mt, int64_t M, int64_t mtiles) { return mt * M / mtiles; }

void gemm_avx512(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* packed, int64_t N,
                 int64_t Kp, GemmOut out, const float* bias) {
  static const TileTable tiles;
  const int64_t kpairs = Kp / 2;
  const int64_t block_elems = kpairs * kBlockN * 2;
  const int64_t block_bytes = block_elems * 2;
  const int64_t nblocks = ceil_div(N, kBlockN);
  const int64_t mtiles = ceil_div(M, kMaxRows);
  const char* packed_end = reinterpret_cast<const char*>(packed + nblocks * block_elems);
  // Tiny problems: don't pay the thread fork.
  const bool tiny = M * N * Kp < (int64_t{1} << 18);

  // Run M tiles mt0..mt1-1 over one panel (`b`: c zmm columns starting at column n0). With
  // several tiles per panel, each tile also prefetches its 1/tn share of `next` (the
  // following block) into L2, so the DRAM stream of the next panel overlaps this panel's
  // compute. (Measured: with a single tile per panel, M <= 6, the hardware prefetcher alone
  // streams faster, ~40 GB/s on one core, and extra software prefetch only slows it down.)
  // [ta, ta + tn) are the tiles that sweep this panel in all (they share the prefetch).
  auto panel = [&](const uint16_t* b, int64_t c, int64_t n0, int64_t mt0, int64_t mt1,
                   int64_t ta, int64_t tn, const char* next) {
    const int64_t ncols = std::min<int64_t>(16 * c, N - n0);
    for (int64_t mt = mt0; mt < mt1; ++mt) {
      const int64_t m0 = tile_start(mt, M, mtiles), rows = tile_start(mt + 1, M, mtiles) - m0;
      const char* pf = nullptr;
      const char* pf_end = nullptr;
      int64_t pf_per_kp = 0;
      if (tn > 1 && next < packed_end) {
        const int64_t lines = block_bytes / 64;
        const int64_t l0 = (mt - ta) * lines / tn, l1 = (mt - ta + 1) * lines / tn;
        pf = next + l0 * 64;
        pf_end = next + l1 * 64;
        pf_per_kp = ceil_div(l1 - l0, kpairs);
      }
      tiles.fn[rows - 1][c - 1](x + m0 * ldx, ldx, b, kpairs, out.offset(m0 * N + n0), N, ncols,
                                bias ? bias + n0 : nullptr, pf, pf_end, pf_per_kp);
    }
  };

  if (M <= kSmallM) {
    // Decode / GEMV-like: split N in 16-column units (so N = 576 splits evenly over 2 threads);
    // each chunk (<= 4 units inside one block) runs all M rows.
    const int64_t units = ceil_div(N, 16);
    auto body = [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1;) {
        const int64_t c = std::min<int64_t>(4 - u % 4, u1 - u);   // stay inside one block
        const int64_t nb = u / 4;
        panel(packed + nb * block_elems + (u % 4) * 32, c, u * 16, 0, mtiles, 0, mtiles,
              reinterpret_cast<const char*>(packed + (nb + 1) * block_elems));
        u += c;
      }
    };
    if (tiny) body(0, units); else tv_pool::parallel_for(0, units, 1, body);
    return;
  }

  // Prefill: work items (M block, 64-column block, M tile), in that nesting order (Goto-style:
  // an M block of x, <= kMBlockTiles tiles, stays in L2 while the weight panels stream past it,
  // and each panel stays in L1/L2 while the block's tiles sweep it). A thread's contiguous range
  // of items thus sweeps its tiles over one panel before moving on to the next. The M blocking
  // also bounds the x footprint per sweep (192 rows x K=1536 bf16 = 576 KiB) and the number of
  // output rows written per panel sweep.
  const int64_t per_mblock = nblocks * kMBlockTiles;
  auto body = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1;) {
      const int64_t mb = i / per_mblock;
      const int64_t ta = mb * kMBlockTiles;                          // first tile of this M block
      const int64_t tn = std::min<int64_t>(kMBlockTiles, mtiles - ta); // tiles in this M block
      const int64_t j = i - mb * per_mblock;
      const int64_t nb = j / tn, mt0 = ta + j % tn;
      const int64_t mt1 = std::min<int64_t>(ta + tn, mt0 + (i1 - i));
      const int64_t n0 = nb * kBlockN;
      const int64_t c = ceil_div(std::min<int64_t>(kBlockN, N - n0), 16);
      panel(packed + nb * block_elems, c, n0, mt0, mt1, ta, tn,
            reinterpret_cast<const char*>(packed + (nb + 1) * block_elems));
      i += mt1 - mt0;
    }
  };
  if (tiny) body(0, nblocks * mtiles); else tv_pool::parallel_for(0, nblocks * mtiles, 1, body);
}

#else  // portable scalar fallback

// Plain fixed-order loop: acc = 0; for k in 0..Kp-1: acc += x[k] * w[k] (fp32, no contraction
// assumed: build with -ffp-contract=off). Each element's sequence is independent of M and of the
// thread, so it is batch invariant too (results need not match the AVX-512 path bit for bit).
void gemm_scalar(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* packed, int64_t N,
                 int64_t Kp, GemmOut out, const float* bias) {
  const int64_t kpairs = Kp / 2;
  const int64_t block_elems = kpairs * kBlockN * 2;
  tv_pool::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint16_t* wb = packed + (n / kBlockN) * block_elems + (n % kBlockN) * 2;
      for (int64_t m = 0; m < M; ++m) {
        const uint16_t* xr = x + m * ldx;
        float acc = 0.0f;
        for (int64_t kp = 0; kp < kpairs; ++kp) {
          const uint16_t* w = wb + kp * kBlockN * 2;
          acc += bf16_bits_to_f(xr[2 * kp]) * bf16_bits_to_f(w[0]);
          acc += bf16_bits_to_f(xr[2 * kp + 1]) * bf16_bits_to_f(w[1]);
        }
        if (bias) acc += bias[n];
        out.store1(m * N + n, acc);
      }
    }
  });
}

#endif

}  // namespace

torch::Tensor gemm_pack_bf16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "gemm_pack_bf16: w must be [N, K]");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "gemm_pack_bf16: w must be bfloat16");
  TORCH_CHECK(w.device().is_cpu(), "gemm_pack_bf16: w must be on the CPU");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t Kp = K + (K & 1);
  const int64_t nblocks = ceil_div(N, kBlockN);
  auto packed = torch::zeros({nblocks, Kp / 2, kBlockN, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb) {
      uint16_t* blk = dst + nb * (Kp / 2) * kBlockN * 2;
      for (int64_t j = 0; j < kBlockN && nb * kBlockN + j < N; ++j) {
        const uint16_t* row = src + (nb * kBlockN + j) * K;
        for (int64_t k = 0; k < K; ++k) blk[(k / 2) * kBlockN * 2 + j * 2 + (k & 1)] = row[k];
      }
    }
  });
  return packed;
}

torch::Tensor gemm_bf16(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t K,
                        c10::optional<torch::Tensor> bias, bool out_float) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "gemm_bf16: x must be bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "gemm_bf16: packed must be a contiguous bfloat16 tensor from gemm_pack_bf16");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "gemm_bf16: CPU tensors only");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "gemm_bf16: x must be [..., K]");
  const int64_t Kp = K + (K & 1);
  TORCH_CHECK(packed.numel() == ceil_div(N, kBlockN) * Kp * kBlockN,
              "gemm_bf16: packed size does not match (N, K)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0,
              "gemm_bf16: packed must be 64-byte aligned (use the tensor gemm_pack_bf16 returned, not a view)");

  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  torch::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, K});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  const int64_t M = x2.size(0);
  if (K & 1) {  // zero-fill the tail pair: copy into a [M, K+1] buffer
    auto xp = torch::zeros({M, Kp}, x2.options());
    xp.narrow(1, 0, K).copy_(x2);
    x2 = xp;
  }
  int64_t ldx = x2.stride(0);
  if (M <= 1) ldx = Kp;
  auto out = torch::empty({M, N}, x.options().dtype(out_float ? at::kFloat : at::kBFloat16));
  if (M == 0 || N == 0) return out.view(out_shape);

  // Bias as fp32, zero-padded to whole blocks (the tile epilogue loads 16 lanes at a time).
  torch::Tensor bias_f;
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "gemm_bf16: bias must have N elements");
    bias_f = torch::zeros({ceil_div(N, kBlockN) * kBlockN}, x.options().dtype(at::kFloat));
    bias_f.narrow(0, 0, N).copy_(bias->reshape({N}));
    bias_ptr = bias_f.data_ptr<float>();
  }

  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const GemmOut op{out.data_ptr(), out_float};
#if defined(TINYVLLM_GEMM_AVX512BF16)
  if (gemm_amx_active()) gemm_amx(xp, ldx, M, wp, N, Kp, op, bias_ptr);
  else gemm_avx512(xp, ldx, M, wp, N, Kp, op, bias_ptr);
#else
  gemm_scalar(xp, ldx, M, wp, N, Kp, op, bias_ptr);
#endif
  return out.view(out_shape);
}

// Whether gemm_bf16 runs the AVX512-BF16 kernel. Without it the portable loop is correct and batch
// invariant but ~100x slower than oneDNN at large M, so callers should not pack weights then.
bool gemm_has_bf16_kernel() {
#if defined(TINYVLLM_GEMM_AVX512BF16)
  return true;
#else
  return false;
#endif
}
