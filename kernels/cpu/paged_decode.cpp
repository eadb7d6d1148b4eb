// Paged decode attention on CPU: each single-query sequence reads its keys and
// values straight out of the block-major pool through its block table, with
// no gathered copy of the context. One task per (sequence, KV head); the
// group of query heads that share a KV head is computed together, so each key
// and value row is read once per group, in two passes:
//
//   1. scores[h, t] = q_h . k_t * scale (softcapped) for the group's heads, one key row at a time;
//   2. p = exp(scores - max_h), vectorised with ATen's Vectorized;
//   3. out_h = sum_t p[h, t] v_t / sum_t p[h, t], one value row at a time.
//
//   pool page  | slot 0 | slot 1 | ... | slot bs-1 |   (k_cache[block] : [bs, kv_heads, head_dim])
//   sequence i: keys 0 .. L-1, key t in page block_table[i, t / bs], slot t % bs
//
// Built without -ffast-math: a NaN in a row must reach that row's output,
// where the sampler fails its request.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include "balance.h"
#include "vec_exp.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using pd_cpu::exp_shifted;

// D > 0: the head dim known at compile time (loops fully unrolled); D == 0: n at run time.
template <int64_t D>
inline float dot(const float* a, const float* b, int64_t runtime_n) {
  if constexpr (D > 0 && D % 16 == 0) {
    // One vector of partial sums, then halved in a tree: a reduction loop over the whole row compiles
    // to sixteen scalar adds in a chain at its end, which bounded the kernel.
    float lanes[16] = {};
    for (int64_t d = 0; d < D; d += 16) {
#pragma omp simd
      for (int j = 0; j < 16; ++j) lanes[j] += a[d + j] * b[d + j];
    }
    for (int width = 8; width > 0; width /= 2) {
#pragma omp simd
      for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
    }
    return lanes[0];
  }
  const int64_t n = D > 0 ? D : runtime_n;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

template <int64_t D>
inline void axpy(float w, const float* x, float* y, int64_t runtime_n) {
  const int64_t n = D > 0 ? D : runtime_n;
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) y[d] += w * x[d];
}

