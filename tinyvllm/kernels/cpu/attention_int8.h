// Int8 Q K^T for the tiled prefill/decode attention over an int8 KV cache (issue 39). Included by
// cpu_kernel.cpp inside its anonymous namespace, after attention_tiled (it reuses PackedTile's V
// packing, PairState, online_softmax, transpose16x16, amx_configure and the work-item scheme).
//
// SageAttention's idea (Zhang et al., "SageAttention: Accurate 8-Bit Attention for Plug-and-play
// Inference Acceleration", ICLR 2025): S = Q K^T in int8 with the quantization scales applied to the
// int32 dot products, P V in higher precision. Here:
//  * K is already int8 in the cache with one bf16 scale per (token, KV head) row (kv_quant.py); it is
//    packed as it is, 4 dims of one position per 32-bit word ([D/4][kKvTile]: the B layout of AMX's
//    TDPBSSD and the b operand of VPDPBUSD): no conversion at all, half the bytes of the bf16 pack.
//  * Q is quantized per (row, query head), symmetric: qs = max|q| / 127 (float32), q8 = round-half-even
//    (q * (127 / max|q|)), from the float32 query (attention_tiled rounds it to bf16 instead). The
//    scale depends on the row alone, so the invariance argument of attention_tiled holds unchanged.
//    K smoothing (SageAttention's K - mean_t(K)) is not applied: the mean over a context's tokens would
//    make a row's K depend on other tokens (docs/kv-cache-dtype.md).
//  * S = float(sum_d q8_d k8_d) * s_k(position), then the base-2 online softmax of attention_tiled with
//    vlog2 = scale * log2(e) * qs (so exactly attention_tiled's softmax and P V on these scores). The
//    int32 sum is exact (|sum| <= 127 * 127 * D < 2^24: exact in float32 too).
//  * AMX-INT8 (TDPBSSD, s8 x s8 -> s32, 16 x 16 x 64 per instruction) where the tiled kernel runs on AMX;
//    else AVX512-VNNI VPDPBUSD, which multiplies UNSIGNED by signed bytes: the query goes in as
//    q8 + 128 (in [1, 255]) and the packed tile carries 128 * sum_d k8_d per position, subtracted
//    from the int32 sum (sum (q8 + 128) k8 - 128 sum k8 = sum q8 k8, exactly).
//  * P V: on the vector path in int8 too (tile_pv8: u8 P x s8 V on VPDPBUSD, V's scales folded into P);
//    on AMX in bf16 (V dequantized while packing, as in attention_tiled's int8 path).
// Each pair's arithmetic depends only on its own query, its context's rows and the fixed tile grid:
// batch-, chunk- and prefix-cache-invariant like attention_tiled.
#pragma once

#if defined(__AVX512VNNI__)
#define TINYVLLM_INT8_QK 1

bool g_int8_qk = true;   // int8 cache: the int8 Q K^T kernel below (off: attention_tiled<int8>, for A/B)
bool g_int8_exp3 = true;  // the int8 kernel's softmax: exp2_deg3_16 (off: exp2_fast16, attention_tiled's)
bool g_int8_pv = true;   // the int8 kernel's P V on the vector path: u8 P x s8 V on VPDPBUSD (off: bf16, vdpbf16ps)
int g_int8_profile = 0;  // measurement only (benchmarks/attention_int8_profile.py): bits skip stages, garbage out

enum Int8ProfileSkip : int { kSkipQk = 1, kSkipSoftmax = 2, kSkipPv = 4, kSkipPack = 8 };

// 2^x as exp2_fast16 with a degree-3 polynomial (minimax for relative error on [0, 1): 7.5e-5, 26x below
// the bf16 rounding of P, 2^-9; p(0) = 0.999925 rounds to exactly 1 in bf16, so the row's largest
// weight is still exactly 1): one FMA less per 16 probabilities, for the int8 kernel only (the bf16
// cache's kernel keeps exp2_fast16 and its bits).
inline __m512 exp2_deg3_16(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, 0x09);
  __m512 y = _mm512_set1_ps(7.802402973175049e-2f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.2606706619262695e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.958339810371399e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.999251365661621e-1f));
  return _mm512_scalef_ps(y, x);
}

