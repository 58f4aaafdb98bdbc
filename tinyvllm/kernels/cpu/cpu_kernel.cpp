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
// Implementations: the vector kernels, written once over cpu_vec.h's vector type (attention_row,
// RMSNorm's and SiLU's vector bodies; VecF = Vec16f when the compiler targets AVX-512, Vec8f on
// AVX2 + FMA; attention_row for head sizes 16/32/64/96/128/256), the tiled attention over a bf16 or
// quantized cache (AVX512_BF16, optionally AMX; its bf16 dot products have no AVX2 form) and portable
// scalar loops (attention_scalar; also what set_vector_kernels(false) selects, for tests). Attention
// and SiLU differ in the last bits between the vector and scalar paths, and between the AVX-512 and
// AVX2 builds (RMSNorm's are identical everywhere), but each is batch invariant on its own.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "cpu_pool.h"
#include "cpu_common.h"
#include "cpu_vec.h"
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <cmath>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

// The vector kernels' ISA, picked at build time (-march): AVX-512 (VecF = Vec16f) or AVX2 + FMA
// (VecF = Vec8f); TINYVLLM_VEC when either. Only the AVX-512 build has the tiled attention.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TINYVLLM_AVX512 1
#define TINYVLLM_VEC 1
using VecF = tv_vec::Vec16f;
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TINYVLLM_AVX2 1
#define TINYVLLM_VEC 1
using VecF = tv_vec::Vec8f;
#endif

namespace {

constexpr int kLanes = 16;

// Whether the AVX-512 kernels may run (tests switch them off to check the portable path).
bool g_vector_kernels = true;
bool g_prefetch = true;
// attention_tiled's query rows per work item: at most kMaxRowBlock, g_row_block by default
// (set_attention_row_block, for A/B). A KV tile is packed once per item, so longer items pack less
// per row; the per-row arithmetic does not depend on it. 64 rather than 32: 1.1-1.3x faster
// attention on a 512-token chunk over 5,000 cached tokens (docs/benchmarks.md), and still 24 items
// per layer for 2-8 threads to share on such a chunk (SmolLM2: 3 KV heads).
constexpr int kMaxRowBlock = 256;
int g_row_block = 64;
bool g_tiled_attention = true;  // bf16 cache + AVX512_BF16: attention_tiled (off: the row kernel, for A/B)

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
                    double scale, torch::Tensor& out,  // [T, Hq, D] float32 or C
                    int64_t window = 0) {  // > 0: keys at positions [pos - window + 1, pos] only
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

  tv_pool::parallel_for(0, num_tokens * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / Hk, hk = item % Hk;
      const int64_t ctx = posp[t] + 1;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;  // first key (sliding window)
      const int64_t* bt = btp + seqp[t] * max_blocks;
      scores.resize(G * ctx);
      // Pass 1: scores for the G query heads sharing this KV head.
      for (int64_t j = lo; j < ctx; ++j) {
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
        for (int64_t j = lo; j < ctx; ++j) m = s[j] > m ? s[j] : m;
        for (int64_t j = lo; j < ctx; ++j) s[j] = exp_nonpos(s[j] - m);
        float sum = 0.0f;
        for (int64_t j = lo; j < ctx; ++j) sum += s[j];
        const float inv = 1.0f / sum;
        float* a = acc.data() + g * D;
        for (int64_t j = lo; j < ctx; ++j) {
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

// ---------------------------------------------------------------- quantized KV cache (issue 39)
// --kv-cache-dtype int8 / fp8 (tinyvllm/attention/kv_quant.py has the format and the reference): a
// layer's cache is [2, num_blocks, block_size, Hk, D + 2] bytes; each (token, KV head) row is its D
// values (int8, or e4m3 bits) and then its own bfloat16 scale, so a row's values depend only on that
// token (the invariance of the bf16 cache holds). Quantize: s = bf16(max|x| / qmax) (qmax 127 or 448),
// q = clamp(round_half_even(x / s)) or e4m3(clamp(x / s, +-448)); dequantize: float(q) * float(s),
// exact in float32.
enum KvKind : int { kKvBf16 = 0, kKvInt8 = 1, kKvFp8 = 2 };

inline float row_scale(const uint8_t* row, int64_t D) {
  uint16_t b;
  std::memcpy(&b, row + D, sizeof(b));
  return to_f(c10::BFloat16(b, c10::BFloat16::from_bits()));
}

inline float fp8_to_f(uint8_t b) { return static_cast<float>(c10::Float8_e4m3fn(b, c10::Float8_e4m3fn::from_bits())); }

template <int Kind>
inline void dequant_row(const uint8_t* row, int64_t D, float* out) {
  const float s = row_scale(row, D);
  for (int64_t i = 0; i < D; ++i)
    out[i] = (Kind == kKvInt8 ? static_cast<float>(static_cast<int8_t>(row[i])) : fp8_to_f(row[i])) * s;
}

// x: D values already rounded to the model dtype (what a bf16 cache would store).
template <int Kind>
inline void quantize_row(const float* x, int64_t D, uint8_t* out) {
  float amax = 0.0f;
  for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(x[i]));
  const c10::BFloat16 sb(amax / (Kind == kKvInt8 ? 127.0f : 448.0f));  // rounds to nearest even
  const float s = to_f(sb);
  for (int64_t i = 0; i < D; ++i) {
    if (!(s > 0.0f)) { out[i] = 0; continue; }
    const float r = x[i] / s;
    if constexpr (Kind == kKvInt8) {
      out[i] = static_cast<uint8_t>(static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(r)))));
    } else {
      out[i] = c10::Float8_e4m3fn(std::min(448.0f, std::max(-448.0f, r))).x;
    }
  }
  std::memcpy(out + D, &sb.x, sizeof(sb.x));
}

// The portable attention over a quantized cache (CPUs without AVX512-BF16, float32 models, and
// set_vector_kernels(false)): each work item dequantizes its context's K and V rows to float32
// (exactly) and runs attention_scalar's arithmetic on them.
template <int Kind, typename O>
void attention_scalar_q(const torch::Tensor& q, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                        const torch::Tensor& block_tables, const torch::Tensor& token_seq,
                        const torch::Tensor& token_pos, double scale, torch::Tensor& out, int64_t window = 0) {
  const int64_t num_tokens = q.size(0), Hq = q.size(1), D = q.size(2), RD = D + 2;
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
  const float fscale = static_cast<float>(scale);

  tv_pool::parallel_for(0, num_tokens * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, kf, vf;
    std::vector<float> acc(G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / Hk, hk = item % Hk;
      const int64_t ctx = posp[t] + 1;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;  // first key (sliding window)
      const int64_t* bt = btp + seqp[t] * max_blocks;
      scores.resize(G * ctx);
      kf.resize(ctx * D);
      vf.resize(ctx * D);
      for (int64_t j = lo; j < ctx; ++j) {
        const int64_t slot = bt[j / bs] * bs + (j % bs);
        dequant_row<Kind>(kp + (slot * Hk + hk) * RD, D, kf.data() + j * D);
        dequant_row<Kind>(vp + (slot * Hk + hk) * RD, D, vf.data() + j * D);
      }
      for (int64_t j = lo; j < ctx; ++j)
        for (int64_t g = 0; g < G; ++g)
          scores[g * ctx + j] = dot(qp + (t * Hq + hk * G + g) * D, kf.data() + j * D, D) * fscale;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores.data() + g * ctx;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = lo; j < ctx; ++j) m = sc[j] > m ? sc[j] : m;
        for (int64_t j = lo; j < ctx; ++j) sc[j] = exp_nonpos(sc[j] - m);
        float sum = 0.0f;
        for (int64_t j = lo; j < ctx; ++j) sum += sc[j];
        const float inv = 1.0f / sum;
        float* a = acc.data() + g * D;
        for (int64_t j = lo; j < ctx; ++j) {
          const float pj = sc[j];
          const float* vrow = vf.data() + j * D;
          for (int64_t d = 0; d < D; ++d) a[d] += pj * vrow[d];
        }
        O* orow = op + (t * Hq + hk * G + g) * D;
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<O>(a[d] * inv);
      }
    }
  });
}

// Work tiles of the vector row kernels (attention_row): runs of up to max_rows
// tokens of one sequence at consecutive positions. Returns each tile's first token, then num_tokens.
inline std::vector<int64_t> query_tiles(const int64_t* seqp, const int64_t* posp, int64_t num_tokens,
                                        int64_t max_rows) {
  std::vector<int64_t> tile_start;
  for (int64_t t = 0; t < num_tokens;) {
    tile_start.push_back(t);
    int64_t e = t + 1;
    while (e < num_tokens && e - t < max_rows && seqp[e] == seqp[t] && posp[e] == posp[e - 1] + 1) ++e;
    t = e;
  }
  tile_start.push_back(num_tokens);
  return tile_start;
}

#if defined(TINYVLLM_VEC)
// ---------------------------------------------------------------------------------------------
// Vector paged attention (the row kernel), written once over the build's vector type VecF (cpu_vec.h:
// Vec16f on AVX-512, Vec8f on AVX2 + FMA; L = its lanes). Same algorithm and the same per-row
// guarantee as attention_scalar (each query row's result is a fixed sequence of operations over its
// own context, so it does not depend on the batch, chunking or prefix-cache hits), but vectorised:
//  * a work item is (tile of up to kTileRows consecutive query rows of one sequence, KV head);
//    each K/V row is converted to float32 once per item and reused by every query row of the
//    tile and every query head of the GQA group (the rows never mix: only the loads are shared);
//  * scores for L positions come from L per-position lane vectors (q*k, D/L FMAs each) folded
//    by one fixed add network (VecF::hsum_lanes), instead of L separate horizontal sums;
//  * softmax uses a vectorised polynomial exp; P*V accumulates in position order with FMAs.
// Not the scalar loop's sequence (FMAs, another exp, L lanes), so its bits differ from the scalar
// path's, and the AVX-512 and AVX2 builds' bits differ from each other (lane count, add trees).

constexpr int kTileRows = 8;
constexpr int kMaxGroup = 16;  // query heads per KV head handled by the vector kernel

