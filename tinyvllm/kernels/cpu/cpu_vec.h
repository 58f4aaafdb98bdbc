// One vector layer for the CPU kernels' loops that differ only in lane width (the row attention of
// cpu_kernel.cpp): Vec16f (AVX-512, 16 float32 lanes) and Vec8f (AVX2 + FMA, 8 lanes), the same
// interface, so a kernel is written once as a template over the vector type and instantiated for
// the ISA the build targets. In the style of vLLM's csrc/cpu/cpu_types_x86.hpp (a small struct per
// vector width wrapping the intrinsics).
//
// Why our own header and not ATen's at::vec::Vectorized<float> (what SGLang's sgl-kernel/csrc/cpu
// uses): the kernels' outputs are specified bit for bit (batch invariance, and the tests compare bits
// across paths and before/after changes), and three of the operations they need are not Vectorized's:
//  * exp: ours is a Cephes range reduction with a degree-6 polynomial (exp_nonpos's coefficients);
//    Vectorized<float>::exp is Sleef's, other bits;
//  * horizontal sums: a fixed add tree per ISA (hsum_lanes: 16 vectors transposed and summed in one
//    network on AVX-512, hadd pairs on AVX2; hsum: pairwise halves); Vectorized's reduce_add has its
//    own order;
//  * masked tails (__mmask16 on AVX-512, a lane mask on AVX2) and the bf16 rounding with NaN kept.
// And Vectorized's width is chosen by the CPU_CAPABILITY_* macros of torch's own multi-ISA build,
// which a torch extension built with -march does not set. So each ISA's operation stays exactly the
// instruction sequence it was before this layer (same bits), now behind one interface.
//
// Interface (V = Vec16f or Vec8f; L = V::kLanes):
//   V::zero(), V::set1(f), V::load(p) for p float* or c10::BFloat16* (bf16 widened exactly),
//   v.store(p) (float: as is; bf16: rounded to nearest even, NaN -> 0x7FC0), v.store_aligned(float*),
//   v.round_bf16() (store()'s bf16 value widened back; round_as<C>(v): that for bf16 C, v for float),
//   a + b, a - b, a * b, a / b, fmadd(a, b, c) = a * b + c and fnmadd(a, b, c) = c - a * b in one rounding,
//   min, max, floor, pow2i(n) = 2^n (n integral), v.hmax(): the largest lane,
//   V::hsum_lanes(v[L]): lane i = the sum of the L lanes of v[i] (each ISA's add tree);
//   written once over V: hsum(v), the sum of v's lanes (pairwise halves), and exp(v), exp lane-wise
//   (clamped to [-87.3, 88.3], ~2 ulp);
//   V::Mask, V::first(n): lanes 0 .. n-1 (n = 0 .. L), V::from(n): lanes n .. L-1 (n < L),
//   V::both(a, b): the lanes in a and b; max_masked(m, x, k): max(m, x) in the lanes of k, m
//   elsewhere; v.keep(k): v in the lanes of k, 0 elsewhere.
#pragma once

#include <c10/util/BFloat16.h>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_common.h"

namespace tv_vec {

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct Vec16f {
  static constexpr int kLanes = 16;
  using Mask = __mmask16;
  __m512 v;

  static Vec16f zero() { return {_mm512_setzero_ps()}; }
  static Vec16f set1(float f) { return {_mm512_set1_ps(f)}; }
  static Vec16f load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec16f load(const c10::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(c10::BFloat16* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), tv_cpu::cvt_f32_bf16_rne(v));
  }
  void store_aligned(float* p) const { _mm512_store_ps(p, v); }
  // Rounded to bf16 (nearest even) and widened back: store()'s value as float32.
  Vec16f round_bf16() const {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(tv_cpu::cvt_f32_bf16_rne(v)), 16))};
  }

  friend Vec16f operator+(Vec16f a, Vec16f b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec16f operator-(Vec16f a, Vec16f b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Vec16f operator*(Vec16f a, Vec16f b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend Vec16f operator/(Vec16f a, Vec16f b) { return {_mm512_div_ps(a.v, b.v)}; }
  friend Vec16f fmadd(Vec16f a, Vec16f b, Vec16f c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec16f fnmadd(Vec16f a, Vec16f b, Vec16f c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
  friend Vec16f max(Vec16f a, Vec16f b) { return {_mm512_max_ps(a.v, b.v)}; }
  friend Vec16f min(Vec16f a, Vec16f b) { return {_mm512_min_ps(a.v, b.v)}; }
  friend Vec16f floor(Vec16f a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)}; }
  // 2^n for integral n in [-126, 127], by building the exponent field.
  friend Vec16f pow2i(Vec16f n) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23))};
  }
  float hmax() const { return _mm512_reduce_max_ps(v); }

  static Mask first(int64_t n) { return static_cast<Mask>((1u << n) - 1u); }
  static Mask from(int64_t n) { return static_cast<Mask>(0xFFFFu << n); }
  static Mask both(Mask a, Mask b) { return a & b; }
  friend Vec16f max_masked(Vec16f m, Vec16f x, Mask k) { return {_mm512_mask_max_ps(m.v, k, m.v, x.v)}; }
  Vec16f keep(Mask k) const { return {_mm512_maskz_mov_ps(k, v)}; }

  // out[i] = sum of the 16 lanes of v[i], for i = 0..15, by a fixed add tree: lanes {l, l+2} then
  // {l, l+1} within each 128-bit group, then across groups (0+1, 2+3, then pairs).
  static Vec16f hsum_lanes(const Vec16f* in) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; ++i)
      w[i] = _mm512_add_ps(_mm512_unpacklo_ps(in[2 * i].v, in[2 * i + 1].v),
                           _mm512_unpackhi_ps(in[2 * i].v, in[2 * i + 1].v));
    for (int i = 0; i < 4; ++i)
      x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return {_mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)))};
  }

};
#endif  // AVX-512