// One KV tile of one KV head of an int8 cache. D = ND * 16, ND a multiple of 4 (D = 64, 128).
template <int ND>
struct PackedTileI8 {
  static constexpr int DQ = ND * 4;  // dim quads
  static constexpr int D = ND * 16;
  alignas(64) uint32_t k[DQ][kKvTile];          // k[i][j] = dims 4i..4i+3 of position j (int8 bytes)
  alignas(64) uint32_t v[kKvTile / 2][ND * 16];  // PackedTile's bf16 pairs of positions (2i, 2i+1)
  alignas(64) float ks[kKvTile];                 // K scale per position
  alignas(64) int32_t ksum128[kKvTile];          // 128 * sum_d k8 per position (VPDPBUSD's offset)
  // The int8 P V's V (pv8): vq[i][d] = the int8 values of positions 4i..4i+3 at dim d (VPDPBUSD's b
  // operand, 4 positions per 32-bit word), unscaled, and each position's V scale.
  alignas(64) uint32_t vq[kKvTile / 4][ND * 16];
  alignas(64) float vs[kKvTile];

  // vq for the 4 positions of quad i: byte interleaves within 128-bit lanes, then a 4 x 4 transpose of
  // the lanes back into dim order (no arithmetic: the cache's bytes as they are).
  void pack_v_quad(const uint8_t* const* vr, int i) {
    for (int db = 0; db < D; db += 64) {
      const __m512i r0 = _mm512_loadu_si512(vr[4 * i] + db), r1 = _mm512_loadu_si512(vr[4 * i + 1] + db);
      const __m512i r2 = _mm512_loadu_si512(vr[4 * i + 2] + db), r3 = _mm512_loadu_si512(vr[4 * i + 3] + db);
      const __m512i a01l = _mm512_unpacklo_epi8(r0, r1), a01h = _mm512_unpackhi_epi8(r0, r1);
      const __m512i a23l = _mm512_unpacklo_epi8(r2, r3), a23h = _mm512_unpackhi_epi8(r2, r3);
      // w_k, 128-bit lane L: the words of dims 16L + 4k .. 16L + 4k + 3
      const __m512i w0 = _mm512_unpacklo_epi16(a01l, a23l), w1 = _mm512_unpackhi_epi16(a01l, a23l);
      const __m512i w2 = _mm512_unpacklo_epi16(a01h, a23h), w3 = _mm512_unpackhi_epi16(a01h, a23h);
      const __m512i t0 = _mm512_shuffle_i32x4(w0, w1, 0x44), t1 = _mm512_shuffle_i32x4(w0, w1, 0xEE);
      const __m512i t2 = _mm512_shuffle_i32x4(w2, w3, 0x44), t3 = _mm512_shuffle_i32x4(w2, w3, 0xEE);
      _mm512_store_si512(&vq[i][db], _mm512_shuffle_i32x4(t0, t2, 0x88));        // dims db + 0..15
      _mm512_store_si512(&vq[i][db + 16], _mm512_shuffle_i32x4(t0, t2, 0xDD));   // db + 16..31
      _mm512_store_si512(&vq[i][db + 32], _mm512_shuffle_i32x4(t1, t3, 0x88));   // db + 32..47
      _mm512_store_si512(&vq[i][db + 48], _mm512_shuffle_i32x4(t1, t3, 0xDD));   // db + 48..63
    }
  }