// Partial dot products of one query with one context row: L lanes whose sum is q . k (float32 FMAs;
// a bf16 cache on a CPU with AVX512_BF16 goes to attention_tiled instead).
template <typename V, typename C, int D>
struct QueryRow {
  static constexpr int L = V::kLanes, ND = D / L;
  V q[ND];
  void load(const float* p) {
    for (int v = 0; v < ND; ++v) q[v] = V::load(p + v * L);
  }
  V dot(const C* row) const {
    V a = q[0] * V::load(row);
    for (int v = 1; v < ND; ++v) a = fmadd(q[v], V::load(row + v * L), a);
    return a;
  }
};

// Prefetch into the caches the cache slot's rows of all KV heads (Hk * D elements, contiguous).
template <typename C>
inline void prefetch_slot(const C* base, int64_t slot, int64_t row_elems) {
  const char* p = reinterpret_cast<const char*>(base + slot * row_elems);
  for (int64_t b = 0; b < row_elems * static_cast<int64_t>(sizeof(C)); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

// sum_j probs[h][j] * V[j] for j = j_lo..n-1 in position order, for NH heads sharing one KV head;
// each V row is converted once. res: [NH, D] float32.
template <typename V, typename C, int D, int NH>
inline void pv_accumulate(const float* const* probs, const C* vp, const int64_t* bt, int64_t bs, int64_t Hk,
                          int64_t hk, int64_t n, float* res, bool prefetch, int64_t j_lo = 0) {
  constexpr int L = V::kLanes, ND = D / L;
  constexpr int64_t kAhead = 16;  // positions
  V acc[NH][ND];
  for (int h = 0; h < NH; ++h)
    for (int v = 0; v < ND; ++v) acc[h][v] = V::zero();
  int64_t blk = j_lo / bs, off = j_lo % bs;
  int64_t pblk = (j_lo + kAhead) / bs, poff = (j_lo + kAhead) % bs;
  for (int64_t j = j_lo; j < n; ++j) {
    const C* row = vp + ((bt[blk] * bs + off) * Hk + hk) * D;
    if (++off == bs) off = 0, ++blk;
    if (prefetch && j + kAhead < n) {
      prefetch_slot(vp, bt[pblk] * bs + poff, Hk * D);
      if (++poff == bs) poff = 0, ++pblk;
    }
    V vv[ND];
    for (int v = 0; v < ND; ++v) vv[v] = V::load(row + v * L);
    for (int h = 0; h < NH; ++h) {
      const V pj = V::set1(probs[h][j]);
      for (int v = 0; v < ND; ++v) acc[h][v] = fmadd(pj, vv[v], acc[h][v]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int v = 0; v < ND; ++v) acc[h][v].store_aligned(res + h * D + v * L);
}

template <typename V, typename C, typename O, int D>
void attention_row(const torch::Tensor& q, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                   const torch::Tensor& block_tables, const torch::Tensor& token_seq,
                   const torch::Tensor& token_pos, double scale, torch::Tensor& out, int64_t window = 0) {
  constexpr int L = V::kLanes, ND = D / L;
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
  const V vscale = V::set1(static_cast<float>(scale));
  alignas(64) static const C zero_row[D] = {};

  const std::vector<int64_t> tile_start = query_tiles(seqp, posp, num_tokens, kTileRows);
  const int64_t num_tiles = static_cast<int64_t>(tile_start.size()) - 1;

  tv_pool::parallel_for(0, num_tiles * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tile = item / Hk, hk = item % Hk;
      const int64_t t0 = tile_start[tile], rows = tile_start[tile + 1] - t0;
      const int64_t* bt = btp + seqp[t0] * max_blocks;
      const int64_t ctx_max = posp[t0 + rows - 1] + 1;
      const int64_t nchunks = (ctx_max + L - 1) / L;
      const int64_t stride = nchunks * L;
      const int64_t pairs = rows * G;
      scores.resize(pairs * stride);
      int64_t ctx[kTileRows * kMaxGroup], lo[kTileRows * kMaxGroup];  // lo: first key (sliding window)
      const float* qrow[kTileRows * kMaxGroup];
      for (int64_t p = 0; p < pairs; ++p) {
        ctx[p] = posp[t0 + p / G] + 1;
        lo[p] = window > 0 ? std::max<int64_t>(0, ctx[p] - window) : 0;
        qrow[p] = qp + ((t0 + p / G) * Hq + hk * G + p % G) * D;
      }
      // K rows of context positions j0..j0+L-1 (a zero row past the context), via the block table.
      const C* krow[L];
      auto rows_of = [&](int64_t j0) {
        int64_t blk = j0 / bs, off = j0 % bs;
        for (int64_t jj = 0; jj < L; ++jj) {
          if (j0 + jj < ctx_max) {
            krow[jj] = kp + ((bt[blk] * bs + off) * Hk + hk) * D;
            if (++off == bs) off = 0, ++blk;
          } else {
            krow[jj] = zero_row;
          }
        }
      };
      // Pass 1: scores = (q . k) * scale, L positions at a time, per (row, head) pair.
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
      if (prefetch) prefetch_chunk(kp, lo[0] / L * L);
      for (int64_t c = lo[0] / L; c < nchunks; ++c) {
        const int64_t j0 = c * L;
        rows_of(j0);
        if (prefetch && j0 % 16 == 0) prefetch_chunk(kp, j0 + 16);
        for (int64_t p = 0; p < pairs; ++p) {
          if (ctx[p] <= j0 || lo[p] >= j0 + L) continue;
          QueryRow<V, C, D> qr;
          qr.load(qrow[p]);
          V part[L];
          for (int jj = 0; jj < L; ++jj) part[jj] = qr.dot(krow[jj]);
          (V::hsum_lanes(part) * vscale).store(scores.data() + p * stride + j0);
        }
      }
      // Softmax per pair: max, exp, fixed-order sum; probabilities overwrite the scores.
      float inv[kTileRows * kMaxGroup];
      for (int64_t p = 0; p < pairs; ++p) {
        float* s = scores.data() + p * stride;
        const int64_t n = ctx[p];
        const int64_t full = n / L, tail = n % L;
        const typename V::Mask tmask = V::first(tail);
        // Sliding window: chunks before c_lo are skipped, positions before lo in chunk c_lo masked.
        const int64_t c_lo = lo[p] / L;
        const typename V::Mask hmask = V::from(lo[p] % L);
        V mv = V::set1(-std::numeric_limits<float>::infinity());
        for (int64_t c = c_lo; c < full; ++c) {
          const V x = V::load(s + c * L);
          mv = c == c_lo ? max_masked(mv, x, hmask) : max(mv, x);
        }
        if (tail) mv = max_masked(mv, V::load(s + full * L), full == c_lo ? V::both(tmask, hmask) : tmask);
        const V m = V::set1(mv.hmax());
        V sum = V::zero();
        for (int64_t c = c_lo; c < full + (tail ? 1 : 0); ++c) {
          V e = tv_vec::exp(V::load(s + c * L) - m);
          if (c == full) e = e.keep(tmask);
          if (c == c_lo) e = e.keep(hmask);
          e.store(s + c * L);
          sum = sum + e;
        }
        inv[p] = 1.0f / tv_vec::hsum(sum);
      }
      // Pass 2: weighted sum of V in position order, per row, up to 4 heads of the GQA group at a
      // time sharing each converted V row.
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = ctx[r * G];
        for (int64_t h0 = 0; h0 < G; h0 += 4) {
          const int nh = static_cast<int>(std::min<int64_t>(4, G - h0));
          const float* probs[4];
          for (int i = 0; i < nh; ++i) probs[i] = scores.data() + (r * G + h0 + i) * stride;
          alignas(64) float res[4 * D];
          const bool pf = prefetch && r == 0 && h0 == 0;
          const int64_t jl = lo[r * G];
          if (pf) prefetch_chunk(vp, jl);
          switch (nh) {
            case 1: pv_accumulate<V, C, D, 1>(probs, vp, bt, bs, Hk, hk, n, res, pf, jl); break;
            case 2: pv_accumulate<V, C, D, 2>(probs, vp, bt, bs, Hk, hk, n, res, pf, jl); break;
            case 3: pv_accumulate<V, C, D, 3>(probs, vp, bt, bs, Hk, hk, n, res, pf, jl); break;
            default: pv_accumulate<V, C, D, 4>(probs, vp, bt, bs, Hk, hk, n, res, pf, jl); break;
          }
          for (int i = 0; i < nh; ++i) {
            const V iv = V::set1(inv[r * G + h0 + i]);
            O* orow = op + ((t0 + r) * Hq + hk * G + h0 + i) * D;
            for (int v = 0; v < ND; ++v) (V::load(res + i * D + v * L) * iv).store(orow + v * L);
          }
        }
      }
    }
  });
}
#endif  // TINYVLLM_VEC

#if defined(TINYVLLM_AVX512)
// The AVX-512 forms of VecF's operations that the tiled attention below calls on __m512 directly.
template <typename T>
inline __m512 load16(const T* p) { return tv_vec::Vec16f::load(p).v; }
template <typename T>
inline void store16(T* p, __m512 x) { tv_vec::Vec16f{x}.store(p); }
inline float hsum(__m512 v) { return tv_vec::hsum(tv_vec::Vec16f{v}); }

#if defined(__AVX512BF16__)
// ---------------------------------------------------------------------------------------------
// Tiled attention over a bf16 paged cache (FlashAttention, Dao et al. 2022, on the paged layout):
// every query row, whether it is one of a long prefill chunk or a lone decode token, goes through
// this kernel. A work item is (run of up to g_row_block consecutive query rows of one sequence, KV
// head): its "pairs" are (row, query head of the GQA group). The context is cut into KV tiles of
// kKvTile positions at fixed absolute positions [c * kKvTile, (c + 1) * kKvTile) from position 0,
// and each tile is packed once per item for bf16 dot products (vdpbf16ps, 2 multiply-adds per lane):
//  * K as [D/2][kKvTile] 32-bit pairs (dims 2i, 2i+1 of one position per lane), so S = Q K^T is
//    16 positions per instruction with the query's dim pair broadcast (the GEMM's inner loop);
//  * V as [kKvTile/2][D] pairs (positions 2i, 2i+1 of one dim per lane), so P V is 16 dims per
//    instruction with the row's probability pair broadcast.
// Per pair and tile: s = q . k, masked past the row's position (causal), online softmax in base 2
// (the running max m of s * scale * log2 e, o and l *= 2^(m_old - m_new) when it moves), P rounded
// to bf16, l += the rounded P lane-wise, o += P V in float32. Precision (issue 37): P V must read
// bf16 probabilities, and two choices keep that rounding far below the bf16 rounding of the output
// itself. The running max is exact, so the largest weight of every row is 2^0, exactly 1 once
// rounded (exp2_fast16(0) is 1 + 2.6e-6); and the normaliser l sums the same rounded P that P V
// uses, so the output is a convex combination of V rows whose weights are each off by at most 2^-8
// relative. On SmolLM2's real queries and caches (benchmarks/bf16_fidelity.py attention) the output
// is 2-3.7x closer to float64 than with a lazily moved max and an unrounded l (relative RMS
// 0.14-0.53e-3 against 0.26-1.2e-3, where rounding the output to bf16 costs 1.7e-3). Cost,
// 2026-12-04, Intel Xeon: the attention of a 512-token chunk over 5,000 cached ones +0.5 % on
// vdpbf16ps, +7 % on AMX (where the vector softmax is the bottleneck; the sum of P is a tile
// product there, see tile_pairs_amx); decode steps within noise. Invariance: a pair's arithmetic
// depends only on its own query, its context and the tile grid, never on which rows share the item,
// how many items there are, or the chunking: tiles sit at fixed positions, each pair's lanes are
// independent accumulator chains, and a row processes exactly the tiles 0..pos / kKvTile. Positions
// past the item's longest context read a zero row; positions past a row's own position are masked
// to probability 0 (exactly 0 * V).

constexpr int kKvTile = 64;    // cached positions per KV tile

// In-register transpose of a 16 x 16 matrix of 32-bit elements: r[i][j] -> r[j][i].
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i u[16];  // u[4i + k], 128-bit lane L: column 4L + k of rows 4i..4i+3
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[k], u[4 + k], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i v1 = _mm512_shuffle_i32x4(u[k], u[4 + k], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], _MM_SHUFFLE(3, 1, 3, 1));
    r[k] = _mm512_shuffle_i32x4(v0, w0, _MM_SHUFFLE(2, 0, 2, 0));
    r[8 + k] = _mm512_shuffle_i32x4(v0, w0, _MM_SHUFFLE(3, 1, 3, 1));
    r[4 + k] = _mm512_shuffle_i32x4(v1, w1, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + k] = _mm512_shuffle_i32x4(v1, w1, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// 32 values of a quantized cache row (dims d..d+31) as 32 bf16 in dim order (the bytes a bf16 row
// would hold there), each times `scale` when kScale (else the raw int8 / e4m3 value, exact in bf16).
// int8: sign-extended and converted; e4m3: its bits moved into a binary16 (sign to bit 15, exponent and
// mantissa to bits 7-13: binary16 has the larger exponent bias, 15 against 7, and the same subnormal
// rule) and converted, times 2^8: exact for every finite e4m3 value, subnormals included.
template <int Kind, bool kScale>
inline __m512i quant_bf16x32(const uint8_t* row, int d, __m512 scale) {
  __m512 f[2];
  for (int h = 0; h < 2; ++h) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d + 16 * h));
    if constexpr (Kind == kKvInt8) {
      f[h] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    } else {
      const __m256i w = _mm256_cvtepu8_epi16(b);
      const __m256i hbits = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7),
                                            _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
      f[h] = _mm512_mul_ps(_mm512_cvtph_ps(hbits), _mm512_set1_ps(256.0f));
    }
    if constexpr (kScale) f[h] = _mm512_mul_ps(f[h], scale);
  }
  return (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]);
}

