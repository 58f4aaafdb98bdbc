// Sampling-side CPU kernels (bound by the pybind module in cpu_kernel.cpp; no PYBIND11_MODULE here).
//
//   // logits: [B, V] float32, row stride V (contiguous); bitmask: [R, W] int32 contiguous, bit t % 32
//   // of word t / 32 set = token t allowed (xgrammar's layout); rows: [R] int64, the logits row each
//   // bitmask row applies to. Sets logits[rows[r], t] = -inf for every forbidden t (and for every
//   // t >= 32 W), in place; other rows and allowed tokens are left bit for bit unchanged.
//   void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows);
//
// The AVX-512 path turns each 16 bits of the mask into a k-mask and writes -inf with one masked
// store per 16 logits (about 3 MB written at [16, 49152], a fraction of a millisecond), against a
// per-token loop in the portable path. No parallel region: the step's torch threads are not woken.
#include <torch/extension.h>
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous(),
              "apply_token_bitmask: logits must be a contiguous [B, V] float32 tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous(),
              "apply_token_bitmask: bitmask must be a contiguous [R, W] int32 tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt64 && rows.size(0) == bitmask.size(0),
              "apply_token_bitmask: rows must be [R] int64, one per bitmask row");
  const int64_t B = logits.size(0), V = logits.size(1), R = bitmask.size(0), W = bitmask.size(1);
  const int64_t covered = std::min<int64_t>(V, 32 * W);  // tokens the mask speaks for; the rest are forbidden
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t b = row_of[r];
    TORCH_CHECK(b >= 0 && b < B, "apply_token_bitmask: row index out of range");
    float* out = logits.data_ptr<float>() + b * V;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>()) + r * W;
    int64_t t = 0;
#if defined(__AVX512F__)
    const __m512 vninf = _mm512_set1_ps(ninf);
    for (; t + 16 <= covered; t += 16) {
      const uint32_t w = words[t >> 5];
      const __mmask16 allowed = static_cast<__mmask16>((t & 16) ? (w >> 16) : (w & 0xFFFFu));
      _mm512_mask_storeu_ps(out + t, static_cast<__mmask16>(~allowed), vninf);
    }
#endif
    for (; t < covered; ++t)
      if (!((words[t >> 5] >> (t & 31)) & 1u)) out[t] = ninf;
    for (; t < V; ++t) out[t] = ninf;
  }
}