  void pack(const uint8_t* const* kr, const uint8_t* const* vr, const uint8_t* const* nk,
            const uint8_t* const* nv, bool vnni, bool pv8) {
    constexpr int kRowBytes = D + 2;
    for (int jb = 0; jb < kKvTile; jb += 16) {
      if (nk != nullptr) {
        for (int j = jb; j < jb + 16; ++j)
          for (int b = 0; b < kRowBytes; b += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(nk[j]) + b, _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(nv[j]) + b, _MM_HINT_T1);
          }
      }
      for (int db = 0; db < DQ; db += 16) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(kr[jb + j] + 4 * db);
        transpose16x16(r);
        for (int d = 0; d < 16; ++d) _mm512_store_si512(&k[db + d][jb], r[d]);
      }
      for (int j = jb; j < jb + 16; ++j) ks[j] = row_scale(kr[j], D);
      if (vnni) {
        __m512i sum = _mm512_setzero_si512();
        for (int i = 0; i < DQ; ++i) sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), _mm512_load_si512(&k[i][jb]));
        _mm512_store_si512(&ksum128[jb], _mm512_slli_epi32(sum, 7));
      }
    }
    if (pv8) {
      for (int i = 0; i < kKvTile / 4; ++i) pack_v_quad(vr, i);
      for (int j = 0; j < kKvTile; ++j) vs[j] = row_scale(vr[j], D);
      return;
    }
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int i = 0; i < kKvTile / 2; ++i)
      for (int d = 0; d < D; d += 32) {
        const __m512i a = PackedTile<ND, kKvInt8>::v_dims(vr[2 * i], d);
        const __m512i b = PackedTile<ND, kKvInt8>::v_dims(vr[2 * i + 1], d);
        _mm512_store_si512(&v[i][d], _mm512_permutex2var_epi16(a, lo, b));
        _mm512_store_si512(&v[i][d + 16], _mm512_permutex2var_epi16(a, hi, b));
      }
  }
};

// A pair's state (PairState: max, lane-wise sum, output; its bf16 q unused) with the int8 query.
template <int ND>
struct alignas(64) PairI8 {
  PairState<ND> st;
  alignas(64) int8_t q[ND * 16];   // q8 (AMX A rows)
  alignas(64) uint8_t qu[ND * 16];  // q8 + 128 (VPDPBUSD's unsigned operand)
  float qs;                          // the query's scale
};

// Quantize one float32 query row (D = ND * 16 values) into p (see the top of the file).
template <int ND>
inline void quantize_query(const float* qrow, PairI8<ND>& p) {
  __m512 x[ND];
  __m512 amax = _mm512_setzero_ps();
  for (int v = 0; v < ND; ++v) {
    x[v] = _mm512_loadu_ps(qrow + v * 16);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(x[v]));
  }
  const float m = _mm512_reduce_max_ps(amax);
  const __m512 inv = _mm512_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
  p.qs = m / 127.0f;
  for (int v = 0; v < ND; ++v) {
    const __m128i b = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x[v], inv)));  // nearest even
    _mm_store_si128(reinterpret_cast<__m128i*>(p.q + v * 16), b);
    _mm_store_si128(reinterpret_cast<__m128i*>(p.qu + v * 16), _mm_xor_si128(b, _mm_set1_epi8(static_cast<char>(0x80))));
  }
}

