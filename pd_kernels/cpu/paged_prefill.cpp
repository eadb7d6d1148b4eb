// Paged prefill attention on CPU: each chunk of queries reads its context's keys and values out of
// the block-major pool through its block table, with flash attention's online softmax. One task per
// (sequence, KV head, tile of queries); the tile's rows are its queries times the query heads that
// share the KV head, so the keys and values are read once for all of them.
//
//   keys kb .. kb+127 of the pages -> KT [hd, 128] (transposed) and VB [128, hd], once per task and block
//   S[r, :] = q_r . KT                          (4 rows x 64 keys of accumulators at a time)
//   m' = max(m, max S[r, :]); p = exp(S - m'); l = l * exp(m - m') + sum p; O_r = O_r * exp(m - m') + p VB
//
// Blocks past a tile's last query are skipped; a key past it is never read. Tasks are shared out
// over the threads by their cost (balance.h). Measured against the reference's gather + SDPA (AMD
// EPYC, 2 threads, 8 heads over 2 KV heads, one sequence): head dim 32 1.4-1.9x at 64-488 queries,
// 1.1-1.3x at 811-1,024, 0.9-1.1x at 2,048; head dims 64 and 128 1.1-1.5x to 488, 1.0-1.1x at
// 811-1,024, 0.9x at 2,048 (pd_kernels.cpu.MAX_PAGED_PREFILL_KEYS sends longer contexts to SDPA).
// Pages of fp32, bf16 or FP8 (kv_fp8.h) are read into the fp32 blocks KT and VB; k_scale is folded
// into the softmax scale and v_scale into the output's normaliser.
// Built without -ffast-math: a NaN score reaches its row's output.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include "balance.h"
#include "kv_fp8.h"
#include "vec_exp.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using pd_cpu::exp_shifted;

// Query rows (queries x group heads) per task: each task gathers and transposes its keys once, so
// longer tiles gather less (256 against 128: 0-15% faster from 811 keys, the same at 488).
constexpr int64_t kTileRows = 256;

template <typename T>
struct PrefillArgs {
  const float* q;
  const T *k, *v;
  float* out;
  const int32_t* table;
  int64_t head_dim, block_size, num_kv_heads, group, window;
  int64_t qs0, qs1, os0, os1, ks0, ks1, ks2, vs0, vs1, vs2, table_stride;
  float scale, cap, value_scale;  // scale: the softmax scale times k_scale
};

struct Task {
  int64_t seq, kv_head, first_query, num_queries;  // queries: rows of q, first_query .. + num_queries
  int64_t context_len;  // the keys the tile's last query sees: its position + 1
};

// Keys per step of the recurrence: pages are gathered in blocks of this many keys, so the per-row
// work of the softmax (max, exponentials, rescaling) is paid once per KB keys, not once per page.
constexpr int64_t KB = 128;

// O[r, :] += sum over t < kn of P[r, t] V[t, :] for four rows (P's rows KB apart, O's D apart).
// The accumulators are explicit vectors, unrolled at compile time, so they stay in registers: as
// float arrays with a simd loop, gcc kept them on the stack and every multiply-add waited on a store.
// Rows go in pairs, or one at a time, where four rows' accumulators would take more than half the
// vector registers (32 with AVX-512, 16 with AVX2).
template <int64_t D>
inline void weighted_values_4(const float* p, const float* vb, int64_t kn, float* o) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t W = Vec::size(), NV = D / W, budget = W >= 16 ? 16 : 8;
  constexpr int64_t R = NV * 4 <= budget ? 4 : NV * 2 <= budget ? 2 : 1;
  for (int64_t r0 = 0; r0 < 4; r0 += R) {
    Vec acc[R][NV];
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t j = 0; j < NV; ++j) acc[r][j] = Vec::loadu(o + (r0 + r) * D + j * W);
    }
    for (int64_t t = 0; t < kn; ++t) {
      const float* vrow = vb + t * D;
      Vec w[R];
      for (int64_t r = 0; r < R; ++r) w[r] = Vec(p[(r0 + r) * KB + t]);
      for (int64_t j = 0; j < NV; ++j) {
        const Vec v = Vec::loadu(vrow + j * W);
        for (int64_t r = 0; r < R; ++r) acc[r][j] = at::vec::fmadd(w[r], v, acc[r][j]);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t j = 0; j < NV; ++j) acc[r][j].store(o + (r0 + r) * D + j * W);
    }
  }
}

