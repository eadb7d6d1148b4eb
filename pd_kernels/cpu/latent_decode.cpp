// Multi-head latent attention (MLA, DeepSeek-V2/V3) decode on CPU, weights absorbed: every query head
// of a sequence attends over the same latent rows, each the key whole (latent_dim = kv_lora_rank +
// rope dims, 576 in V3) and the value in its first v_dim (kv_lora_rank) values. A row is read from
// the pool once for all heads, in tiles of kTile keys, with flash attention's online softmax:
//
//   QT [latent_dim, Hp]  q transposed once per task, times the softmax scale (heads padded to Hp, a
//                        multiple of the vector width, with zeros)
//   rows [kTile]         the tile's latent rows, read through the block table (fp32 pages in place,
//                        bf16 and FP8 ones converted into an fp32 buffer, kv_fp8.h)
//   ST [kTile, Hp]       scores, row t = K_t . QT: vectors run over the heads, each key value broadcast
//   m, l [Hp]            m' = max(m, max_t ST); p = exp(ST - m'); l = l * exp(m - m') + sum_t p
//   O [Hp, v_dim]        O = O * exp(m - m') + P^T rows[:, :v_dim]   (heads x value columns per block)
//
// Both products keep a block of accumulators in vector registers (scores: head vectors x keys,
// values: heads x value vectors), sized for the ISA's register file. With 16 to 128 heads sharing a
// row, the work per byte read is that of a matrix product (16 heads: 34,816 FLOPs per row of 1,152
// bf16 bytes), and the kernel is bound by the multiply-adds, not by memory: bench.latent_decode, one
// thread of a Xeon (AVX-512) at 4,096 tokens, ran 0.7-0.87 of an fp32 matmul's FLOP/s at 128 heads
// and 0.34-0.49 at 16, which read 0.2 (bf16) to 0.34 (fp32) of the stream bandwidth.
//
// One task per (sequence, range of keys). Contexts are split when the batch has fewer keys than the
// threads need to stay busy (batch 1, long contexts); each split leaves (O, m, l), and the thread
// that finishes a sequence's last split merges them, scaled by exp(m_split - max m), into the output
// (the log-sum-exp combination), in the same parallel region: on a busy host, every region more is
// another wait for a descheduled thread. Tasks go to threads by their cost (balance.h). Built without
// -ffast-math: a NaN score reaches its head's output.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include "balance.h"
#include "kv_fp8.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
// AVX-512 has 32 vector registers, AVX2 16: the accumulator blocks below are sized to fit.
constexpr bool kWide = W >= 16;

// Keys per step of the recurrence: the softmax's per-head work is paid once per tile.
constexpr int64_t kTile = 32;
// Score blocks: up to kMaxHeadVecs head vectors x score_keys(head vectors) keys of accumulators.
constexpr int64_t kMaxHeadVecs = kWide ? 4 : 2;
constexpr int64_t kMaxScoreKeys = kWide ? 12 : 8;
// Value blocks: kValueHeads heads x kValueVecs vectors of value columns.
constexpr int64_t kValueHeads = 4;
constexpr int64_t kValueVecs = kWide ? 4 : 2;
// A context is split into tasks of at least this many keys, and only when the batch gives the
// threads fewer than kTasksPerThread tasks' worth of keys each.
constexpr int64_t kMinSplitKeys = 256;
constexpr int64_t kTasksPerThread = 4;

template <typename T>
struct LatentArgs {
  const float* q;
  const T* cache;
  float* out;
  const int32_t *table, *lens;
  const int64_t* rows;
  int64_t num_heads, heads_padded, latent_dim, v_dim, block_size;
  int64_t qs0, qs1, os0, os1, cs0, cs1, table_stride;
  float scale, value_scale;  // scale: the softmax scale times the pool's; value_scale: the pool's
};

// A sequence's keys first .. last - 1. A split task's (O, m, l) go to partials[part]; its sequence's
// splits are groups[group].
struct Task {
  int64_t seq, first, last;
  bool split;
  int64_t part, group;
};

