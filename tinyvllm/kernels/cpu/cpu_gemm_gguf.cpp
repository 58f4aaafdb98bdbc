// Batch-invariant linear layer on GGUF block-quantized weights (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), bf16
// or float32 activations: y = x @ W^T (+ bias) with W kept in its 4/6/8-bit blocks, repacked once at
// load (tinyvllm/model/gguf_quant.py) into the layout below.
//
// Interface (bound by the pybind module in cpu_kernel.cpp):
//
//   // x: [..., K] bf16 or float32 (K a multiple of 32). qs, scales: the repacked weight (layout
//   // below) of an [N, K] matrix. fmt: 0 = Q8_0 (w = d*q), 1 = Q4 (w = d*q + m; Q4_0 is m = -8d), 2 =
//   // Q4_K (as 1 with fp32 d, m per 32: d = d_super*sc_j, m = -dmin_super*m_j), 3 = Q6_K (the 6-bit
//   // q-32 and one fp32 scale d_super*sc_j per 16). Returns [..., N] in x's dtype: bf16 rounded
//   // once (RNE) from the fp32 value defined under "Arithmetic", or that fp32 value itself. Errors
//   // (RuntimeError): another dtype or device, K % 32 != 0, qs/scales not matching (N, K, fmt).
//   torch::Tensor gemm_gguf(x, qs, scales, fmt, N, K, bias = None);
//   torch::Tensor gemm_gguf_ref(...)   // same arguments; the portable scalar loop (tests)
//   std::string gemm_gguf_isa()        // "avx512_bf16", "avx2" (AVX2 + FMA + F16C) or "scalar"
//   torch::Tensor gemm_gguf_q8(...)    // same arguments, fmt 0..2: int8 activations per 32-block
//   torch::Tensor gemm_gguf_q8_ref(...) // its portable scalar loop
//   std::string gemm_gguf_q8_isa()     // "avx512_vnni" (VPDPBUSD), "avx2" (VPMADDUBSW) or "scalar"
//   (float32 x runs the AVX2 kernels on AVX-512 machines too; the AVX-512 kernels read bf16 only.)
//   (gemm_gguf_q8's arithmetic: the section "int8 activations" below.)
//
// Repacked layout, per group g of 16 output columns (G = ceil(N/16), zero-padded) and per block b of
// 32 k (nb = K/32; a K-quant super-block of 256 is 8 such blocks):
//   fmt 1, 2 (Q4, Q4_K): qs uint8 [G, nb, 8, 32]; chunk j covers k = 4j..4j+3 of the block;
//       byte 2c+e (c = column in the group, e = 0/1) = q[c][4j+e] | q[c][4j+2+e] << 4.
//       fmt 1: scales fp16 [G, nb, 2, 16]: d then m of each column's block.
//       fmt 2: scales uint8 [G, nb/8, 384], per super-block s of 8 blocks: bytes 32i..32i+31 the
//       6-bit sc then m of block 8s+i (16 columns each); bytes 256..319 fp32 d[16], 320..383 fp32
//       -dmin[16] (the fp16 super-block values). The block's d' = d*sc and m' = -dmin*m are formed
//       in fp32 (exact: 11 x 6 bits), so the arithmetic below sees the exact products.
//   fmt 3 (Q6_K, q = 0..63, w = d*(q-32)): qs uint8 [G, nb, 384]: bytes 0..255 the low nibbles in
//       the fmt 1 layout; bytes 256 + 32t .. +31 (t = 0..3) the top two bits of chunks j = 2t (low
//       nibble of each byte) and 2t+1 (high nibble), each nibble h | h' << 2 for the two values its
//       chunk's byte holds. scales uint8 [G, nb/8, 320], per super-block: bytes 32i..32i+31 the int8
//       sc of k 0..15 then k 16..31 of block 8s+i (16 columns each), bytes 256..319 fp32 d[16].
//       The scale d*sc is formed in fp32 (exact: 11 x 8 bits).
//   fmt 0 (Q8_0): qs int8 [G, nb, 16, 32]; row kp holds byte 2c+e = q[c][2kp+e].
//       scales fp16 [G, nb, 1, 16]: d.
// So one 32-byte load is one or two k-pairs x 16 columns, already in the pair order of the
// VDPBF16PS B operand (as the bf16 GEMM's VNNI packing, cpu_gemm.cpp).
//
// Arithmetic (the same for every row, every M, every tile shape; the scalar reference spells it
// out): the quantized integers q are converted to bf16 exactly (|q| <= 128), and for each output
// element (m, n), with fp32 lanes (dpbf16(p, x, q) = fma(x_even, q_even, fma(x_odd, q_odd, p)):
// VDPBF16PS's order; for bf16 x every product is exact, so fma = mul + add; for float32 x the
// products round, and every path uses the fmas):
//     acc = 0
//     for b in 0..nb-1:                      // fixed k order, no split-K
//       if Q6_K:
//         for h in 0, 1:                     // the two 16-weight sub-blocks of the block
//           p = 0;  for kp in 8h..8h+7: p = dpbf16(p, x[m, 32b+2kp : +2], q[n, 32b+2kp : +2])
//           acc = fma(p, d[n,b,h], acc)
//       else:
//         p = 0;  for kp in 0..15: p = dpbf16(p, x[m, 32b+2kp : +2], q[n, 32b+2kp : +2])
//         acc = fma(p, d[n,b], acc)
//         if Q4, Q4_K: acc = fma(xs[m,b], m[n,b], acc)  // xs[m,b] = sum of x[m, 32b : 32b+32] (fixed order)
//     y = bf16_rne(acc (+ bias[n]))          // float32 x: y = acc (+ bias[n])
// i.e. the block factorisation sum_b d_b (x . q)_b + m_b sum(x)_b (the one llama.cpp's
// ggml_vec_dot_q4_1_q8_1 uses, but with bf16 activations instead of int8-quantized ones, and the
// weights' exact values d*q+m instead of their bf16 rounding: closer to the float32 dequantized
// model than the bf16 path). Row m's result depends on nothing but row m and W: batch invariant.
//
// Speed: Q4 nibbles -> bf16 words is one vpmovzxbw per two k-pairs and one vpermw table lookup per
// k-pair (the 16 values 0..15 as bf16), so a decode step streams ~5 bits/weight instead of 16
// (Q4_K: 4.75; Q6_K: 6.625, its 6-bit values looked up in a 64-word table with vpermt2w).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "cpu_pool.h"
#include "cpu_common.h"
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#include <immintrin.h>
#define TINYVLLM_QGEMM_AVX512 1
#endif
// The AVX2 kernels are built wherever AVX2 exists (AVX-512 machines too): they run every float32 call.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TINYVLLM_QGEMM_AVX2 1
#endif

namespace {

using tv_cpu::GemmOut;
using tv_cpu::ceil_div;
using tv_cpu::f_to_bf16_bits;

constexpr int64_t kGroup = 16;   // columns per group
constexpr int64_t kQBlock = 32;  // k per GGUF block


// Activations are bf16 (uint16_t bits) or float32, as the call's x is; outputs too, or float32 for
// bf16 x with out_float.
inline float act_f(uint16_t h) { return tv_cpu::bf16_bits_to_f(h); }
inline float act_f(float f) { return f; }
inline void store_out(void* out, bool f32, int64_t i, float v) { GemmOut{out, f32}.store1(i, v); }

inline float half_to_f(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// Format traits: nibbles (Q4, Q4_K) or int8 (Q8_0, Q6_K); a block minimum (Q4, Q4_K); two
// 16-sub-blocks per block (Q6_K). The K-quants' scales d_super * sc_j are exact in fp32, not fp16.
constexpr bool fmt_nib(int fmt) { return fmt >= 1; }  // a low-nibble plane in the Q4 layout
constexpr bool fmt_hi2(int fmt) { return fmt == 3; }  // plus a plane of the top two bits (Q6_K)
constexpr bool fmt_min(int fmt) { return fmt == 1 || fmt == 2; }
constexpr bool fmt_halves(int fmt) { return fmt == 3; }
inline int64_t qs_block_bytes(int fmt) { return fmt == 0 ? 512 : fmt == 3 ? 384 : 256; }
// Bytes of scales per (group, block): fp16 d (Q8_0); fp16 d, m (Q4); Q4_K: 384 per 8 blocks;
// fp32 two scales (Q6_K).
inline int64_t sc_group_block_bytes(int fmt) { return fmt == 0 ? 32 : fmt == 1 ? 64 : fmt == 2 ? 48 : 40; }

inline float f32_at(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, sizeof(f));
  return f;
}

// Column c's scale `which` (0: d, or Q6_K's first 16; 1: m, or Q6_K's second 16) of block b, as fp32.
// gs: the group's scales at block 0.
inline float scale_at(int fmt, const uint8_t* gs, int64_t b, int which, int c) {
  if (fmt == 2) {
    const uint8_t* sb = gs + (b / 8) * 384;
    return f32_at(sb + 256 + 64 * which + 4 * c) * static_cast<float>(sb[(b % 8) * 32 + 16 * which + c]);
  }
  if (fmt == 3) {
    const uint8_t* sb = gs + (b / 8) * 320;
    return f32_at(sb + 256 + 4 * c) * static_cast<float>(static_cast<int8_t>(sb[(b % 8) * 32 + 16 * which + c]));
  }
  uint16_t h;
  std::memcpy(&h, gs + b * sc_group_block_bytes(fmt) + 32 * which + 2 * c, sizeof(h));
  return half_to_f(h);
}

// Sum of x[r, 32b : 32b+32] in a fixed order: s = ((x0 + x1) + x2) + ... (scalar, the reference's).
template <typename T>
inline float block_sum_scalar(const T* x) {
  float s = 0.0f;
  for (int i = 0; i < 32; ++i) s += act_f(x[i]);
  return s;
}

// The integer q[n][k] of the repacked weight (reference path).
inline int q_at(int fmt, const uint8_t* gq, int64_t b, int c, int k) {
  if (fmt_nib(fmt)) {
    const uint8_t* blk = gq + b * qs_block_bytes(fmt);
    const int j = k / 4, kk = k % 4;
    const uint8_t byte = blk[j * 32 + 2 * c + (kk & 1)];
    const int lo = kk < 2 ? (byte & 0xF) : (byte >> 4);
    if (!fmt_hi2(fmt)) return lo;
    const uint8_t hb = blk[256 + (j / 2) * 32 + 2 * c + (kk & 1)];
    const int h = (j & 1) ? (hb >> 4) : (hb & 0xF);
    return (lo | (((kk < 2 ? h : h >> 2) & 3) << 4)) - 32;
  }
  const int8_t* row = reinterpret_cast<const int8_t*>(gq + b * 512 + (k / 2) * 32);
  return row[2 * c + (k & 1)];
}

// The scalar references' loop over every output element (m, n), columns split over threads in 16s:
// y[m, n] = elem(m, c, gq, gs) (+ bias[n]) stored rounded (or float32), where c is n's column in its
// group and gq / gs the group's weights and scales at block 0.
template <typename Elem>
void ref_elements(int64_t M, int64_t N, int64_t K, const uint8_t* qs, const uint8_t* sc, int fmt, void* out,
                  bool out_f32, const float* bias, const Elem& elem) {
  const int64_t nb = K / kQBlock;
  const int64_t gq_stride = nb * qs_block_bytes(fmt), gs_stride = nb * sc_group_block_bytes(fmt);
  tv_pool::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t g = n / kGroup;
      const int c = static_cast<int>(n % kGroup);
      for (int64_t m = 0; m < M; ++m) {
        float acc = elem(m, c, qs + g * gq_stride, sc + g * gs_stride);
        if (bias) acc += bias[n];
        store_out(out, out_f32, m * N + n, acc);
      }
    }
  });
}