// Softmax and P V in int8 of one tile for N pairs, from their scores s (the int8 P V, pv8).
// O = sum_j P_j V_j with V_j = s_v(j) v8_j: V's scale varies along the reduction, so it is folded into
// the probabilities, P'_j = P_j s_v(j), which are quantized per (pair, tile) to unsigned bytes,
// p8_j = round_half_even(P'_j * 255 / max_j P'_j) (masked and past-the-context positions: 0; all 0 when
// max_j P'_j < 2^-100), and
// O += (max_j P'_j / 255) * float(sum_j p8_j v8_j), the int32 sum exact (at most 64 * 255 * 127) on
// VPDPBUSD (u8 x s8, 4 positions per instruction: half the instructions of vdpbf16ps's 2). The
// normaliser l adds the float32 probabilities. The rounding of P' is at most half a step of the tile's
// largest P' (bf16 P: 2^-9 relative); SageAttention (Zhang et al., ICLR 2025) keeps P V in 16 bits
// for that reason, so it was measured before it became the vector path's default (docs/kv-cache-dtype.md:
// next-token KL against the bf16 cache within 0.0003 nats of the bf16 P V's on four prompt sets).
// The scale and the rounding depend only on the pair's own row and the tile: invariance holds.
template <int ND, int N, bool kExp3>
inline void tile_pv8(const PackedTileI8<ND>& t, PairI8<ND>* ps, const __m512 (*s)[kKvTile / 16], int32_t j0,
                     __m512 vscale) {
  constexpr int NC = kKvTile / 16;
  alignas(64) uint8_t p8[N][kKvTile];
  float psc[N];
  __m512 alpha[N];
  bool changed[N];
  for (int n = 0; n < N; ++n) {
    if (g_int8_profile & kSkipSoftmax) {
      for (int c = 0; c < NC; ++c) _mm_store_si128(reinterpret_cast<__m128i*>(&p8[n][c * 16]), _mm512_cvtepi32_epi8(_mm512_castps_si512(s[n][c])));
      changed[n] = false, psc[n] = 1.0f;
      continue;
    }
    __m512 p[NC];
    PairState<ND>& st = ps[n].st;
    changed[n] = tile_probs<ND, kExp3 ? exp2_deg3_16 : exp2_fast16>(st, s[n], j0, _mm512_mul_ps(vscale, _mm512_set1_ps(ps[n].qs)), p, alpha[n]);
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3]));
    _mm512_store_ps(st.l, _mm512_fmadd_ps(_mm512_load_ps(st.l), alpha[n], sum));
    __m512 mx = _mm512_setzero_ps();
    for (int c = 0; c < NC; ++c) {
      p[c] = _mm512_mul_ps(p[c], _mm512_load_ps(&t.vs[c * 16]));
      mx = _mm512_max_ps(mx, p[c]);
    }
    // A tile whose largest P' (P <= 1 against the running max, times V's scale) is below 2^-100, or 0
    // (masked, zero V), adds nothing (p8 = 0): 255 / m must stay finite, and such a tile is far below
    // float32's resolution of O for any V a bf16 model holds.
    const float m = _mm512_reduce_max_ps(mx);
    const bool live = m > 0x1p-100f;
    psc[n] = live ? m / 255.0f : 0.0f;
    const __m512 inv = _mm512_set1_ps(live ? 255.0f / m : 0.0f);
    for (int c = 0; c < NC; ++c)
      _mm_store_si128(reinterpret_cast<__m128i*>(&p8[n][c * 16]),
                      _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(p[c], inv))));
  }
  if (g_int8_profile & kSkipPv) return;
  __m512i acc[N][ND];
  for (int n = 0; n < N; ++n)
    for (int v = 0; v < ND; ++v) acc[n][v] = _mm512_setzero_si512();
  for (int i = 0; i < kKvTile / 4; ++i) {
    __m512i vv[ND];
    for (int v = 0; v < ND; ++v) vv[v] = _mm512_load_si512(&t.vq[i][v * 16]);
    for (int n = 0; n < N; ++n) {
      int32_t w;
      std::memcpy(&w, &p8[n][4 * i], 4);
      const __m512i pp = _mm512_set1_epi32(w);
      for (int v = 0; v < ND; ++v) acc[n][v] = _mm512_dpbusd_epi32(acc[n][v], pp, vv[v]);
    }
  }
  for (int n = 0; n < N; ++n) {
    const __m512 sc = _mm512_set1_ps(psc[n]);
    for (int v = 0; v < ND; ++v) {
      float* o = ps[n].st.o + v * 16;
      __m512 x = _mm512_load_ps(o);
      if (changed[n]) x = _mm512_mul_ps(x, alpha[n]);
      _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[n][v]), sc, x));
    }
  }
}