// A split sequence: its partial results first_part .. first_part + num_parts - 1.
struct SplitGroup {
  int64_t seq, first_part, num_parts;
};

template <typename T>
inline const T* latent_row(const LatentArgs<T>& a, const int32_t* pages, int64_t t) {
  return a.cache + pages[t / a.block_size] * a.cs0 + (t % a.block_size) * a.cs1;
}

constexpr int64_t score_keys(int64_t head_vecs) {
  return head_vecs == 1 ? kMaxScoreKeys : head_vecs == 2 ? (kWide ? 8 : 5) : 6;
}

// The next tile's rows, requested a few lines at a time before every block of products of this tile,
// so that reading them overlaps its multiply-adds.
struct Prefetcher {
  const char* rows[kTile];
  int64_t num_rows = 0, row_bytes = 0, per_step = 0, row = 0, offset = 0;  // the next line: rows[row] + offset

  template <typename T>
  void plan(const T* const* next, int64_t num_next, int64_t d_len, int64_t steps) {
    for (int64_t t = 0; t < num_next; ++t) rows[t] = reinterpret_cast<const char*>(next[t]);
    num_rows = num_next;
    row_bytes = d_len * static_cast<int64_t>(sizeof(T));
    const int64_t lines = num_next * ((row_bytes + 63) / 64);
    per_step = (lines + steps - 1) / std::max<int64_t>(steps, 1);
    row = offset = 0;
  }
  void step() {
    for (int64_t k = 0; k < per_step && row < num_rows; ++k) {
      __builtin_prefetch(rows[row] + offset, 0, 2);
      offset += 64;
      if (offset >= row_bytes) {
        offset = 0;
        ++row;
      }
    }
  }
};

// ST[t, hv0 * W ..] for keys t < MT of rows and NH head vectors from hv0: the D loop broadcasts each
// key value against NH vectors of QT.
template <int64_t NH, int64_t MT>
inline void score_block(const float* qt, int64_t hp, int64_t d_len, const float* const* rows, int64_t hv0,
                        float* st) {
  Vec acc[MT][NH];
  for (int64_t i = 0; i < MT; ++i) {
    for (int64_t j = 0; j < NH; ++j) acc[i][j] = Vec(0.f);
  }
  const float* q = qt + hv0 * W;
  for (int64_t d = 0; d < d_len; ++d, q += hp) {
    Vec qv[NH];
    for (int64_t j = 0; j < NH; ++j) qv[j] = Vec::loadu(q + j * W);
    for (int64_t i = 0; i < MT; ++i) {
      const Vec k(rows[i][d]);
      for (int64_t j = 0; j < NH; ++j) acc[i][j] = at::vec::fmadd(qv[j], k, acc[i][j]);
    }
  }
  for (int64_t i = 0; i < MT; ++i) {
    for (int64_t j = 0; j < NH; ++j) acc[i][j].store(st + i * hp + (hv0 + j) * W);
  }
}

// Scores of keys 0 .. n - 1 (rows padded past n with a zero row) for NH head vectors from hv0.
template <int64_t NH>
inline void score_group(const float* qt, int64_t hp, int64_t d_len, const float* const* rows, int64_t n,
                        int64_t hv0, float* st, Prefetcher& prefetch) {
  constexpr int64_t MT = score_keys(NH);
  for (int64_t t0 = 0; t0 < n; t0 += MT) {
    prefetch.step();
    score_block<NH, MT>(qt, hp, d_len, rows + t0, hv0, st + t0 * hp);
  }
}

void scores(const float* qt, int64_t hp, int64_t d_len, const float* const* rows, int64_t n, float* st,
            Prefetcher& prefetch) {
  const int64_t num_vecs = hp / W;
  for (int64_t hv0 = 0; hv0 < num_vecs; hv0 += kMaxHeadVecs) {
    const int64_t nh = std::min(kMaxHeadVecs, num_vecs - hv0);
    if (nh == kMaxHeadVecs) {
      score_group<kMaxHeadVecs>(qt, hp, d_len, rows, n, hv0, st, prefetch);
    } else if (nh == 3) {
      score_group<3>(qt, hp, d_len, rows, n, hv0, st, prefetch);
    } else if (nh == 2) {
      score_group<2>(qt, hp, d_len, rows, n, hv0, st, prefetch);
    } else {
      score_group<1>(qt, hp, d_len, rows, n, hv0, st, prefetch);
    }
  }
}

