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
        float sum = 0.0f;
        for (int64_t j = 0; j < ctx; ++j) {
          s[j] = std::exp(s[j] - m);
          sum += s[j];
        }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention_cpu, "paged attention, one query row at a time (CPU)");
}