// One KV tile of one KV head, packed for vdpbf16ps (see above). D = ND * 16, ND even.
// A quantized cache (Kind int8 / fp8, rows of D bytes + a bf16 scale): K is packed unscaled (its
// int8 / e4m3 values are exact in bf16) with the per-position scales in ks, which the caller applies
// to the scores (S = (Q K_q^T) * s_k: no rounding of the dequantized K); V is dequantized into bf16
// (one rounding of v * s_v, at most 2^-9 relative: below the int8 / fp8 rounding itself).
template <int ND, int Kind = kKvBf16>
struct PackedTile {
  static constexpr int DP = ND * 8;  // dim pairs
  static constexpr int D = ND * 16;
  using E = std::conditional_t<Kind == kKvBf16, c10::BFloat16, uint8_t>;  // a cache row's elements
  alignas(64) uint32_t k[DP][kKvTile];
  alignas(64) uint32_t v[kKvTile / 2][ND * 16];
  alignas(64) float ks[kKvTile];  // K scales per position (quantized caches only)

  // The 16 dim pairs [db, db + 16) of row r, as a bf16 row would hold them.
  static inline __m512i k_pairs(const E* r, int db) {
    if constexpr (Kind == kKvBf16) return _mm512_loadu_si512(reinterpret_cast<const uint32_t*>(r) + db);
    else return quant_bf16x32<Kind, false>(r, 2 * db, _mm512_setzero_ps());
  }
  // Dims [d, d + 32) of V row r as 32 bf16.
  static inline __m512i v_dims(const E* r, int d) {
    if constexpr (Kind == kKvBf16) return _mm512_loadu_si512(r + d);
    else return quant_bf16x32<Kind, true>(r, d, _mm512_set1_ps(row_scale(r, D)));
  }

  // rows[j]: the K (kr) and V (vr) cache rows of tile position j (a zero row past the context).
  // nk / nv, when not null: the next tile's rows, prefetched into L2 a 16-row group at a time between
  // the transposes (a burst of the whole tile's prefetches before the pack would stall the core
  // on its few fill buffers instead of overlapping the loads with this tile's work).
  void pack(const E* const* kr, const E* const* vr, const E* const* nk, const E* const* nv) {
    constexpr int kRowBytes = Kind == kKvBf16 ? ND * 32 : ND * 16 + 2;
    for (int jb = 0; jb < kKvTile; jb += 16) {
      if (nk != nullptr) {
        for (int j = jb; j < jb + 16; ++j)
          for (int b = 0; b < kRowBytes; b += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(nk[j]) + b, _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(nv[j]) + b, _MM_HINT_T1);
          }
      }
      for (int db = 0; db < DP; db += 16) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j) r[j] = k_pairs(kr[jb + j], db);
        transpose16x16(r);
        for (int d = 0; d < 16; ++d) _mm512_store_si512(&k[db + d][jb], r[d]);
      }
      if constexpr (Kind != kKvBf16)
        for (int j = jb; j < jb + 16; ++j) ks[j] = row_scale(kr[j], D);
    }
    // Word 2i of the result = a[i], word 2i+1 = b[i] (i = 0..15), and the same for a[16..31], b[16..31].
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int i = 0; i < kKvTile / 2; ++i)
      for (int d = 0; d < ND * 16; d += 32) {
        const __m512i a = v_dims(vr[2 * i], d), b = v_dims(vr[2 * i + 1], d);
        _mm512_store_si512(&v[i][d], _mm512_permutex2var_epi16(a, lo, b));
        _mm512_store_si512(&v[i][d + 16], _mm512_permutex2var_epi16(a, hi, b));
      }
  }
};

// Running state of one (row, head) pair: the query as bf16 dim pairs, max, lane-wise sum, output.
template <int ND>
struct PairState {
  alignas(64) uint32_t q[ND * 8];
  alignas(64) float l[16];
  alignas(64) float o[ND * 16];
  float m;
  int32_t pos;  // the row's position: tile positions after it are masked
  int32_t lo;   // the row's first key (sliding window; 0 without): tile positions before it are masked
};

// 2^x lane-wise for finite x (denormal or 0 below -126; x <= 0 where the softmax calls it):
// x = n + f with n = floor(x) and f = x - n in [0, 1) in one VREDUCEPS, 2^f by a degree-4 polynomial fitted for relative error on [0, 1) (max 2.6e-6, far below the bf16
// rounding of P, 2^-9), times 2^n by VSCALEFPS (which takes floor(x) itself). Seven instructions
// with the caller's fmsub (Cephes-style range reduction, as in cpu_vec.h's exp, without its clamp and round).
inline __m512 exp2_fast16(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, 0x09);  // imm: 0 fraction bits kept, round down, no exceptions
  __m512 y = _mm512_set1_ps(1.3534121215343475e-2f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.2011482417583466e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4144279956817627e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9300383329391479e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0000026226043701f));
  return _mm512_scalef_ps(y, x);
}