#if defined(__AVX2__) && defined(__FMA__)
struct Vec8f {
  static constexpr int kLanes = 8;
  using Mask = __m256;  // all-ones lanes
  __m256 v;

  static Vec8f zero() { return {_mm256_setzero_ps()}; }
  static Vec8f set1(float f) { return {_mm256_set1_ps(f)}; }
  static Vec8f load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec8f load(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
  }
  // The 8 lanes as bfloat16 bits, round to nearest even, NaN -> 0x7FC0 (c10::BFloat16's rule).
  __m128i bf16_bits() const {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(c10::BFloat16* p) const { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits()); }
  void store_aligned(float* p) const { _mm256_store_ps(p, v); }
  Vec8f round_bf16() const { return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_bits()), 16))}; }

  friend Vec8f operator+(Vec8f a, Vec8f b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend Vec8f operator-(Vec8f a, Vec8f b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend Vec8f operator*(Vec8f a, Vec8f b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend Vec8f operator/(Vec8f a, Vec8f b) { return {_mm256_div_ps(a.v, b.v)}; }
  friend Vec8f fmadd(Vec8f a, Vec8f b, Vec8f c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec8f fnmadd(Vec8f a, Vec8f b, Vec8f c) { return {_mm256_fnmadd_ps(a.v, b.v, c.v)}; }
  friend Vec8f max(Vec8f a, Vec8f b) { return {_mm256_max_ps(a.v, b.v)}; }
  friend Vec8f min(Vec8f a, Vec8f b) { return {_mm256_min_ps(a.v, b.v)}; }
  friend Vec8f floor(Vec8f a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)}; }
  friend Vec8f pow2i(Vec8f n) {
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23))};
  }
  float hmax() const {
    alignas(32) float l[8];
    _mm256_store_ps(l, v);
    float mx = l[0];
    for (int i = 1; i < 8; ++i) mx = l[i] > mx ? l[i] : mx;
    return mx;
  }

  static Mask first(int64_t n) {
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  }
  static Mask from(int64_t n) { return _mm256_andnot_ps(first(n), _mm256_castsi256_ps(_mm256_set1_epi32(-1))); }
  static Mask both(Mask a, Mask b) { return _mm256_and_ps(a, b); }
  friend Vec8f max_masked(Vec8f m, Vec8f x, Mask k) {
    return {_mm256_max_ps(m.v, _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()), x.v, k))};
  }
  Vec8f keep(Mask k) const { return {_mm256_and_ps(v, k)}; }

  // out[i] = sum of the 8 lanes of v[i], i = 0..7, by a fixed add tree (pairs, then quads, then halves).
  static Vec8f hsum_lanes(const Vec8f* in) {
    const __m256 t0 = _mm256_hadd_ps(in[0].v, in[1].v), t1 = _mm256_hadd_ps(in[2].v, in[3].v);
    const __m256 t2 = _mm256_hadd_ps(in[4].v, in[5].v), t3 = _mm256_hadd_ps(in[6].v, in[7].v);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return {_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31))};
  }

};
#endif  // AVX2

// Written once over V, the same instructions on each ISA as V's primitives:

// x rounded to the storage dtype C and back (bf16: nearest even; float: x itself).
template <typename C, typename V>
inline V round_as(V x) {
  if constexpr (std::is_same_v<C, c10::BFloat16>) return x.round_bf16();
  else return x;
}

// Fixed-order sum of the lanes of v (pairwise halves).
template <typename V>
inline float hsum(V v) {
  alignas(64) float l[V::kLanes];
  v.store_aligned(l);
  for (int w = V::kLanes / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) l[i] += l[i + w];
  return l[0];
}

// exp(x) lane-wise for x in [-87.3, 88.3] (clamped): Cephes range reduction x = n ln2 + r and a
// degree-6 polynomial (the scalar exp_nonpos's coefficients in cpu_kernel.cpp), ~2 ulp.
template <typename V>
inline V exp(V x) {
  x = max(min(x, V::set1(88.3f)), V::set1(-87.3f));
  const V fx = floor(fmadd(x, V::set1(1.44269504088896341f), V::set1(0.5f)));
  V r = fnmadd(fx, V::set1(0.693359375f), x);
  r = fnmadd(fx, V::set1(-2.12194440e-4f), r);
  const V z = r * r;
  V y = V::set1(1.9875691500e-4f);
  y = fmadd(y, r, V::set1(1.3981999507e-3f));
  y = fmadd(y, r, V::set1(8.3334519073e-3f));
  y = fmadd(y, r, V::set1(4.1665795894e-2f));
  y = fmadd(y, r, V::set1(1.6666665459e-1f));
  y = fmadd(y, r, V::set1(5.0000001201e-1f));
  y = fmadd(y, z, r) + V::set1(1.0f);
  return y * pow2i(fx);  // n in [-126, 127] for the clamped range
}

}  // namespace tv_vec