template <typename T>
void gemm_ref(const T* x, int64_t ldx, int64_t M, const uint8_t* qs, const uint8_t* sc, int fmt,
              int64_t N, int64_t K, void* out, bool out_f32, const float* bias) {
  const int64_t nb = K / kQBlock;
  ref_elements(M, N, K, qs, sc, fmt, out, out_f32, bias, [&](int64_t m, int c, const uint8_t* gq, const uint8_t* gs) {
        const T* xr = x + m * ldx;
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
          float p = 0.0f;
          for (int kp = 0; kp < 16; ++kp) {  // VDPBF16PS: odd element first, then even
            const int k = 2 * kp;           // (fma: for bf16 x the product is exact, so = mul + add)
            p = std::fma(act_f(xr[b * 32 + k + 1]), static_cast<float>(q_at(fmt, gq, b, c, k + 1)), p);
            p = std::fma(act_f(xr[b * 32 + k]), static_cast<float>(q_at(fmt, gq, b, c, k)), p);
            if (fmt_halves(fmt) && kp % 8 == 7) {  // Q6_K: fold each 16-weight sub-block
              acc = std::fma(p, scale_at(fmt, gs, b, kp / 8, c), acc);
              p = 0.0f;
            }
          }
          if (fmt_halves(fmt)) continue;
          acc = std::fma(p, scale_at(fmt, gs, b, 0, c), acc);
          if (fmt_min(fmt)) acc = std::fma(block_sum_scalar(xr + b * 32), scale_at(fmt, gs, b, 1, c), acc);
        }
        return acc;
  });
}

#if defined(TINYVLLM_QGEMM_AVX512)

// 32 words: bf16 of (i & 15) (vpermw reads 5 index bits; the upper half repeats the lower).
inline __m512i nibble_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = f_to_bf16_bits(static_cast<float>(i & 15));
  return _mm512_load_si512(t);
}

// The 16 columns' scale `which` of block b as fp32 lanes (scale_at's vector form). gs: the group's
// scales at block 0. Q4_K: the u8 sc (m) times the super-block's fp32 d (-dmin): exact products.
template <int FMT>
inline __m512 load_scales(const uint8_t* gs, int64_t b, int which) {
  if constexpr (FMT == 2) {
    const uint8_t* sb = gs + (b / 8) * 384;
    const __m512 s = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + (b % 8) * 32 + 16 * which))));
    return _mm512_mul_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(sb + 256 + 64 * which)), s);
  } else if constexpr (FMT == 3) {
    const uint8_t* sb = gs + (b / 8) * 320;
    const __m512 s = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + (b % 8) * 32 + 16 * which))));
    return _mm512_mul_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(sb + 256)), s);
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gs + b * (FMT == 0 ? 32 : 64) + 32 * which)));
  }
}

// 64 words: bf16 of i - 32 (Q6_K), the two 32-word halves of a vpermt2w table.
inline __m512i q6_table(int half) {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = f_to_bf16_bits(static_cast<float>(32 * half + i - 32));
  return _mm512_load_si512(t);
}

// The 32 bf16 words (16 columns x one k-pair) of k-pair 2j+half of a block: w = the chunk's 32
// nibble bytes as words, h = its top-two-bits nibbles as words (Q6_K; ignored otherwise).
template <int FMT>
inline __m512i decode_pair(__m512i w, __m512i h, int half, __m512i table, __m512i t6lo, __m512i t6hi) {
  if constexpr (fmt_hi2(FMT)) {
    // index bits 0..3: the nibble; bits 4..5: the top bits (vpermt2w ignores bits 6 and up)
    const __m512i lo = half ? _mm512_srli_epi16(w, 4) : w;
    const __m512i hi = half ? _mm512_slli_epi16(h, 2) : _mm512_slli_epi16(h, 4);
    const __m512i idx = _mm512_ternarylogic_epi32(_mm512_set1_epi16(0x0F), lo, hi, 0xCA);  // a ? b : c
    return _mm512_permutex2var_epi16(t6lo, idx, t6hi);
  } else {
    return _mm512_permutexvar_epi16(half ? _mm512_srli_epi16(w, 4) : w, table);
  }
}

// Top-two-bits plane of chunk j of block b as words (its nibble in bits 0..3).
inline __m512i load_hi2(const uint8_t* gq, int64_t b, int j) {
  const __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gq + b * 384 + 256 + (j / 2) * 32)));
  return (j & 1) ? _mm512_srli_epi16(h, 4) : h;
}

// acc[r][c] (+ bias) rounded to bf16 (RNE), or float32 as it is, into out rows r, columns 16c..16c+15
// (masked past ncols).
template <int R, int C>
inline void store_tile(__m512 (&acc)[R][C], GemmOut out, int64_t ldo, int64_t ncols, const float* bias) {
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c)
    if (!tv_cpu::store_cols16(out, ldo, R, ncols, c, bias, [&](int64_t r) { return acc[r][c]; })) break;
}

// The steps qtile and qtile_scratch (and the q8 tiles below) share. Zero an R x C tile of vectors.
template <int R, int C, typename V>
inline void zero_tile(V (&a)[R][C]) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) a[r][c] = V{};
}

// xr[r] = row r of x (rows ldx elements apart).
template <int R>
inline void row_ptrs(const uint16_t* x, int64_t ldx, const uint16_t* (&xr)[R]) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) xr[r] = x + r * ldx;
}

// p[r][c] = dpbf16(p[r][c], x[r] k-pair at k, bv[c]) for the tile's R rows (xr[r]: row r of x).
template <int R, int C>
inline void dot_pair(__m512 (&p)[R][C], const uint16_t* const* xr, int64_t k, const __m512i* bv) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    int32_t pair;
    std::memcpy(&pair, xr[r] + k, sizeof(pair));
    const __m512i xv = _mm512_set1_epi32(pair);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) p[r][c] = _mm512_dpbf16_ps(p[r][c], (__m512bh)xv, (__m512bh)bv[c]);
  }
}

// Fold the partials of a block (or Q6_K sub-block) into the accumulators: acc = fma(p, d, acc), then
// for a block minimum (kMin: Q4, Q4_K) acc = fma(sum(x)_b, m, acc); p = 0 where kReset (Q6_K's first
// half). dv[c], mv[c]: group c's scales d and m as fp32 lanes; xs: [R][nb] block sums.
template <int R, int C, bool kMin, bool kReset>
inline void fold_tile(__m512 (&acc)[R][C], __m512 (&p)[R][C], const __m512* dv, const __m512* mv, const float* xs,
                      int64_t nb, int64_t b) {
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      acc[r][c] = _mm512_fmadd_ps(p[r][c], dv[c], acc[r][c]);
      if constexpr (kMin) acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(xs[r * nb + b]), mv[c], acc[r][c]);
      if constexpr (kReset) p[r][c] = _mm512_setzero_ps();
    }
}

// Nibble chunk j (32 bytes) of block b as 32 words (qb: bytes per block in the qs layout).
inline __m512i load_nibble_words(const uint8_t* gq, int64_t qb, int64_t b, int j) {
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gq + b * qb + j * 32)));
}

// Q8_0: k-pair kp of block b (32 int8: 16 columns x 2) as 32 bf16 words, words 0..15 from bytes 0..15.
inline __m512i q8_pair_words(const uint8_t* gq, int64_t b, int kp) {
  const int8_t* row = reinterpret_cast<const int8_t*>(gq + b * 512 + kp * 32);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // words 0..15 from lo, 16..31 from hi
}

// R rows x C groups tile. gq[c]/gs[c]: group c's qs/scales at block 0. xs: [R][nb] block sums (Q4, Q4_K).
template <int R, int C, int FMT>
void qtile(const uint16_t* __restrict x, int64_t ldx, const float* __restrict xs, int64_t nb,
           const uint8_t* const* gq, const uint8_t* const* gs, GemmOut out, int64_t ldo,
           int64_t ncols, const float* __restrict bias, __m512i table) {
  constexpr int64_t qb = FMT == 0 ? 512 : FMT == 3 ? 384 : 256;
  __m512i t6lo = _mm512_setzero_si512(), t6hi = _mm512_setzero_si512();
  if constexpr (fmt_hi2(FMT)) { t6lo = q6_table(0); t6hi = q6_table(1); }
  const uint16_t* xr[R];
  row_ptrs(x, ldx, xr);
  __m512 acc[R][C], dv[C], mv[C];
  zero_tile(acc);
  for (int64_t b = 0; b < nb; ++b) {
    __m512 p[R][C];
    zero_tile(p);
    if constexpr (fmt_nib(FMT)) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        __m512i w[C], h[C];
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          w[c] = load_nibble_words(gq[c], qb, b, j);
          h[c] = fmt_hi2(FMT) ? load_hi2(gq[c], b, j) : w[c];
        }
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          __m512i bv[C];
#pragma GCC unroll 4
          for (int c = 0; c < C; ++c) bv[c] = decode_pair<FMT>(w[c], h[c], half, table, t6lo, t6hi);
          dot_pair<R, C>(p, xr, b * 32 + 4 * j + 2 * half, bv);
          if constexpr (fmt_halves(FMT)) {
            if (half == 1 && j % 4 == 3) {  // Q6_K: k-pair 2j+1 = 7 or 15 ends a 16-weight sub-block
#pragma GCC unroll 4
              for (int c = 0; c < C; ++c) dv[c] = load_scales<FMT>(gs[c], b, j / 4);
              fold_tile<R, C, false, true>(acc, p, dv, mv, xs, nb, b);
            }
          }
        }
      }
    } else {
#pragma GCC unroll 4
      for (int kp = 0; kp < 16; ++kp) {
        __m512i bv[C];
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) bv[c] = q8_pair_words(gq[c], b, kp);
        dot_pair<R, C>(p, xr, b * 32 + 2 * kp, bv);
      }
    }
    if constexpr (!fmt_halves(FMT)) {
      // Fold the block: acc = fma(p, d, acc) (Q4, Q4_K: then acc = fma(sum(x)_b, m, acc)).
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        dv[c] = load_scales<FMT>(gs[c], b, 0);
        if constexpr (fmt_min(FMT)) mv[c] = load_scales<FMT>(gs[c], b, 1);
      }
      fold_tile<R, C, fmt_min(FMT), false>(acc, p, dv, mv, xs, nb, b);
    }
  }
  store_tile<R, C>(acc, out, ldo, ncols, bias);
}

using QTileFn = void (*)(const uint16_t*, int64_t, const float*, int64_t, const uint8_t* const*,
                         const uint8_t* const*, GemmOut, int64_t, int64_t, const float*, __m512i);

template <int FMT>
QTileFn pick(int r, int c) {  // r <= 2 rows, c <= 4 groups (accumulators + block partials: <= 16 zmm)
  static const QTileFn fns[2][4] = {{&qtile<1, 1, FMT>, &qtile<1, 2, FMT>, &qtile<1, 3, FMT>, &qtile<1, 4, FMT>},
                                    {&qtile<2, 1, FMT>, &qtile<2, 2, FMT>, &qtile<2, 3, FMT>, &qtile<2, 4, FMT>}};
  return fns[r - 1][c - 1];
}

QTileFn pick_fmt(int fmt, int r, int c) {
  switch (fmt) {
    case 0: return pick<0>(r, c);
    case 1: return pick<1>(r, c);
    case 2: return pick<2>(r, c);
    default: return pick<3>(r, c);
  }
}