// Online softmax of one pair over one tile, in base 2 (Milakov & Gimelshein 2018; FlashAttention,
// Dao et al. 2022, Alg. 1 lines 9-11): s = the tile's raw q . k (kKvTile / 16 vectors), vlog2 =
// scale * log2(e), masked past the row's position. ps.m is the running max of s * vlog2, so every
// probability 2^(s * vlog2 - m) is at most 1, and the maximum's rounds to exactly 1. Updates m and the
// lane-wise sum l, writes the tile's probabilities as bf16 pairs to pb (kKvTile / 2 words), and adds
// those rounded probabilities (not the float32 ones) to l, so that the normaliser and P V see the
// same weights (kTileSum: l is only rescaled here; the caller's tile product adds the sum). Returns
// whether the pair's output must be scaled by alpha = 2^(m_old - m_new) before this tile's P V is
// added (not on the pair's first tile, where o and l are still 0, nor when m stays: same bits as no
// scaling). Which branches run depends only on the pair's own position,
// scores and the tile, never on the other rows.
//
// tile_probs is its first half (the running max and the float32 probabilities p[kKvTile / 16], masked
// positions 0), shared with attention_int8.h's int8 P V, which quantizes p itself.
template <int ND, __m512 (*Exp2)(__m512) = exp2_fast16>
inline bool tile_probs(PairState<ND>& ps, const __m512* s, int32_t j0, __m512 vlog2, __m512* p, __m512& alpha) {
  constexpr int NC = kKvTile / 16;
  const bool full = ps.pos - j0 >= kKvTile - 1 && ps.lo <= j0;  // every position of the tile is in the row's range
  __mmask16 mk[NC];
  __m512 mx;
  static_assert(NC == 4, "the max below takes four score vectors");
  if (full) {
    mx = _mm512_max_ps(_mm512_max_ps(s[0], s[1]), _mm512_max_ps(s[2], s[3]));
  } else {
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i lim = _mm512_set1_epi32(ps.pos - j0), first = _mm512_set1_epi32(ps.lo - j0);
    mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int c = 0; c < NC; ++c) {
      const __m512i jc = _mm512_add_epi32(iota, _mm512_set1_epi32(c * 16));
      mk[c] = _mm512_cmple_epi32_mask(jc, lim) & _mm512_cmpge_epi32_mask(jc, first);
      mx = _mm512_mask_max_ps(mx, mk[c], mx, s[c]);
    }
  }
  // vlog2 > 0, so max(s) * vlog2 = max(s * vlog2) exactly (rounding is monotonic).
  mx = _mm512_mul_ps(mx, vlog2);
  bool changed = false;
  alpha = _mm512_set1_ps(1.0f);
  if (_mm512_cmp_ps_mask(mx, _mm512_set1_ps(ps.m), _CMP_GT_OQ)) {
    const float m_new = _mm512_reduce_max_ps(mx);
    if (ps.m != -std::numeric_limits<float>::infinity()) {  // the first tile: o = l = 0, nothing to scale
      changed = true;
      alpha = Exp2(_mm512_set1_ps(ps.m - m_new));
    }
    ps.m = m_new;
  }
  const __m512 mv = _mm512_set1_ps(ps.m);
  for (int c = 0; c < NC; ++c) {
    p[c] = Exp2(_mm512_fmsub_ps(s[c], vlog2, mv));
    if (!full) p[c] = _mm512_maskz_mov_ps(mk[c], p[c]);
  }
  return changed;
}

template <int ND, bool kTileSum = false, __m512 (*Exp2)(__m512) = exp2_fast16>  // Exp2: attention_int8.h's may differ
inline bool online_softmax(PairState<ND>& ps, const __m512* s, int32_t j0, __m512 vlog2, uint32_t* pb,
                           __m512& alpha) {
  constexpr int NC = kKvTile / 16;
  __m512 p[NC];
  const bool changed = tile_probs<ND, Exp2>(ps, s, j0, vlog2, p, alpha);
  if constexpr (kTileSum) {
    for (int c = 0; c < NC; c += 2) _mm512_store_si512(pb + c * 8, (__m512i)_mm512_cvtne2ps_pbh(p[c + 1], p[c]));
    if (changed) _mm512_store_ps(ps.l, _mm512_mul_ps(_mm512_load_ps(ps.l), alpha));
    return changed;
  }
  // A bf16 word pair's even element, shifted up, and its odd one, masked, are the two rounded
  // probabilities as float32 (lanes hold positions in another order than p's: l is a sum over lanes).
  const __m512i odd = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 sum = _mm512_setzero_ps();
  for (int c = 0; c < NC; c += 2) {
    const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(p[c + 1], p[c]);
    _mm512_store_si512(pb + c * 8, b);
    sum = _mm512_add_ps(sum, _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(b, 16)),
                                           _mm512_castsi512_ps(_mm512_and_si512(b, odd))));
  }
  _mm512_store_ps(ps.l, _mm512_fmadd_ps(_mm512_load_ps(ps.l), alpha, sum));  // alpha = 1: exactly l + sum
  return changed;
}

// One KV tile (first position j0) for N pairs at once (register blocking; the pairs never mix).
template <int ND, int N, int Kind = kKvBf16>
inline void tile_pairs(const PackedTile<ND, Kind>& t, PairState<ND>* ps, int32_t j0, __m512 vscale) {
  constexpr int DP = ND * 8, NC = kKvTile / 16;
  __m512 s[N][NC];
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < NC; ++c) s[n][c] = _mm512_setzero_ps();
  for (int dp = 0; dp < DP; ++dp) {
    __m512bh kv[NC];
    for (int c = 0; c < NC; ++c) kv[c] = (__m512bh)_mm512_load_si512(&t.k[dp][c * 16]);
    for (int n = 0; n < N; ++n) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(ps[n].q[dp]));
      for (int c = 0; c < NC; ++c) s[n][c] = _mm512_dpbf16_ps(s[n][c], qb, kv[c]);
    }
  }
  if constexpr (Kind != kKvBf16)  // S = (Q K_q^T) * s_k per position
    for (int c = 0; c < NC; ++c) {
      const __m512 sk = _mm512_load_ps(&t.ks[c * 16]);
      for (int n = 0; n < N; ++n) s[n][c] = _mm512_mul_ps(s[n][c], sk);
    }
  alignas(64) uint32_t pb[N][kKvTile / 2];
  __m512 alpha[N];
  bool changed[N];
  for (int n = 0; n < N; ++n) changed[n] = online_softmax(ps[n], s[n], j0, vscale, pb[n], alpha[n]);
  __m512 acc[N][ND];
  for (int n = 0; n < N; ++n)
    for (int v = 0; v < ND; ++v) {
      acc[n][v] = _mm512_load_ps(ps[n].o + v * 16);
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
    for (int v = 0; v < ND; ++v) _mm512_store_ps(ps[n].o + v * 16, acc[n][v]);
}

// Pairs computed together: as many as keep the accumulators (N x 4 for S, N x ND for O) in registers.
template <int ND>
constexpr int kGroupPairs = ND <= 4 ? 6 : (ND == 6 ? 4 : 2);

template <int ND, int N = kGroupPairs<ND>, int Kind = kKvBf16>
inline void tile_group(const PackedTile<ND, Kind>& t, PairState<ND>* ps, int n, int32_t j0, __m512 vscale) {
  if constexpr (N > 1) {
    if (n < N) return tile_group<ND, N - 1, Kind>(t, ps, n, j0, vscale);
  }
  tile_pairs<ND, N, Kind>(t, ps, j0, vscale);
}


#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
// The same tiles on AMX (Intel Advanced Matrix Extensions: 16 x 16 float32 accumulator tiles,
// TDPBF16PS = 16 rows x 16 columns x 32 bf16 products): 16 pairs at a time. S = Q K^T takes the
// pairs' bf16 queries as the A tiles (rows = pairs) and the packed K tile as B (its [D/2][kKvTile]
// pair layout is AMX's B layout); P V takes the bf16 probabilities as A and the packed V tile as B,
// accumulating into the pairs' outputs. Each output element depends only on its own A row and B
// column, so the invariance argument is the kernel's above (rows past the pairs are zero padding).
// The normaliser l is a tile product too: the same bf16 probabilities times a B tile whose column 0
// is ones add each row's sum of rounded P to lane 0 of its l (the softmax's vector loop, the
// bottleneck on AMX, then does no summing: 10 % of the attention time of a 512-token chunk).
// Tiles 0-3: accumulators, 4: B, 5: A, 6: l, 7: the ones; all 16 rows x 64 bytes.
inline bool amx_enabled() { return tv_cpu::os_grants_amx(); }
bool g_amx = [] {  // TINYVLLM_AMX_ATTENTION=0: the vdpbf16ps / VPDPBUSD tiles instead (A/B runs of a whole server)
  const char* e = std::getenv("TINYVLLM_AMX_ATTENTION");
  return !(e && e[0] == '0');
}();

inline void amx_configure() { tv_cpu::configure_tiles({16, 16, 16, 16, 16, 16, 16, 16}); }

#define TINYVLLM_TILE_FOR4(F) F(0) F(1) F(2) F(3)

// 16 pairs (ps[0..15]; the ones past n are padding with zero queries) over one packed tile.
template <int ND, int Kind = kKvBf16>
inline void tile_pairs_amx(const PackedTile<ND, Kind>& t, PairState<ND>* ps, int n, int32_t j0, __m512 vscale) {
  constexpr int NC = kKvTile / 16, KS = ND / 2;  // 16-position column blocks; 32-dim k steps
  constexpr long kPairStride = sizeof(PairState<ND>);
  static_assert(NC == 4, "four accumulator tiles hold one KV tile's scores");
  alignas(64) float sb[16][kKvTile];
  alignas(64) uint32_t pb[16][kKvTile / 2];
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int ks = 0; ks < KS; ++ks) {
    _tile_loadd(5, ps[0].q + ks * 16, kPairStride);
#define TINYVLLM_QK(C) _tile_loadd(4, &t.k[ks * 16][C * 16], kKvTile * 4); _tile_dpbf16ps(C, 5, 4);
    TINYVLLM_TILE_FOR4(TINYVLLM_QK)
#undef TINYVLLM_QK
  }
#define TINYVLLM_ST(C) _tile_stored(C, &sb[0][C * 16], kKvTile * 4);
  TINYVLLM_TILE_FOR4(TINYVLLM_ST)
