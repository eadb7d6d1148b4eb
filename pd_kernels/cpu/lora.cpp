// Multi-LoRA deltas for a batch of rows, fp32: pd_kernels.lora_delta's cpu kernel (Punica's shrink, then
// expand; pd_kernels/reference_lora.py states the arithmetic).
//
// Each row n with an adapter (slot s = row_slots[n], not NO_LORA) adds its adapter's delta into the base
// layer's output, slice i of the output columns using slice i's A rows:
//
//   t[n]       = A[s] x[n]                             A[s]: [num_slices * rank, in]      (shrink, fp32)
//   out[n, o] += B[s, o] . t[n, i*rank .. i*rank+rank)  B[s]: [out, rank], o in slice i   (expand)
//
// A decode batch holds a few rows per adapter, scattered (the engine orders rows by request), so:
//
//   rows grouped by slot: a counting sort, stable; NO_LORA rows dropped (all they cost is that pass)
//
//   shrink, threads split the groups of G rows of one slot:
//     for each group, each quad of A[s]'s rows:  t[m, k] = x[row(m)] . A[s, k]
//     (each A row loaded once per group of G rows; dot products over vectors, one horizontal sum each)
//
//   expand, threads split the output columns in tiles of C vectors (C*L columns, never across a slice):
//     for each slot present:
//       the tile's block of B[s], C*L x rank and contiguous, transposed to rank rows of C*L columns
//       for its rows in groups of G:  acc[g] = sum_j broadcast(t[m_g, i*rank + j]) * Bt[j]
//                                      out[row(m_g), tile] += acc[g]
//
// Each thread owns its columns of out in the expand, so no two write one value. The delta is accumulated
// in fp32 and added once, as the reference does; results match it to float32 rounding (sums in another
// order), not bit for bit. No -ffast-math: a NaN in a row of x reaches that row's outputs.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
constexpr int32_t kNoLora = -1;  // pd_kernels.checks.NO_LORA
// Shrink: G rows times C rows of A of accumulators, plus C vectors of A and one of x, must fit the vector
// registers (32 with AVX-512, 16 with AVX2 and the generic build).
constexpr int kShrinkRows = kLanes >= 16 ? 4 : 2;
constexpr int kShrinkCols = 4;
// Expand: G rows times C vectors of columns of accumulators, plus C vectors of Bt and one broadcast.
constexpr int kExpandRows = 4;
constexpr int kExpandCols = kLanes >= 16 ? 4 : 2;
constexpr int64_t kTileColumns = kExpandCols * kLanes;
// Multiply-adds a task should hold at least, so that splitting a small batch costs less than the fork.
constexpr int64_t kMinTaskMacs = 32768;

// The adapter rows of the batch, grouped by slot.
struct SlotGroups {
  std::vector<int64_t> slots;   // the slots present, ascending
  std::vector<int64_t> starts;  // slots[i]'s rows are rows[starts[i] .. starts[i + 1])
  std::vector<int64_t> rows;    // row ids, by slot, in batch order within a slot
};

SlotGroups group_rows(const int32_t* row_slots, int64_t num_rows, int64_t num_slots) {
  std::vector<int64_t> offsets(num_slots + 1, 0);
  for (int64_t n = 0; n < num_rows; ++n) {
    const int32_t s = row_slots[n];
    TORCH_CHECK(s == kNoLora || (s >= 0 && s < num_slots), "lora_delta_rows: row ", n, " has slot ", s,
                ", not in [0, ", num_slots, ") nor NO_LORA (", kNoLora, ")");
    if (s != kNoLora) ++offsets[s + 1];
  }
  SlotGroups groups;
  for (int64_t s = 0; s < num_slots; ++s) {
    if (offsets[s + 1]) {
      groups.slots.push_back(s);
      groups.starts.push_back(offsets[s]);
    }
    offsets[s + 1] += offsets[s];
  }
  groups.starts.push_back(offsets[num_slots]);
  groups.rows.resize(offsets[num_slots]);
  for (int64_t n = 0; n < num_rows; ++n) {
    if (row_slots[n] != kNoLora) groups.rows[offsets[row_slots[n]]++] = n;
  }
  return groups;
}

// dots[g][c] = rows[g] . weights[c] over n elements, for G rows and C weight rows.
template <int G, int C>
inline void dots(const float* const* rows, const float* const* weights, int64_t n, float out[G][C]) {
  Vec acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = Vec(0.f);
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    Vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = Vec::loadu(weights[c] + k);
    for (int g = 0; g < G; ++g) {
      const Vec xv = Vec::loadu(rows[g] + k);
      for (int c = 0; c < C; ++c) acc[g][c] = at::vec::fmadd(xv, wv[c], acc[g][c]);
    }
  }
  if (k < n) {  // the tail: partial loads fill the missing lanes with zeros
    const int count = static_cast<int>(n - k);
    Vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = Vec::loadu(weights[c] + k, count);
    for (int g = 0; g < G; ++g) {
      const Vec xv = Vec::loadu(rows[g] + k, count);
      for (int c = 0; c < C; ++c) acc[g][c] = at::vec::fmadd(xv, wv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c)
      out[g][c] = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, acc[g][c]);
}

