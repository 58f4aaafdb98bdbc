// The output of gemm_bf16's kernels (cpu_gemm.cpp, cpu_gemm_amx.cpp): each element is a float32 sum
// (+ bias in float32), stored either rounded to bf16 (round-to-nearest-even, torch's float ->
// bfloat16 bits: denormals kept, NaN -> 0x7FC0) or as the float32 value itself. The float32 form
// is for the LM head: a logit rounded to bf16 is off by up to 2^-9 of its size (0.03 nats at a
// logit of 16), more than the gap of many near-ties (issue 37).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace tv_gemm {

// Same as c10::detail::round_to_nearest_even (torch's scalar float -> bfloat16).
inline uint16_t f_to_bf16_bits(float f) {
  if (f != f) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The same on 16 lanes. VCVTNEPS2BF16 would flush denormal inputs to zero, so it is done with
// integer ops.
inline __m256i cvt_f32_bf16_rne(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
#endif

// Where the kernels write: p points at element 0 of the output, bf16 bits (f32 false) or float32.
// Offsets are in elements.
struct GemmOut {
  void* p;
  bool f32;
  GemmOut offset(int64_t n) const {
    return {f32 ? static_cast<void*>(static_cast<float*>(p) + n) : static_cast<void*>(static_cast<uint16_t*>(p) + n),
            f32};
  }
  void store1(int64_t off, float v) const {
    if (f32) static_cast<float*>(p)[off] = v;
    else static_cast<uint16_t*>(p)[off] = f_to_bf16_bits(v);
  }
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // Lanes set in mask of v to elements off .. off + 15.
  void store16(int64_t off, __mmask16 mask, __m512 v) const {
    if (f32) _mm512_mask_storeu_ps(static_cast<float*>(p) + off, mask, v);
    else _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + off, mask, cvt_f32_bf16_rne(v));
  }
#endif
};

}  // namespace tv_gemm