// D > 0: the head dim known at compile time.
template <typename T, int64_t D>
void prefill_task(const PrefillArgs<T>& a, const Task& task) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t hd = D > 0 ? D : a.head_dim, bs = a.block_size, group = a.group, g = task.kv_head;
  const int64_t rows = task.num_queries * group;
  const int64_t padded_rows = (rows + 3) / 4 * 4;
  // o: the rows' outputs; kt: the block's keys transposed [hd, KB]; vb: its values [KB, hd]; s: scores [rows, KB].
  std::vector<float> o(padded_rows * hd, 0.f), kt(hd * KB), vb(KB * hd), s(padded_rows * KB), key_row(hd);
  std::vector<float> m(rows, kNegInf), l(rows, 0.f);
  std::vector<const float*> qr(padded_rows);
  for (int64_t row = 0; row < padded_rows; ++row) {
    const int64_t r = std::min(row, rows - 1);  // padding rows repeat the last: computed, never stored
    qr[row] = a.q + (task.first_query + r / group) * a.qs0 + (g * group + r % group) * a.qs1;
  }
  // The tile's queries are the positions just before context_len.
  const int64_t first_pos = task.context_len - task.num_queries, last_pos = task.context_len - 1;
  const int64_t lowest = a.window > 0 ? std::max<int64_t>(0, first_pos - a.window + 1) : 0;
  const int32_t* pages = a.table + task.seq * a.table_stride;
  for (int64_t kb = lowest / KB * KB; kb <= last_pos; kb += KB) {
    const int64_t kn = std::min(KB, last_pos + 1 - kb);  // keys read: kb .. kb + kn - 1, never past the last query
    for (int64_t t = 0; t < kn; ++t) {
      const int64_t key = kb + t, page = pages[key / bs], slot = key % bs;
      const T* krow = a.k + page * a.ks0 + g * a.ks2 + slot * a.ks1;
      const T* vrow = a.v + page * a.vs0 + g * a.vs2 + slot * a.vs1;
      pd_cpu::load_row<T>(krow, key_row.data(), hd);
      for (int64_t d = 0; d < hd; ++d) kt[d * KB + t] = key_row[d];
      pd_cpu::load_row<T>(vrow, vb.data() + t * hd, hd);
    }
    for (int64_t t = kn; t < KB; ++t) {
      for (int64_t d = 0; d < hd; ++d) kt[d * KB + t] = 0.f;
      std::fill(vb.data() + t * hd, vb.data() + (t + 1) * hd, 0.f);
    }
    // Scores: four rows by 64 keys at a time, each KT row loaded once for the four.
    for (int64_t r0 = 0; r0 < padded_rows; r0 += 4) {
      for (int64_t c = 0; c < KB; c += 64) {
        float acc0[64] = {}, acc1[64] = {}, acc2[64] = {}, acc3[64] = {};
        for (int64_t d = 0; d < hd; ++d) {
          const float* ktd = kt.data() + d * KB + c;
          const float q0 = qr[r0][d], q1 = qr[r0 + 1][d], q2 = qr[r0 + 2][d], q3 = qr[r0 + 3][d];
#pragma omp simd
          for (int64_t t = 0; t < 64; ++t) {
            const float kv = ktd[t];
            acc0[t] += q0 * kv;
            acc1[t] += q1 * kv;
            acc2[t] += q2 * kv;
            acc3[t] += q3 * kv;
          }
        }
        float* s0 = s.data() + r0 * KB + c;
#pragma omp simd
        for (int64_t t = 0; t < 64; ++t) {
          s0[t] = acc0[t] * a.scale;
          s0[KB + t] = acc1[t] * a.scale;
          s0[2 * KB + t] = acc2[t] * a.scale;
          s0[3 * KB + t] = acc3[t] * a.scale;
        }
      }
    }
    // The softmax's recurrence, row by row; a row's weights stay in s (0 where it may not look).
    for (int64_t row = 0; row < padded_rows; ++row) {
      float* sr = s.data() + row * KB;
      float* orow = o.data() + row * hd;
      if (row >= rows) {
        std::fill(sr, sr + KB, 0.f);
        continue;
      }
      const int64_t p = first_pos + row / group;
      const int64_t hi = std::min(kn, p - kb + 1);  // keys t < hi are not in the future
      const int64_t lo = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1 - kb) : 0;
      if (hi <= lo) {
        std::fill(sr, sr + KB, 0.f);
        continue;
      }
      if (a.cap > 0.f) {
        for (int64_t t = lo; t < hi; ++t) sr[t] = a.cap * std::tanh(sr[t] / a.cap);
      }
      float block_max = kNegInf;
      int nan = 0;
#pragma omp simd reduction(max : block_max) reduction(| : nan)
      for (int64_t t = lo; t < hi; ++t) {
        nan |= sr[t] != sr[t];
        block_max = sr[t] > block_max ? sr[t] : block_max;
      }
      const float m_old = m[row];
      const float m_new = nan || std::isnan(m_old) ? std::numeric_limits<float>::quiet_NaN() : std::max(m_old, block_max);
      for (int64_t t = 0; t < lo; ++t) sr[t] = kNegInf;
      for (int64_t t = hi; t < KB; ++t) sr[t] = kNegInf;
      const float sum = exp_shifted(sr, KB, m_new);
      if (m_old == kNegInf) {  // the first keys this row sees
        l[row] = sum;
        std::fill(orow, orow + hd, 0.f);
      } else {
        const float alpha = std::exp(m_old - m_new);
        l[row] = l[row] * alpha + sum;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) orow[d] *= alpha;
      }
      m[row] = m_new;
    }
    // O += P V: four rows at a time, each value row loaded once for the four.
    for (int64_t r0 = 0; r0 < padded_rows; r0 += 4) {
      float* o0 = o.data() + r0 * hd;
      const float* p0 = s.data() + r0 * KB;
      if constexpr (D > 0 && D % at::vec::Vectorized<float>::size() == 0) {
        weighted_values_4<D>(p0, vb.data(), kn, o0);
      } else {
        for (int64_t r = 0; r < 4; ++r) {
          float* orow = o0 + r * hd;
          const float* pr = p0 + r * KB;
          for (int64_t t = 0; t < kn; ++t) {
            const float w = pr[t];
            const float* vrow = vb.data() + t * hd;
#pragma omp simd
            for (int64_t d = 0; d < hd; ++d) orow[d] += w * vrow[d];
          }
        }
      }
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    float* dst = a.out + (task.first_query + row / group) * a.os0 + (g * group + row % group) * a.os1;
    const float inv = a.value_scale / l[row];
    const float* orow = o.data() + row * hd;
#pragma omp simd
    for (int64_t d = 0; d < hd; ++d) dst[d] = orow[d] * inv;
  }
}