// O[h0 + i, v0 ..] = O * alpha[h0 + i] + sum over t < n of P[t, h0 + i] rows[t][v0 ..], for
// kValueHeads heads and NV value vectors.
template <int64_t NV>
inline void value_block(const float* st, int64_t hp, const float* const* rows, int64_t n, int64_t h0, int64_t v0,
                        const float* alpha, float* o, int64_t v_len) {
  constexpr int64_t MH = kValueHeads;
  Vec acc[MH][NV];
  for (int64_t i = 0; i < MH; ++i) {
    const Vec scale(alpha[h0 + i]);
    for (int64_t j = 0; j < NV; ++j) acc[i][j] = Vec::loadu(o + (h0 + i) * v_len + v0 + j * W) * scale;
  }
  for (int64_t t = 0; t < n; ++t) {
    Vec v[NV];
    for (int64_t j = 0; j < NV; ++j) v[j] = Vec::loadu(rows[t] + v0 + j * W);
    const float* p = st + t * hp + h0;
    for (int64_t i = 0; i < MH; ++i) {
      const Vec w(p[i]);
      for (int64_t j = 0; j < NV; ++j) acc[i][j] = at::vec::fmadd(w, v[j], acc[i][j]);
    }
  }
  for (int64_t i = 0; i < MH; ++i) {
    for (int64_t j = 0; j < NV; ++j) acc[i][j].store(o + (h0 + i) * v_len + v0 + j * W);
  }
}

// Value columns outer, heads inner: a block of columns of the tile's rows stays in L1 while every
// head's accumulators pass over it.
void weighted_values(const float* st, int64_t hp, const float* const* rows, int64_t n, const float* alpha, float* o,
                     int64_t v_len, Prefetcher& prefetch) {
  int64_t v0 = 0;
  for (; v0 + kValueVecs * W <= v_len; v0 += kValueVecs * W) {
    for (int64_t h0 = 0; h0 < hp; h0 += kValueHeads) {
      prefetch.step();
      value_block<kValueVecs>(st, hp, rows, n, h0, v0, alpha, o, v_len);
    }
  }
  for (; v0 < v_len; v0 += W) {
    for (int64_t h0 = 0; h0 < hp; h0 += kValueHeads) {
      prefetch.step();
      value_block<1>(st, hp, rows, n, h0, v0, alpha, o, v_len);
    }
  }
}

// The blocks of products scores() and weighted_values() run for a tile of n keys: the prefetcher's steps.
int64_t product_blocks(int64_t hp, int64_t n, int64_t v_len) {
  int64_t blocks = 0;
  for (int64_t hv0 = 0; hv0 < hp / W; hv0 += kMaxHeadVecs) {
    const int64_t keys = score_keys(std::min(kMaxHeadVecs, hp / W - hv0));
    blocks += (n + keys - 1) / keys;
  }
  const int64_t wide = v_len / (kValueVecs * W), narrow = (v_len - wide * kValueVecs * W) / W;
  return blocks + (wide + narrow) * (hp / kValueHeads);
}