// One tile for N pairs on AVX512-VNNI (S) and AVX512-BF16 (P V): tile_pairs with int8 S.
// kPv8: P V in int8 instead (tile_pv8 above).
template <int ND, int N, bool kExp3, bool kPv8>
inline void tile_pairs_i8(const PackedTileI8<ND>& t, PairI8<ND>* ps, int32_t j0, __m512 vscale) {
  constexpr int DQ = ND * 4, NC = kKvTile / 16;
  __m512 s[N][NC];
  if (!(g_int8_profile & kSkipQk)) {
    __m512i acc[N][NC];
    for (int n = 0; n < N; ++n)
      for (int c = 0; c < NC; ++c) acc[n][c] = _mm512_setzero_si512();
    for (int dq = 0; dq < DQ; ++dq) {
      __m512i kv[NC];
      for (int c = 0; c < NC; ++c) kv[c] = _mm512_load_si512(&t.k[dq][c * 16]);
      for (int n = 0; n < N; ++n) {
        int32_t w;
        std::memcpy(&w, ps[n].qu + 4 * dq, 4);
        const __m512i qb = _mm512_set1_epi32(w);
        for (int c = 0; c < NC; ++c) acc[n][c] = _mm512_dpbusd_epi32(acc[n][c], qb, kv[c]);
      }
    }
    for (int c = 0; c < NC; ++c) {
      const __m512i k128 = _mm512_load_si512(&t.ksum128[c * 16]);
      const __m512 sk = _mm512_load_ps(&t.ks[c * 16]);
      for (int n = 0; n < N; ++n) s[n][c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[n][c], k128)), sk);
    }
  } else {
    for (int n = 0; n < N; ++n)
      for (int c = 0; c < NC; ++c) s[n][c] = _mm512_load_ps(&t.ks[c * 16]);
  }
  if constexpr (kPv8) {
    tile_pv8<ND, N, kExp3>(t, ps, s, j0, vscale);
    return;
  }
  alignas(64) uint32_t pb[N][kKvTile / 2];
  __m512 alpha[N];
  bool changed[N];
  for (int n = 0; n < N; ++n) {
    if (g_int8_profile & kSkipSoftmax) {
      for (int c = 0; c < kKvTile / 2; c += 16) _mm512_store_si512(&pb[n][c], _mm512_castps_si512(s[n][c / 8]));
      changed[n] = false;
      continue;
    }
    changed[n] = online_softmax<ND, false, kExp3 ? exp2_deg3_16 : exp2_fast16>(ps[n].st, s[n], j0, _mm512_mul_ps(vscale, _mm512_set1_ps(ps[n].qs)), pb[n], alpha[n]);
  }
  if (g_int8_profile & kSkipPv) return;
  __m512 acc[N][ND];
  for (int n = 0; n < N; ++n)
    for (int v = 0; v < ND; ++v) {
      acc[n][v] = _mm512_load_ps(ps[n].st.o + v * 16);
      if (changed[n]) acc[n][v] = _mm512_mul_ps(acc[n][v], alpha[n]);
    }
  for (int i = 0; i < kKvTile / 2; ++i) {
    __m512bh vv[ND];
    for (int v = 0; v < ND; ++v) vv[v] = (__m512bh)_mm512_load_si512(&t.v[i][v * 16]);
    for (int n = 0; n < N; ++n) {
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pb[n][i]));
      for (int v = 0; v < ND; ++v) acc[n][v] = _mm512_dpbf16_ps(acc[n][v], pp, vv[v]);
    }
  }
  for (int n = 0; n < N; ++n)
    for (int v = 0; v < ND; ++v) _mm512_store_ps(ps[n].st.o + v * 16, acc[n][v]);
}

template <int ND, int N, bool kExp3, bool kPv8>
inline void tile_group_i8(const PackedTileI8<ND>& t, PairI8<ND>* ps, int n, int32_t j0, __m512 vscale) {
  if constexpr (N > 1) {
    if (n < N) return tile_group_i8<ND, N - 1, kExp3, kPv8>(t, ps, n, j0, vscale);
  }
  tile_pairs_i8<ND, N, kExp3, kPv8>(t, ps, j0, vscale);
}