// Larger M: the panel's integers are converted to bf16 words once per (M block, panel) into a
// scratch buffer ([nb][16 k-pairs][C][32 words], 64-byte aligned; scales as fp32 [nb][C][2][16]),
// then tiles of R rows sweep it. The conversion is exact, so a tile reading the scratch runs the
// very instruction sequence per element of the in-register tile above: same bits (tests).
template <int R, int C, int FMT>
void qtile_scratch(const uint16_t* __restrict x, int64_t ldx, const float* __restrict xs, int64_t nb,
                   const uint16_t* __restrict sw, const float* __restrict sf, GemmOut out,
                   int64_t ldo, int64_t ncols, const float* __restrict bias) {
  const uint16_t* xr[R];
  row_ptrs(x, ldx, xr);
  __m512 acc[R][C], dv[C], mv[C];
  zero_tile(acc);
  for (int64_t b = 0; b < nb; ++b) {
    const uint16_t* wb = sw + b * 16 * C * 32;
    __m512 p[R][C];
    zero_tile(p);
#pragma GCC unroll 16
    for (int kp = 0; kp < 16; ++kp) {
      __m512i bv[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) bv[c] = _mm512_load_si512(reinterpret_cast<const void*>(wb + (kp * C + c) * 32));
      dot_pair<R, C>(p, xr, b * 32 + 2 * kp, bv);
      if constexpr (fmt_halves(FMT)) {
        if (kp % 8 == 7) {
#pragma GCC unroll 4
          for (int c = 0; c < C; ++c) dv[c] = _mm512_load_ps(sf + (b * C + c) * 32 + 16 * (kp / 8));
          fold_tile<R, C, false, true>(acc, p, dv, mv, xs, nb, b);
        }
      }
    }
    if constexpr (!fmt_halves(FMT)) {
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        dv[c] = _mm512_load_ps(sf + (b * C + c) * 32);
        mv[c] = _mm512_load_ps(sf + (b * C + c) * 32 + 16);
      }
      fold_tile<R, C, fmt_min(FMT), false>(acc, p, dv, mv, xs, nb, b);
    }
  }
  store_tile<R, C>(acc, out, ldo, ncols, bias);
}

// Convert groups gq[0..c-1] (all nb blocks) into the scratch layout of qtile_scratch (C slots).
template <int FMT>
void convert_panel(const uint8_t* const* gq, const uint8_t* const* gs, int c, int C, int64_t nb,
                   uint16_t* sw, float* sf, __m512i table) {
  for (int64_t b = 0; b < nb; ++b) {
    uint16_t* wb = sw + b * 16 * C * 32;
    for (int i = 0; i < C; ++i) {
      float* bs = sf + (b * C + i) * 32;
      if (i >= c) {  // padding slot: zero weights and scales
        for (int kp = 0; kp < 16; ++kp) _mm512_store_si512(reinterpret_cast<void*>(wb + (kp * C + i) * 32), _mm512_setzero_si512());
        _mm512_store_ps(bs, _mm512_setzero_ps());
        _mm512_store_ps(bs + 16, _mm512_setzero_ps());
        continue;
      }
      _mm512_store_ps(bs, load_scales<FMT>(gs[i], b, 0));
      _mm512_store_ps(bs + 16, FMT == 0 ? _mm512_setzero_ps() : load_scales<FMT>(gs[i], b, 1));
      if constexpr (fmt_nib(FMT)) {
        constexpr int64_t qb = FMT == 3 ? 384 : 256;
        __m512i t6lo = _mm512_setzero_si512(), t6hi = _mm512_setzero_si512();
        if constexpr (fmt_hi2(FMT)) { t6lo = q6_table(0); t6hi = q6_table(1); }
        for (int j = 0; j < 8; ++j) {
          const __m512i w = load_nibble_words(gq[i], qb, b, j);
          const __m512i h = fmt_hi2(FMT) ? load_hi2(gq[i], b, j) : w;
          _mm512_store_si512(reinterpret_cast<void*>(wb + ((2 * j) * C + i) * 32), decode_pair<FMT>(w, h, 0, table, t6lo, t6hi));
          _mm512_store_si512(reinterpret_cast<void*>(wb + ((2 * j + 1) * C + i) * 32), decode_pair<FMT>(w, h, 1, table, t6lo, t6hi));
        }
      } else {
        for (int kp = 0; kp < 16; ++kp)
          _mm512_store_si512(reinterpret_cast<void*>(wb + (kp * C + i) * 32), q8_pair_words(gq[i], b, kp));
      }
    }
  }
}

using QTileSFn = void (*)(const uint16_t*, int64_t, const float*, int64_t, const uint16_t*, const float*,
                          GemmOut, int64_t, int64_t, const float*);

template <int FMT>
QTileSFn pick_scratch(int r) {
  switch (r) {
    case 1: return &qtile_scratch<1, 3, FMT>;
    case 2: return &qtile_scratch<2, 3, FMT>;
    case 3: return &qtile_scratch<3, 3, FMT>;
    default: return &qtile_scratch<4, 3, FMT>;
  }
}

QTileSFn pick_scratch_fmt(int fmt, int r) {
  switch (fmt) {
    case 0: return pick_scratch<0>(r);
    case 1: return pick_scratch<1>(r);
    case 2: return pick_scratch<2>(r);
    default: return pick_scratch<3>(r);
  }
}

void convert_panel_fmt(int fmt, const uint8_t* const* gq, const uint8_t* const* gs, int c, int C, int64_t nb,
                       uint16_t* sw, float* sf, __m512i table) {
  switch (fmt) {
    case 0: convert_panel<0>(gq, gs, c, C, nb, sw, sf, table); break;
    case 1: convert_panel<1>(gq, gs, c, C, nb, sw, sf, table); break;
    case 2: convert_panel<2>(gq, gs, c, C, nb, sw, sf, table); break;
    default: convert_panel<3>(gq, gs, c, C, nb, sw, sf, table); break;
  }
}

constexpr int64_t kSmallM = 2;        // up to this M: in-register tiles of all M rows x 4 groups
constexpr int64_t kRows = 4;          // larger M: scratch tiles of <= 4 rows x 3 groups
constexpr int kScratchC = 3;
constexpr int64_t kMBlockRows = 256;  // larger M: M blocks (Goto "mc") swept over each converted panel

// The work division both AVX-512 arithmetics share (threads over column groups; per element the
// arithmetic does not depend on it). M <= small_m: items of up to 4 groups, each one call
// small(gq, gs, c, n0, ncols). Larger M: items (M block of kMBlockRows, panel of kScratchC groups),
// M block outer: convert(gq, gs, c, scratch) once per item into a 64-byte aligned buffer of
// scratch_bytes, then tile(r0, r1, n0, ncols, scratch) per near-equal tile of <= kRows rows
// (e.g. 5 rows -> 3 + 2).
template <typename Small, typename Convert, typename Tile>
void for_each_tile(int64_t M, int64_t N, int64_t K, const uint8_t* qs, const uint8_t* sc, int fmt, int64_t small_m,
                   int64_t scratch_bytes, const Small& small, const Convert& convert, const Tile& tile) {
  const int64_t nb = K / kQBlock;
  const int64_t G = ceil_div(N, kGroup);
  const int64_t gq_stride = nb * qs_block_bytes(fmt), gs_stride = nb * sc_group_block_bytes(fmt);
  const bool tiny = M * N * K < (int64_t{1} << 18);
  if (M <= small_m) {
    auto body = [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1;) {
        const int64_t c = std::min<int64_t>(4, u1 - u);
        const uint8_t* gq[4];
        const uint8_t* gs[4];
        for (int64_t i = 0; i < c; ++i) { gq[i] = qs + (u + i) * gq_stride; gs[i] = sc + (u + i) * gs_stride; }
        const int64_t n0 = u * kGroup;
        small(gq, gs, static_cast<int>(c), n0, std::min<int64_t>(c * kGroup, N - n0));
        u += c;
      }
    };
    if (tiny) body(0, G); else tv_pool::parallel_for(0, G, 1, body);
    return;
  }
  const int64_t panels = ceil_div(G, kScratchC);
  const int64_t mblocks = ceil_div(M, kMBlockRows);
  auto body = [&](int64_t i0, int64_t i1) {
    uint8_t* scratch = static_cast<uint8_t*>(std::aligned_alloc(64, scratch_bytes));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t mb = i / panels, pn = i % panels;
      const int64_t g0 = pn * kScratchC;
      const int c = static_cast<int>(std::min<int64_t>(kScratchC, G - g0));
      const uint8_t* gq[kScratchC];
      const uint8_t* gs[kScratchC];
      for (int j = 0; j < c; ++j) { gq[j] = qs + (g0 + j) * gq_stride; gs[j] = sc + (g0 + j) * gs_stride; }
      convert(gq, gs, c, scratch);
      const int64_t n0 = g0 * kGroup, ncols = std::min<int64_t>(c * kGroup, N - n0);
      const int64_t mlo = mb * kMBlockRows, mhi = std::min<int64_t>(M, mlo + kMBlockRows);
      const int64_t mtiles = ceil_div(mhi - mlo, kRows);
      for (int64_t t = 0; t < mtiles; ++t)
        tile(mlo + t * (mhi - mlo) / mtiles, mlo + (t + 1) * (mhi - mlo) / mtiles, n0, ncols, scratch);
    }
    std::free(scratch);
  };
  if (tiny) body(0, mblocks * panels); else tv_pool::parallel_for(0, mblocks * panels, 1, body);
}

void gemm_avx512(const uint16_t* x, int64_t ldx, int64_t M, const float* xs, const uint8_t* qs,
                 const uint8_t* sc, int fmt, int64_t N, int64_t K, GemmOut out, const float* bias) {
  const int64_t nb = K / kQBlock;
  const __m512i table = nibble_table();
  // scratch: the panel's bf16 words [nb][16 k-pairs][C][32], then its fp32 scales [nb][C][2][16]
  const int64_t sw_bytes = nb * 16 * kScratchC * 32 * 2, sf_bytes = nb * kScratchC * 32 * 4;
  for_each_tile(
      M, N, K, qs, sc, fmt, kSmallM, sw_bytes + sf_bytes,
      [&](const uint8_t* const* gq, const uint8_t* const* gs, int c, int64_t n0, int64_t ncols) {
        pick_fmt(fmt, static_cast<int>(M), c)(x, ldx, xs, nb, gq, gs, out.offset(n0), N, ncols, bias ? bias + n0 : nullptr,
                                              table);
      },
      [&](const uint8_t* const* gq, const uint8_t* const* gs, int c, uint8_t* scratch) {
        convert_panel_fmt(fmt, gq, gs, c, kScratchC, nb, reinterpret_cast<uint16_t*>(scratch),
                          reinterpret_cast<float*>(scratch + sw_bytes), table);
      },
      [&](int64_t r0, int64_t r1, int64_t n0, int64_t ncols, uint8_t* scratch) {
        pick_scratch_fmt(fmt, static_cast<int>(r1 - r0))(
            x + r0 * ldx, ldx, xs ? xs + r0 * nb : nullptr, nb, reinterpret_cast<const uint16_t*>(scratch),
            reinterpret_cast<const float*>(scratch + sw_bytes), out.offset(r0 * N + n0), N, ncols, bias ? bias + n0 : nullptr);
      });
}

#endif

#if defined(TINYVLLM_QGEMM_AVX2)
// ---------------------------------------------------------------------------------------------
// AVX2 + FMA (no AVX-512: AMD Zen 1-3, older Intel). The reference's per-element sequence exactly,
// with the 8 fp32 lanes of a vector holding 8 output columns: per block, p = 0 then for each
// k-pair p += x[odd] q[odd], p += x[even] q[even] (vfmadd: the products of a bf16 and an integer
// |q| <= 128 are exact in fp32, so fma == the reference's mul + add), then acc = fma(p, d, acc)
// and acc = fma(xs, m, acc). So gemm_gguf == gemm_gguf_ref bit for bit, and rows are batch
// invariant as there. A work item is 32 columns (two groups: four independent p chains per row, as
// the chain of 32 dependent fmas per block would otherwise bound M = 1); per block the item's
// weights are decoded once into fp32 (qf[32 k][32 columns], 4 KB, L1) and swept by up to 4 rows at a
// time (16 chains); at M <= 2 (decode) the weights are decoded in registers and used at once
// (avx2_rows_direct). Both give the same bits: only the loop order around each element's chain
// differs.

