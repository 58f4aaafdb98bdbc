// Helpers every CPU kernel source shares (cpu_kernel.cpp, cpu_gemm.cpp, cpu_gemm_amx.cpp,
// cpu_gemm_gguf.cpp), written once:
//  * bf16 <-> float32 bits: widening, and round-to-nearest-even narrowing (torch's rule);
//  * GemmOut, the output of the GEMM kernels (bf16 rounded or float32), and the tile epilogue that
//    every register / AMX tile of gemm_bf16 and gemm_gguf ends with (+ bias, round, masked store);
//  * the AMX permission request (arch_prctl) and tile configuration.
// The per-ISA vector types of the loops that differ only in lane width are in cpu_vec.h.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tv_cpu {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// bf16 bits -> float32 (exact).
inline float bf16_bits_to_f(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// float32 -> bf16 bits, round to nearest even: c10::detail::round_to_nearest_even (torch's scalar
// float -> bfloat16; denormals kept), NaN -> 0x7FC0 (c10's quiet NaN; rounding could otherwise turn a
// NaN into Inf or -0).
inline uint16_t f_to_bf16_bits(float f) {
  if (f != f) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// f_to_bf16_bits on 16 lanes. VCVTNEPS2BF16 would flush denormal inputs to zero, so it is done with
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

// Lanes 0 .. n-1 of 16 (n >= 16: all).
inline __mmask16 first_lanes16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}
#endif

// Where the GEMM kernels write: p points at element 0 of the output, bf16 bits (f32 false) or
// float32. Offsets are in elements. Each element is a float32 sum (+ bias in float32), stored either
// rounded to bf16 (f_to_bf16_bits) or as the float32 value itself. The float32 form is for the LM
// head: a logit rounded to bf16 is off by up to 2^-9 of its size (0.03 nats at a logit of 16), more
// than the gap of many near-ties (issue 37).
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

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The tile epilogue of gemm_bf16 (VDPBF16PS and AMX) and gemm_gguf: column slice c (columns 16c ..
// 16c+15) of a tile of `rows` rows, row r's float32 sums row(r): + bias (float32; bias null: none),
// rounded to bf16 or kept float32 (GemmOut), stored masked past ncols into out (row stride ldo).
// Returns false when the slice starts at or past ncols (nothing stored; the later slices neither).
template <typename Row>
inline bool store_cols16(GemmOut out, int64_t ldo, int64_t rows, int64_t ncols, int c, const float* bias, Row row) {
  const int64_t valid = ncols - 16 * c;
  if (valid <= 0) return false;
  const __mmask16 mask = first_lanes16(valid);
  const __m512 bb = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * c) : _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = row(r);
    out.store16(r * ldo + 16 * c, mask, bias ? _mm512_add_ps(v, bb) : v);
  }
  return true;
}
#endif

#if defined(__AMX_TILE__)
// Whether the OS grants this process the AMX tile state: Linux asks for it once per process
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), kernel 5.16+); without it the first tile
// instruction faults.
inline bool os_grants_amx() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

// The 64-byte tile configuration of LDTILECFG (palette 1: up to 16 rows x 64 bytes per tile).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0 .. 7 of 64 bytes a row; rows[i] rows each.
inline void configure_tiles(const uint8_t (&rows)[8]) {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.colsb[i] = 64, cfg.rows[i] = rows[i];
  // GCC's _tile_loadconfig is an asm statement that does not tell the compiler it reads cfg: without
  // this barrier the stores above can be dropped (seen: a zero config, then a fault at LDTILECFG).
  asm volatile("" ::: "memory");
  _tile_loadconfig(&cfg);
}
#endif

}  // namespace tv_cpu