#undef TINYVLLM_ST
  for (int r = 0; r < 16; ++r) {
    if (r < n) {
      __m512 sv[NC];
      for (int c = 0; c < NC; ++c) sv[c] = _mm512_load_ps(&sb[r][c * 16]);
      if constexpr (Kind != kKvBf16)  // S = (Q K_q^T) * s_k per position
        for (int c = 0; c < NC; ++c) sv[c] = _mm512_mul_ps(sv[c], _mm512_load_ps(&t.ks[c * 16]));
      __m512 alpha;
      if (online_softmax<ND, true>(ps[r], sv, j0, vscale, pb[r], alpha))
        for (int v = 0; v < ND; ++v) _mm512_store_ps(ps[r].o + v * 16, _mm512_mul_ps(_mm512_load_ps(ps[r].o + v * 16), alpha));
    } else {
      for (int c = 0; c < kKvTile / 2; c += 16) _mm512_store_si512(&pb[r][c], _mm512_setzero_si512());
    }
  }
  // B tile of the normaliser: k-pair rows of 16 columns, column 0 the bf16 pair (1, 1), the rest 0.
  alignas(64) static const uint32_t ones[16][16] = {{0x3F803F80u}, {0x3F803F80u}, {0x3F803F80u}, {0x3F803F80u},
                                                    {0x3F803F80u}, {0x3F803F80u}, {0x3F803F80u}, {0x3F803F80u},
                                                    {0x3F803F80u}, {0x3F803F80u}, {0x3F803F80u}, {0x3F803F80u},
                                                    {0x3F803F80u}, {0x3F803F80u}, {0x3F803F80u}, {0x3F803F80u}};
  _tile_loadd(7, &ones[0][0], 64);
  _tile_loadd(6, ps[0].l, kPairStride);
  for (int v0 = 0; v0 < ND; v0 += 4) {
#define TINYVLLM_LD(C) if (v0 + C < ND) _tile_loadd(C, ps[0].o + (v0 + C) * 16, kPairStride);
    TINYVLLM_TILE_FOR4(TINYVLLM_LD)
#undef TINYVLLM_LD
    for (int ks = 0; ks < kKvTile / 32; ++ks) {
      _tile_loadd(5, &pb[0][ks * 16], kKvTile * 2);
      if (v0 == 0) _tile_dpbf16ps(6, 5, 7);  // l += the row's sum of these 32 rounded probabilities
#define TINYVLLM_PV(C) if (v0 + C < ND) { _tile_loadd(4, &t.v[ks * 16][(v0 + C) * 16], ND * 64); _tile_dpbf16ps(C, 5, 4); }
      TINYVLLM_TILE_FOR4(TINYVLLM_PV)
#undef TINYVLLM_PV
    }
#define TINYVLLM_SO(C) if (v0 + C < ND) _tile_stored(C, ps[0].o + (v0 + C) * 16, kPairStride);
    TINYVLLM_TILE_FOR4(TINYVLLM_SO)
#undef TINYVLLM_SO
  }
  _tile_stored(6, ps[0].l, kPairStride);
}
#undef TINYVLLM_TILE_FOR4
#endif  // AMX

template <typename O, int ND, int Kind = kKvBf16>
void attention_tiled(const torch::Tensor& q, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                     const torch::Tensor& block_tables, const torch::Tensor& token_seq,
                     const torch::Tensor& token_pos, double scale, torch::Tensor& out, int64_t window = 0) {
  using C = typename PackedTile<ND, Kind>::E;  // a cache row's elements: bf16, or bytes (+ the scale)
  constexpr int D = ND * 16, NG = kGroupPairs<ND>;
  constexpr int RD = Kind == kKvBf16 ? D : D + 2;  // elements per cache row
  const int64_t num_tokens = q.size(0), Hq = q.size(1);
  const int64_t bs = key_cache.size(1), Hk = key_cache.size(2);
  const int64_t G = Hq / Hk;
  const int64_t max_blocks = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const C* kp = static_cast<const C*>(key_cache.data_ptr());
  const C* vp = static_cast<const C*>(value_cache.data_ptr());
  const int64_t* btp = block_tables.data_ptr<int64_t>();
  const int64_t* seqp = token_seq.data_ptr<int64_t>();
  const int64_t* posp = token_pos.data_ptr<int64_t>();
  O* op = out.data_ptr<O>();
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale * 1.4426950408889634));  // base-2 softmax
  alignas(64) static const C zero_row[RD + 64] = {};  // (+ 64: the quantized loads read 16-byte pieces)

  // Work items: (run of up to g_row_block tokens of one sequence at consecutive positions, KV head),
  // handed out longest first from a shared counter (a descheduled thread delays only its own item).
  struct Item { int64_t t0, rows, hk, cost; };
  const int64_t row_block = g_row_block;  // read once: the items and the per-thread pair states agree
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
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  const bool use_amx = g_amx && amx_enabled();
#endif

  tv_pool::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
    std::vector<PairState<ND>> st(row_block * G + 16);  // + AMX's padding rows past the last pair
    auto tile = std::make_unique<PackedTile<ND, Kind>>();
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (use_amx) amx_configure();
#endif
    // The row pointers of a tile and of the next one (double buffer: the next one's are prefetched).
    const C* rows[2][2][kKvTile];
    for (int64_t it; (it = next.fetch_add(1, std::memory_order_relaxed)) < num_items;) {
      const Item& w = items[it];
      const int64_t pairs = w.rows * G;
      const int64_t* bt = btp + seqp[w.t0] * max_blocks;
      const int64_t pos0 = posp[w.t0], ctx_max = pos0 + w.rows;
      for (int64_t p = 0; p < pairs; ++p) {
        PairState<ND>& s = st[p];
        const float* qrow = qp + ((w.t0 + p / G) * Hq + w.hk * G + p % G) * D;
        for (int v = 0; v < ND; v += 2)  // cvtne2ps(hi, lo): dims (2i, 2i+1) in one 32-bit lane
          _mm512_store_si512(s.q + v * 8, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qrow + v * 16 + 16),
                                                                       _mm512_loadu_ps(qrow + v * 16)));
        s.m = -std::numeric_limits<float>::infinity();
        _mm512_store_ps(s.l, _mm512_setzero_ps());
        for (int v = 0; v < ND; ++v) _mm512_store_ps(s.o + v * 16, _mm512_setzero_ps());
        s.pos = static_cast<int32_t>(pos0 + p / G);
        s.lo = window > 0 ? static_cast<int32_t>(std::max<int64_t>(0, s.pos + 1 - window)) : 0;
      }
      // Tile positions [j0, j0 + kKvTile) through the block table, whole blocks at a time.
      const auto fill = [&](int64_t j0, const C** kr, const C** vr) {
        int64_t j = 0;
        for (int64_t blk = j0 / bs, off = j0 % bs; j < kKvTile && j0 + j < ctx_max; ++blk, off = 0) {
          const int64_t n = std::min({bs - off, kKvTile - j, ctx_max - j0 - j});
          const int64_t e = ((bt[blk] * bs + off) * Hk + w.hk) * RD;
          for (int64_t i = 0; i < n; ++i, ++j) kr[j] = kp + e + i * Hk * RD, vr[j] = vp + e + i * Hk * RD;
        }
        for (; j < kKvTile; ++j) kr[j] = vr[j] = zero_row;
      };
      // Sliding window: the tiles before the first row's first key are skipped; a tile is taken only
      // by the rows whose [lo, pos] meets it, so a row's tiles are lo / kKvTile .. pos / kKvTile.
      const int64_t jstart = st[0].lo / kKvTile * kKvTile;
      int cur = 0;
      fill(jstart, rows[0][0], rows[0][1]);
      for (int64_t j0 = jstart; j0 < ctx_max; j0 += kKvTile, cur ^= 1) {
        const bool more = j0 + kKvTile < ctx_max;
        if (more) fill(j0 + kKvTile, rows[cur ^ 1][0], rows[cur ^ 1][1]);
        // The block table scatters the rows, so the hardware prefetchers do not follow them: the next
        // tile's rows are prefetched into L2 during this tile's pack (a prefetch distance of one tile
        // beat two and three, and L2 beat L1: docs/benchmarks.md).
        const bool pf = more && g_prefetch;
        tile->pack(rows[cur][0], rows[cur][1], pf ? rows[cur ^ 1][0] : nullptr, pf ? rows[cur ^ 1][1] : nullptr);
        // Rows whose position is before this tile are done with it; the others take it.
        const int64_t first = std::max<int64_t>(0, j0 - pos0) * G;
        // Rows whose first key is past this tile have not reached it (only with a window).
        const int64_t last = window > 0 ? std::min<int64_t>(pairs, std::max<int64_t>(0, j0 + kKvTile + window - 1 - pos0) * G)
                                        : pairs;
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
        if (use_amx) {
          for (int64_t p = first; p < last; p += 16)
            tile_pairs_amx<ND, Kind>(*tile, st.data() + p, static_cast<int>(std::min<int64_t>(16, last - p)),
                               static_cast<int32_t>(j0), vscale);
          continue;
        }
#endif
        for (int64_t p = first; p < last; p += NG)
          tile_group<ND, NG, Kind>(*tile, st.data() + p, static_cast<int>(std::min<int64_t>(NG, last - p)),
                         static_cast<int32_t>(j0), vscale);
      }
      for (int64_t p = 0; p < pairs; ++p) {
        const __m512 inv = _mm512_set1_ps(1.0f / hsum(_mm512_load_ps(st[p].l)));
        O* orow = op + ((w.t0 + p / G) * Hq + w.hk * G + p % G) * D;
        for (int v = 0; v < ND; ++v) store16(orow + v * 16, _mm512_mul_ps(_mm512_load_ps(st[p].o + v * 16), inv));
      }
    }
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (use_amx) _tile_release();
#endif
  });
}

#include "attention_int8.h"  // issue 39: the int8 Q K^T over an int8 cache (attention_tiled_i8)

// Dot-product ceilings (the benchmarks' references: what the tiled attention's S = Q K^T loop could
// reach on this CPU, operands from L1), FLOP = 2 per multiply-add, on every thread:
//  * vec_dot_ceiling<false>: tile_pairs' inner loop, per dim pair 4 K vectors and 6 broadcast queries,
//    24 independent vdpbf16ps chains; <true>: the same shape with VPDPBUSD (AVX512-VNNI: 64 int8
//    multiply-adds per instruction against vdpbf16ps's 32; issue 39's int8 reference);
//  * amx_dot_ceiling<false>: tile_pairs_amx's loop, per 32-dim step one A tile load, then for 4
//    accumulator tiles one B tile load and one TDPBF16PS (16 x 16 x 32 multiply-adds); <true>: TDPBSSD
//    (AMX-INT8: 16 x 16 x 64).
// Runs body(begin, end) on every thread (at::parallel_for over the threads); returns
// flop_per_thread * threads / seconds.
template <typename Body>
double flops_on_all_threads(double flop_per_thread, const Body& body) {
  const int64_t nthreads = at::get_num_threads();
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, nthreads, 1, body);
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(nthreads) * flop_per_thread / sec;
}

// Operand words of the ceilings: bf16 pairs near 1.0, or int8 quads 1..4.
template <bool kInt8, int KS, int NQ>
inline void ceiling_operands(uint32_t (&k)[KS][kKvTile], uint32_t (&q)[NQ][KS]) {
  for (int i = 0; i < KS * kKvTile; ++i) (&k[0][0])[i] = (kInt8 ? 0x01020304u : 0x3F803F80u) + (i & 7);
  for (int i = 0; i < NQ * KS; ++i) (&q[0][0])[i] = (kInt8 ? 0x04030201u : 0x3F803F80u) - (i & 3);
}

