// CPU kernels: paged attention, RMSNorm (+ residual), SiLU-and-mul, rotary + KV-cache write.
//
// Paged attention reads K/V in place from the paged cache through the block table
// (PagedAttention, Kwon et al. SOSP 2023); no padded copy is materialised. Every query row
// (a decode token or one token of a prefill chunk) is computed by the same fixed-order
// sequence of operations over its own context positions 0..pos, so its result does not
// depend on the batch, on chunk boundaries, or on whether its prefix came from the prefix
// cache (batch invariance). Two passes over the context: scores, then max / exp / sum and
// the weighted sum of V in position order.
//
// Two implementations: AVX-512 (attention_avx512, silu's vector body; chosen when the
// compiler targets AVX-512 and the head size is 16/32/64/96/128) and portable scalar loops
// (attention_scalar; also what set_vector_kernels(false) selects, for tests). They differ in
// the last bits from each other, but each is batch invariant on its own.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define TINYVLLM_AVX512 1
#endif

namespace {

constexpr int kLanes = 16;

// Whether the AVX-512 kernels may run (tests switch them off to check the portable path).
bool g_vector_kernels = true;
bool g_prefetch = true;

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

template <>
inline float to_f<c10::BFloat16>(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// exp(x) for x <= 0 (softmax weights): Cephes-style range reduction x = n ln2 + r and a degree-6
// polynomial, ~2 ulp. Plain arithmetic, so the compiler vectorises the loop that calls it and every
// element gets bit-identical results whether it lands in a vector lane or not (batch invariance).
inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - fx * 0.693359375f;
  r = r - fx * -2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// Dot product of a float query and a cache row with a fixed summation order.
template <typename T>
inline float dot(const float* q, const T* k, int d) {
  float lanes[kLanes] = {0};
  int i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += q[i + l] * to_f(k[i + l]);
  }
  for (int l = 0; i + l < d; ++l) lanes[l] += q[i + l] * to_f(k[i + l]);
  // Fixed pairwise reduction of the lanes.
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  return lanes[0];
}

template <typename C, typename O>
void attention_scalar(const torch::Tensor& q,            // [T, Hq, D] float32
                    const torch::Tensor& key_cache,    // [num_blocks, bs, Hk, D]
                    const torch::Tensor& value_cache,  // [num_blocks, bs, Hk, D]
                    const torch::Tensor& block_tables, // [S, max_blocks] int64
                    const torch::Tensor& token_seq,    // [T] int64
                    const torch::Tensor& token_pos,    // [T] int64
                    double scale, torch::Tensor& out) {  // [T, Hq, D] float32 or C
  const int64_t num_tokens = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = key_cache.size(1), Hk = key_cache.size(2);
  const int64_t G = Hq / Hk;
  const int64_t max_blocks = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const C* kp = key_cache.data_ptr<C>();
  const C* vp = value_cache.data_ptr<C>();
  const int64_t* btp = block_tables.data_ptr<int64_t>();
  const int64_t* seqp = token_seq.data_ptr<int64_t>();
  const int64_t* posp = token_pos.data_ptr<int64_t>();
  O* op = out.data_ptr<O>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_tokens * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / Hk, hk = item % Hk;
      const int64_t ctx = posp[t] + 1;
      const int64_t* bt = btp + seqp[t] * max_blocks;
      scores.resize(G * ctx);
      // Pass 1: scores for the G query heads sharing this KV head.
      for (int64_t j = 0; j < ctx; ++j) {
        const int64_t slot = bt[j / bs] * bs + (j % bs);
        const C* krow = kp + (slot * Hk + hk) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qrow = qp + (t * Hq + hk * G + g) * D;
          scores[g * ctx + j] = dot(qrow, krow, D) * fscale;
        }
      }
      // Pass 2: softmax and weighted sum of V, in position order.
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * ctx;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < ctx; ++j) m = s[j] > m ? s[j] : m;
        for (int64_t j = 0; j < ctx; ++j) s[j] = exp_nonpos(s[j] - m);
        float sum = 0.0f;
        for (int64_t j = 0; j < ctx; ++j) sum += s[j];
        const float inv = 1.0f / sum;
        float* a = acc.data() + g * D;
        for (int64_t j = 0; j < ctx; ++j) {
          const int64_t slot = bt[j / bs] * bs + (j % bs);
          const C* vrow = vp + (slot * Hk + hk) * D;
          const float p = s[j];
          for (int64_t d = 0; d < D; ++d) a[d] += p * to_f(vrow[d]);
        }
        O* orow = op + (t * Hq + hk * G + g) * D;
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<O>(a[d] * inv);
      }
    }
  });
}