template <typename T>
void prefill_typed(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& block_table, const std::vector<int64_t>& query_starts,
                   const std::vector<int64_t>& seq_lens, const std::vector<int64_t>& seqs, float scale,
                   int64_t window, float softcap, float value_scale, torch::Tensor& out) {
  PrefillArgs<T> a{
      q.data_ptr<float>(), static_cast<const T*>(k_cache.data_ptr()), static_cast<const T*>(v_cache.data_ptr()),
      out.data_ptr<float>(), block_table.data_ptr<int32_t>(), q.size(2), k_cache.size(1), k_cache.size(2),
      q.size(1) / k_cache.size(2), window, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
      k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
      block_table.stride(0), scale * pd_cpu::kRowFactor<T>, softcap, value_scale * pd_cpu::kRowFactor<T>,
  };
  const int64_t tile = std::max<int64_t>(1, kTileRows / a.group);
  std::vector<Task> tasks;
  for (int64_t i : seqs) {
    const int64_t start = query_starts[i], end = query_starts[i + 1], len = seq_lens[i];
    for (int64_t first = start; first < end; first += tile) {
      const int64_t n = std::min(tile, end - first);
      for (int64_t g = 0; g < a.num_kv_heads; ++g) {
        // The tile's queries are positions len - (end - first) .. len - (end - first) + n - 1.
        tasks.push_back(Task{i, g, first, n, len - (end - first - n)});
      }
    }
  }
  // A task's cost: its rows times the keys it reads (a causal tile reads up to its last query).
  std::vector<int64_t> costs;
  costs.reserve(tasks.size());
  for (const Task& t : tasks) {
    const int64_t first_pos = t.context_len - t.num_queries;
    const int64_t lowest = a.window > 0 ? std::max<int64_t>(0, first_pos - a.window + 1) : 0;
    costs.push_back(t.num_queries * a.group * (t.context_len - lowest / KB * KB));
  }
  pd_cpu::parallel_balanced(costs, [&](const std::vector<int64_t>& share) {
    for (int64_t t : share) {
      if (a.head_dim == 32) prefill_task<T, 32>(a, tasks[t]);
      else if (a.head_dim == 64) prefill_task<T, 64>(a, tasks[t]);
      else if (a.head_dim == 128) prefill_task<T, 128>(a, tasks[t]);
      else prefill_task<T, 0>(a, tasks[t]);
    }
  });
}

}  // namespace