template <bool kInt8>
double vec_dot_ceiling(int64_t iters) {
  constexpr int KS = kInt8 ? 16 : 32;  // dwords of a 64-dim row: 2 bf16 or 4 int8 each
  std::atomic<int64_t> sink{0};
  const double flops = flops_on_all_threads(static_cast<double>(iters) * KS * 24 * 16 * (kInt8 ? 4 : 2) * 2,
                                            [&](int64_t b, int64_t e) {
    alignas(64) uint32_t k[KS][kKvTile];
    alignas(64) uint32_t q[6][KS];
    ceiling_operands<kInt8>(k, q);
    for (int64_t rep = b; rep < e; ++rep) {
      __m512 s[6][4];
      for (int n = 0; n < 6; ++n)
        for (int c = 0; c < 4; ++c) s[n][c] = _mm512_setzero_ps();
      for (int64_t it = 0; it < iters; ++it)
        for (int dp = 0; dp < KS; ++dp) {
          __m512i kv[4];
          for (int c = 0; c < 4; ++c) kv[c] = _mm512_load_si512(&k[dp][c * 16]);
          for (int n = 0; n < 6; ++n) {
            const __m512i qb = _mm512_set1_epi32(static_cast<int>(q[n][dp]));
            for (int c = 0; c < 4; ++c) {
              if constexpr (kInt8) s[n][c] = _mm512_castsi512_ps(_mm512_dpbusd_epi32(_mm512_castps_si512(s[n][c]), qb, kv[c]));
              else s[n][c] = _mm512_dpbf16_ps(s[n][c], (__m512bh)qb, (__m512bh)kv[c]);
            }
          }
        }
      __m512 t = _mm512_setzero_ps();
      for (int n = 0; n < 6; ++n)
        for (int c = 0; c < 4; ++c) t = _mm512_add_ps(t, s[n][c]);
      sink += static_cast<int64_t>(_mm512_reduce_add_ps(t) != 0.0f);
    }
  });
  return flops + 0.0 * sink.load();
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
template <bool kInt8>
double amx_dot_ceiling(int64_t iters) {
  if (!amx_enabled()) return 0.0;
  return flops_on_all_threads(static_cast<double>(iters) * 2 * 4 * 16 * 16 * (kInt8 ? 64 : 32) * 2,
                              [&](int64_t b, int64_t e) {
    alignas(64) uint32_t k[32][kKvTile];
    alignas(64) uint32_t q[16][32];
    ceiling_operands<kInt8>(k, q);
    amx_configure();
    for (int64_t rep = b; rep < e; ++rep) {
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t it = 0; it < iters; ++it)
        for (int ks = 0; ks < 2; ++ks) {
          _tile_loadd(5, &q[0][ks * 16], 128);
// GCC's tile intrinsics paste the tile number into their asm: literal numbers only.
#define TINYVLLM_CEIL_DP(C) if constexpr (kInt8) _tile_dpbssd(C, 5, 4); else _tile_dpbf16ps(C, 5, 4);
          _tile_loadd(4, &k[ks * 16][0], kKvTile * 4); TINYVLLM_CEIL_DP(0)
          _tile_loadd(4, &k[ks * 16][16], kKvTile * 4); TINYVLLM_CEIL_DP(1)
          _tile_loadd(4, &k[ks * 16][32], kKvTile * 4); TINYVLLM_CEIL_DP(2)
          _tile_loadd(4, &k[ks * 16][48], kKvTile * 4); TINYVLLM_CEIL_DP(3)
#undef TINYVLLM_CEIL_DP
        }
      alignas(64) int32_t sink[16][16];
      _tile_stored(0, sink, 64);
    }
    _tile_release();
  });
}
#endif
#endif  // __AVX512BF16__
#endif  // TINYVLLM_AVX512


// Paged attention over the packed batch: the tiled kernel (bf16 cache, AVX512_BF16), else the row kernel
// when the head size allows it, else the scalar loops.
template <typename C, typename O>
void attention_impl(const torch::Tensor& q, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                    const torch::Tensor& block_tables, const torch::Tensor& token_seq,
                    const torch::Tensor& token_pos, double scale, torch::Tensor& out, int64_t window = 0) {
#if defined(TINYVLLM_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<C, c10::BFloat16>) {
    if (g_vector_kernels && g_tiled_attention) {
      switch (q.size(2)) {
        case 32: return attention_tiled<O, 2>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out, window);
        case 64: return attention_tiled<O, 4>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out, window);
        case 96: return attention_tiled<O, 6>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out, window);
        case 128: return attention_tiled<O, 8>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out, window);
        default: break;
      }
    }
  }
#endif
#if defined(TINYVLLM_VEC)
  if (g_vector_kernels && q.size(1) / key_cache.size(2) <= kMaxGroup) {
#define TINYVLLM_ROW(D) return attention_row<VecF, C, O, D>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out, window);
    switch (q.size(2)) {
      case 16: TINYVLLM_ROW(16)
      case 32: TINYVLLM_ROW(32)
      case 64: TINYVLLM_ROW(64)
      case 96: TINYVLLM_ROW(96)
      case 128: TINYVLLM_ROW(128)
      case 256: TINYVLLM_ROW(256)  // Gemma 2/3
      default: break;
    }
#undef TINYVLLM_ROW
  }
#endif
  attention_scalar<C, O>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out, window);
}

// Paged attention over an int8 / fp8 cache: the tiled kernel on AVX512-BF16 (where allow_tiled: not
// for float32 models, whose queries it would round to bf16), else attention_scalar_q.
template <typename O>
void attention_q_impl(int kind, bool allow_tiled, const torch::Tensor& q, const torch::Tensor& key_cache,
                      const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                      const torch::Tensor& token_seq, const torch::Tensor& token_pos, double scale,
                      torch::Tensor& out, int64_t window = 0) {
#if defined(TINYVLLM_AVX512) && defined(__AVX512BF16__)
  if (allow_tiled && g_vector_kernels && g_tiled_attention) {
#if defined(TINYVLLM_INT8_QK)
    // A sliding window shorter than some row's context: attention_tiled below (which masks it); a window
    // covering every row's context is no window.
    if (kind == kKvInt8 && g_int8_qk && (window <= 0 || token_pos.numel() == 0 || window > token_pos.max().item<int64_t>())) {
      if (q.size(2) == 64) return attention_tiled_i8<O, 4>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out);
      if (q.size(2) == 128) return attention_tiled_i8<O, 8>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out);
    }
#endif
#define TINYVLLM_QT(ND) return kind == kKvInt8 \
      ? attention_tiled<O, ND, kKvInt8>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out, window) \
      : attention_tiled<O, ND, kKvFp8>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out, window);
    switch (q.size(2)) {
      case 32: TINYVLLM_QT(2)
      case 64: TINYVLLM_QT(4)
      case 96: TINYVLLM_QT(6)
      case 128: TINYVLLM_QT(8)
      default: break;
    }
#undef TINYVLLM_QT
  }
#endif
  if (kind == kKvInt8) attention_scalar_q<kKvInt8, O>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out, window);
  else attention_scalar_q<kKvFp8, O>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out, window);
}

// The KV kind of a cache tensor: int8 -> kKvInt8, uint8 (e4m3 bits) -> kKvFp8, else kKvBf16 (model dtype).
inline int kv_kind(const torch::Tensor& cache) {
  if (cache.scalar_type() == torch::kChar) return kKvInt8;
  if (cache.scalar_type() == torch::kByte) return kKvFp8;
  return kKvBf16;
}

}  // namespace

torch::Tensor paged_attention_cpu(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                                  torch::Tensor block_tables, torch::Tensor token_seq,
                                  torch::Tensor token_pos, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q must be [T, Hq, D] float32");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window)");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "caches must be contiguous [num_blocks, block_size, Hk, D]");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  auto out = torch::empty_like(q);
  if (const int kind = kv_kind(key_cache); kind != kKvBf16) {
    TORCH_CHECK(key_cache.size(3) == q.size(2) + 2 && value_cache.scalar_type() == key_cache.scalar_type(),
                "a quantized cache is [num_blocks, block_size, Hk, D + 2] int8 / uint8 (e4m3) for K and V");
    attention_q_impl<float>(kind, true, q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out, window);
  } else if (key_cache.scalar_type() == torch::kBFloat16) {
    attention_impl<c10::BFloat16, float>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out, window);
  } else if (key_cache.scalar_type() == torch::kFloat32) {
    attention_impl<float, float>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out, window);
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
  tv_pool::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(H);
    for (int64_t t = begin; t < end; ++t) {
      alignas(64) float lanes[kLanes] = {0};
      int64_t i = 0;
#if defined(TINYVLLM_VEC)
      // Same arithmetic as the scalar loops below (mul then add, lane l takes elements l mod 16),
      // so both paths give identical results; on AVX2 the 16 lanes are two 8-lane vectors.
      if (g_vector_kernels) {
        constexpr int L = VecF::kLanes, S = kLanes / L;
        VecF acc[S];
        for (int e = 0; e < S; ++e) acc[e] = VecF::zero();
        for (; i + kLanes <= H; i += kLanes) {
          for (int e = 0; e < S; ++e) {
            VecF v = VecF::load(xp + t * H + i + L * e);
            if (rp) v = tv_vec::round_as<C>(v + VecF::load(rp + t * H + i + L * e));
            v.store(h.data() + i + L * e);
            v.store(rop + t * H + i + L * e);
            acc[e] = acc[e] + v * v;
          }
        }
        for (int e = 0; e < S; ++e) acc[e].store(lanes + L * e);
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
#if defined(TINYVLLM_VEC)
      const VecF vinv = VecF::set1(inv);
      for (; j < vec_end; j += VecF::kLanes)
        (VecF::load(wp + j) * tv_vec::round_as<C>(VecF::load(h.data() + j) * vinv)).store(op + t * H + j);
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
  tv_pool::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const C* g = xp + t * 2 * I;
      const C* u = g + I;
      int64_t i = 0;
#if defined(TINYVLLM_VEC)
      // Element i always takes the same path (vector body or scalar tail), whatever the batch.
      if (g_vector_kernels) {
        for (; i + VecF::kLanes <= I; i += VecF::kLanes) {
          const VecF gv = VecF::load(g + i);
          const VecF e = tv_vec::exp(VecF::zero() - gv);
          const VecF silu = tv_vec::round_as<C>(gv / (VecF::set1(1.0f) + e));
          (silu * VecF::load(u + i)).store(op + t * I + i);
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

// Rotate-half rotary embedding of one head row x (D = 2 * half values) by the position's cos c and
// sin s: put(i, x[i] c[i] - x[i + half] s[i]) and put(i + half, x[i + half] c[i] + x[i] s[i]).
template <typename C, typename Put>
inline void rope_row(const C* x, const float* c, const float* s, int64_t half, const Put& put) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
    put(i, x1 * c[i] - x2 * s[i]);
    put(i + half, x2 * c[i] + x1 * s[i]);
  }
}

// The Hq query heads of one token's qkv row x, rotated and rounded to the model dtype, into q [Hq, D] float32.
template <typename C>
inline void rope_queries(const C* x, const float* c, const float* s, int64_t Hq, int64_t D, float* q) {
  for (int64_t h = 0; h < Hq; ++h) {
    float* o = q + h * D;
    rope_row(x + h * D, c, s, D / 2, [&](int64_t i, float r) { o[i] = round_to<C>(r); });
  }
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
  tv_pool::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const C* x = xp + t * row;
      const float* c = cp + pp[t] * half;
      const float* s = sp + pp[t] * half;
      rope_queries<C>(x, c, s, Hq, D, qo + t * Hq * D);
      const int64_t slot = slp[t];
      if (slot < 0) continue;
      for (int64_t h = 0; h < Hk; ++h) {
        const C* k = x + (Hq + h) * D;
        const C* v = x + (Hq + Hk + h) * D;
        C* kd = kc + (slot * Hk + h) * D;
        C* vd = vc + (slot * Hk + h) * D;
        rope_row(k, c, s, half, [&](int64_t i, float r) { kd[i] = from_f<C>(r); });
        for (int64_t i = 0; i < D; ++i) vd[i] = v[i];
      }
    }
  });
}