constexpr int kAvx2Cols = 32;

// Nibble `shift` (0, 4, 8, 12) of 8 widened 16-bit words, as fp32 (the Q4 layout's four k per word).
inline __m256 avx2_nibble(__m256i w, int shift) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, shift), _mm256_set1_epi32(0xF)));
}

// qf[k * 32 + c] = q of column c0 + c (c < 16 * ng) at k of block b, as fp32.
inline void avx2_decode_block(int fmt, const uint8_t* const* gq, int ng, int64_t b, float* qf) {
  for (int h = 0; h < ng; ++h) {
    float* qh = qf + 16 * h;
    if (fmt == 1 || fmt == 2) {  // nibbles: chunk j's word c = q[c][4j] | q[c][4j+1] << 8 | q[c][4j+2] << 4 | q[c][4j+3] << 12
      const uint8_t* blk = gq[h] + b * 256;
      for (int j = 0; j < 8; ++j) {
        const __m128i* src = reinterpret_cast<const __m128i*>(blk + j * 32);
        for (int half = 0; half < 2; ++half) {
          const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(src + half));
          float* o = qh + 8 * half;
          _mm256_storeu_ps(o + (4 * j) * kAvx2Cols, avx2_nibble(w, 0));
          _mm256_storeu_ps(o + (4 * j + 1) * kAvx2Cols, avx2_nibble(w, 8));
          _mm256_storeu_ps(o + (4 * j + 2) * kAvx2Cols, avx2_nibble(w, 4));
          _mm256_storeu_ps(o + (4 * j + 3) * kAvx2Cols, avx2_nibble(w, 12));
        }
      }
    } else if (fmt == 0) {  // int8: row kp's word c = q[c][2kp] | q[c][2kp+1] << 8
      const uint8_t* blk = gq[h] + b * 512;
      for (int kp = 0; kp < 16; ++kp) {
        const __m128i* src = reinterpret_cast<const __m128i*>(blk + kp * 32);
        for (int half = 0; half < 2; ++half) {
          const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(src + half));
          float* o = qh + 8 * half;
          _mm256_storeu_ps(o + (2 * kp) * kAvx2Cols, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w, 24), 24)));
          _mm256_storeu_ps(o + (2 * kp + 1) * kAvx2Cols, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w, 16), 24)));
        }
      }
    } else {  // Q6_K: the reference's decoder (its two bit planes), then the same fp32 sweep
      for (int k = 0; k < 32; ++k)
        for (int c = 0; c < 16; ++c) qh[k * kAvx2Cols + c] = static_cast<float>(q_at(fmt, gq[h], b, c, k));
    }
  }
}

// sc[which * 32 + c]: scale `which` (d, or m / Q6_K's second half) of column c0 + c at block b.
inline void avx2_block_scales(int fmt, const uint8_t* const* gs, int ng, int64_t b, float* sc) {
  const int nwhich = (fmt_min(fmt) || fmt_halves(fmt)) ? 2 : 1;
  for (int h = 0; h < ng; ++h) {
    for (int which = 0; which < nwhich; ++which) {
      float* o = sc + which * kAvx2Cols + 16 * h;
      if (fmt <= 1) {  // fp16 [nb, 1 or 2, 16]
        const __m128i* src = reinterpret_cast<const __m128i*>(gs[h] + b * sc_group_block_bytes(fmt) + 32 * which);
        _mm256_storeu_ps(o, _mm256_cvtph_ps(_mm_loadu_si128(src)));
        _mm256_storeu_ps(o + 8, _mm256_cvtph_ps(_mm_loadu_si128(src + 1)));
      } else {
        for (int c = 0; c < 16; ++c) o[c] = scale_at(fmt, gs[h], b, which, c);
      }
    }
  }
}

// Rows r0 .. r0+R-1 of an item's fp32 accumulators (kAvx2Cols apart) + bias into out's columns c0 ..
// c0+cols-1 (bf16 rounded, or float32).
inline void avx2_store_item(const float* acc, int64_t r0, int64_t R, int64_t c0, int64_t cols, const float* bias,
                            void* out, bool out_f32, int64_t N) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float v = acc[r * kAvx2Cols + c];
      if (bias) v += bias[c0 + c];
      store_out(out, out_f32, (r0 + r) * N + c0 + c, v);
    }
}

// acc = fma(p, d, acc) per vector, d = scale `which` of the block (the reference's fold).
template <int R, int NV>
inline void avx2_fold(const __m256* p, const float* sc, int which, float* acc) {
  for (int v = 0; v < NV; ++v) {
    const __m256 d = _mm256_loadu_ps(sc + which * kAvx2Cols + 8 * v);
    for (int r = 0; r < R; ++r) {
      float* a = acc + r * kAvx2Cols + 8 * v;
      _mm256_storeu_ps(a, _mm256_fmadd_ps(p[r * NV + v], d, _mm256_loadu_ps(a)));
    }
  }
}

// acc = fma(xs[r, b], m, acc): the block minimum's term (Q4_0/Q4_1, Q4_K).
template <int R, int NV>
inline void avx2_fold_min(const float* sc, const float* xs, int64_t nb, int64_t b, float* acc) {
  for (int r = 0; r < R; ++r) {
    const __m256 s = _mm256_set1_ps(xs[r * nb + b]);
    for (int v = 0; v < NV; ++v) {
      float* a = acc + r * kAvx2Cols + 8 * v;
      _mm256_storeu_ps(a, _mm256_fmadd_ps(s, _mm256_loadu_ps(sc + kAvx2Cols + 8 * v), _mm256_loadu_ps(a)));
    }
  }
}

// Rows r0..r0+R-1 of one block: acc[r][v] (v: 8-column vectors, NV = 2 * ng) updated in memory.
template <int R, int NV>
inline void avx2_rows(int fmt, const float* qf, const float* sc, const float* xf, int64_t K, int64_t b,
                      const float* xs, int64_t nb, float* acc) {
  const float* x0 = xf + b * 32;
  const int halves = fmt_halves(fmt) ? 2 : 1;
  const int kps = 16 / halves;
  for (int h = 0; h < halves; ++h) {
    __m256 p[R][NV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) p[r][v] = _mm256_setzero_ps();
    for (int kp = h * kps; kp < (h + 1) * kps; ++kp) {
      for (int e = 1; e >= 0; --e) {  // odd element first, then even (the reference's order)
        const int k = 2 * kp + e;
        __m256 q[NV];
        for (int v = 0; v < NV; ++v) q[v] = _mm256_loadu_ps(qf + k * kAvx2Cols + 8 * v);
        for (int r = 0; r < R; ++r) {
          const __m256 xv = _mm256_broadcast_ss(x0 + r * K + k);
          for (int v = 0; v < NV; ++v) p[r][v] = _mm256_fmadd_ps(xv, q[v], p[r][v]);
        }
      }
    }
    avx2_fold<R, NV>(&p[0][0], sc, fmt_halves(fmt) ? h : 0, acc);
  }
  if (fmt_min(fmt)) avx2_fold_min<R, NV>(sc, xs, nb, b, acc);
}

// M <= 2, Q8_0 / Q4: the same per-element sequence with the weights decoded in registers and used at
// once (the qf pass above costs as much as the fmas when only one or two rows reuse it).
template <int R, int NV>
inline void avx2_rows_direct(int fmt, const uint8_t* const* gq, int64_t b, const float* sc, const float* xf,
                             int64_t K, const float* xs, int64_t nb, float* acc) {
  const float* x0 = xf + b * 32;
  __m256 p[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) p[r][v] = _mm256_setzero_ps();
  if (fmt == 0) {
    for (int kp = 0; kp < 16; ++kp) {
      for (int v = 0; v < NV; ++v) {
        const __m128i* src = reinterpret_cast<const __m128i*>(gq[v / 2] + b * 512 + kp * 32) + (v & 1);
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(src));
        const __m256 qo = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w, 16), 24));
        const __m256 qe = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w, 24), 24));
        for (int r = 0; r < R; ++r) {
          p[r][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(x0 + r * K + 2 * kp + 1), qo, p[r][v]);
          p[r][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(x0 + r * K + 2 * kp), qe, p[r][v]);
        }
      }
    }
  } else {  // nibbles, chunk j: k = 4j+1, 4j, 4j+3, 4j+2 (pairs 2j, 2j+1, odd first)
    for (int j = 0; j < 8; ++j) {
      for (int v = 0; v < NV; ++v) {
        const __m128i* src = reinterpret_cast<const __m128i*>(gq[v / 2] + b * 256 + j * 32) + (v & 1);
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(src));
        const __m256 q0 = avx2_nibble(w, 0), q1 = avx2_nibble(w, 8), q2 = avx2_nibble(w, 4), q3 = avx2_nibble(w, 12);
        for (int r = 0; r < R; ++r) {
          const float* xk = x0 + r * K + 4 * j;
          p[r][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + 1), q1, p[r][v]);
          p[r][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(xk), q0, p[r][v]);
          p[r][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + 3), q3, p[r][v]);
          p[r][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + 2), q2, p[r][v]);
        }
      }
    }
  }
  avx2_fold<R, NV>(&p[0][0], sc, 0, acc);
  if (fmt_min(fmt)) avx2_fold_min<R, NV>(sc, xs, nb, b, acc);
}

template <int NV>
inline void avx2_rows_any(int R, int fmt, const float* qf, const float* sc, const float* xf, int64_t K, int64_t b,
                          const float* xs, int64_t nb, float* acc) {
  switch (R) {
    case 4: avx2_rows<4, NV>(fmt, qf, sc, xf, K, b, xs, nb, acc); break;
    case 3: avx2_rows<3, NV>(fmt, qf, sc, xf, K, b, xs, nb, acc); break;
    case 2: avx2_rows<2, NV>(fmt, qf, sc, xf, K, b, xs, nb, acc); break;
    default: avx2_rows<1, NV>(fmt, qf, sc, xf, K, b, xs, nb, acc); break;
  }
}