// NaN-propagating max: a NaN score makes the row NaN, as in the reference.
inline float nan_max(const float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int64_t t = 0; t < n; ++t) {
    nan |= std::isnan(s[t]);
    m = std::max(m, s[t]);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

// A row of the page a loop reads next, requested while it reads this one (one row per row read): a
// page is a jump to another block, where the hardware prefetcher (which stops at 4 KiB boundaries)
// starts cold, so each page began with a stall.
inline void prefetch_row(const float* row, int64_t row_len) {
  constexpr int64_t kLine = 64 / sizeof(float);
  for (int64_t d = 0; d < row_len; d += kLine) __builtin_prefetch(row + d);
}

struct DecodeArgs {
  const float *q, *k, *v;
  float* out;
  const int32_t *table, *lens;
  const int64_t* rows;
  int64_t head_dim, block_size, num_kv_heads, group, window;
  int64_t qs0, qs1, os0, os1, ks0, ks1, ks2, vs0, vs1, vs2, table_stride;
  float scale, cap;
};

// acc[h * hd + d] += sum over visible keys t of p[h, t] * v_t[d].
template <int64_t D, int64_t G>
inline void weighted_values(const DecodeArgs& a, const int32_t* pages, int64_t g, int64_t first, int64_t len,
                            int64_t n, const float* p, float* acc) {
  const int64_t hd = D > 0 ? D : a.head_dim, bs = a.block_size, group = G > 0 ? G : a.group;
  for (int64_t page = first / bs; page * bs < len; ++page) {
    const int64_t t0 = std::max(page * bs, first), t1 = std::min((page + 1) * bs, len);
    const float* next = (page + 1) * bs < len ? a.v + pages[page + 1] * a.vs0 + g * a.vs2 : nullptr;
    const float* v = a.v + pages[page] * a.vs0 + g * a.vs2 + (t0 - page * bs) * a.vs1;
    for (int64_t t = t0; t < t1; ++t, v += a.vs1) {
      if (next != nullptr) prefetch_row(next + (t - page * bs) * a.vs1, hd);
      for (int64_t h = 0; h < group; ++h) axpy<D>(p[h * n + (t - first)], v, acc + h * hd, hd);
    }
  }
}

// One (sequence i, KV head g) task; scores, acc and inv are this thread's scratch.
// G > 0: the GQA group size known at compile time, so the group's accumulators
// can stay in registers across the value rows; G == 0: a.group at run time.
template <int64_t D, int64_t G>
void decode_task(const DecodeArgs& a, int64_t i, int64_t g, float* scores, float* acc, float* inv) {
  const int64_t len = a.lens[i], row = a.rows[i], hd = D > 0 ? D : a.head_dim, bs = a.block_size;
  const int64_t group = G > 0 ? G : a.group;
  const int64_t first = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0, n = len - first;
  const float* qg = a.q + row * a.qs0 + g * group * a.qs1;
  const int32_t* pages = a.table + i * a.table_stride;
  // Pass 1: scores[h * n + (t - first)] for every visible key t.
  for (int64_t page = first / bs; page * bs < len; ++page) {
    const int64_t t0 = std::max(page * bs, first), t1 = std::min((page + 1) * bs, len);
    // This page's value rows are requested too: pass 3 then finds them in cache (a task's keys and
    // values, 2 x 300 x 64 floats at a 300-token context, stay well within L2).
    const float* next = (page + 1) * bs < len ? a.k + pages[page + 1] * a.ks0 + g * a.ks2 : nullptr;
    const float* k = a.k + pages[page] * a.ks0 + g * a.ks2 + (t0 - page * bs) * a.ks1;
    const float* v = a.v + pages[page] * a.vs0 + g * a.vs2 + (t0 - page * bs) * a.vs1;
    for (int64_t t = t0; t < t1; ++t, k += a.ks1, v += a.vs1) {
      if (next != nullptr) prefetch_row(next + (t - page * bs) * a.ks1, hd);
      prefetch_row(v, hd);
      for (int64_t h = 0; h < group; ++h) scores[h * n + (t - first)] = dot<D>(qg + h * a.qs1, k, hd) * a.scale;
    }
  }
  if (a.cap > 0.f) {
    for (int64_t j = 0; j < group * n; ++j) scores[j] = a.cap * std::tanh(scores[j] / a.cap);
  }
  // Pass 2: softmax weights, unnormalised.
  for (int64_t h = 0; h < group; ++h) {
    float* sh = scores + h * n;
    inv[h] = 1.f / exp_shifted(sh, n, nan_max(sh, n));
  }
  // Pass 3: the weighted sum of values, in a local array when its size is known (registers, not memory).
  if constexpr (G > 0 && D > 0) {
    float local[G * D] = {};
    weighted_values<D, G>(a, pages, g, first, len, n, scores, local);
    std::copy(local, local + G * D, acc);
  } else {
    std::fill(acc, acc + group * hd, 0.f);
    weighted_values<D, G>(a, pages, g, first, len, n, scores, acc);
  }
  for (int64_t h = 0; h < group; ++h) {
    float* oh = a.out + row * a.os0 + (g * group + h) * a.os1;
    const float* acc_h = acc + h * hd;
#pragma omp simd
    for (int64_t d = 0; d < hd; ++d) oh[d] = acc_h[d] * inv[h];
  }
}

template <int64_t D, int64_t G>
void decode_all(const DecodeArgs& a, int64_t num_decodes, int64_t max_len) {
  // A task's cost: the keys it reads (contexts differ by 10-100x in a mixed batch).
  std::vector<int64_t> costs(num_decodes * a.num_kv_heads);
  for (int64_t task = 0; task < static_cast<int64_t>(costs.size()); ++task) {
    const int64_t len = a.lens[task / a.num_kv_heads];
    costs[task] = a.window > 0 ? std::min<int64_t>(len, a.window) : len;
  }
  pd_cpu::parallel_balanced(costs, [&](const std::vector<int64_t>& share) {
    std::vector<float> scores(a.group * max_len), acc(a.group * a.head_dim), inv(a.group);
    for (int64_t task : share) {
      decode_task<D, G>(a, task / a.num_kv_heads, task % a.num_kv_heads, scores.data(), acc.data(), inv.data());
    }
  });
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
  const int64_t num_decodes = token_rows.size(0), head_dim = q.size(2);
  DecodeArgs a{
      q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), out.data_ptr<float>(),
      block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), token_rows.data_ptr<int64_t>(),
      head_dim, k_cache.size(1), k_cache.size(2), q.size(1) / k_cache.size(2), window,
      q.stride(0), q.stride(1), out.stride(0), out.stride(1),
      k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
      block_table.stride(0), static_cast<float>(scale), static_cast<float>(softcap),
  };
  int64_t max_len = 0;
  for (int64_t i = 0; i < num_decodes; ++i) max_len = std::max<int64_t>(max_len, a.lens[i]);
  // The common shapes (head dim 64 or 128, GQA group 4, 7 or 8; the built-in model's 32 x 4) get their own instances.
  const int64_t group = a.group;
  if (head_dim == 32 && group == 4) return decode_all<32, 4>(a, num_decodes, max_len);
  if (head_dim == 64 && group == 4) return decode_all<64, 4>(a, num_decodes, max_len);
  if (head_dim == 64 && group == 7) return decode_all<64, 7>(a, num_decodes, max_len);
  if (head_dim == 64 && group == 8) return decode_all<64, 8>(a, num_decodes, max_len);
  if (head_dim == 128 && group == 4) return decode_all<128, 4>(a, num_decodes, max_len);
  if (head_dim == 128 && group == 7) return decode_all<128, 7>(a, num_decodes, max_len);
  if (head_dim == 128 && group == 8) return decode_all<128, 8>(a, num_decodes, max_len);
  if (head_dim == 64) return decode_all<64, 0>(a, num_decodes, max_len);
  if (head_dim == 128) return decode_all<128, 0>(a, num_decodes, max_len);
  return decode_all<0, 0>(a, num_decodes, max_len);
}
