// The whole fused MoE in one call, fp32, for up to MAX_SLOTS_PER_EXPERT (128) slots per expert (pd_kernels/cpu/moe.py).
//
// With few rows per expert (a decode step) the block is bound by reading the experts' weights:
// each touched expert's w13 and w2 must come from memory once. The torch path
// (a gather, then per expert two GEMMs, a SiLU-and-mul and a weighting, then
// one index_add_) runs about ten ops per expert, and oneDNN's GEMM on a handful
// of rows read the weights at a fraction of the stream bandwidth. Here, from the
// checkpoint layout as it is (no packing):
//
//   slots sorted by expert (a counting sort, stable: token order within an expert)
//
//   pass 1, threads split the intermediate features j (pairs of them):
//     for each touched expert e, its slots s in groups of R:
//       g = x[token(s)] . w13[e, j],  u = x[token(s)] . w13[e, I + j]
//       act[s, j] = silu(g) * u                       (act: [slots, I])
//
//   pass 2, threads split the output features h (groups of 4):
//     for each touched expert e, its slots s in groups of R:
//       out[token(s), h] += weight(s) * (act[s] . w2[e, h])
//
// Every weight row is one sequential stream, read once per group of R slots
// while it is in the L1 cache (R slots share each load of it); each thread
// owns its output columns in pass 2, so the routed weights and the sum over a
// token's experts are fused without atomics, in expert order. The dot products
// run over vectors of the row with one horizontal sum at its end, so results
// match the torch path to float32 rounding, not bit for bit. No -ffast-math: a
// NaN in a token's row reaches that token's outputs.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
// Slots per group: R rows times C weight rows of accumulators, plus C weight vectors and one row vector,
// must fit the vector registers (32 with AVX-512, 16 with AVX2).
constexpr int kMaxRows = kLanes >= 16 ? 4 : 2;
// Weight elements a task should read at least, so that splitting a small expert across the threads costs
// less than the fork.
constexpr int64_t kMinTaskElements = 32768;

// dots[r][c] = rows[r] . weights[c] over n elements, for R rows and C weight rows. Each weight stream also
// prefetches `ahead` floats on, where the next group of weight rows starts: a row is one 4 KiB page at
// H = 1024, and the hardware prefetchers stop at a page's end.
template <int R, int C>
inline void dots(const float* const* rows, const float* const* weights, int64_t n, int64_t ahead, float out[R][C]) {
  Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Vec(0.f);
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    Vec wv[C];
    for (int c = 0; c < C; ++c) {
      __builtin_prefetch(weights[c] + k + ahead);
      wv[c] = Vec::loadu(weights[c] + k);
    }
    for (int r = 0; r < R; ++r) {
      const Vec xv = Vec::loadu(rows[r] + k);
      for (int c = 0; c < C; ++c) acc[r][c] = at::vec::fmadd(xv, wv[c], acc[r][c]);
    }
  }
  if (k < n) {  // the tail: partial loads fill the missing lanes with zeros
    const int count = static_cast<int>(n - k);
    Vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = Vec::loadu(weights[c] + k, count);
    for (int r = 0; r < R; ++r) {
      const Vec xv = Vec::loadu(rows[r] + k, count);
      for (int c = 0; c < C; ++c) acc[r][c] = at::vec::fmadd(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      out[r][c] = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, acc[r][c]);
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// The slots of the batch grouped by expert.
struct SortedSlots {
  std::vector<int64_t> experts;  // the touched experts, ascending
  std::vector<int64_t> starts;   // experts[i]'s slots are [starts[i], starts[i + 1])
  std::vector<int64_t> tokens;   // each sorted slot's token
  std::vector<float> weights;    // each sorted slot's routed weight
};

SortedSlots sort_slots(const int64_t* ids, const float* routed, int64_t num_slots, int64_t top_k,
                       int64_t num_experts) {
  std::vector<int64_t> offsets(num_experts + 1, 0);
  for (int64_t s = 0; s < num_slots; ++s) {
    TORCH_CHECK(ids[s] >= 0 && ids[s] < num_experts, "fused_moe_rows: expert id ", ids[s], " out of [0, ",
                num_experts, ")");
    ++offsets[ids[s] + 1];
  }
  SortedSlots sorted;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (offsets[e + 1]) {
      sorted.experts.push_back(e);
      sorted.starts.push_back(offsets[e]);
    }
    offsets[e + 1] += offsets[e];
  }
  sorted.starts.push_back(num_slots);
  sorted.tokens.resize(num_slots);
  sorted.weights.resize(num_slots);
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t at = offsets[ids[s]]++;
    sorted.tokens[at] = s / top_k;
    sorted.weights[at] = routed[s];
  }
  return sorted;
}