template <typename T>
void gemm_avx2(const T* x, int64_t ldx, int64_t M, const float* xs, const uint8_t* qs, const uint8_t* sc,
               int fmt, int64_t N, int64_t K, void* out, bool out_f32, const float* bias) {
  const int64_t nb = K / kQBlock, G = ceil_div(N, kGroup), items = ceil_div(G, 2);
  const int64_t gq_stride = nb * qs_block_bytes(fmt), gs_stride = nb * sc_group_block_bytes(fmt);
  // x as fp32 once per call (the inner loop broadcasts one value per fma group from memory).
  std::vector<float> xf(static_cast<size_t>(M * K));
  tv_pool::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t k = 0; k < K; ++k) xf[m * K + k] = act_f(x[m * ldx + k]);
  });
  tv_pool::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    alignas(32) float qf[32 * kAvx2Cols];
    alignas(32) float scv[2 * kAvx2Cols];
    std::vector<float> acc(static_cast<size_t>(M * kAvx2Cols));
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t g0 = 2 * it;
      const int ng = g0 + 1 < G ? 2 : 1;
      const uint8_t* gq[2] = {qs + g0 * gq_stride, qs + (g0 + ng - 1) * gq_stride};
      const uint8_t* gs[2] = {sc + g0 * gs_stride, sc + (g0 + ng - 1) * gs_stride};
      std::fill(acc.begin(), acc.end(), 0.0f);
      const bool direct = M <= 2 && fmt <= 2;  // fmt 2 (Q4_K) shares Q4's nibble layout
      for (int64_t b = 0; b < nb; ++b) {
        avx2_block_scales(fmt, gs, ng, b, scv);
        if (direct) {
          auto run = [&](auto r, auto nv) {
            avx2_rows_direct<decltype(r)::value, decltype(nv)::value>(fmt, gq, b, scv, xf.data(), K, xs, nb, acc.data());
          };
          using One = std::integral_constant<int, 1>;
          using Two = std::integral_constant<int, 2>;
          using Four = std::integral_constant<int, 4>;
          if (ng == 2) { if (M == 2) run(Two{}, Four{}); else run(One{}, Four{}); }
          else { if (M == 2) run(Two{}, Two{}); else run(One{}, Two{}); }
          continue;
        }
        avx2_decode_block(fmt, gq, ng, b, qf);
        for (int64_t r0 = 0; r0 < M; r0 += 4) {
          const int R = static_cast<int>(std::min<int64_t>(4, M - r0));
          const float* xr = xf.data() + r0 * K;
          const float* xsr = xs ? xs + r0 * nb : nullptr;
          float* ar = acc.data() + r0 * kAvx2Cols;
          if (ng == 2) avx2_rows_any<4>(R, fmt, qf, scv, xr, K, b, xsr, nb, ar);
          else avx2_rows_any<2>(R, fmt, qf, scv, xr, K, b, xsr, nb, ar);
        }
      }
      const int64_t c0 = g0 * kGroup, cols = std::min<int64_t>(16 * ng, N - c0);
      avx2_store_item(acc.data(), 0, M, c0, cols, bias, out, out_f32, N);
    }
  });
}
#endif

// =============================================================================================
// int8 activations (gemm_gguf_q8): Q8_0, Q4_0/Q4_1 and Q4_K weights against activations quantized
// to int8 per row and 32-block, the scheme of llama.cpp's ggml_vec_dot_q4_1_q8_1 / q8_0_q8_0
// (its q8_1 / q8_0 activation blocks), on the same repacked weights as gemm_gguf. Arithmetic, for
// each row m and block b (k = 32b .. 32b+31), then each output element (m, n):
//     amax = max_k |x[m,k]|;  dx = amax / 127;  inv = dx > 0 ? 1 / dx : 0   (fp32, RNE)
//     xq[m,k] = rne(x[m,k] * inv)                  // |xq| <= 127 (amax * inv <= 127 (1 + 2^-23))
//     (amax not finite: dx = NaN, xq = 0, so the row's outputs are NaN, as in gemm_gguf;
//      amax so small (< ~3.7e-37) that 1 / dx overflows: dx = 0, xq = 0, the block adds 0)
//     acc = 0
//     for b in 0..nb-1:
//       isum = sum_k xq[m,k] * q[n,k]             // int32, exact (|isum| <= 32 * 127 * 255)
//       acc = fma(float(isum), d[n,b] * dx[m,b], acc)     // float(isum) exact (< 2^24)
//       if Q4, Q4_K: acc = fma(xs[m,b], m[n,b], acc)     // xs[m,b] = dx[m,b] * float(sum_k xq[m,k])
//     y = bf16_rne(acc (+ bias[n]))
// The only rounding steps are per row (the quantization) and per block (the fold, in b order); the
// integer sum has no order. So every row's result depends on nothing but that row and W, for any M
// and tiling: batch invariant, and equal to the scalar gemm_gguf_q8_ref bit for bit. Against
// gemm_gguf (bf16 activations) it is less exact (the int8 rounding of x, 2^-8 of a block's amax),
// the trade llama.cpp makes. The block minimum's term takes the sum of the *quantized* block (llama.cpp's
// q8_1 s), so the result is the exact dot product of the dequantized activations xq*dx with the exact
// weights d*q + m: the error is sum_k e_k w_k (e_k = x_k - xq_k dx). With the exact sum of x instead
// it would be d sum_k e_k q_k, and q = 0..15 is not centred (a Q4_1 block's m is about -8d), so that
// error is several times larger: measured mean KL against float32 2.8e-2 that way, 5.5e-3 this way
// (bf16 activations: 2.4e-3; docs/benchmarks.md).
// Built where AVX512-BF16 (the section above: its helpers) and AVX512-VNNI both exist (AMD Zen 4,
// Intel Sapphire Rapids and later), for bf16 x; float32 x, and every call where VNNI is missing, run
// the AVX2 kernel below (gemm_q8_avx2); without AVX2 gemm_gguf_q8 is the scalar loop. For float32 x
// the quantizer reads the unrounded activations and y = acc (+ bias) stays float32: the arithmetic
// of llama.cpp's CPU backend (float32 activations quantized per block, float32 between the linears).
//
// Speed (AVX512-VNNI): VPDPBUSD multiplies 64 u8 weights by s8 activations into 16 int32 lanes, so
// one instruction is 4 k x 16 columns, against VDPBF16PS's 2 k x 16 and the bf16 kernel's table
// lookup per k-pair. A lane needs one column's 4 bytes; the repacked layout keeps a column's bytes
// as one 16-bit word per 32-byte chunk (k-pair or nibble pair), so one VPERMW per 64 bytes
// interleaves the words of two chunks (word 2c = c, word 2c+1 = 16 + c) and:
//   Q8_0: rows kp = 2t, 2t+1 -> lane c = q[c][4t .. 4t+3] (t = 0..7), natural k order. The u8
//     operand is q ^ 0x80 = q + 128, so isum = dpbusd - 128 * sum_k xq (per row and block, xc).
//   Q4, Q4_K: chunks 2t, 2t+1 (t = 0..3) -> lane c's low nibbles = q[c] at k = 8t + {0, 1, 4, 5},
//     high nibbles at 8t + {2, 3, 6, 7}; the quantized activations are stored in that order
//     (position 8t + i holds k = 8t + kQ4Perm[i]; the permutation is its own inverse).
constexpr int kQ4Perm[8] = {0, 1, 4, 5, 2, 3, 6, 7};

// The activations of one call, quantized as above. xq: int8 [M, K] (Q4 formats: the nibble order);
// dx: [M, nb]; xs: [M, nb] dx * sum(xq) (Q4 formats); xc: [M, nb] 128 * sum(xq) (Q8_0).
struct ActQ8 {
  std::vector<int8_t> xq;
  std::vector<float> dx, xs;
  std::vector<int32_t> xc;
};

// Block scale dx and the reciprocal used to quantize (the per-block scalar part of both paths).
inline void q8_block_scale(float amax, bool finite, float* dx, float* inv) {
  if (!finite) {
    *dx = std::numeric_limits<float>::quiet_NaN();
    *inv = 0.0f;
    return;
  }
  *dx = amax / 127.0f;
  *inv = *dx > 0.0f ? 1.0f / *dx : 0.0f;
  if (!(*inv <= std::numeric_limits<float>::max())) {  // amax < ~3.7e-37: 1/dx overflows; drop the block
    *dx = 0.0f;
    *inv = 0.0f;
  }
}

inline int8_t q8_round(float v) { return static_cast<int8_t>(static_cast<int>(std::nearbyint(v))); }

// Scalar quantization of row x (K values) into its xq/dx/xs/xc row slices (xs, xc: null if unused).
template <typename T>
void quantize_row_ref(const T* x, int64_t K, int fmt, int8_t* xq, float* dx, float* xs, int32_t* xc) {
  const int64_t nb = K / kQBlock;
  for (int64_t b = 0; b < nb; ++b) {
    const T* xb = x + b * 32;
    float amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < 32; ++i) {
      const float a = std::fabs(act_f(xb[i]));
      finite = finite && a <= std::numeric_limits<float>::max();
      amax = a > amax ? a : amax;
    }
    float inv;
    q8_block_scale(amax, finite, dx + b, &inv);
    int32_t s = 0;
    for (int k = 0; k < 32; ++k) {
      const int8_t v = finite ? q8_round(act_f(xb[k]) * inv) : int8_t{0};
      const int pos = fmt == 0 ? k : 8 * (k / 8) + kQ4Perm[k % 8];
      xq[b * 32 + pos] = v;
      s += v;
    }
    if (xc) xc[b] = 128 * s;
    if (xs) xs[b] = dx[b] * static_cast<float>(s);
  }
}

// xq[m, k] of block b at natural k (reference path).
inline int xq_at(int fmt, const int8_t* xqr, int64_t b, int k) {
  return xqr[b * 32 + (fmt == 0 ? k : 8 * (k / 8) + kQ4Perm[k % 8])];
}

void gemm_q8_ref(const ActQ8& a, int64_t M, const uint8_t* qs, const uint8_t* sc, int fmt, int64_t N, int64_t K,
                 void* out, bool out_f32, const float* bias) {
  const int64_t nb = K / kQBlock;
  ref_elements(M, N, K, qs, sc, fmt, out, out_f32, bias, [&](int64_t m, int c, const uint8_t* gq, const uint8_t* gs) {
        const int8_t* xqr = a.xq.data() + m * K;
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
          int32_t isum = 0;
          for (int k = 0; k < 32; ++k) isum += xq_at(fmt, xqr, b, k) * q_at(fmt, gq, b, c, k);
          const float s = scale_at(fmt, gs, b, 0, c) * a.dx[m * nb + b];
          acc = std::fma(static_cast<float>(isum), s, acc);
          if (fmt_min(fmt)) acc = std::fma(a.xs[m * nb + b], scale_at(fmt, gs, b, 1, c), acc);
        }
        return acc;
  });
}

#if defined(TINYVLLM_QGEMM_AVX512) && defined(__AVX512VNNI__)
#define TINYVLLM_QGEMM_VNNI 1

// Vector quantization of row x: the same per-element operations as quantize_row_ref (fp32 multiply,
// round to nearest even by VCVTPS2DQ under the default MXCSR), so the same bytes.
void quantize_row_vnni(const uint16_t* x, int64_t K, int fmt, int8_t* xq, float* dx, float* xs, int32_t* xc) {
  const int64_t nb = K / kQBlock;
  alignas(64) int8_t tmp[32];
  const __m512 fmax = _mm512_set1_ps(std::numeric_limits<float>::max());
  for (int64_t b = 0; b < nb; ++b) {
    const uint16_t* xb = x + b * 32;
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb))), 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16))), 16));
    const __m512 alo = _mm512_abs_ps(lo), ahi = _mm512_abs_ps(hi);
    const bool finite = (_mm512_cmp_ps_mask(alo, fmax, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(ahi, fmax, _CMP_NLE_UQ)) == 0;
    const float amax = finite ? _mm512_reduce_max_ps(_mm512_max_ps(alo, ahi)) : 0.0f;
    float inv;
    q8_block_scale(amax, finite, dx + b, &inv);
    int32_t s = 0;
    if (finite) {
      const __m512 iv = _mm512_set1_ps(inv);
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, iv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, iv));
      _mm_store_si128(reinterpret_cast<__m128i*>(tmp), _mm512_cvtepi32_epi8(qlo));
      _mm_store_si128(reinterpret_cast<__m128i*>(tmp + 16), _mm512_cvtepi32_epi8(qhi));
      s = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    } else {
      std::memset(tmp, 0, sizeof(tmp));
    }
    int8_t* o = xq + b * 32;
    if (fmt == 0) {
      std::memcpy(o, tmp, 32);
    } else {
      for (int g = 0; g < 4; ++g)
        for (int i = 0; i < 8; ++i) o[8 * g + i] = tmp[8 * g + kQ4Perm[i]];
    }
    if (xc) xc[b] = 128 * s;
    if (xs) xs[b] = dx[b] * static_cast<float>(s);
  }
}