#if defined(TINYVLLM_AVX512)
// ---------------------------------------------------------------------------------------------
// AVX-512 paged attention. Same algorithm and the same per-row guarantee as attention_scalar
// (each query row's result is a fixed sequence of operations over its own context, so it does
// not depend on the batch, chunking or prefix-cache hits), but vectorised:
//  * a work item is (tile of up to kTileRows consecutive query rows of one sequence, KV head);
//    each K/V row is converted to float32 once per item and reused by every query row of the
//    tile and every query head of the GQA group (the rows never mix: only the loads are shared);
//  * scores for 16 positions come from 16 per-position lane vectors (q*k, D/16 FMAs each) folded
//    by one fixed transpose-and-add network (hsum16), instead of 16 separate horizontal sums;
//  * softmax uses a vectorised polynomial exp; P*V accumulates in position order with FMAs.

constexpr int kTileRows = 8;
constexpr int kMaxGroup = 16;  // query heads per KV head handled by the vector kernel

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Round 16 floats to bfloat16 with round-to-nearest-even (c10::BFloat16's rule, NaN aside).
inline __m256i to_bf16_bits(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  // NaN -> 0x7FC0 (c10's quiet NaN); rounding could otherwise turn a NaN into Inf or -0.
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(x));
}
inline __m512 round16(float*, __m512 x) { return x; }
inline __m512 round16(c10::BFloat16*, __m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(x)), 16));
}

// out[i] = sum of the 16 lanes of v[i], for i = 0..15, by a fixed add tree:
// lanes {l, l+2} then {l, l+1} within each 128-bit group, then across groups (0+1, 2+3, then pairs).
inline __m512 hsum16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Fixed-order sum of the 16 lanes of one vector (pairwise halves).
inline float hsum(__m512 v) {
  alignas(64) float l[16];
  _mm512_store_ps(l, v);
  for (int w = 8; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) l[i] += l[i + w];
  return l[0];
}

// exp(x) lane-wise for x in [-87.3, 88.3] (clamped): Cephes range reduction x = n ln2 + r and a
// degree-6 polynomial (the scalar exp_nonpos's coefficients), ~2 ulp.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3f)), _mm512_set1_ps(-87.3f));
  const __m512 fx = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
  const __m512 z = _mm512_mul_ps(r, r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, r), _mm512_set1_ps(1.0f));
  // 2^n by building the exponent field: n in [-126, 127] for the clamped range.
  const __m512i n = _mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127));
  return _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(n, 23)));
}

// Partial dot products of one query with one context row: 16 lanes whose sum is q . k.
// bf16 cache with AVX512_BF16 and an even number of 16-wide groups: vdpbf16ps on the raw cache row
// (the query is bf16-exact: it was rounded to the model dtype after rotary); otherwise float32 FMAs.
template <typename C, int ND>
struct QueryRow {
  __m512 q[ND];
  void load(const float* p) {
    for (int v = 0; v < ND; ++v) q[v] = _mm512_loadu_ps(p + v * 16);
  }
  __m512 dot(const C* row) const {
    __m512 a = _mm512_mul_ps(q[0], load16(row));
    for (int v = 1; v < ND; ++v) a = _mm512_fmadd_ps(q[v], load16(row + v * 16), a);
    return a;
  }
};

#if defined(__AVX512BF16__)
template <int ND>
struct QueryRowBf16 {
  __m512bh q[ND / 2];
  void load(const float* p) {
    // cvtne2ps(hi, lo): element pairs (2i, 2i+1) line up with the cache row's bf16 pairs.
    for (int v = 0; v < ND / 2; ++v) q[v] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + v * 32 + 16), _mm512_loadu_ps(p + v * 32));
  }
  __m512 dot(const c10::BFloat16* row) const {
    __m512 a = _mm512_setzero_ps();
    for (int v = 0; v < ND / 2; ++v)
      a = _mm512_dpbf16_ps(a, q[v], (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(row + v * 32)));
    return a;
  }
};
template <>
struct QueryRow<c10::BFloat16, 2> : QueryRowBf16<2> {};
template <>
struct QueryRow<c10::BFloat16, 4> : QueryRowBf16<4> {};
template <>
struct QueryRow<c10::BFloat16, 6> : QueryRowBf16<6> {};
template <>
struct QueryRow<c10::BFloat16, 8> : QueryRowBf16<8> {};
#endif

