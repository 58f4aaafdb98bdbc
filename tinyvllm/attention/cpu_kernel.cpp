// Paged attention for the CPU: one query row at a time, reading K/V through the block table.
//
// Every query row (a decode token or one token of a prefill chunk) is computed by the same
// fixed-order loop over its own context positions 0..pos, so its result does not depend on
// the batch, on chunk boundaries, or on whether its prefix came from the prefix cache
// (batch invariance). Two passes over the context: scores (dot products with a fixed
// 16-lane partial-sum order), max, exp / sum / weighted sum of V in position order.
// K/V are read in place from the paged cache (PagedAttention, Kwon et al. SOSP 2023);
// no padded copy is materialised.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr int kLanes = 16;

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

template <typename C>
void attention_impl(const torch::Tensor& q,            // [T, Hq, D] float32
                    const torch::Tensor& key_cache,    // [num_blocks, bs, Hk, D]
                    const torch::Tensor& value_cache,  // [num_blocks, bs, Hk, D]
                    const torch::Tensor& block_tables, // [S, max_blocks] int64
                    const torch::Tensor& token_seq,    // [T] int64
                    const torch::Tensor& token_pos,    // [T] int64
                    double scale, torch::Tensor& out) {  // [T, Hq, D] float32
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
  float* op = out.data_ptr<float>();
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
        float* orow = op + (t * Hq + hk * G + g) * D;
        for (int64_t d = 0; d < D; ++d) orow[d] = a[d] * inv;
      }
    }
  });
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
    attention_impl<c10::BFloat16>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out);
  } else if (key_cache.scalar_type() == torch::kFloat32) {
    attention_impl<float>(q, key_cache, value_cache, block_tables, token_seq, token_pos, scale, out);
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
      float lanes[kLanes] = {0};
      for (int64_t i = 0; i < H; ++i) {
        float v = to_f(xp[t * H + i]);
        if (rp) v = round_to<C>(v + to_f(rp[t * H + i]));  // residual add in the model dtype
        h[i] = v;
        rop[t * H + i] = from_f<C>(v);
      }
      int64_t i = 0;
      for (; i + kLanes <= H; i += kLanes)
        for (int l = 0; l < kLanes; ++l) lanes[l] += h[i + l] * h[i + l];
      for (int l = 0; i + l < H; ++l) lanes[l] += h[i + l] * h[i + l];
      for (int w = kLanes / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
      const float inv = 1.0f / std::sqrt(lanes[0] / static_cast<float>(H) + feps);
      for (int64_t j = 0; j < H; ++j)
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
      for (int64_t i = 0; i < I; ++i) {
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
  auto out = torch::empty({T, Hq, D}, q.options());
  block_tables = block_tables.contiguous();
  if (qkv.scalar_type() == torch::kBFloat16) {
    rope_and_cache_impl<c10::BFloat16>(qkv, cos, sin, positions, key_cache, value_cache, slot_mapping, Hq, Hk, q);
    attention_impl<c10::BFloat16>(q, key_cache, value_cache, block_tables, token_seq, positions, scale, out);
  } else if (qkv.scalar_type() == torch::kFloat32) {
    rope_and_cache_impl<float>(qkv, cos, sin, positions, key_cache, value_cache, slot_mapping, Hq, Hk, q);
    attention_impl<float>(q, key_cache, value_cache, block_tables, token_seq, positions, scale, out);
  } else {
    TORCH_CHECK(false, "unsupported dtype");
  }
  return out.view({T, Hq * D}).to(qkv.scalar_type());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention_cpu, "paged attention, one query row at a time (CPU)");
  m.def("rms_norm", &rms_norm_cpu, "RMSNorm with optional fused residual add -> (out, residual)");
  m.def("silu_and_mul", &silu_and_mul_cpu, "SwiGLU activation: silu(x[:, :I]) * x[:, I:]");
  m.def("rope_cache_attention", &rope_cache_attention_cpu, "rotary + KV write + paged attention");
}