// t[first .. first + G) = A x for G grouped rows of one slot; a: that slot's A, [t_width, in].
template <int G>
void shrink_rows(const float* x, int64_t x_stride, const int64_t* rows, const float* a, int64_t in_features,
                 int64_t t_width, float* t) {
  const float* xr[G];
  for (int g = 0; g < G; ++g) xr[g] = x + rows[g] * x_stride;
  int64_t k = 0;
  for (; k + kShrinkCols <= t_width; k += kShrinkCols) {
    const float* w[kShrinkCols];
    for (int c = 0; c < kShrinkCols; ++c) w[c] = a + (k + c) * in_features;
    float d[G][kShrinkCols];
    dots<G, kShrinkCols>(xr, w, in_features, d);
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kShrinkCols; ++c) t[g * t_width + k + c] = d[g][c];
  }
  for (; k < t_width; ++k) {
    const float* w[1] = {a + k * in_features};
    float d[G][1];
    dots<G, 1>(xr, w, in_features, d);
    for (int g = 0; g < G; ++g) t[g * t_width + k] = d[g][0];
  }
}

// out[rows[g], col .. col + count) += t[g, 0 .. rank) . Bt for G grouped rows; bt: the tile's B, [rank,
// kTileColumns]. Each broadcast of t serves C vectors of columns, each vector of Bt G rows.
template <int G>
void expand_rows(const float* t, int64_t t_width, const int64_t* rows, const float* bt, int64_t rank, float* out,
                 int64_t out_stride, int64_t col, int64_t count) {
  constexpr int C = kExpandCols;
  Vec acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = Vec(0.f);
  for (int64_t j = 0; j < rank; ++j) {
    Vec b[C];
    for (int c = 0; c < C; ++c) b[c] = Vec::loadu(bt + j * kTileColumns + c * kLanes);
    for (int g = 0; g < G; ++g) {
      const Vec tv(t[g * t_width + j]);
      for (int c = 0; c < C; ++c) acc[g][c] = at::vec::fmadd(tv, b[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    float* o = out + rows[g] * out_stride + col;
    for (int c = 0; c < C && c * kLanes < count; ++c) {
      const int64_t left = count - c * kLanes;
      if (left >= kLanes) {
        (Vec::loadu(o + c * kLanes) + acc[g][c]).store(o + c * kLanes);
      } else {
        (Vec::loadu(o + c * kLanes, left) + acc[g][c]).store(o + c * kLanes, left);
      }
    }
  }
}

// Calls fn(std::integral_constant<int, G>(), first) over [begin, end) in groups of G <= MaxRows rows.
template <int MaxRows, typename Fn>
void row_groups(int64_t begin, int64_t end, const Fn& fn) {
  for (int64_t first = begin; first < end; first += MaxRows) {
    switch (std::min<int64_t>(MaxRows, end - first)) {
      case 8: if constexpr (MaxRows >= 8) fn(std::integral_constant<int, 8>(), first); break;
      case 7: if constexpr (MaxRows >= 7) fn(std::integral_constant<int, 7>(), first); break;
      case 6: if constexpr (MaxRows >= 6) fn(std::integral_constant<int, 6>(), first); break;
      case 5: if constexpr (MaxRows >= 5) fn(std::integral_constant<int, 5>(), first); break;
      case 4: if constexpr (MaxRows >= 4) fn(std::integral_constant<int, 4>(), first); break;
      case 3: if constexpr (MaxRows >= 3) fn(std::integral_constant<int, 3>(), first); break;
      case 2: fn(std::integral_constant<int, 2>(), first); break;
      default: fn(std::integral_constant<int, 1>(), first); break;
    }
  }
}

// A tile of kTileColumns output columns or fewer, inside one slice.
struct ColumnTile {
  int64_t col;    // its first output column
  int64_t count;  // its columns
  int64_t slice;  // the slice it lies in
};

std::vector<ColumnTile> column_tiles(const std::vector<int64_t>& slice_starts, int64_t out_features) {
  std::vector<ColumnTile> tiles;
  for (size_t i = 0; i < slice_starts.size(); ++i) {
    const int64_t end = i + 1 < slice_starts.size() ? slice_starts[i + 1] : out_features;
    for (int64_t col = slice_starts[i]; col < end; col += kTileColumns)
      tiles.push_back({col, std::min(kTileColumns, end - col), static_cast<int64_t>(i)});
  }
  return tiles;
}

}  // namespace

// out [rows, out] and x [rows, in]: fp32, rows may be strided, last axis contiguous; lora_a [slots, slices *
// rank, in] and lora_b [slots, out, rank] contiguous fp32; row_slots int32 [rows]; slice_starts ascending
// from 0. Adds each adapter row's delta into out. The checks are pd_kernels.checks.check_lora_args's,
// repeated here for what the pointers assume.
void lora_delta_rows(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& lora_a,
                     const torch::Tensor& lora_b, const torch::Tensor& row_slots,
                     const std::vector<int64_t>& slice_starts) {
  const torch::Tensor* floats[] = {&out, &x, &lora_a, &lora_b};
  for (const auto* t : floats) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(),
                "lora_delta_rows: out, x, lora_a and lora_b must be fp32 CPU tensors");
  }
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && lora_a.dim() == 3 && lora_b.dim() == 3 && row_slots.dim() == 1,
              "lora_delta_rows: expected out [N, O], x [N, I], lora_a [S, K * R, I], lora_b [S, O, R], "
              "row_slots [N]");
  TORCH_CHECK(out.stride(1) == 1 && x.stride(1) == 1 && lora_a.is_contiguous() && lora_b.is_contiguous(),
              "lora_delta_rows: out and x need contiguous rows, lora_a and lora_b must be contiguous");
  TORCH_CHECK(row_slots.scalar_type() == at::kInt && row_slots.is_contiguous() && row_slots.device().is_cpu(),
              "lora_delta_rows: row_slots must be a contiguous int32 CPU tensor");
  const int64_t num_rows = out.size(0), out_features = out.size(1), in_features = x.size(1);
  const int64_t num_slots = lora_b.size(0), rank = lora_b.size(2);
  const int64_t t_width = static_cast<int64_t>(slice_starts.size()) * rank;
  TORCH_CHECK(x.size(0) == num_rows && row_slots.size(0) == num_rows && lora_b.size(1) == out_features &&
                  lora_a.size(0) == num_slots && lora_a.size(1) == t_width && lora_a.size(2) == in_features &&
                  !slice_starts.empty() && slice_starts[0] == 0,
              "lora_delta_rows: lora_a ", lora_a.sizes(), " and lora_b ", lora_b.sizes(), " do not fit out ",
              out.sizes(), ", x ", x.sizes(), " and ", slice_starts.size(), " slices");
  for (size_t i = 1; i < slice_starts.size(); ++i) {
    TORCH_CHECK(slice_starts[i - 1] < slice_starts[i] && slice_starts[i] < out_features,
                "lora_delta_rows: slice_starts must ascend strictly below ", out_features);
  }
  const SlotGroups groups = group_rows(row_slots.data_ptr<int32_t>(), num_rows, num_slots);
  const int64_t num_adapter_rows = static_cast<int64_t>(groups.rows.size());
  if (num_adapter_rows == 0 || in_features == 0) return;
  const float* xp = x.data_ptr<float>();
  const float* ap = lora_a.data_ptr<float>();
  const float* bp = lora_b.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);

  // Shrink into t [adapter rows, slices * rank], row m of t being groups.rows[m]'s.
  std::vector<float> t(num_adapter_rows * t_width);
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (group index, first row) of each group of rows
  for (size_t i = 0; i < groups.slots.size(); ++i)
    for (int64_t first = groups.starts[i]; first < groups.starts[i + 1]; first += kShrinkRows)
      blocks.emplace_back(static_cast<int64_t>(i), first);
  const int64_t block_grain = std::max<int64_t>(1, kMinTaskMacs / (kShrinkRows * t_width * in_features));
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), block_grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const auto [i, first] = blocks[b];
      const int64_t end = std::min(first + kShrinkRows, groups.starts[i + 1]);
      const float* a = ap + groups.slots[i] * t_width * in_features;
      row_groups<kShrinkRows>(first, end, [&](auto size, int64_t f) {
        shrink_rows<decltype(size)::value>(xp, x_stride, groups.rows.data() + f, a, in_features, t_width,
                                           t.data() + f * t_width);
      });
    }
  });

  // Expand over column tiles; each task owns its tiles' columns of every row.
  const std::vector<ColumnTile> tiles = column_tiles(slice_starts, out_features);
  const int64_t tile_grain = std::max<int64_t>(1, kMinTaskMacs / (kTileColumns * rank * num_adapter_rows));
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), tile_grain, [&](int64_t q0, int64_t q1) {
    std::vector<float> bt(rank * kTileColumns, 0.f);  // one tile's block of B transposed: [rank, columns]
    for (int64_t q = q0; q < q1; ++q) {
      const ColumnTile& tile = tiles[q];
      for (size_t i = 0; i < groups.slots.size(); ++i) {
        const float* b = bp + (groups.slots[i] * out_features + tile.col) * rank;  // [count, rank]
        at::vec::transpose_mxn<float>(b, rank, bt.data(), kTileColumns, static_cast<int>(tile.count),
                                      static_cast<int>(rank));
        row_groups<kExpandRows>(groups.starts[i], groups.starts[i + 1], [&](auto size, int64_t f) {
          expand_rows<decltype(size)::value>(t.data() + f * t_width + tile.slice * rank, t_width,
                                             groups.rows.data() + f, bt.data(), rank, op, out_stride, tile.col,
                                             tile.count);
        });
      }
    }
  });
}