// sum_j probs[h][j] * V[j] for j = 0..n-1 in position order, for NH heads sharing one KV head;
// each V row is converted once. res: [NH, D] float32.
// Prefetch into the caches the cache slot's rows of all KV heads (Hk * D elements, contiguous).
template <typename C>
inline void prefetch_slot(const C* base, int64_t slot, int64_t row_elems) {
  const char* p = reinterpret_cast<const char*>(base + slot * row_elems);
  for (int64_t b = 0; b < row_elems * static_cast<int64_t>(sizeof(C)); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

template <typename C, int ND, int NH>
inline void pv_accumulate(const float* const* probs, const C* vp, const int64_t* bt, int64_t bs, int64_t Hk,
                          int64_t hk, int64_t n, float* res, bool prefetch) {
  constexpr int D = ND * 16;
  constexpr int64_t kAhead = 16;  // positions
  __m512 acc[NH][ND];
  for (int h = 0; h < NH; ++h)
    for (int v = 0; v < ND; ++v) acc[h][v] = _mm512_setzero_ps();
  int64_t blk = 0, off = 0;
  int64_t pblk = kAhead / bs, poff = kAhead % bs;
  for (int64_t j = 0; j < n; ++j) {
    const C* row = vp + ((bt[blk] * bs + off) * Hk + hk) * D;
    if (++off == bs) off = 0, ++blk;
    if (prefetch && j + kAhead < n) {
      prefetch_slot(vp, bt[pblk] * bs + poff, Hk * D);
      if (++poff == bs) poff = 0, ++pblk;
    }
    __m512 vv[ND];
    for (int v = 0; v < ND; ++v) vv[v] = load16(row + v * 16);
    for (int h = 0; h < NH; ++h) {
      const __m512 pj = _mm512_set1_ps(probs[h][j]);
      for (int v = 0; v < ND; ++v) acc[h][v] = _mm512_fmadd_ps(pj, vv[v], acc[h][v]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int v = 0; v < ND; ++v) _mm512_store_ps(res + h * D + v * 16, acc[h][v]);
}

template <typename C, typename O, int ND>
void attention_avx512(const torch::Tensor& q, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                      const torch::Tensor& block_tables, const torch::Tensor& token_seq,
                      const torch::Tensor& token_pos, double scale, torch::Tensor& out) {
  constexpr int D = ND * 16;
  const int64_t num_tokens = q.size(0), Hq = q.size(1);
  const int64_t bs = key_cache.size(1), Hk = key_cache.size(2);
  const int64_t G = Hq / Hk;
  const int64_t max_blocks = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const C* kp = key_cache.data_ptr<C>();
  const C* vp = value_cache.data_ptr<C>();
  const int64_t* btp = block_tables.data_ptr<int64_t>();
  const int64_t* seqp = token_seq.data_ptr<int64_t>();
  const int64_t* posp = token_pos.data_ptr<int64_t>();
  O* op = out.data_ptr<O>();
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale));
  alignas(64) static const C zero_row[D] = {};

  // Tiles: runs of up to kTileRows tokens of one sequence at consecutive positions.
  std::vector<int64_t> tile_start;
  for (int64_t t = 0; t < num_tokens;) {
    tile_start.push_back(t);
    int64_t e = t + 1;
    while (e < num_tokens && e - t < kTileRows && seqp[e] == seqp[t] && posp[e] == posp[e - 1] + 1) ++e;
    t = e;
  }
  tile_start.push_back(num_tokens);
  const int64_t num_tiles = static_cast<int64_t>(tile_start.size()) - 1;

  at::parallel_for(0, num_tiles * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tile = item / Hk, hk = item % Hk;
      const int64_t t0 = tile_start[tile], rows = tile_start[tile + 1] - t0;
      const int64_t* bt = btp + seqp[t0] * max_blocks;
      const int64_t ctx_max = posp[t0 + rows - 1] + 1;
      const int64_t nchunks = (ctx_max + 15) / 16;
      const int64_t stride = nchunks * 16;
      const int64_t pairs = rows * G;
      scores.resize(pairs * stride);
      int64_t ctx[kTileRows * kMaxGroup];
      const float* qrow[kTileRows * kMaxGroup];
      for (int64_t p = 0; p < pairs; ++p) {
        ctx[p] = posp[t0 + p / G] + 1;
        qrow[p] = qp + ((t0 + p / G) * Hq + hk * G + p % G) * D;
      }
      // Cache rows of context positions j0..j0+15 (a zero row past the context), via the block table.
      const C* krow[16];
      const C* vrow[16];
      auto rows_of = [&](int64_t j0) {
        int64_t blk = j0 / bs, off = j0 % bs;
        for (int64_t jj = 0; jj < 16; ++jj) {
          if (j0 + jj < ctx_max) {
            const int64_t e = ((bt[blk] * bs + off) * Hk + hk) * D;
            krow[jj] = kp + e;
            vrow[jj] = vp + e;
            if (++off == bs) off = 0, ++blk;
          } else {
            krow[jj] = vrow[jj] = zero_row;
          }
        }
      };
      // Pass 1: scores = (q . k) * scale, 16 positions at a time, per (row, head) pair.
      // Software prefetch (the block table scatters the context, so the hardware prefetcher restarts
      // at every block): the first KV head's item fetches the next 16 positions' rows of all heads,
      // which the other heads' items then find in cache.
      const bool prefetch = g_prefetch && hk == 0;
      auto prefetch_chunk = [&](const C* base, int64_t j0) {
        int64_t blk = j0 / bs, off = j0 % bs;
        for (int64_t j = j0; j < std::min<int64_t>(j0 + 16, ctx_max); ++j) {
          prefetch_slot(base, bt[blk] * bs + off, Hk * D);
          if (++off == bs) off = 0, ++blk;
        }
      };
      if (prefetch) prefetch_chunk(kp, 0);
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t j0 = c * 16;
        rows_of(j0);
        if (prefetch) prefetch_chunk(kp, j0 + 16);
        for (int64_t p = 0; p < pairs; ++p) {
          if (ctx[p] <= j0) continue;
          QueryRow<C, ND> qr;
          qr.load(qrow[p]);
          __m512 part[16];
          for (int jj = 0; jj < 16; ++jj) part[jj] = qr.dot(krow[jj]);
          _mm512_storeu_ps(scores.data() + p * stride + j0, _mm512_mul_ps(hsum16(part), vscale));
        }
      }
      // Softmax per pair: max, exp, fixed-order sum; probabilities overwrite the scores.
      float inv[kTileRows * kMaxGroup];
      for (int64_t p = 0; p < pairs; ++p) {
        float* s = scores.data() + p * stride;
        const int64_t n = ctx[p];
        const int64_t full = n / 16, tail = n % 16;
        const __mmask16 tmask = static_cast<__mmask16>((1u << tail) - 1u);
        __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t c = 0; c < full; ++c) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + c * 16));
        if (tail) mv = _mm512_mask_max_ps(mv, tmask, mv, _mm512_loadu_ps(s + full * 16));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t c = 0; c < full + (tail ? 1 : 0); ++c) {
          __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + c * 16), m));
          if (c == full) e = _mm512_maskz_mov_ps(tmask, e);
          _mm512_storeu_ps(s + c * 16, e);
          sum = _mm512_add_ps(sum, e);
        }
        inv[p] = 1.0f / hsum(sum);
      }
      // Pass 2: weighted sum of V in position order, per row, up to 4 heads of the GQA group at a
      // time sharing each converted V row.
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = ctx[r * G];
        for (int64_t h0 = 0; h0 < G; h0 += 4) {
          const int nh = static_cast<int>(std::min<int64_t>(4, G - h0));
          const float* probs[4];
          float* outs[4];
          __m512 iv[4];
          for (int i = 0; i < nh; ++i) {
            const int64_t p = r * G + h0 + i;
            probs[i] = scores.data() + p * stride;
            iv[i] = _mm512_set1_ps(inv[p]);
          }
          alignas(64) float res[4 * D];
          const bool pf = prefetch && r == 0 && h0 == 0;
          if (pf) prefetch_chunk(vp, 0);
          switch (nh) {
            case 1: pv_accumulate<C, ND, 1>(probs, vp, bt, bs, Hk, hk, n, res, pf); break;
            case 2: pv_accumulate<C, ND, 2>(probs, vp, bt, bs, Hk, hk, n, res, pf); break;
            case 3: pv_accumulate<C, ND, 3>(probs, vp, bt, bs, Hk, hk, n, res, pf); break;
            default: pv_accumulate<C, ND, 4>(probs, vp, bt, bs, Hk, hk, n, res, pf); break;
          }
          for (int i = 0; i < nh; ++i) {
            O* orow = op + ((t0 + r) * Hq + hk * G + h0 + i) * D;
            for (int v = 0; v < ND; ++v) store16(orow + v * 16, _mm512_mul_ps(_mm512_load_ps(res + i * D + v * 16), iv[i]));
          }
        }
      }
    }
  });
}
#endif  // TINYVLLM_AVX512