// Word 2c = c, word 2c+1 = 16 + c: lane c gets word c of both 32-byte halves.
inline __m512i q8_pair_index() {
  alignas(64) uint16_t t[32];
  for (int c = 0; c < 16; ++c) { t[2 * c] = static_cast<uint16_t>(c); t[2 * c + 1] = static_cast<uint16_t>(16 + c); }
  return _mm512_load_si512(t);
}

// u8 weight vectors 2t2 and 2t2+1 of block b (lane c: column c's 4 bytes; see the header above).
template <int FMT>
inline void q8_weights(const uint8_t* gq, int64_t b, int t2, __m512i idx, __m512i* w0, __m512i* w1) {
  if constexpr (FMT == 0) {
    const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
    const uint8_t* p = gq + b * 512 + t2 * 128;
    *w0 = _mm512_xor_si512(_mm512_permutexvar_epi16(idx, _mm512_loadu_si512(p)), sign);
    *w1 = _mm512_xor_si512(_mm512_permutexvar_epi16(idx, _mm512_loadu_si512(p + 64)), sign);
  } else {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    const __m512i v = _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(gq + b * 256 + t2 * 64));
    *w0 = _mm512_and_si512(v, nib);
    *w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
  }
}

// One block's fold of R x C int32 partials into acc (the header's per-block step).
template <int R, int C, int FMT>
inline void q8_fold(__m512i (&p)[R][C], __m512 (&acc)[R][C], const __m512* dv, const __m512* mv, const float* dx,
                    const float* xs, const int32_t* xc, int64_t nb, int64_t b) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m512 dxr = _mm512_set1_ps(dx[r * nb + b]);
    __m512i corr = _mm512_setzero_si512();
    if constexpr (FMT == 0) corr = _mm512_set1_epi32(xc[r * nb + b]);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m512i pi = FMT == 0 ? _mm512_sub_epi32(p[r][c], corr) : p[r][c];
      acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pi), _mm512_mul_ps(dv[c], dxr), acc[r][c]);
      if constexpr (fmt_min(FMT)) acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(xs[r * nb + b]), mv[c], acc[r][c]);
    }
  }
}

// p[r][c] += the int8 dot products of the 4 activation bytes of row r at k-offset `off` (rows K apart)
// with w[c] (VPDPBUSD: integer sums, exact in any order).
template <int R, int C>
inline void dot_quad(__m512i (&p)[R][C], const int8_t* xq, int64_t K, int64_t off, const __m512i* w) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    int32_t xd;
    std::memcpy(&xd, xq + r * K + off, sizeof(xd));
    const __m512i xv = _mm512_set1_epi32(xd);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) p[r][c] = _mm512_dpbusd_epi32(p[r][c], w[c], xv);
  }
}

// R rows x C groups, weights decoded in registers (small M). xq rows are K bytes apart; dx/xs/xc
// rows nb apart.
template <int R, int C, int FMT>
void q8tile(const int8_t* __restrict xq, int64_t K, const float* __restrict dx, const float* __restrict xs,
            const int32_t* __restrict xc, int64_t nb, const uint8_t* const* gq, const uint8_t* const* gs,
            GemmOut out, int64_t ldo, int64_t ncols, const float* __restrict bias) {
  const __m512i idx = q8_pair_index();
  __m512 acc[R][C];
  zero_tile(acc);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i p[R][C];
    zero_tile(p);
#pragma GCC unroll 4
    for (int t2 = 0; t2 < 4; ++t2) {
      __m512i w0[C], w1[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) q8_weights<FMT>(gq[c], b, t2, idx, &w0[c], &w1[c]);
      dot_quad<R, C>(p, xq, K, b * 32 + 8 * t2, w0);
      dot_quad<R, C>(p, xq, K, b * 32 + 8 * t2 + 4, w1);
    }
    __m512 dv[C], mv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      dv[c] = load_scales<FMT>(gs[c], b, 0);
      mv[c] = fmt_min(FMT) ? load_scales<FMT>(gs[c], b, 1) : _mm512_setzero_ps();
    }
    q8_fold<R, C, FMT>(p, acc, dv, mv, dx, xs, xc, nb, b);
  }
  store_tile<R, C>(acc, out, ldo, ncols, bias);
}

// Larger M: a panel of C groups converted once into u8 weight vectors ([nb][8][C][64 bytes]) and
// fp32 scales ([nb][C][2][16]), swept by R-row tiles: the same integers and the same fold as
// q8tile, so the same bits.
template <int R, int C, int FMT>
void q8tile_scratch(const int8_t* __restrict xq, int64_t K, const float* __restrict dx, const float* __restrict xs,
                    const int32_t* __restrict xc, int64_t nb, const uint8_t* __restrict sw, const float* __restrict sf,
                    GemmOut out, int64_t ldo, int64_t ncols, const float* __restrict bias) {
  __m512 acc[R][C];
  zero_tile(acc);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i p[R][C];
    zero_tile(p);
    const uint8_t* wb = sw + b * 8 * C * 64;
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      __m512i w[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) w[c] = _mm512_load_si512(reinterpret_cast<const void*>(wb + (t * C + c) * 64));
      dot_quad<R, C>(p, xq, K, b * 32 + 4 * t, w);
    }
    __m512 dv[C], mv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      dv[c] = _mm512_load_ps(sf + (b * C + c) * 32);
      mv[c] = _mm512_load_ps(sf + (b * C + c) * 32 + 16);
    }
    q8_fold<R, C, FMT>(p, acc, dv, mv, dx, xs, xc, nb, b);
  }
  store_tile<R, C>(acc, out, ldo, ncols, bias);
}

template <int FMT>
void q8_convert_panel(const uint8_t* const* gq, const uint8_t* const* gs, int c, int C, int64_t nb, uint8_t* sw,
                      float* sf) {
  const __m512i idx = q8_pair_index();
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* wb = sw + b * 8 * C * 64;
    for (int i = 0; i < C; ++i) {
      float* bs = sf + (b * C + i) * 32;
      if (i >= c) {  // padding slot
        for (int t = 0; t < 8; ++t) _mm512_store_si512(reinterpret_cast<void*>(wb + (t * C + i) * 64), _mm512_setzero_si512());
        _mm512_store_ps(bs, _mm512_setzero_ps());
        _mm512_store_ps(bs + 16, _mm512_setzero_ps());
        continue;
      }
      _mm512_store_ps(bs, load_scales<FMT>(gs[i], b, 0));
      _mm512_store_ps(bs + 16, fmt_min(FMT) ? load_scales<FMT>(gs[i], b, 1) : _mm512_setzero_ps());
      for (int t2 = 0; t2 < 4; ++t2) {
        __m512i w0, w1;
        q8_weights<FMT>(gq[i], b, t2, idx, &w0, &w1);
        _mm512_store_si512(reinterpret_cast<void*>(wb + ((2 * t2) * C + i) * 64), w0);
        _mm512_store_si512(reinterpret_cast<void*>(wb + ((2 * t2 + 1) * C + i) * 64), w1);
      }
    }
  }
}

using Q8TileFn = void (*)(const int8_t*, int64_t, const float*, const float*, const int32_t*, int64_t,
                          const uint8_t* const*, const uint8_t* const*, GemmOut, int64_t, int64_t, const float*);
using Q8TileSFn = void (*)(const int8_t*, int64_t, const float*, const float*, const int32_t*, int64_t,
                           const uint8_t*, const float*, GemmOut, int64_t, int64_t, const float*);
using Q8ConvFn = void (*)(const uint8_t* const*, const uint8_t* const*, int, int, int64_t, uint8_t*, float*);


template <int FMT>
Q8TileFn q8_pick(int r, int c) {
  static const Q8TileFn fns[2][4] = {{&q8tile<1, 1, FMT>, &q8tile<1, 2, FMT>, &q8tile<1, 3, FMT>, &q8tile<1, 4, FMT>},
                                     {&q8tile<2, 1, FMT>, &q8tile<2, 2, FMT>, &q8tile<2, 3, FMT>, &q8tile<2, 4, FMT>}};
  return fns[r - 1][c - 1];
}

// In-register tiles of 3 or 4 rows take at most 2 groups (R x C accumulators and partial sums, plus the
// decoded weights, within the 32 zmm registers).
template <int FMT>
Q8TileFn q8_pick34(int r, int c) {
  static const Q8TileFn fns[2][2] = {{&q8tile<3, 1, FMT>, &q8tile<3, 2, FMT>}, {&q8tile<4, 1, FMT>, &q8tile<4, 2, FMT>}};
  return fns[r - 3][c - 1];
}

// gemm_q8_vnni's in-register path runs up to this M (near-equal row tiles of <= 4 rows over each item's
// groups, the weights decoded again per row tile from L1), the scratch path above it. Measured on an AMX
// Xeon (docs/benchmarks.md, "int8-activation GGUF GEMM at 3-8 rows"): the scratch path's panel conversion
// cost a whole-model GEMM pass ~3 ms more at 3 rows than at 2, more than the rows themselves.
constexpr int64_t kSmallMQ8 = 8;

static_assert(kRows <= 4, "q8_pick_scratch has tiles of 1..4 rows");

template <int FMT>
Q8TileSFn q8_pick_scratch(int r) {
  static const Q8TileSFn fns[4] = {&q8tile_scratch<1, kScratchC, FMT>, &q8tile_scratch<2, kScratchC, FMT>,
                                   &q8tile_scratch<3, kScratchC, FMT>, &q8tile_scratch<4, kScratchC, FMT>};
  return fns[r - 1];
}

template <int FMT>
void gemm_q8_vnni_fmt(const ActQ8& a, int64_t M, const uint8_t* qs, const uint8_t* sc, int64_t N, int64_t K,
                      GemmOut out, const float* bias) {
  const int64_t nb = K / kQBlock;
  const int8_t* xq = a.xq.data();
  const float* dx = a.dx.data();
  const float* xs = a.xs.empty() ? nullptr : a.xs.data();
  const int32_t* xc = a.xc.empty() ? nullptr : a.xc.data();
  // scratch: the panel's u8 weight vectors [nb][8][C][64 bytes], then its fp32 scales [nb][C][2][16]
  const int64_t sw_bytes = nb * 8 * kScratchC * 64, sf_bytes = nb * kScratchC * 32 * 4;
  const int64_t mtiles = ceil_div(M, int64_t{4});
  for_each_tile(
      M, N, K, qs, sc, FMT, kSmallMQ8, sw_bytes + sf_bytes,
      [&](const uint8_t* const* gq, const uint8_t* const* gs, int c, int64_t n0, int64_t ncols) {
        for (int64_t t = 0; t < mtiles; ++t) {
          const int64_t r0 = t * M / mtiles, rows = (t + 1) * M / mtiles - r0;
          const int8_t* xq_t = xq + r0 * K;
          const float* dx_t = dx + r0 * nb;
          const float* xs_t = xs ? xs + r0 * nb : nullptr;
          const int32_t* xc_t = xc ? xc + r0 * nb : nullptr;
          if (rows <= 2) {
            q8_pick<FMT>(static_cast<int>(rows), c)(xq_t, K, dx_t, xs_t, xc_t, nb, gq, gs, out.offset(r0 * N + n0), N,
                                                    ncols, bias ? bias + n0 : nullptr);
            continue;
          }
          for (int j = 0; j < c; j += 2) {
            const int cc = std::min(2, c - j);
            q8_pick34<FMT>(static_cast<int>(rows), cc)(xq_t, K, dx_t, xs_t, xc_t, nb, gq + j, gs + j,
                                                       out.offset(r0 * N + n0 + kGroup * j), N,
                                                       std::min<int64_t>(cc * kGroup, ncols - kGroup * j),
                                                       bias ? bias + n0 + kGroup * j : nullptr);
          }
        }
      },
      [&](const uint8_t* const* gq, const uint8_t* const* gs, int c, uint8_t* scratch) {
        q8_convert_panel<FMT>(gq, gs, c, kScratchC, nb, scratch, reinterpret_cast<float*>(scratch + sw_bytes));
      },
      [&](int64_t r0, int64_t r1, int64_t n0, int64_t ncols, uint8_t* scratch) {
        q8_pick_scratch<FMT>(static_cast<int>(r1 - r0))(
            xq + r0 * K, K, dx + r0 * nb, xs ? xs + r0 * nb : nullptr, xc ? xc + r0 * nb : nullptr, nb, scratch,
            reinterpret_cast<const float*>(scratch + sw_bytes), out.offset(r0 * N + n0), N, ncols, bias ? bias + n0 : nullptr);
      });
}