// q, out: [num_tokens, heads, head_dim] fp32 (head_dim contiguous).
// k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim] views (head_dim contiguous) of fp32,
// bf16, float8_e4m3fn or float8_e5m2, read as float(stored) * k_scale (v_scale for values).
// block_table: int32 [num_seqs, >= pages]; query_starts: int64 [num_seqs + 1] rows of q per sequence
// (cu_seqlens); seq_lens: int64 [num_seqs]; seqs: the sequences to run (those with more than one query).
void paged_prefill_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                             const torch::Tensor& block_table, const std::vector<int64_t>& query_starts,
                             const std::vector<int64_t>& seq_lens, const std::vector<int64_t>& seqs, double scale,
                             int64_t window, double softcap, double k_scale, double v_scale, torch::Tensor& out) {
  const float s = static_cast<float>(scale * k_scale), cap = static_cast<float>(softcap);
  const float vs = static_cast<float>(v_scale);
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      return prefill_typed<float>(q, k_cache, v_cache, block_table, query_starts, seq_lens, seqs, s, window, cap, vs, out);
    case at::kBFloat16:
      return prefill_typed<pd_cpu::Bf16>(q, k_cache, v_cache, block_table, query_starts, seq_lens, seqs, s, window,
                                         cap, vs, out);
    case at::kFloat8_e4m3fn:
      return prefill_typed<pd_cpu::E4m3>(q, k_cache, v_cache, block_table, query_starts, seq_lens, seqs, s, window,
                                         cap, vs, out);
    case at::kFloat8_e5m2:
      return prefill_typed<pd_cpu::E5m2>(q, k_cache, v_cache, block_table, query_starts, seq_lens, seqs, s, window,
                                         cap, vs, out);
    default:
      TORCH_CHECK(false, "paged_prefill_attention: pages of ", k_cache.scalar_type(), " are not read here");
  }
}