// Paged attention over the packed batch: the AVX-512 kernel when the head size allows it.
template <typename C, typename O>
void attention_impl(const torch::Tensor& q, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                    const torch::Tensor& block_tables, const torch::Tensor& token_seq,
                    const torch::Tensor& token_pos, double scale, torch::Tensor& out) {
#if defined(TINYVLLM_AVX512)
  if (g_vector_kernels && q.size(1) / key_cache.size(2) <= kMaxGroup) {
    switch (q.size(2)) {
      case 16: return attention_avx512<C, O, 1>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out);
      case 32: return attention_avx512<C, O, 2>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out);
      case 64: return attention_avx512<C, O, 4>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out);
      case 96: return attention_avx512<C, O, 6>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out);
      case 128: return attention_avx512<C, O, 8>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out);
      default: break;
    }
  }
#endif
  attention_scalar<C, O>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out);
}

}  // namespace

torch::Tensor paged_attention_cpu(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                                  torch::Tensor block_tables, torch::Tensor token_seq,
                                  torch::Tensor token_pos, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q must be [T, Hq, D] float32");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "caches must be contiguous [num_blocks, block_size, Hk, D]");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  auto out = torch::empty_like(q);
  if (key_cache.scalar_type() == torch::kBFloat16) {
    attention_impl<c10::BFloat16, float>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out);
  } else if (key_cache.scalar_type() == torch::kFloat32) {
    attention_impl<float, float>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out);
  } else {
    TORCH_CHECK(false, "unsupported KV cache dtype");
  }
  return out;
}