// The online softmax over one tile, vectorised over heads: ST becomes p; alpha = exp(m - m') per head.
// m' - m' is NaN where m' is (a NaN score, or an infinite one, which the reference also turns into
// NaN) and 0 elsewhere: added to every exponential, it carries that head's NaN to its output, which
// exp_u20's clamping would otherwise lose.
void softmax_tile(float* st, int64_t hp, int64_t n, float* m, float* l, float* alpha) {
  for (int64_t h = 0; h < hp; h += W) {
    Vec top(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < n; ++t) top = at::vec::maximum(top, Vec::loadu(st + t * hp + h));
    const Vec old = Vec::loadu(m + h), fresh = at::vec::maximum(old, top), poison = fresh - fresh;
    const Vec rescale = (old - fresh).exp_u20() + poison;
    Vec sum(0.f);
    for (int64_t t = 0; t < n; ++t) {
      const Vec p = (Vec::loadu(st + t * hp + h) - fresh).exp_u20() + poison;
      p.store(st + t * hp + h);
      sum = sum + p;
    }
    (Vec::loadu(l + h) * rescale + sum).store(l + h);
    fresh.store(m + h);
    rescale.store(alpha + h);
  }
}

// One thread's buffers, reused across its tasks.
struct Scratch {
  std::vector<float> qt, st, keys, zero, o, m, l, alpha;
  std::vector<const float*> rows;
  Scratch(int64_t hp, int64_t d_len, int64_t v_len)
      : qt(d_len * hp), st((kTile + kMaxScoreKeys) * hp), keys(kTile * d_len), zero(d_len, 0.f), o(hp * v_len),
        m(hp), l(hp), alpha(hp), rows(kTile + kMaxScoreKeys) {}
};

template <typename T>
void run_task(const LatentArgs<T>& a, const Task& task, Scratch& s, float* partials) {
  const int64_t hp = a.heads_padded, d_len = a.latent_dim, v_len = a.v_dim;
  const int32_t* pages = a.table + task.seq * a.table_stride;
  const float* q = a.q + a.rows[task.seq] * a.qs0;
  std::fill(s.qt.begin(), s.qt.end(), 0.f);
  for (int64_t h = 0; h < a.num_heads; ++h) {
    for (int64_t d = 0; d < d_len; ++d) s.qt[d * hp + h] = q[h * a.qs1 + d] * a.scale;
  }
  std::fill(s.o.begin(), s.o.end(), 0.f);
  std::fill(s.m.begin(), s.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.end(), 0.f);
  const T* next[kTile];
  Prefetcher prefetch;
  for (int64_t t0 = task.first; t0 < task.last; t0 += kTile) {
    const int64_t n = std::min(kTile, task.last - t0);
    for (int64_t t = 0; t < n; ++t) {
      const T* row = latent_row(a, pages, t0 + t);
      if constexpr (std::is_same_v<T, float>) {
        s.rows[t] = row;
      } else {
        pd_cpu::load_row<T>(row, s.keys.data() + t * d_len, d_len);
        s.rows[t] = s.keys.data() + t * d_len;
      }
    }
    std::fill(s.rows.begin() + n, s.rows.end(), s.zero.data());
    const int64_t num_next = std::min(kTile, std::max<int64_t>(0, task.last - t0 - kTile));
    for (int64_t t = 0; t < num_next; ++t) next[t] = latent_row(a, pages, t0 + kTile + t);
    prefetch.plan(next, num_next, d_len, product_blocks(hp, n, v_len));
    scores(s.qt.data(), hp, d_len, s.rows.data(), n, s.st.data(), prefetch);
    softmax_tile(s.st.data(), hp, n, s.m.data(), s.l.data(), s.alpha.data());
    weighted_values(s.st.data(), hp, s.rows.data(), n, s.alpha.data(), s.o.data(), v_len, prefetch);
  }
  if (task.split) {
    float* part = partials + task.part * hp * (v_len + 2);
    std::copy(s.o.begin(), s.o.end(), part);
    std::copy(s.m.begin(), s.m.end(), part + hp * v_len);
    std::copy(s.l.begin(), s.l.end(), part + hp * v_len + hp);
    return;
  }
  float* out = a.out + a.rows[task.seq] * a.os0;
  for (int64_t h = 0; h < a.num_heads; ++h) {
    const float norm = a.value_scale / s.l[h];
    const float* oh = s.o.data() + h * v_len;
    float* dst = out + h * a.os1;
#pragma omp simd
    for (int64_t v = 0; v < v_len; ++v) dst[v] = oh[v] * norm;
  }
}