// Pass 1 for R slots from `first` of one expert and the intermediate-feature pairs [p0, p1).
template <int R>
void gate_up_rows(const float* hidden, int64_t hidden_size, const SortedSlots& sorted, int64_t first,
                  const float* w13, int64_t inter, int64_t p0, int64_t p1, float* act) {
  const float* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = hidden + sorted.tokens[first + r] * hidden_size;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t j = 2 * p;
    if (j + 1 < inter) {
      const float* w[4] = {w13 + j * hidden_size, w13 + (j + 1) * hidden_size, w13 + (inter + j) * hidden_size,
                           w13 + (inter + j + 1) * hidden_size};
      float d[R][4];
      dots<R, 4>(rows, w, hidden_size, 2 * hidden_size, d);
      for (int r = 0; r < R; ++r) {
        float* a = act + (first + r) * inter + j;
        a[0] = silu(d[r][0]) * d[r][2];
        a[1] = silu(d[r][1]) * d[r][3];
      }
    } else {  // an odd last feature
      const float* w[2] = {w13 + j * hidden_size, w13 + (inter + j) * hidden_size};
      float d[R][2];
      dots<R, 2>(rows, w, hidden_size, 2 * hidden_size, d);
      for (int r = 0; r < R; ++r) act[(first + r) * inter + j] = silu(d[r][0]) * d[r][1];
    }
  }
}

// Pass 2 for R slots from `first` of one expert and the output features [h0, h1).
template <int R>
void down_rows(const float* act, int64_t inter, const SortedSlots& sorted, int64_t first, const float* w2,
               int64_t hidden_size, int64_t h0, int64_t h1, float* out) {
  const float* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = act + (first + r) * inter;
  int64_t h = h0;
  for (; h + 4 <= h1; h += 4) {
    const float* w[4] = {w2 + h * inter, w2 + (h + 1) * inter, w2 + (h + 2) * inter, w2 + (h + 3) * inter};
    float d[R][4];
    dots<R, 4>(rows, w, inter, 4 * inter, d);
    for (int r = 0; r < R; ++r) {
      float* o = out + sorted.tokens[first + r] * hidden_size + h;
      const float weight = sorted.weights[first + r];
      for (int c = 0; c < 4; ++c) o[c] += weight * d[r][c];
    }
  }
  for (; h < h1; ++h) {
    const float* w[1] = {w2 + h * inter};
    float d[R][1];
    dots<R, 1>(rows, w, inter, inter, d);
    for (int r = 0; r < R; ++r) out[sorted.tokens[first + r] * hidden_size + h] += sorted.weights[first + r] * d[r][0];
  }
}

template <int R>
using Rows = std::integral_constant<int, R>;

// Calls fn(Rows<R>(), first) over an expert's slots [begin, end) in groups of R <= kMaxRows slots.
template <typename Fn>
void slot_groups(int64_t begin, int64_t end, const Fn& fn) {
  for (int64_t first = begin; first < end; first += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, end - first)) {
      case 4: if constexpr (kMaxRows >= 4) fn(Rows<4>(), first); break;
      case 3: if constexpr (kMaxRows >= 3) fn(Rows<3>(), first); break;
      case 2: fn(Rows<2>(), first); break;
      default: fn(Rows<1>(), first); break;
    }
  }
}

}  // namespace

// hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]: contiguous fp32; topk_ids [T, k] int64 and topk_weights [T, k]
// fp32, contiguous. Returns a new [T, H]: each token's routed experts' SwiGLU MLPs, weighted and summed.
// The checks are pd_kernels.checks.check_fused_moe_args's, repeated here for what the pointers assume.
torch::Tensor fused_moe_rows(const torch::Tensor& hidden, const torch::Tensor& w13, const torch::Tensor& w2,
                             const torch::Tensor& topk_ids, const torch::Tensor& topk_weights) {
  for (const auto* t : {&hidden, &w13, &w2, &topk_weights}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->is_contiguous(),
                "fused_moe_rows: hidden, w13, w2 and topk_weights must be contiguous fp32 CPU tensors");
  }
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_ids.is_contiguous(),
              "fused_moe_rows: topk_ids must be contiguous int64");
  TORCH_CHECK(hidden.dim() == 2 && w13.dim() == 3 && w2.dim() == 3 && topk_ids.dim() == 2 &&
                  topk_ids.sizes() == topk_weights.sizes() && topk_ids.size(0) == hidden.size(0),
              "fused_moe_rows: expected hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk [T, k]");
  const int64_t num_tokens = hidden.size(0), hidden_size = hidden.size(1), num_experts = w13.size(0);
  const int64_t inter = w13.size(1) / 2, top_k = topk_ids.size(1), num_slots = num_tokens * top_k;
  TORCH_CHECK(w13.size(1) == 2 * inter && w13.size(2) == hidden_size && w2.size(0) == num_experts &&
                  w2.size(1) == hidden_size && w2.size(2) == inter,
              "fused_moe_rows: w13 ", w13.sizes(), " and w2 ", w2.sizes(), " do not fit hidden ", hidden.sizes());
  auto out = torch::zeros({num_tokens, hidden_size}, hidden.options());
  if (num_slots == 0 || inter == 0) return out;
  const SortedSlots sorted = sort_slots(topk_ids.data_ptr<int64_t>(), topk_weights.data_ptr<float>(), num_slots,
                                        top_k, num_experts);
  auto act = torch::empty({num_slots, inter}, hidden.options());
  const float* x = hidden.data_ptr<float>();
  const float* w13p = w13.data_ptr<float>();
  const float* w2p = w2.data_ptr<float>();
  float* actp = act.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const int64_t num_touched = static_cast<int64_t>(sorted.experts.size());

  // Pass 1 over pairs of intermediate features (a pair's gate and up rows: 4 rows of H per expert).
  const int64_t num_pairs = (inter + 1) / 2;
  const int64_t pair_grain = std::max<int64_t>(1, kMinTaskElements / (4 * hidden_size * num_touched));
  at::parallel_for(0, num_pairs, pair_grain, [&](int64_t p0, int64_t p1) {
    for (int64_t i = 0; i < num_touched; ++i) {
      const float* w = w13p + sorted.experts[i] * 2 * inter * hidden_size;
      slot_groups(sorted.starts[i], sorted.starts[i + 1], [&](auto rows, int64_t first) {
        gate_up_rows<decltype(rows)::value>(x, hidden_size, sorted, first, w, inter, p0, p1, actp);
      });
    }
  });
  // Pass 2 over groups of 4 output features; each thread owns its columns of every token's row.
  const int64_t num_groups = (hidden_size + 3) / 4;
  const int64_t group_grain = std::max<int64_t>(1, kMinTaskElements / (4 * inter * num_touched));
  at::parallel_for(0, num_groups, group_grain, [&](int64_t g0, int64_t g1) {
    const int64_t h0 = 4 * g0, h1 = std::min(hidden_size, 4 * g1);
    for (int64_t i = 0; i < num_touched; ++i) {
      const float* w = w2p + sorted.experts[i] * hidden_size * inter;
      slot_groups(sorted.starts[i], sorted.starts[i + 1], [&](auto rows, int64_t first) {
        down_rows<decltype(rows)::value>(actp, inter, sorted, first, w, hidden_size, h0, h1, outp);
      });
    }
  });
  return out;
}