namespace {

template <typename C>
inline C from_f(float x) { return static_cast<C>(x); }  // c10::BFloat16(float) rounds to nearest even

// Round a float to the storage dtype and back (identity for float32).
template <typename C>
inline float round_to(float x) { return to_f(from_f<C>(x)); }

template <typename C>
void rms_norm_impl(const torch::Tensor& x, const torch::Tensor* residual, const torch::Tensor& weight,
                   double eps, torch::Tensor& out, torch::Tensor& res_out) {
  const int64_t T = x.size(0), H = x.size(1);
  const C* xp = x.data_ptr<C>();
  const C* rp = residual ? residual->data_ptr<C>() : nullptr;
  const C* wp = weight.data_ptr<C>();
  C* op = out.data_ptr<C>();
  C* rop = res_out.data_ptr<C>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(H);
    for (int64_t t = begin; t < end; ++t) {
      alignas(64) float lanes[kLanes] = {0};
      int64_t i = 0;
#if defined(TINYVLLM_AVX512)
      // Same arithmetic as the scalar loops below (mul then add, lane l takes elements l mod 16),
      // so both paths give identical results.
      if (g_vector_kernels) {
        __m512 acc = _mm512_setzero_ps();
        for (; i + kLanes <= H; i += kLanes) {
          __m512 v = load16(xp + t * H + i);
          if (rp) v = round16(rop, _mm512_add_ps(v, load16(rp + t * H + i)));
          _mm512_storeu_ps(h.data() + i, v);
          store16(rop + t * H + i, v);
          acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
        }
        _mm512_store_ps(lanes, acc);
      }
#endif
      const int64_t vec_end = i;
      for (int64_t j = i; j < H; ++j) {
        float v = to_f(xp[t * H + j]);
        if (rp) v = round_to<C>(v + to_f(rp[t * H + j]));  // residual add in the model dtype
        h[j] = v;
        rop[t * H + j] = from_f<C>(v);
      }
      for (; i + kLanes <= H; i += kLanes)
        for (int l = 0; l < kLanes; ++l) lanes[l] += h[i + l] * h[i + l];
      for (int l = 0; i + l < H; ++l) lanes[l] += h[i + l] * h[i + l];
      for (int w = kLanes / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
      const float inv = 1.0f / std::sqrt(lanes[0] / static_cast<float>(H) + feps);
      int64_t j = 0;
#if defined(TINYVLLM_AVX512)
      const __m512 vinv = _mm512_set1_ps(inv);
      for (; j < vec_end; j += kLanes)
        store16(op + t * H + j, _mm512_mul_ps(load16(wp + j), round16(op, _mm512_mul_ps(_mm512_loadu_ps(h.data() + j), vinv))));
#endif
      for (; j < H; ++j)
        op[t * H + j] = from_f<C>(to_f(wp[j]) * round_to<C>(h[j] * inv));
    }
  });
}