void gemm_q8_vnni(const ActQ8& a, int64_t M, const uint8_t* qs, const uint8_t* sc, int fmt, int64_t N, int64_t K,
                  GemmOut out, const float* bias) {
  switch (fmt) {
    case 0: gemm_q8_vnni_fmt<0>(a, M, qs, sc, N, K, out, bias); break;
    case 1: gemm_q8_vnni_fmt<1>(a, M, qs, sc, N, K, out, bias); break;
    default: gemm_q8_vnni_fmt<2>(a, M, qs, sc, N, K, out, bias); break;
  }
}
#endif

#if defined(TINYVLLM_QGEMM_AVX2)
// ---------------------------------------------------------------------------------------------
// int8 activations on AVX2 (gemm_q8_avx2): the arithmetic above with VPMADDUBSW / VPMADDWD (llama.cpp's
// AVX2 ggml_vec_dot_q4_1_q8_1 multiplies the same way), for CPUs without AVX512-VNNI (AMD Zen 1-3,
// Intel before Ice Lake) and for float32 activations everywhere. Every integer sum is exact, so the
// result is gemm_gguf_q8_ref's bit for bit:
//   Q4, Q4_K: chunk j's 32 bytes hold, per column c, the nibble pairs (k = 4j, 4j+1) (low nibbles of
//     bytes 2c, 2c+1) and (4j+2, 4j+3) (high nibbles). VPMADDUBSW (u8 nibble x s8 activation, adjacent
//     pairs summed into int16 lane c) against the broadcast activation pair: |lane| <= 2 * 15 * 127,
//     and each of a block's two int16 sums (low, high) adds 8 of them: <= 30480, no saturation. At the
//     block's end the two are interleaved and summed pairwise into int32 by VPMADDWD with ones.
//   Q8_0: row kp's 16 bytes per 8 columns, sign-extended to int16, VPMADDWD against the broadcast int16
//     activation pair (x[2kp], x[2kp+1]): int32 lane c = q[c][2kp] x[2kp] + q[c][2kp+1] x[2kp+1], exact
//     for every q including -128 (no u8 trick, so no correction term).
// A work item is 32 columns (two groups) and sweeps its rows two at a time over its weights (<= 24 KB
// per item at K = 1536: L1/L2), so a decode step reads each weight once and a prefill re-reads it
// from cache.

constexpr int kQ8Avx2Rows = 2;

// 32 activations as 4 x 8 fp32 (bf16 widened exactly, or float32 as it is).
template <typename T>
inline void avx2_load32(const T* x, __m256* v) {
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
    } else {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * i));
      v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
}

// quantize_row_ref's bytes (fp32 multiply, VCVTPS2DQ rounds to nearest even under the default MXCSR),
// eight lanes at a time; the int8 packing restores the natural k order, then the Q4 nibble order.
template <typename T>
void quantize_row_avx2(const T* x, int64_t K, int fmt, int8_t* xq, float* dx, float* xs, int32_t* xc) {
  const int64_t nb = K / kQBlock;
  const __m256 sign = _mm256_set1_ps(-0.0f), fmax = _mm256_set1_ps(std::numeric_limits<float>::max());
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i q4perm = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,
                                          0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
  for (int64_t b = 0; b < nb; ++b) {
    __m256 v[4], a[4];
    avx2_load32(x + b * 32, v);
    int bad = 0;
    for (int i = 0; i < 4; ++i) {
      a[i] = _mm256_andnot_ps(sign, v[i]);
      bad |= _mm256_movemask_ps(_mm256_cmp_ps(a[i], fmax, _CMP_NLE_UQ));
    }
    const bool finite = bad == 0;
    float amax = 0.0f;
    if (finite) {
      const __m256 m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      amax = _mm_cvtss_f32(h);
    }
    float inv;
    q8_block_scale(amax, finite, dx + b, &inv);
    __m256i packed = _mm256_setzero_si256();
    int32_t s = 0;
    if (finite) {
      const __m256 iv = _mm256_set1_ps(inv);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], iv));
      const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
      h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
      s = _mm_cvtsi128_si32(h);
      const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      packed = _mm256_permutevar8x32_epi32(p8, order);  // |q| <= 127: the packs never saturate
      if (fmt != 0) packed = _mm256_shuffle_epi8(packed, q4perm);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * 32), packed);
    if (xc) xc[b] = 128 * s;
    if (xs) xs[b] = dx[b] * static_cast<float>(s);
  }
}

// Rows r0 .. r0+R-1 x NG groups over every block; acc [R][32] fp32 (zeroed by the caller) gets the
// header's per-block folds in b order. xq16: the int16 activations in natural k order (Q8_0). sc:
// the item's scales, [nb][2][32] fp32 (avx2_block_scales per block, formed once per item).
template <int R, int NG, int FMT>
void q8_avx2_tile(const ActQ8& a, const int16_t* xq16, int64_t K, int64_t nb, int64_t r0,
                  const uint8_t* const* gq, const float* sc, float* acc) {
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i isum[R][2 * NG];
    if constexpr (FMT == 0) {
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < 2 * NG; ++v) isum[r][v] = _mm256_setzero_si256();
      for (int kp = 0; kp < 16; ++kp) {
        __m256i w[2 * NG];
        for (int g = 0; g < NG; ++g) {
          const __m128i* src = reinterpret_cast<const __m128i*>(gq[g] + b * 512 + kp * 32);
          w[2 * g] = _mm256_cvtepi8_epi16(_mm_loadu_si128(src));
          w[2 * g + 1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(src + 1));
        }
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, xq16 + (r0 + r) * K + b * 32 + 2 * kp, sizeof(pair));
          const __m256i xv = _mm256_set1_epi32(pair);
          for (int v = 0; v < 2 * NG; ++v) isum[r][v] = _mm256_add_epi32(isum[r][v], _mm256_madd_epi16(w[v], xv));
        }
      }
    } else {
      __m256i lo[R][NG], hi[R][NG];
      for (int r = 0; r < R; ++r)
        for (int g = 0; g < NG; ++g) lo[r][g] = hi[r][g] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        __m256i wl[NG], wh[NG];
        for (int g = 0; g < NG; ++g) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gq[g] + b * 256 + j * 32));
          wl[g] = _mm256_and_si256(v, nib);
          wh[g] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        }
        const int pl = 8 * (j >> 1) + 2 * (j & 1);  // k = 4j, 4j+1 in the Q4 nibble order; 4j+2, 4j+3 at pl + 4
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = a.xq.data() + (r0 + r) * K + b * 32;
          int16_t pl2, ph2;
          std::memcpy(&pl2, xr + pl, 2);
          std::memcpy(&ph2, xr + pl + 4, 2);
          const __m256i xl = _mm256_set1_epi16(pl2), xh = _mm256_set1_epi16(ph2);
          for (int g = 0; g < NG; ++g) {
            lo[r][g] = _mm256_add_epi16(lo[r][g], _mm256_maddubs_epi16(wl[g], xl));
            hi[r][g] = _mm256_add_epi16(hi[r][g], _mm256_maddubs_epi16(wh[g], xh));
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int g = 0; g < NG; ++g) {  // columns {0-3, 8-11} and {4-7, 12-15}, then back to 0-7, 8-15
          const __m256i p = _mm256_madd_epi16(_mm256_unpacklo_epi16(lo[r][g], hi[r][g]), ones);
          const __m256i q = _mm256_madd_epi16(_mm256_unpackhi_epi16(lo[r][g], hi[r][g]), ones);
          isum[r][2 * g] = _mm256_permute2x128_si256(p, q, 0x20);
          isum[r][2 * g + 1] = _mm256_permute2x128_si256(p, q, 0x31);
        }
    }
    const float* scv = sc + b * 2 * kAvx2Cols;
    for (int r = 0; r < R; ++r) {
      const __m256 dxr = _mm256_set1_ps(a.dx[(r0 + r) * nb + b]);
      for (int v = 0; v < 2 * NG; ++v) {
        float* ac = acc + r * kAvx2Cols + 8 * v;
        const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(scv + 8 * v), dxr);
        __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][v]), s, _mm256_loadu_ps(ac));
        if constexpr (fmt_min(FMT))
          t = _mm256_fmadd_ps(_mm256_set1_ps(a.xs[(r0 + r) * nb + b]), _mm256_loadu_ps(scv + kAvx2Cols + 8 * v), t);
        _mm256_storeu_ps(ac, t);
      }
    }
  }
}

using Q8Avx2Fn = void (*)(const ActQ8&, const int16_t*, int64_t, int64_t, int64_t, const uint8_t* const*,
                          const float*, float*);

template <int FMT>
Q8Avx2Fn q8_avx2_pick(int r, int ng) {
  static const Q8Avx2Fn fns[2][2] = {{&q8_avx2_tile<1, 1, FMT>, &q8_avx2_tile<1, 2, FMT>},
                                     {&q8_avx2_tile<2, 1, FMT>, &q8_avx2_tile<2, 2, FMT>}};
  return fns[r - 1][ng - 1];
}

void gemm_q8_avx2(const ActQ8& a, int64_t M, const uint8_t* qs, const uint8_t* sc, int fmt, int64_t N, int64_t K,
                  void* out, bool out_f32, const float* bias) {
  const int64_t nb = K / kQBlock, G = ceil_div(N, kGroup), items = ceil_div(G, 2);
  const int64_t gq_stride = nb * qs_block_bytes(fmt), gs_stride = nb * sc_group_block_bytes(fmt);
  std::vector<int16_t> xq16;
  if (fmt == 0) xq16.assign(a.xq.begin(), a.xq.end());
  tv_pool::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    alignas(32) float acc[kQ8Avx2Rows * kAvx2Cols];
    std::vector<float> scales(static_cast<size_t>(nb * 2 * kAvx2Cols));
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t g0 = 2 * it;
      const int ng = g0 + 1 < G ? 2 : 1;
      const uint8_t* gq[2] = {qs + g0 * gq_stride, qs + (g0 + ng - 1) * gq_stride};
      const uint8_t* gs[2] = {sc + g0 * gs_stride, sc + (g0 + ng - 1) * gs_stride};
      const int64_t c0 = g0 * kGroup, cols = std::min<int64_t>(16 * ng, N - c0);
      for (int64_t b = 0; b < nb; ++b) avx2_block_scales(fmt, gs, ng, b, scales.data() + b * 2 * kAvx2Cols);
      for (int64_t r0 = 0; r0 < M; r0 += kQ8Avx2Rows) {
        const int R = static_cast<int>(std::min<int64_t>(kQ8Avx2Rows, M - r0));
        std::fill(acc, acc + R * kAvx2Cols, 0.0f);
        Q8Avx2Fn fn = fmt == 0 ? q8_avx2_pick<0>(R, ng) : fmt == 1 ? q8_avx2_pick<1>(R, ng) : q8_avx2_pick<2>(R, ng);
        fn(a, xq16.data(), K, nb, r0, gq, scales.data(), acc);
        avx2_store_item(acc, r0, R, c0, cols, bias, out, out_f32, N);
      }
    }
  });
}
#endif