// rope_and_cache_impl for an int8 / fp8 cache ([num_blocks, bs, Hk, D + 2] bytes): the same rotary,
// K and V rounded to the model dtype C (the values a C cache would hold), then each (token, KV head)
// row quantized with its own scale (quantize_row; kv_quant.quantize is the reference, bit for bit).
template <typename C, int Kind>
void rope_and_cache_q_impl(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                           const torch::Tensor& positions, torch::Tensor& key_cache, torch::Tensor& value_cache,
                           const torch::Tensor& slot_mapping, int64_t Hq, int64_t Hk, torch::Tensor& q_out) {
  const int64_t T = qkv.size(0), D = q_out.size(2), half = D / 2, RD = D + 2;
  const int64_t row = qkv.stride(0);
  const C* xp = qkv.data_ptr<C>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const int64_t* slp = slot_mapping.data_ptr<int64_t>();
  uint8_t* kc = static_cast<uint8_t*>(key_cache.data_ptr());
  uint8_t* vc = static_cast<uint8_t*>(value_cache.data_ptr());
  float* qo = q_out.data_ptr<float>();
  tv_pool::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> kf(D), vf(D);
    for (int64_t t = begin; t < end; ++t) {
      const C* x = xp + t * row;
      const float* c = cp + pp[t] * half;
      const float* s = sp + pp[t] * half;
      rope_queries<C>(x, c, s, Hq, D, qo + t * Hq * D);
      const int64_t slot = slp[t];
      if (slot < 0) continue;
      for (int64_t h = 0; h < Hk; ++h) {
        const C* k = x + (Hq + h) * D;
        const C* v = x + (Hq + Hk + h) * D;
        rope_row(k, c, s, half, [&](int64_t i, float r) { kf[i] = round_to<C>(r); });
        for (int64_t i = 0; i < D; ++i) vf[i] = to_f(v[i]);
        quantize_row<Kind>(kf.data(), D, kc + (slot * Hk + h) * RD);
        quantize_row<Kind>(vf.data(), D, vc + (slot * Hk + h) * RD);
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
// window > 0: a sliding-window layer (a query at position p attends to keys p - window + 1 .. p).
torch::Tensor rope_cache_attention_cpu(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                       torch::Tensor positions, torch::Tensor kv_cache,
                                       torch::Tensor slot_mapping, torch::Tensor block_tables,
                                       torch::Tensor token_seq, int64_t Hq, int64_t Hk, double scale,
                                       int64_t window) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [T, (Hq+2Hk)*D] with unit inner stride");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache must be [2, nb, bs, Hk, D]");
  const int kind = kv_kind(kv_cache);
  const int64_t T = qkv.size(0), D = kv_cache.size(4) - (kind == kKvBf16 ? 0 : 2);
  auto key_cache = kv_cache.select(0, 0);
  auto value_cache = kv_cache.select(0, 1);
  auto q = torch::empty({T, Hq, D}, qkv.options().dtype(torch::kFloat32));
  auto out = torch::empty({T, Hq, D}, qkv.options());
  block_tables = block_tables.contiguous();
  if (kind != kKvBf16) {  // int8 / fp8 cache (issue 39)
    TORCH_CHECK(qkv.size(1) == (Hq + 2 * Hk) * D, "qkv must be [T, (Hq+2Hk)*D] for a [2, nb, bs, Hk, D + 2] cache");
    if (qkv.scalar_type() == torch::kBFloat16) {
      if (kind == kKvInt8)
        rope_and_cache_q_impl<c10::BFloat16, kKvInt8>(qkv, cos, sin, positions, key_cache, value_cache, slot_mapping, Hq, Hk, q);
      else
        rope_and_cache_q_impl<c10::BFloat16, kKvFp8>(qkv, cos, sin, positions, key_cache, value_cache, slot_mapping, Hq, Hk, q);
      attention_q_impl<c10::BFloat16>(kind, true, q, key_cache, value_cache, block_tables, token_seq, positions, scale, out, window);
    } else if (qkv.scalar_type() == torch::kFloat32) {
      if (kind == kKvInt8)
        rope_and_cache_q_impl<float, kKvInt8>(qkv, cos, sin, positions, key_cache, value_cache, slot_mapping, Hq, Hk, q);
      else
        rope_and_cache_q_impl<float, kKvFp8>(qkv, cos, sin, positions, key_cache, value_cache, slot_mapping, Hq, Hk, q);
      attention_q_impl<float>(kind, false, q, key_cache, value_cache, block_tables, token_seq, positions, scale, out, window);
    } else {
      TORCH_CHECK(false, "unsupported dtype");
    }
    return out.view({T, Hq * D});
  }
  if (qkv.scalar_type() == torch::kBFloat16) {
    rope_and_cache_impl<c10::BFloat16>(qkv, cos, sin, positions, key_cache, value_cache, slot_mapping, Hq, Hk, q);
    attention_impl<c10::BFloat16, c10::BFloat16>(q, key_cache, value_cache, block_tables, token_seq, positions, scale, out, window);
  } else if (qkv.scalar_type() == torch::kFloat32) {
    rope_and_cache_impl<float>(qkv, cos, sin, positions, key_cache, value_cache, slot_mapping, Hq, Hk, q);
    attention_impl<float, float>(q, key_cache, value_cache, block_tables, token_seq, positions, scale, out, window);
  } else {
    TORCH_CHECK(false, "unsupported dtype");
  }
  return out.view({T, Hq * D});
}

// cpu_gemm.cpp: batch-invariant bf16 linear on packed weights.
torch::Tensor gemm_pack_bf16(torch::Tensor w);
bool gemm_has_bf16_kernel();
torch::Tensor gemm_bf16(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t K,
                        c10::optional<torch::Tensor> bias, bool out_float);
void gemm_amx_bind(pybind11::module& m);  // cpu_gemm_amx.cpp: set_amx_gemm, has_amx_gemm

// cpu_sample.cpp: the grammar bitmask applied to logits.
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows);

torch::Tensor gemm_gguf(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, int64_t fmt, int64_t N, int64_t K,
                        c10::optional<torch::Tensor> bias, bool out_float);
torch::Tensor gemm_gguf_ref(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, int64_t fmt, int64_t N,
                            int64_t K, c10::optional<torch::Tensor> bias);
std::string gemm_gguf_isa();
torch::Tensor gemm_gguf_q8(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, int64_t fmt, int64_t N, int64_t K,
                           c10::optional<torch::Tensor> bias, bool out_float);
torch::Tensor gemm_gguf_q8_ref(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, int64_t fmt, int64_t N,
                               int64_t K, c10::optional<torch::Tensor> bias);