template <typename C>
void silu_and_mul_impl(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t T = x.size(0), I = x.size(1) / 2;
  const C* xp = x.data_ptr<C>();
  C* op = out.data_ptr<C>();
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const C* g = xp + t * 2 * I;
      const C* u = g + I;
      int64_t i = 0;
#if defined(TINYVLLM_AVX512)
      // Element i always takes the same path (vector body or scalar tail), whatever the batch.
      if (g_vector_kernels) {
        for (; i + 16 <= I; i += 16) {
          const __m512 gv = load16(g + i);
          const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
          const __m512 silu = round16(op, _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
          store16(op + t * I + i, _mm512_mul_ps(silu, load16(u + i)));
        }
      }
#endif
      for (; i < I; ++i) {
        const float gv = to_f(g[i]);
        const float silu = round_to<C>(gv / (1.0f + std::exp(-gv)));
        op[t * I + i] = from_f<C>(silu * to_f(u[i]));
      }
    }
  });
}

// Rotary embedding (rotate-half layout) on q and k from a fused qkv row, K/V written into the
// paged cache at slot_mapping; q returned rotated, rounded to the model dtype, as float32.
template <typename C>
void rope_and_cache_impl(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                         const torch::Tensor& positions, torch::Tensor& key_cache, torch::Tensor& value_cache,
                         const torch::Tensor& slot_mapping, int64_t Hq, int64_t Hk, torch::Tensor& q_out) {
  const int64_t T = qkv.size(0), D = key_cache.size(3), half = D / 2;
  const int64_t row = qkv.stride(0);
  const C* xp = qkv.data_ptr<C>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const int64_t* slp = slot_mapping.data_ptr<int64_t>();
  C* kc = key_cache.data_ptr<C>();
  C* vc = value_cache.data_ptr<C>();
  float* qo = q_out.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const C* x = xp + t * row;
      const float* c = cp + pp[t] * half;
      const float* s = sp + pp[t] * half;
      for (int64_t h = 0; h < Hq; ++h) {
        const C* q = x + h * D;
        float* o = qo + (t * Hq + h) * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f(q[i]), x2 = to_f(q[i + half]);
          o[i] = round_to<C>(x1 * c[i] - x2 * s[i]);
          o[i + half] = round_to<C>(x2 * c[i] + x1 * s[i]);
        }
      }
      const int64_t slot = slp[t];
      if (slot < 0) continue;
      for (int64_t h = 0; h < Hk; ++h) {
        const C* k = x + (Hq + h) * D;
        const C* v = x + (Hq + Hk + h) * D;
        C* kd = kc + (slot * Hk + h) * D;
        C* vd = vc + (slot * Hk + h) * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f(k[i]), x2 = to_f(k[i + half]);
          kd[i] = from_f<C>(x1 * c[i] - x2 * s[i]);
          kd[i + half] = from_f<C>(x2 * c[i] + x1 * s[i]);
        }
        for (int64_t i = 0; i < D; ++i) vd[i] = v[i];
      }
    }
  });
}

}  // namespace