// The tasks: one per sequence, or a sequence's keys in near-equal ranges (multiples of kTile) when
// the batch has too few keys to give every thread kTasksPerThread tasks of at least kMinSplitKeys.
std::vector<Task> plan_tasks(const int32_t* lens, int64_t num_decodes, std::vector<SplitGroup>& groups) {
  int64_t total = 0;
  for (int64_t i = 0; i < num_decodes; ++i) total += lens[i];
  const int64_t want = at::get_num_threads() * kTasksPerThread;
  const int64_t target = std::max(kMinSplitKeys, (total + want - 1) / want);
  std::vector<Task> tasks;
  int64_t num_parts = 0;
  for (int64_t i = 0; i < num_decodes; ++i) {
    const int64_t len = lens[i], splits = (len + target - 1) / target;
    if (splits <= 1) {
      tasks.push_back({i, 0, len, false, 0, 0});
      continue;
    }
    const int64_t step = ((len + splits - 1) / splits + kTile - 1) / kTile * kTile;
    const int64_t group = static_cast<int64_t>(groups.size());
    groups.push_back({i, num_parts, 0});
    for (int64_t first = 0; first < len; first += step) {
      tasks.push_back({i, first, std::min(len, first + step), true, num_parts++, group});
      ++groups.back().num_parts;
    }
  }
  return tasks;
}

// out[seq, h] = sum_s O_s[h] exp(m_s[h] - M) / sum_s l_s[h] exp(m_s[h] - M), for M = max_s m_s[h] (NaN
// if any m_s[h] is): a split sequence's partial results, each [O (hp x v_dim) | m (hp) | l (hp)].
template <typename T>
void merge_group(const LatentArgs<T>& a, const SplitGroup& group, const float* partials, float* acc) {
  const int64_t hp = a.heads_padded, v_len = a.v_dim, stride = hp * (v_len + 2);
  const float* first = partials + group.first_part * stride;
  for (int64_t h = 0; h < a.num_heads; ++h) {
    float top = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int64_t k = 0; k < group.num_parts; ++k) {
      const float m = first[k * stride + hp * v_len + h];
      nan |= std::isnan(m);
      top = std::max(top, m);
    }
    if (nan) top = std::numeric_limits<float>::quiet_NaN();
    std::fill(acc, acc + v_len, 0.f);
    float sum = 0.f;
    for (int64_t k = 0; k < group.num_parts; ++k) {
      const float* part = first + k * stride;
      const float w = std::exp(part[hp * v_len + h] - top);
      sum += part[hp * v_len + hp + h] * w;
      const float* oh = part + h * v_len;
#pragma omp simd
      for (int64_t v = 0; v < v_len; ++v) acc[v] += oh[v] * w;
    }
    const float norm = a.value_scale / sum;
    float* dst = a.out + a.rows[group.seq] * a.os0 + h * a.os1;
#pragma omp simd
    for (int64_t v = 0; v < v_len; ++v) dst[v] = acc[v] * norm;
  }
}