#if defined(__AMX_INT8__) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define TINYVLLM_INT8_AMX 1
#define TINYVLLM_TILE_FOR4(F) F(0) F(1) F(2) F(3)
// 16 pairs on AMX: S in TDPBSSD (tiles 0-3 accumulate int32, 5 the pairs' q8 rows, 4 the K tile's 16
// dim quads x 16 positions), then tile_pairs_amx's softmax and bf16 P V (the tile configuration of
// amx_configure: all tiles 16 rows x 64 bytes).
template <int ND, bool kExp3>
inline void tile_pairs_amx_i8(const PackedTileI8<ND>& t, PairI8<ND>* ps, int n, int32_t j0, __m512 vscale) {
  constexpr int NC = kKvTile / 16, KS = ND / 4;  // 64-dim k steps
  constexpr long kPairStride = sizeof(PairI8<ND>);
  alignas(64) int32_t sb[16][kKvTile];
  alignas(64) uint32_t pb[16][kKvTile / 2];
  if (!(g_int8_profile & kSkipQk)) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int ks = 0; ks < KS; ++ks) {
      _tile_loadd(5, ps[0].q + ks * 64, kPairStride);
#define TINYVLLM_QK(C) _tile_loadd(4, &t.k[ks * 16][C * 16], kKvTile * 4); _tile_dpbssd(C, 5, 4);
      TINYVLLM_TILE_FOR4(TINYVLLM_QK)
#undef TINYVLLM_QK
    }
#define TINYVLLM_ST(C) _tile_stored(C, &sb[0][C * 16], kKvTile * 4);
    TINYVLLM_TILE_FOR4(TINYVLLM_ST)
#undef TINYVLLM_ST
  } else {
    for (int r = 0; r < 16; ++r)
      for (int c = 0; c < NC; ++c) _mm512_store_si512(&sb[r][c * 16], _mm512_set1_epi32(r + c));
  }
  for (int r = 0; r < 16; ++r) {
    if (r < n && !(g_int8_profile & kSkipSoftmax)) {
      __m512 sv[NC];
      for (int c = 0; c < NC; ++c)
        sv[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(&sb[r][c * 16])), _mm512_load_ps(&t.ks[c * 16]));
      __m512 alpha;
      PairState<ND>& st = ps[r].st;
      if (online_softmax<ND, true, kExp3 ? exp2_deg3_16 : exp2_fast16>(st, sv, j0, _mm512_mul_ps(vscale, _mm512_set1_ps(ps[r].qs)), pb[r], alpha))
        for (int v = 0; v < ND; ++v) _mm512_store_ps(st.o + v * 16, _mm512_mul_ps(_mm512_load_ps(st.o + v * 16), alpha));
    } else {
      for (int c = 0; c < kKvTile / 2; c += 16) _mm512_store_si512(&pb[r][c], _mm512_setzero_si512());
    }
  }
  if (g_int8_profile & kSkipPv) return;
  // tile_pairs_amx's P V and normaliser (see there), with this file's pair stride.
  alignas(64) static const uint32_t ones[16][16] = {{0x3F803F80u}, {0x3F803F80u}, {0x3F803F80u}, {0x3F803F80u},
                                                    {0x3F803F80u}, {0x3F803F80u}, {0x3F803F80u}, {0x3F803F80u},
                                                    {0x3F803F80u}, {0x3F803F80u}, {0x3F803F80u}, {0x3F803F80u},
                                                    {0x3F803F80u}, {0x3F803F80u}, {0x3F803F80u}, {0x3F803F80u}};
  _tile_loadd(7, &ones[0][0], 64);
  _tile_loadd(6, ps[0].st.l, kPairStride);
  for (int v0 = 0; v0 < ND; v0 += 4) {
#define TINYVLLM_LD(C) _tile_loadd(C, ps[0].st.o + (v0 + C) * 16, kPairStride);
    TINYVLLM_TILE_FOR4(TINYVLLM_LD)
#undef TINYVLLM_LD
    for (int ks = 0; ks < kKvTile / 32; ++ks) {
      _tile_loadd(5, &pb[0][ks * 16], kKvTile * 2);
      if (v0 == 0) _tile_dpbf16ps(6, 5, 7);
#define TINYVLLM_PV(C) _tile_loadd(4, &t.v[ks * 16][(v0 + C) * 16], ND * 64); _tile_dpbf16ps(C, 5, 4);
      TINYVLLM_TILE_FOR4(TINYVLLM_PV)
#undef TINYVLLM_PV
    }
#define TINYVLLM_SO(C) _tile_stored(C, ps[0].st.o + (v0 + C) * 16, kPairStride);
    TINYVLLM_TILE_FOR4(TINYVLLM_SO)
#undef TINYVLLM_SO
  }
  _tile_stored(6, ps[0].st.l, kPairStride);
}
#undef TINYVLLM_TILE_FOR4
#endif  // AMX-INT8

