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
// Pages of fp32, bf16 or FP8 (kv_fp8.h): a row of another type is read into fp32 first (head_dim
// floats in L1), and the scales are folded in: k_scale into the softmax scale, v_scale into the
// output's normaliser. Built without -ffast-math: a NaN in a row must reach that row's output,
// where the sampler fails its request.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include "balance.h"
#include "kv_fp8.h"
#include "vec_exp.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using pd_cpu::exp_shifted;

// Head dims beyond this are not served (pd_kernels.checks.MAX_HEAD_DIM): a converted row's buffer.
constexpr int64_t kMaxHeadDim = 256;

// The row of T at src as floats: src itself for fp32, else converted into buf.
template <typename T, int64_t D>
inline const float* row_floats(const T* src, float* buf, int64_t runtime_n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    pd_cpu::load_row<T>(src, buf, D > 0 ? D : runtime_n);
    return buf;
  }
}

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
template <typename T>
inline void prefetch_row(const T* row, int64_t row_len) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t d = 0; d < row_len; d += kLine) __builtin_prefetch(row + d);
}

template <typename T>
struct DecodeArgs {
  const float* q;
  const T *k, *v;
  float* out;
  const int32_t *table, *lens;
  const int64_t* rows;
  int64_t head_dim, block_size, num_kv_heads, group, window;
  int64_t qs0, qs1, os0, os1, ks0, ks1, ks2, vs0, vs1, vs2, table_stride;
  float scale, cap, value_scale;  // scale: the softmax scale times k_scale
};

// acc[h * hd + d] += sum over visible keys t of p[h, t] * v_t[d].
template <typename T, int64_t D, int64_t G>
inline void weighted_values(const DecodeArgs<T>& a, const int32_t* pages, int64_t g, int64_t first, int64_t len,
                            int64_t n, const float* p, float* acc) {
  const int64_t hd = D > 0 ? D : a.head_dim, bs = a.block_size, group = G > 0 ? G : a.group;
  alignas(64) float buf[kMaxHeadDim];
  for (int64_t page = first / bs; page * bs < len; ++page) {
    const int64_t t0 = std::max(page * bs, first), t1 = std::min((page + 1) * bs, len);
    const T* next = (page + 1) * bs < len ? a.v + pages[page + 1] * a.vs0 + g * a.vs2 : nullptr;
    const T* v = a.v + pages[page] * a.vs0 + g * a.vs2 + (t0 - page * bs) * a.vs1;
    for (int64_t t = t0; t < t1; ++t, v += a.vs1) {
      if (next != nullptr) prefetch_row(next + (t - page * bs) * a.vs1, hd);
      const float* row = row_floats<T, D>(v, buf, hd);
      for (int64_t h = 0; h < group; ++h) axpy<D>(p[h * n + (t - first)], row, acc + h * hd, hd);
    }
  }
}

// One (sequence i, KV head g) task; scores, acc and inv are this thread's scratch.
// G > 0: the GQA group size known at compile time, so the group's accumulators
// can stay in registers across the value rows; G == 0: a.group at run time.
template <typename T, int64_t D, int64_t G>
void decode_task(const DecodeArgs<T>& a, int64_t i, int64_t g, float* scores, float* acc, float* inv) {
  const int64_t len = a.lens[i], row = a.rows[i], hd = D > 0 ? D : a.head_dim, bs = a.block_size;
  const int64_t group = G > 0 ? G : a.group;
  const int64_t first = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0, n = len - first;
  const float* qg = a.q + row * a.qs0 + g * group * a.qs1;
  const int32_t* pages = a.table + i * a.table_stride;
  alignas(64) float buf[kMaxHeadDim];
  // Pass 1: scores[h * n + (t - first)] for every visible key t.
  for (int64_t page = first / bs; page * bs < len; ++page) {
    const int64_t t0 = std::max(page * bs, first), t1 = std::min((page + 1) * bs, len);
    // This page's value rows are requested too: pass 3 then finds them in cache (a task's keys and
    // values, 2 x 300 x 64 floats at a 300-token context, stay well within L2).
    const T* next = (page + 1) * bs < len ? a.k + pages[page + 1] * a.ks0 + g * a.ks2 : nullptr;
    const T* k = a.k + pages[page] * a.ks0 + g * a.ks2 + (t0 - page * bs) * a.ks1;
    const T* v = a.v + pages[page] * a.vs0 + g * a.vs2 + (t0 - page * bs) * a.vs1;
    for (int64_t t = t0; t < t1; ++t, k += a.ks1, v += a.vs1) {
      if (next != nullptr) prefetch_row(next + (t - page * bs) * a.ks1, hd);
      prefetch_row(v, hd);
      const float* key = row_floats<T, D>(k, buf, hd);
      for (int64_t h = 0; h < group; ++h) scores[h * n + (t - first)] = dot<D>(qg + h * a.qs1, key, hd) * a.scale;
    }
  }
  if (a.cap > 0.f) {
    for (int64_t j = 0; j < group * n; ++j) scores[j] = a.cap * std::tanh(scores[j] / a.cap);
  }
  // Pass 2: softmax weights, unnormalised.
  for (int64_t h = 0; h < group; ++h) {
    float* sh = scores + h * n;
    inv[h] = a.value_scale / exp_shifted(sh, n, nan_max(sh, n));
  }
  // Pass 3: the weighted sum of values, in a local array when its size is known (registers, not memory).
  if constexpr (G > 0 && D > 0) {
    float local[G * D] = {};
    weighted_values<T, D, G>(a, pages, g, first, len, n, scores, local);
    std::copy(local, local + G * D, acc);
  } else {
    std::fill(acc, acc + group * hd, 0.f);
    weighted_values<T, D, G>(a, pages, g, first, len, n, scores, acc);
  }
  for (int64_t h = 0; h < group; ++h) {
    float* oh = a.out + row * a.os0 + (g * group + h) * a.os1;
    const float* acc_h = acc + h * hd;
#pragma omp simd
    for (int64_t d = 0; d < hd; ++d) oh[d] = acc_h[d] * inv[h];
  }
}