struct Prepared {
  torch::Tensor x2, out, xs, bias_f;
  int64_t M = 0, ldx = 0;
  bool f32 = false;      // x float32 instead of bf16
  bool out_f32 = false;  // the output float32 (x float32, or out_float)
  std::vector<int64_t> out_shape;
};

// Calls f(pointer to row 0 of x) with x's element type (uint16_t bf16 bits or float).
template <typename F>
void with_x(const Prepared& p, const F& f) {
  if (p.f32) f(static_cast<const float*>(p.x2.data_ptr<float>()));
  else f(reinterpret_cast<const uint16_t*>(p.x2.data_ptr<at::BFloat16>()));
}

// block_sums: also the fixed-order sums of each row's 32-blocks (gemm_gguf's Q4, Q4_K fold).
// out_float: float32 outputs for bf16 x too (the LM head's logits; a float32 x always gets them).
Prepared prepare(torch::Tensor x, const torch::Tensor& qs, const torch::Tensor& scales, int64_t fmt, int64_t N,
                 int64_t K, const c10::optional<torch::Tensor>& bias, bool block_sums = true, bool out_float = false) {
  TORCH_CHECK(fmt >= 0 && fmt <= 3, "gemm_gguf: fmt must be 0 (Q8_0), 1 (Q4_0/Q4_1), 2 (Q4_K) or 3 (Q6_K)");
  TORCH_CHECK((x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) && x.device().is_cpu(),
              "gemm_gguf: x must be a CPU bfloat16 or float32 tensor");
  TORCH_CHECK(K % kQBlock == 0 && x.dim() >= 1 && x.size(-1) == K, "gemm_gguf: x must be [..., K], K % 32 == 0");
  const int64_t G = ceil_div(N, kGroup), nb = K / kQBlock;
  TORCH_CHECK(qs.is_contiguous() && qs.numel() * qs.element_size() == G * nb * qs_block_bytes(fmt),
              "gemm_gguf: qs size does not match (N, K, fmt)");
  const at::ScalarType sdt = fmt >= 2 ? at::kByte : at::kHalf;
  TORCH_CHECK(fmt < 2 || nb % 8 == 0, "gemm_gguf: the K-quants need K % 256 == 0");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == sdt &&
              scales.numel() * scales.element_size() == G * nb * sc_group_block_bytes(static_cast<int>(fmt)),
              "gemm_gguf: scales must be float16 (fmt 0, 1) or uint8 (fmt 2, 3) matching (N, K, fmt)");
  Prepared p;
  p.f32 = x.scalar_type() == at::kFloat;
  p.out_shape.assign(x.sizes().begin(), x.sizes().end());
  p.out_shape.back() = N;
  p.x2 = x.dim() == 2 ? x : x.reshape({-1, K});
  if (p.x2.stride(1) != 1) p.x2 = p.x2.contiguous();
  p.M = p.x2.size(0);
  p.ldx = p.M <= 1 ? K : p.x2.stride(0);
  p.out_f32 = p.f32 || out_float;
  p.out = torch::empty({p.M, N}, x.options().dtype(p.out_f32 ? at::kFloat : at::kBFloat16));
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "gemm_gguf: bias must have N elements");
    p.bias_f = bias->reshape({N}).to(at::kFloat).contiguous();
  }
  if (block_sums && fmt_min(static_cast<int>(fmt)) && p.M > 0) {
    p.xs = torch::empty({p.M, nb}, x.options().dtype(at::kFloat));
    float* xsp = p.xs.data_ptr<float>();
    const int64_t ldx = p.ldx;
    with_x(p, [&](const auto* xp) {
      tv_pool::parallel_for(0, p.M, 16, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m)
          for (int64_t b = 0; b < nb; ++b) xsp[m * nb + b] = block_sum_scalar(xp + m * ldx + b * 32);
      });
    });
  }
  return p;
}

}  // namespace

namespace {
// Which gemm_gguf_q8 kernel runs a call: VNNI for bf16 where built; AVX2 (float32 always, bf16 where
// VNNI is not built); the scalar loop where neither is (or for the _ref entry point).
enum class Q8Kernel { kRef, kAvx2, kVnni };

Q8Kernel q8_kernel(bool f32, bool ref) {
  if (ref) return Q8Kernel::kRef;
#if defined(TINYVLLM_QGEMM_VNNI)
  if (!f32) return Q8Kernel::kVnni;
#endif
#if defined(TINYVLLM_QGEMM_AVX2)
  return Q8Kernel::kAvx2;
#else
  (void)f32;
  return Q8Kernel::kRef;
#endif
}

// gemm_gguf_q8's activations, quantized by the kernel's vector loop (the same bytes as the scalar
// loop) or by the scalar loop.
ActQ8 quantize_acts(const Prepared& p, int fmt, int64_t K, Q8Kernel kind) {
  const int64_t nb = K / kQBlock, M = p.M, ldx = p.ldx;
  ActQ8 a;
  a.xq.resize(static_cast<size_t>(M * K));
  a.dx.resize(static_cast<size_t>(M * nb));
  if (fmt == 0 && kind == Q8Kernel::kVnni) a.xc.resize(static_cast<size_t>(M * nb));  // its u8 trick's correction
  if (fmt_min(fmt)) a.xs.resize(static_cast<size_t>(M * nb));
  with_x(p, [&](const auto* xp) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(xp)>>;
    tv_pool::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        int8_t* xq = a.xq.data() + m * K;
        float* dx = a.dx.data() + m * nb;
        int32_t* xc = a.xc.empty() ? nullptr : a.xc.data() + m * nb;
        float* xs = fmt_min(fmt) ? a.xs.data() + m * nb : nullptr;
#if defined(TINYVLLM_QGEMM_VNNI)
        if constexpr (std::is_same_v<T, uint16_t>) {
          if (kind == Q8Kernel::kVnni) { quantize_row_vnni(xp + m * ldx, K, fmt, xq, dx, xs, xc); continue; }
        }
#endif
#if defined(TINYVLLM_QGEMM_AVX2)
        if (kind == Q8Kernel::kAvx2) { quantize_row_avx2(xp + m * ldx, K, fmt, xq, dx, xs, xc); continue; }
#endif
        (void)kind;
        quantize_row_ref(xp + m * ldx, K, fmt, xq, dx, xs, xc);
      }
    });
  });
  return a;
}

torch::Tensor gemm_q8_impl(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, int64_t fmt, int64_t N, int64_t K,
                           c10::optional<torch::Tensor> bias, bool ref, bool out_float) {
  TORCH_CHECK(fmt >= 0 && fmt <= 2, "gemm_gguf_q8: fmt must be 0 (Q8_0), 1 (Q4_0/Q4_1) or 2 (Q4_K); Q6_K runs on gemm_gguf");
  Prepared p = prepare(x, qs, scales, fmt, N, K, bias, /*block_sums=*/false, out_float);
  if (p.M == 0 || N == 0) return p.out.view(p.out_shape);
  const Q8Kernel kind = q8_kernel(p.f32, ref);
  const ActQ8 a = quantize_acts(p, static_cast<int>(fmt), K, kind);
  void* op = p.out.data_ptr();
  const float* bp = p.bias_f.defined() ? p.bias_f.data_ptr<float>() : nullptr;
  const uint8_t* q = static_cast<const uint8_t*>(qs.data_ptr());
  const uint8_t* s = static_cast<const uint8_t*>(scales.data_ptr());
#if defined(TINYVLLM_QGEMM_VNNI)
  if (kind == Q8Kernel::kVnni) {
    gemm_q8_vnni(a, p.M, q, s, static_cast<int>(fmt), N, K, GemmOut{op, p.out_f32}, bp);
    return p.out.view(p.out_shape);
  }
#endif
#if defined(TINYVLLM_QGEMM_AVX2)
  if (kind == Q8Kernel::kAvx2) {
    gemm_q8_avx2(a, p.M, q, s, static_cast<int>(fmt), N, K, op, p.out_f32, bp);
    return p.out.view(p.out_shape);
  }
#endif
  gemm_q8_ref(a, p.M, q, s, static_cast<int>(fmt), N, K, op, p.out_f32, bp);
  return p.out.view(p.out_shape);
}
}  // namespace

torch::Tensor gemm_gguf_q8(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, int64_t fmt, int64_t N, int64_t K,
                           c10::optional<torch::Tensor> bias, bool out_float) {
  return gemm_q8_impl(x, qs, scales, fmt, N, K, bias, false, out_float);
}

torch::Tensor gemm_gguf_q8_ref(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, int64_t fmt, int64_t N,
                               int64_t K, c10::optional<torch::Tensor> bias) {
  return gemm_q8_impl(x, qs, scales, fmt, N, K, bias, true, false);
}

std::string gemm_gguf_q8_isa() {
#if defined(TINYVLLM_QGEMM_VNNI)
  return "avx512_vnni";
#elif defined(TINYVLLM_QGEMM_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

torch::Tensor gemm_gguf(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, int64_t fmt, int64_t N, int64_t K,
                        c10::optional<torch::Tensor> bias, bool out_float) {
  Prepared p = prepare(x, qs, scales, fmt, N, K, bias, true, out_float);
  if (p.M == 0 || N == 0) return p.out.view(p.out_shape);
  void* op = p.out.data_ptr();
  const float* bp = p.bias_f.defined() ? p.bias_f.data_ptr<float>() : nullptr;
  const float* xsp = p.xs.defined() ? p.xs.data_ptr<float>() : nullptr;
  const uint8_t* q = static_cast<const uint8_t*>(qs.data_ptr());
  const uint8_t* s = static_cast<const uint8_t*>(scales.data_ptr());
  const int f = static_cast<int>(fmt);
#if defined(TINYVLLM_QGEMM_AVX512)
  if (!p.f32) {
    gemm_avx512(reinterpret_cast<const uint16_t*>(p.x2.data_ptr<at::BFloat16>()), p.ldx, p.M, xsp, q, s, f, N, K,
                GemmOut{op, p.out_f32}, bp);
    return p.out.view(p.out_shape);
  }
#endif
  with_x(p, [&](const auto* xp) {
#if defined(TINYVLLM_QGEMM_AVX2)
    gemm_avx2(xp, p.ldx, p.M, xsp, q, s, f, N, K, op, p.out_f32, bp);
#else
    gemm_ref(xp, p.ldx, p.M, q, s, f, N, K, op, p.out_f32, bp);
#endif
  });
  return p.out.view(p.out_shape);
}

torch::Tensor gemm_gguf_ref(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, int64_t fmt, int64_t N,
                            int64_t K, c10::optional<torch::Tensor> bias) {
  Prepared p = prepare(x, qs, scales, fmt, N, K, bias);
  if (p.M == 0 || N == 0) return p.out.view(p.out_shape);
  with_x(p, [&](const auto* xp) {
    gemm_ref(xp, p.ldx, p.M, static_cast<const uint8_t*>(qs.data_ptr()), static_cast<const uint8_t*>(scales.data_ptr()),
             static_cast<int>(fmt), N, K, p.out.data_ptr(), p.f32,
             p.bias_f.defined() ? p.bias_f.data_ptr<float>() : nullptr);
  });
  return p.out.view(p.out_shape);
}

std::string gemm_gguf_isa() {
#if defined(TINYVLLM_QGEMM_AVX512)
  return "avx512_bf16";
#elif defined(TINYVLLM_QGEMM_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}