std::string gemm_gguf_q8_isa();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  gemm_amx_bind(m);
  m.def("apply_token_bitmask", &apply_token_bitmask,
        "logits[rows[r], t] = -inf where bit t of bitmask row r is clear (in place)");
  m.def("gemm_gguf", &gemm_gguf, "y = x @ W^T (+ bias) on repacked GGUF blocks (cpu_gemm_gguf.cpp), batch invariant "
        "(out_float: float32 outputs for a bf16 x too)",
        py::arg("x"), py::arg("qs"), py::arg("scales"), py::arg("fmt"), py::arg("N"), py::arg("K"),
        py::arg("bias") = py::none(), py::arg("out_float") = false);
  m.def("gemm_gguf_ref", &gemm_gguf_ref, "the portable scalar loop of gemm_gguf (tests)", py::arg("x"),
        py::arg("qs"), py::arg("scales"), py::arg("fmt"), py::arg("N"), py::arg("K"), py::arg("bias") = py::none());
  m.def("gemm_gguf_isa", &gemm_gguf_isa,
        "which gemm_gguf kernel was built: avx512_bf16, avx2 (equal to gemm_gguf_ref bit for bit) or scalar");
  m.def("gemm_gguf_q8", &gemm_gguf_q8,
        "y = x @ W^T (+ bias) on repacked Q8_0/Q4_0/Q4_1/Q4_K blocks with int8 activations per 32-block "
        "(cpu_gemm_gguf.cpp), batch invariant",
        py::arg("x"), py::arg("qs"), py::arg("scales"), py::arg("fmt"), py::arg("N"), py::arg("K"),
        py::arg("bias") = py::none(), py::arg("out_float") = false);
  m.def("gemm_gguf_q8_ref", &gemm_gguf_q8_ref, "the portable scalar loop of gemm_gguf_q8 (tests)", py::arg("x"),
        py::arg("qs"), py::arg("scales"), py::arg("fmt"), py::arg("N"), py::arg("K"), py::arg("bias") = py::none());
  m.def("gemm_gguf_q8_isa", &gemm_gguf_q8_isa,
        "which gemm_gguf_q8 kernel was built: avx512_vnni (equal to gemm_gguf_q8_ref bit for bit) or scalar");
  m.def("gemm_has_bf16_kernel", &gemm_has_bf16_kernel,
        "whether gemm_bf16 was built with AVX512-BF16 (pack weights only then)");
  m.def("gemm_pack_bf16", &gemm_pack_bf16, "pack a [N, K] bf16 weight for gemm_bf16");
  m.def("gemm_bf16", &gemm_bf16, "y = x @ W^T (+ bias) in bf16 on packed W, batch invariant (out_float: the "
        "float32 sums, not rounded to bf16)", py::arg("x"), py::arg("packed"), py::arg("N"), py::arg("K"),
        py::arg("bias") = py::none(), py::arg("out_float") = false);
  m.def("paged_attention", &paged_attention_cpu, "paged attention, one query row at a time (CPU); window > 0: "
        "keys at positions [pos - window + 1, pos] only (sliding window)",
        pybind11::arg("q"), pybind11::arg("key_cache"), pybind11::arg("value_cache"), pybind11::arg("block_tables"),
        pybind11::arg("token_seq"), pybind11::arg("token_pos"), pybind11::arg("scale"), pybind11::arg("window") = 0);
  m.def("rms_norm", &rms_norm_cpu, "RMSNorm with optional fused residual add -> (out, residual)");
  m.def("silu_and_mul", &silu_and_mul_cpu, "SwiGLU activation: silu(x[:, :I]) * x[:, I:]");
  m.def("set_vector_kernels", [](bool on) { g_vector_kernels = on; },
        "use the AVX-512 kernels where built (default) or the portable scalar loops (tests)");
  m.def("set_attention_row_block", [](int64_t n) {
    TORCH_CHECK(n >= 1 && n <= kMaxRowBlock, "attention row block must be in [1, ", kMaxRowBlock, "], got ", n);
    g_row_block = static_cast<int>(n);
  }, "query rows per work item of the tiled attention (A/B only: outputs do not depend on it)");
  m.def("attention_row_block", []() { return g_row_block; }, "query rows per work item of the tiled attention");
  m.def("set_tiled_attention", [](bool on) { g_tiled_attention = on; },
        "bf16 cache: the tiled kernel (default) or the row kernel (tests of the AVX-512 path without AVX512_BF16)");
  m.def("has_tiled_attention", []() {
#if defined(TINYVLLM_AVX512) && defined(__AVX512BF16__)
    return true;
#else
    return false;
#endif
  }, "whether the tiled bf16 attention kernel (AVX512_BF16) was compiled in");
  m.def("bf16_dot_ceiling", [](int64_t iters) {
#if defined(TINYVLLM_AVX512) && defined(__AVX512BF16__)
    return vec_dot_ceiling<false>(iters);
#else
    (void)iters;
    return 0.0;
#endif
  }, "FLOP/s of the tiled attention's bf16 dot-product loop on all threads (0 without AVX512_BF16)");
  m.def("amx_attention_on", []() {
#if defined(TINYVLLM_AVX512) && defined(__AVX512BF16__) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
    return g_amx && amx_enabled();
#else
    return false;
#endif
  }, "whether the tiled attention runs on AMX now (has_amx_attention and not switched off by set_amx_attention "
     "or TINYVLLM_AMX_ATTENTION=0)");
  m.def("has_amx_attention", []() {
#if defined(TINYVLLM_AVX512) && defined(__AVX512BF16__) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
    return amx_enabled();
#else
    return false;
#endif
  }, "whether the tiled attention runs on AMX tiles here (built with AMX-BF16 and the OS grants tile state)");
  m.def("set_amx_attention", [](bool on) {
#if defined(TINYVLLM_AVX512) && defined(__AVX512BF16__) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
    g_amx = on;
#else
    (void)on;
#endif
  }, "tiled attention on AMX where available (default; TINYVLLM_AMX_ATTENTION=0 at load: off) or on the "
     "AVX-512 vector tiles (tests, A/B)");
  m.def("amx_dot_ceiling", [](int64_t iters) {
#if defined(TINYVLLM_AVX512) && defined(__AVX512BF16__) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
    return amx_dot_ceiling<false>(iters);
#else
    (void)iters;
    return 0.0;
#endif
  }, "FLOP/s of the AMX tiled attention's S = Q K^T loop on all threads (0 without AMX)");
  m.def("int8_dot_ceiling", [](int64_t iters) {
#if defined(TINYVLLM_AVX512) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
    return vec_dot_ceiling<true>(iters);
#else
    (void)iters;
    return 0.0;
#endif
  }, "FLOP/s of a VPDPBUSD (AVX512-VNNI) loop shaped like the tiled attention's S = Q K^T, all threads (0 without it)");
  m.def("amx_int8_dot_ceiling", [](int64_t iters) {
#if defined(TINYVLLM_AVX512) && defined(__AVX512BF16__) && defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
    return amx_dot_ceiling<true>(iters);
#else
    (void)iters;
    return 0.0;
#endif
  }, "FLOP/s of a TDPBSSD (AMX-INT8) loop shaped like amx_dot_ceiling's, all threads (0 without AMX-INT8)");
  m.def("has_int8_attention", []() {
#if defined(TINYVLLM_AVX512) && defined(__AVX512BF16__) && defined(TINYVLLM_INT8_QK)
    return true;
#else
    return false;
#endif
  }, "whether the int8 Q K^T attention over an int8 cache (attention_int8.h: VPDPBUSD / AMX-INT8) was compiled in");
  m.def("set_int8_attention", [](bool on, int64_t profile, bool exp3, bool pv8) {
#if defined(TINYVLLM_AVX512) && defined(__AVX512BF16__) && defined(TINYVLLM_INT8_QK)
    g_int8_qk = on;
    g_int8_profile = static_cast<int>(profile);
    g_int8_exp3 = exp3;
    g_int8_pv = pv8;
#else
    (void)on, (void)profile, (void)exp3, (void)pv8;
#endif
  }, "int8 cache, head size 64 / 128: the int8 Q K^T kernel (default) or bf16 tiles (A/B); exp3: its softmax's "
     "degree-3 exp2 (default) or the bf16 kernel's degree-4 one (A/B); pv8: P V in int8 on the vector path "
     "(VPDPBUSD, default; with exp3 only) or bf16 (A/B; AMX always keeps bf16 P V); profile != 0 skips stages for "
     "measurements only (1 Q K^T, 2 softmax, 4 P V, 8 packing: wrong outputs)",
     py::arg("on"), py::arg("profile") = 0, py::arg("exp3") = true, py::arg("pv8") = true);
  m.def("set_prefetch", [](bool on) { g_prefetch = on; }, "attention software prefetch (for measurements)");
  m.def("set_parallel_pool", [](bool on) { return tv_pool::Pool::get().set_enabled(on); },
        "run the kernels' parallel loops on cpu_pool.h's pool (True) or at::parallel_for (False; the default "
        "unless TINYVLLM_CPU_POOL=1); returns the previous setting");
  m.def("parallel_pool_stats", []() { return tv_pool::Pool::get().stats(); },
        "(jobs, jobs run by the caller alone after a late worker, late-worker events) of cpu_pool.h's pool");
  m.def("parallel_pool_cover", [](int64_t begin, int64_t end, int64_t grain, int64_t reps) {
    // Test hook: run tv_pool::parallel_for(begin, end, grain) reps times; return how often each index
    // was visited ([end - begin] int64), whether every range began on begin + a multiple of grain, and
    // whether an exception thrown in one chunk reached the caller.
    auto counts = torch::zeros({std::max<int64_t>(end - begin, 0)}, torch::kInt64);
    std::vector<std::atomic<int64_t>> c(static_cast<size_t>(std::max<int64_t>(end - begin, 0)));
    std::atomic<bool> aligned{true};
    for (int64_t r = 0; r < reps; ++r)
      tv_pool::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
        if ((b - begin) % grain != 0) aligned = false;
        for (int64_t i = b; i < e; ++i) c[i - begin].fetch_add(1, std::memory_order_relaxed);
      });
    bool rethrown = false;
    try {
      tv_pool::parallel_for(begin, end, grain, [&](int64_t b, int64_t) {
        if (b == begin) throw std::runtime_error("chunk failed");
      });
    } catch (const std::runtime_error&) {
      rethrown = true;
    }
    int64_t* cp = counts.data_ptr<int64_t>();
    for (size_t i = 0; i < c.size(); ++i) cp[i] = c[i].load();
    return std::make_tuple(counts, aligned.load(), rethrown);
  }, py::arg("begin"), py::arg("end"), py::arg("grain"), py::arg("reps"));
  m.def("vector_kernels_isa", []() {
#if defined(TINYVLLM_AVX512)
    return std::string("avx512");
#elif defined(TINYVLLM_AVX2)
    return std::string("avx2");
#else
    return std::string("none");
#endif
  }, "which vector paths attention, RMSNorm and SiLU have: avx512, avx2 (AVX2 + FMA, no AVX-512) or none");
  m.def("has_avx512", []() {
#if defined(TINYVLLM_AVX512)
    return true;
#else
    return false;
#endif
  }, "whether the AVX-512 kernels were compiled in");
  m.def("rope_cache_attention", &rope_cache_attention_cpu, "rotary + KV write + paged attention",
        pybind11::arg("qkv"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("positions"),
        pybind11::arg("kv_cache"), pybind11::arg("slot_mapping"), pybind11::arg("block_tables"),
        pybind11::arg("token_seq"), pybind11::arg("Hq"), pybind11::arg("Hk"), pybind11::arg("scale"),
        pybind11::arg("window") = 0);
}