template <typename T>
void latent_typed(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& block_table,
                  const torch::Tensor& seq_lens, const torch::Tensor& token_rows, float scale, float value_scale,
                  torch::Tensor& out) {
  const int64_t num_decodes = token_rows.size(0), num_heads = q.size(1);
  LatentArgs<T> a{
      q.data_ptr<float>(), static_cast<const T*>(cache.data_ptr()), out.data_ptr<float>(),
      block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), token_rows.data_ptr<int64_t>(),
      num_heads, (num_heads + W - 1) / W * W, q.size(2), out.size(2), cache.size(1),
      q.stride(0), q.stride(1), out.stride(0), out.stride(1), cache.stride(0), cache.stride(1),
      block_table.stride(0), scale * pd_cpu::kRowFactor<T>, value_scale * pd_cpu::kRowFactor<T>,
  };
  for (int64_t i = 0; i < num_decodes; ++i) TORCH_CHECK(a.lens[i] >= 1, "latent_decode_attention: empty context");
  std::vector<SplitGroup> groups;
  const std::vector<Task> tasks = plan_tasks(a.lens, num_decodes, groups);
  int64_t num_parts = 0;
  std::vector<std::atomic<int64_t>> unfinished(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    unfinished[g].store(groups[g].num_parts, std::memory_order_relaxed);
    num_parts += groups[g].num_parts;
  }
  std::vector<float> partials(num_parts * a.heads_padded * (a.v_dim + 2));
  std::vector<int64_t> costs(tasks.size());
  for (size_t k = 0; k < tasks.size(); ++k) costs[k] = tasks[k].last - tasks[k].first;
  pd_cpu::parallel_balanced(costs, [&](const std::vector<int64_t>& share) {
    Scratch scratch(a.heads_padded, a.latent_dim, a.v_dim);
    for (int64_t k : share) {
      const Task& task = tasks[k];
      run_task<T>(a, task, scratch, partials.data());
      // The last split of a sequence to finish merges them all (acq_rel: it sees the others' partials).
      if (task.split && unfinished[task.group].fetch_sub(1, std::memory_order_acq_rel) == 1) {
        merge_group<T>(a, groups[task.group], partials.data(), scratch.o.data());
      }
    }
  });
}

}  // namespace

// q: [num_tokens, num_heads, latent_dim] fp32; out: [num_tokens, num_heads, v_dim] fp32 (both with
// the last axis contiguous); latent_dim and v_dim multiples of 16 (every ISA's vector width).
// latent_cache: [num_blocks, block_size, 1, latent_dim] view (rows contiguous) of fp32, bf16,
// float8_e4m3fn or float8_e5m2, read as float(stored) * scale; a row's first v_dim values are its value.
// block_table: int32 [num_decodes, >= pages]; seq_lens: int32 [num_decodes]; token_rows: int64
// [num_decodes], each decode's row of q and out.
void latent_decode_attention(const torch::Tensor& q, const torch::Tensor& latent_cache,
                             const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                             const torch::Tensor& token_rows, double softmax_scale, double scale,
                             torch::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && latent_cache.dim() == 4, "latent_decode_attention: bad ranks");
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "latent_decode_attention: fp32 q, out");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && latent_cache.stride(3) == 1,
              "latent_decode_attention: the last axes of q, out and latent_cache must be contiguous");
  TORCH_CHECK(q.size(2) % 16 == 0 && out.size(2) % 16 == 0 && out.size(2) <= q.size(2),
              "latent_decode_attention: latent_dim and v_dim must be multiples of 16, v_dim <= latent_dim");
  TORCH_CHECK(latent_cache.size(2) == 1 && latent_cache.size(3) == q.size(2),
              "latent_decode_attention: latent_cache must be [num_blocks, block_size, 1, latent_dim]");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  token_rows.scalar_type() == at::kLong && seq_lens.is_contiguous() && token_rows.is_contiguous() &&
                  block_table.stride(1) == 1,
              "latent_decode_attention: int32 block_table and seq_lens, int64 token_rows, contiguous");
  const float s = static_cast<float>(softmax_scale * scale), vs = static_cast<float>(scale);
  switch (latent_cache.scalar_type()) {
    case at::kFloat:
      return latent_typed<float>(q, latent_cache, block_table, seq_lens, token_rows, s, vs, out);
    case at::kBFloat16:
      return latent_typed<pd_cpu::Bf16>(q, latent_cache, block_table, seq_lens, token_rows, s, vs, out);
    case at::kFloat8_e4m3fn:
      return latent_typed<pd_cpu::E4m3>(q, latent_cache, block_table, seq_lens, token_rows, s, vs, out);
    case at::kFloat8_e5m2:
      return latent_typed<pd_cpu::E5m2>(q, latent_cache, block_table, seq_lens, token_rows, s, vs, out);
    default:
      TORCH_CHECK(false, "latent_decode_attention: pages of ", latent_cache.scalar_type(), " are not read here");
  }
}
