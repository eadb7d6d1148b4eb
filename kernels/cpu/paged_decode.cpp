// Paged decode attention on CPU: each single-query sequence reads its keys and
// values straight out of the block-major pool through its block table, with
// no gathered copy of the context. One task per (sequence, KV head); the
// group of query heads that share a KV head walk the same pages, so each page
// is read once per group. Softmax is online (running max and sum), in fp32.
//
//   pool page  | slot 0 | slot 1 | ... | slot bs-1 |   (k_cache[block] : [bs, kv_heads, head_dim])
//   sequence i: keys 0 .. L-1, key t in page block_table[i, t / bs], slot t % bs
//
// No -ffast-math: a NaN in a row must reach that row's output, where the
// sampler fails its request; reductions are vectorised with `omp simd` instead.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

inline void axpy(float w, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) y[d] += w * x[d];
}

inline void scale_in_place(float c, float* y, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) y[d] *= c;
}

}  // namespace

// q, out: [num_tokens, heads, head_dim] fp32 (head_dim contiguous).
// k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim] fp32 views (head_dim contiguous).
// block_table: int32 [num_decodes, >= pages]; seq_lens: int32 [num_decodes]; token_rows: int64 [num_decodes].
// window <= 0: no sliding window; softcap <= 0: no softcap.
void paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                            const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                            const torch::Tensor& token_rows, double scale, int64_t window, double softcap,
                            torch::Tensor& out) {
  const int64_t num_decodes = token_rows.size(0);
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* rows = token_rows.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const int64_t table_stride = block_table.stride(0);
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, num_decodes * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(group * head_dim), run_max(group), run_sum(group), scores(block_size);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / num_kv_heads, g = task % num_kv_heads;
      const int64_t len = lens[i], row = rows[i];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(run_max.begin(), run_max.end(), neg_inf);
      std::fill(run_sum.begin(), run_sum.end(), 0.f);
      for (int64_t page = first / block_size; page * block_size < len; ++page) {
        const int64_t block = table[i * table_stride + page];
        const int64_t t0 = std::max(page * block_size, first), t1 = std::min((page + 1) * block_size, len);
        const float* kpage = kp + block * ks0 + g * ks2;
        const float* vpage = vp + block * vs0 + g * vs2;
        for (int64_t h = 0; h < group; ++h) {
          const float* qh = qp + row * qs0 + (g * group + h) * qs1;
          float page_max = neg_inf;
          for (int64_t t = t0; t < t1; ++t) {
            float s = dot(qh, kpage + (t - page * block_size) * ks1, head_dim) * fscale;
            if (fcap > 0.f) s = fcap * std::tanh(s / fcap);
            scores[t - t0] = s;
            // NaN-propagating max: a NaN score makes the row NaN, as in the reference.
            page_max = (s > page_max || std::isnan(s)) ? s : page_max;
          }
          const float new_max = (page_max > run_max[h] || std::isnan(page_max)) ? page_max : run_max[h];
          float* acc_h = acc.data() + h * head_dim;
          if (run_max[h] != neg_inf) {
            const float correction = std::exp(run_max[h] - new_max);
            run_sum[h] *= correction;
            scale_in_place(correction, acc_h, head_dim);
          }
          for (int64_t t = t0; t < t1; ++t) {
            const float w = std::exp(scores[t - t0] - new_max);
            run_sum[h] += w;
            axpy(w, vpage + (t - page * block_size) * vs1, acc_h, head_dim);
          }
          run_max[h] = new_max;
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        float* oh = op + row * os0 + (g * group + h) * os1;
        const float inv = 1.f / run_sum[h];
        const float* acc_h = acc.data() + h * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) oh[d] = acc_h[d] * inv;
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention over a block-major pool (fp32)");
}