template <typename T, int64_t D, int64_t G>
void decode_all(const DecodeArgs<T>& a, int64_t num_decodes, int64_t max_len) {
  // A task's cost: the keys it reads (contexts differ by 10-100x in a mixed batch).
  std::vector<int64_t> costs(num_decodes * a.num_kv_heads);
  for (int64_t task = 0; task < static_cast<int64_t>(costs.size()); ++task) {
    const int64_t len = a.lens[task / a.num_kv_heads];
    costs[task] = a.window > 0 ? std::min<int64_t>(len, a.window) : len;
  }
  pd_cpu::parallel_balanced(costs, [&](const std::vector<int64_t>& share) {
    std::vector<float> scores(a.group * max_len), acc(a.group * a.head_dim), inv(a.group);
    for (int64_t task : share) {
      decode_task<T, D, G>(a, task / a.num_kv_heads, task % a.num_kv_heads, scores.data(), acc.data(), inv.data());
    }
  });
}

template <typename T>
void decode_typed(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const torch::Tensor& block_table, const torch::Tensor& seq_lens, const torch::Tensor& token_rows,
                  float scale, int64_t window, float softcap, float value_scale, torch::Tensor& out) {
  const int64_t num_decodes = token_rows.size(0), head_dim = q.size(2);
  DecodeArgs<T> a{
      q.data_ptr<float>(), static_cast<const T*>(k_cache.data_ptr()), static_cast<const T*>(v_cache.data_ptr()),
      out.data_ptr<float>(), block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
      token_rows.data_ptr<int64_t>(), head_dim, k_cache.size(1), k_cache.size(2), q.size(1) / k_cache.size(2), window,
      q.stride(0), q.stride(1), out.stride(0), out.stride(1),
      k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
      block_table.stride(0), scale * pd_cpu::kRowFactor<T>, softcap, value_scale * pd_cpu::kRowFactor<T>,
  };
  int64_t max_len = 0;
  for (int64_t i = 0; i < num_decodes; ++i) max_len = std::max<int64_t>(max_len, a.lens[i]);
  // The common shapes (head dim 64 or 128, GQA group 4, 7 or 8; the built-in model's 32 x 4) get their own instances.
  const int64_t group = a.group;
  if (head_dim == 32 && group == 4) return decode_all<T, 32, 4>(a, num_decodes, max_len);
  if (head_dim == 64 && group == 4) return decode_all<T, 64, 4>(a, num_decodes, max_len);
  if (head_dim == 64 && group == 3) return decode_all<T, 64, 3>(a, num_decodes, max_len);
  if (head_dim == 64 && group == 7) return decode_all<T, 64, 7>(a, num_decodes, max_len);
  if (head_dim == 64 && group == 8) return decode_all<T, 64, 8>(a, num_decodes, max_len);
  if (head_dim == 128 && group == 4) return decode_all<T, 128, 4>(a, num_decodes, max_len);
  if (head_dim == 128 && group == 7) return decode_all<T, 128, 7>(a, num_decodes, max_len);
  if (head_dim == 128 && group == 8) return decode_all<T, 128, 8>(a, num_decodes, max_len);
  if (head_dim == 64) return decode_all<T, 64, 0>(a, num_decodes, max_len);
  if (head_dim == 128) return decode_all<T, 128, 0>(a, num_decodes, max_len);
  return decode_all<T, 0, 0>(a, num_decodes, max_len);
}

}  // namespace

// q, out: [num_tokens, heads, head_dim] fp32 (head_dim contiguous).
// k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim] views (head_dim contiguous) of fp32,
// bf16, float8_e4m3fn or float8_e5m2, read as float(stored) * k_scale (v_scale for values).
// block_table: int32 [num_decodes, >= pages]; seq_lens: int32 [num_decodes]; token_rows: int64 [num_decodes].
// window <= 0: no sliding window; softcap <= 0: no softcap.
void paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                            const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                            const torch::Tensor& token_rows, double scale, int64_t window, double softcap,
                            double k_scale, double v_scale, torch::Tensor& out) {
  TORCH_CHECK(q.size(2) <= kMaxHeadDim, "head_dim ", q.size(2), " is over ", kMaxHeadDim);
  const float s = static_cast<float>(scale * k_scale), cap = static_cast<float>(softcap);
  const float vs = static_cast<float>(v_scale);
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      return decode_typed<float>(q, k_cache, v_cache, block_table, seq_lens, token_rows, s, window, cap, vs, out);
    case at::kBFloat16:
      return decode_typed<pd_cpu::Bf16>(q, k_cache, v_cache, block_table, seq_lens, token_rows, s, window, cap, vs, out);
    case at::kFloat8_e4m3fn:
      return decode_typed<pd_cpu::E4m3>(q, k_cache, v_cache, block_table, seq_lens, token_rows, s, window, cap, vs, out);
    case at::kFloat8_e5m2:
      return decode_typed<pd_cpu::E5m2>(q, k_cache, v_cache, block_table, seq_lens, token_rows, s, window, cap, vs, out);
    default:
      TORCH_CHECK(false, "paged_decode_attention: pages of ", k_cache.scalar_type(), " are not read here");
  }
}