// attention_tiled over an int8 cache with the int8 Q K^T above (same work items, tiles, prefetch and
// normalisation; see attention_tiled). D = ND * 16 with ND = 4 or 8.
template <typename O, int ND, bool kExp3, bool kPv8>
void attention_tiled_i8_impl(const torch::Tensor& q, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                        const torch::Tensor& block_tables, const torch::Tensor& token_seq,
                        const torch::Tensor& token_pos, double scale, torch::Tensor& out) {
  static_assert(ND % 4 == 0, "the int8 Q K^T takes 64-dim steps");
  constexpr int D = ND * 16, NG = kGroupPairs<ND>, RD = D + 2;
  const int64_t num_tokens = q.size(0), Hq = q.size(1);
  const int64_t bs = key_cache.size(1), Hk = key_cache.size(2);
  const int64_t G = Hq / Hk;
  const int64_t max_blocks = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const uint8_t* kp = static_cast<const uint8_t*>(key_cache.data_ptr());
  const uint8_t* vp = static_cast<const uint8_t*>(value_cache.data_ptr());
  const int64_t* btp = block_tables.data_ptr<int64_t>();
  const int64_t* seqp = token_seq.data_ptr<int64_t>();
  const int64_t* posp = token_pos.data_ptr<int64_t>();
  O* op = out.data_ptr<O>();
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale * 1.4426950408889634));
  alignas(64) static const uint8_t zero_row[RD + 64] = {};

  struct Item { int64_t t0, rows, hk, cost; };
  const int64_t row_block = g_row_block;
  std::vector<Item> items;
  for (int64_t t = 0; t < num_tokens;) {
    int64_t e = t + 1;
    while (e < num_tokens && e - t < row_block && seqp[e] == seqp[t] && posp[e] == posp[e - 1] + 1) ++e;
    for (int64_t hk = 0; hk < Hk; ++hk) items.push_back({t, e - t, hk, (e - t) * (posp[e - 1] + 1)});
    t = e;
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
#if defined(TINYVLLM_INT8_AMX)
  const bool use_amx = g_amx && amx_enabled();
#else
  const bool use_amx = false;
#endif
  const int profile = g_int8_profile;

  tv_pool::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
    std::vector<PairI8<ND>> st(row_block * G + 16);  // + AMX's padding rows past the last pair
    auto tile = std::make_unique<PackedTileI8<ND>>();
#if defined(TINYVLLM_INT8_AMX)
    if (use_amx) amx_configure();
#endif
    const uint8_t* rows[2][2][kKvTile];
    for (int64_t it; (it = next.fetch_add(1, std::memory_order_relaxed)) < num_items;) {
      const Item& w = items[it];
      const int64_t pairs = w.rows * G;
      const int64_t* bt = btp + seqp[w.t0] * max_blocks;
      const int64_t pos0 = posp[w.t0], ctx_max = pos0 + w.rows;
      for (int64_t p = 0; p < pairs; ++p) {
        PairI8<ND>& s = st[p];
        quantize_query<ND>(qp + ((w.t0 + p / G) * Hq + w.hk * G + p % G) * D, s);
        s.st.m = -std::numeric_limits<float>::infinity();
        _mm512_store_ps(s.st.l, _mm512_setzero_ps());
        for (int v = 0; v < ND; ++v) _mm512_store_ps(s.st.o + v * 16, _mm512_setzero_ps());
        s.st.pos = static_cast<int32_t>(pos0 + p / G);
        s.st.lo = 0;  // no sliding window here (attention_q_impl sends windowed calls to attention_tiled)
      }
      const auto fill = [&](int64_t j0, const uint8_t** kr, const uint8_t** vr) {
        int64_t j = 0;
        for (int64_t blk = j0 / bs, off = j0 % bs; j < kKvTile && j0 + j < ctx_max; ++blk, off = 0) {
          const int64_t n = std::min({bs - off, kKvTile - j, ctx_max - j0 - j});
          const int64_t e = ((bt[blk] * bs + off) * Hk + w.hk) * RD;
          for (int64_t i = 0; i < n; ++i, ++j) kr[j] = kp + e + i * Hk * RD, vr[j] = vp + e + i * Hk * RD;
        }
        for (; j < kKvTile; ++j) kr[j] = vr[j] = zero_row;
      };
      int cur = 0;
      fill(0, rows[0][0], rows[0][1]);
      for (int64_t j0 = 0; j0 < ctx_max; j0 += kKvTile, cur ^= 1) {
        const bool more = j0 + kKvTile < ctx_max;
        if (more) fill(j0 + kKvTile, rows[cur ^ 1][0], rows[cur ^ 1][1]);
        const bool pf = more && g_prefetch;
        if (!(profile & kSkipPack) || j0 == 0)
          tile->pack(rows[cur][0], rows[cur][1], pf ? rows[cur ^ 1][0] : nullptr, pf ? rows[cur ^ 1][1] : nullptr,
                     !use_amx, kPv8 && !use_amx);
        const int64_t first = std::max<int64_t>(0, j0 - pos0) * G;
#if defined(TINYVLLM_INT8_AMX)
        if (use_amx) {
          for (int64_t p = first; p < pairs; p += 16)
            tile_pairs_amx_i8<ND, kExp3>(*tile, st.data() + p, static_cast<int>(std::min<int64_t>(16, pairs - p)),
                                  static_cast<int32_t>(j0), vscale);
          continue;
        }
#endif
        for (int64_t p = first; p < pairs; p += NG)
          tile_group_i8<ND, NG, kExp3, kPv8>(*tile, st.data() + p, static_cast<int>(std::min<int64_t>(NG, pairs - p)),
                                static_cast<int32_t>(j0), vscale);
      }
      for (int64_t p = 0; p < pairs; ++p) {
        const __m512 inv = _mm512_set1_ps(1.0f / hsum(_mm512_load_ps(st[p].st.l)));
        O* orow = op + ((w.t0 + p / G) * Hq + w.hk * G + p % G) * D;
        for (int v = 0; v < ND; ++v) store16(orow + v * 16, _mm512_mul_ps(_mm512_load_ps(st[p].st.o + v * 16), inv));
      }
    }
#if defined(TINYVLLM_INT8_AMX)
    if (use_amx) _tile_release();
#endif
  });
}

template <typename O, int ND>
void attention_tiled_i8(const torch::Tensor& q, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                        const torch::Tensor& block_tables, const torch::Tensor& token_seq,
                        const torch::Tensor& token_pos, double scale, torch::Tensor& out) {
  if (g_int8_exp3 && g_int8_pv)  // pv8 on the vector path only: AMX keeps the bf16 P V tiles
    attention_tiled_i8_impl<O, ND, true, true>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out);
  else if (g_int8_exp3)
    attention_tiled_i8_impl<O, ND, true, false>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out);
  else
    attention_tiled_i8_impl<O, ND, false, false>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out);
}
#endif  // __AVX512VNNI__