std::vector<torch::Tensor> rms_norm_cpu(torch::Tensor x, std::optional<torch::Tensor> residual,
                                        torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [T, H]");
  auto out = torch::empty_like(x);
  auto res_out = torch::empty_like(x);
  torch::Tensor r;
  if (residual.has_value()) r = residual->contiguous();
  const torch::Tensor* rp = residual.has_value() ? &r : nullptr;
  if (x.scalar_type() == torch::kBFloat16) rms_norm_impl<c10::BFloat16>(x, rp, weight.contiguous(), eps, out, res_out);
  else if (x.scalar_type() == torch::kFloat32) rms_norm_impl<float>(x, rp, weight.contiguous(), eps, out, res_out);
  else TORCH_CHECK(false, "unsupported dtype");
  return {out, res_out};
}

torch::Tensor silu_and_mul_cpu(torch::Tensor x) {
  x = x.contiguous();
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == torch::kBFloat16) silu_and_mul_impl<c10::BFloat16>(x, out);
  else if (x.scalar_type() == torch::kFloat32) silu_and_mul_impl<float>(x, out);
  else TORCH_CHECK(false, "unsupported dtype");
  return out;
}

// Rotary + KV-cache write + paged attention for one layer: qkv [T, (Hq+2Hk)*D] -> out [T, Hq*D].
torch::Tensor rope_cache_attention_cpu(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                       torch::Tensor positions, torch::Tensor kv_cache,
                                       torch::Tensor slot_mapping, torch::Tensor block_tables,
                                       torch::Tensor token_seq, int64_t Hq, int64_t Hk, double scale) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [T, (Hq+2Hk)*D] with unit inner stride");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache must be [2, nb, bs, Hk, D]");
  const int64_t T = qkv.size(0), D = kv_cache.size(4);
  auto key_cache = kv_cache.select(0, 0);
  auto value_cache = kv_cache.select(0, 1);
  auto q = torch::empty({T, Hq, D}, qkv.options().dtype(torch::kFloat32));
  auto out = torch::empty({T, Hq, D}, qkv.options());
  block_tables = block_tables.contiguous();
  if (qkv.scalar_type() == torch::kBFloat16) {
    rope_and_cache_impl<c10::BFloat16>(qkv, cos, sin, positions, key_cache, value_cache, slot_mapping, Hq, Hk, q);
    attention_impl<c10::BFloat16, c10::BFloat16>(q, key_cache, value_cache, block_tables, token_seq, positions, scale, out);
  } else if (qkv.scalar_type() == torch::kFloat32) {
    rope_and_cache_impl<float>(qkv, cos, sin, positions, key_cache, value_cache, slot_mapping, Hq, Hk, q);
    attention_impl<float, float>(q, key_cache, value_cache, block_tables, token_seq, positions, scale, out);
  } else {
    TORCH_CHECK(false, "unsupported dtype");
  }
  return out.view({T, Hq * D});
}

// cpu_gemm.cpp: batch-invariant bf16 linear on packed weights.
torch::Tensor gemm_pack_bf16(torch::Tensor w);
bool gemm_has_bf16_kernel();
torch::Tensor gemm_bf16(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t K,
                        c10::optional<torch::Tensor> bias);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm_has_bf16_kernel", &gemm_has_bf16_kernel,
        "whether gemm_bf16 was built with AVX512-BF16 (pack weights only then)");
  m.def("gemm_pack_bf16", &gemm_pack_bf16, "pack a [N, K] bf16 weight for gemm_bf16");
  m.def("gemm_bf16", &gemm_bf16, "y = x @ W^T (+ bias) in bf16 on packed W, batch invariant", py::arg("x"),
        py::arg("packed"), py::arg("N"), py::arg("K"), py::arg("bias") = py::none());
  m.def("paged_attention", &paged_attention_cpu, "paged attention, one query row at a time (CPU)");
  m.def("rms_norm", &rms_norm_cpu, "RMSNorm with optional fused residual add -> (out, residual)");
  m.def("silu_and_mul", &silu_and_mul_cpu, "SwiGLU activation: silu(x[:, :I]) * x[:, I:]");
  m.def("set_vector_kernels", [](bool on) { g_vector_kernels = on; },
        "use the AVX-512 kernels where built (default) or the portable scalar loops (tests)");
  m.def("set_prefetch", [](bool on) { g_prefetch = on; }, "attention software prefetch (for measurements)");
  m.def("has_avx512", []() {
#if defined(TINYVLLM_AVX512)
    return true;
#else
    return false;
#endif
  }, "whether the AVX-512 kernels were compiled in");
  m.def("rope_cache_attention", &rope_cache_attention_cpu, "rotary + KV write + paged attention");
}
