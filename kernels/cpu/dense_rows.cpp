// A dense layer for a batch of a few rows (a decode step's): y = x W^T + b, fp32,
// W in its checkpoint layout [out_features, in_features].
//
// With one or two rows a dense layer is bound by reading its weight, and
// each weight element is used once per row. oneDNN's packed GEMM, tuned for
// many rows, streamed the built-in model's weights at 17 GB/s there on two
// threads (AMD EPYC); this reads each weight row once, from the checkpoint
// layout, for every row of x at once, at 22 GB/s:
//
//   W rows j .. j+3 (kCols)  x  up to four rows of x  ->  4 x 4 vector accumulators,
//   one pass over in_features, then each accumulator summed across its lanes
//
//   out_features is split across the threads in blocks of 16 rows of W; a batch
//   of more than four rows goes through the block again, four rows at a time,
//   while the block's weights are still in L1.
//
// The lane sums add in a different order from oneDNN's: results match
// torch.nn.functional.linear to float32 rounding, not bit for bit. No
// -ffast-math: a NaN in a row of x reaches that row's outputs.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>

namespace {

using Vec = at::vec::Vectorized<float>;

// Rows of W per accumulator block, and rows of x per pass over it.
constexpr int kCols = 4;
constexpr int kMaxRows = 4;
// Each accumulator block asks for the weights of the block this many blocks ahead, a cache line of
// each row per vector step: one core streamed the built-in model's weights 7-10% faster with it.
constexpr int64_t kPrefetchBlocks = 2;
// Rows of W per task: a whole number of accumulator blocks.
constexpr int64_t kBlockRows = 16;
// Weight elements a task should read at least, so that splitting a small layer across the threads
// costs less than the fork.
constexpr int64_t kMinTaskElements = 32768;

inline float lane_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// out[r, j] = x[r] . w[j] + bias[j] for R rows of x and rows j0 .. j1 of w (out_features rows).
template <int R>
void rows_times_weight(const float* x, int64_t x_stride, const float* w, int64_t in_features, int64_t out_features,
                       int64_t j0, int64_t j1, const float* bias, float* out) {
  const int64_t out_stride = out_features;
  const int64_t full = in_features - in_features % Vec::size();
  const int tail = static_cast<int>(in_features - full);
  int64_t j = j0;
  for (; j + kCols <= j1; j += kCols) {
    Vec acc[R][kCols];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kCols; ++c) acc[r][c] = Vec(0.f);
    auto step = [&](int64_t k, int count) {
      if (count == Vec::size() && j + (kPrefetchBlocks + 1) * kCols <= out_features)
        for (int c = 0; c < kCols; ++c)
          __builtin_prefetch(w + (j + kPrefetchBlocks * kCols + c) * in_features + k, 0, 0);
      Vec wv[kCols];
      for (int c = 0; c < kCols; ++c) wv[c] = Vec::loadu(w + (j + c) * in_features + k, count);
      for (int r = 0; r < R; ++r) {
        const Vec xv = Vec::loadu(x + r * x_stride + k, count);
        for (int c = 0; c < kCols; ++c) acc[r][c] = at::vec::fmadd(xv, wv[c], acc[r][c]);
      }
    };
    for (int64_t k = 0; k < full; k += Vec::size()) step(k, Vec::size());
    if (tail) step(full, tail);  // the partial load fills the missing lanes with zeros
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kCols; ++c)
        out[r * out_stride + j + c] = lane_sum(acc[r][c]) + (bias ? bias[j + c] : 0.f);
  }
  for (; j < j1; ++j) {
    for (int r = 0; r < R; ++r) {
      Vec acc(0.f);
      for (int64_t k = 0; k < full; k += Vec::size())
        acc = at::vec::fmadd(Vec::loadu(x + r * x_stride + k), Vec::loadu(w + j * in_features + k), acc);
      if (tail) acc = at::vec::fmadd(Vec::loadu(x + r * x_stride + full, tail),
                                     Vec::loadu(w + j * in_features + full, tail), acc);
      out[r * out_stride + j] = lane_sum(acc) + (bias ? bias[j] : 0.f);
    }
  }
}

}  // namespace

// x: [rows, in] (rows may be strided, in contiguous); weight: [out, in] contiguous; bias: [out] or
// empty. Returns a new contiguous [rows, out].
// The checks are kernels.checks.check_linear_args's, here so that a dense layer can call this
// without a Python wrapper's microseconds per call.
torch::Tensor linear_rows(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "linear_rows: x and weight must be 2-D, got ", x.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "linear_rows: fp32 only");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "linear_rows: CPU tensors only");
  TORCH_CHECK(x.stride(1) == 1, "linear_rows: x's last dim must be contiguous");
  TORCH_CHECK(weight.is_contiguous(), "linear_rows: weight must be contiguous [out_features, in_features]");
  TORCH_CHECK(weight.size(1) == x.size(1), "linear_rows: weight has ", weight.size(1), " input features, x has ",
              x.size(1));
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->dim() == 1 &&
                    bias->size(0) == weight.size(0),
                "linear_rows: bias must be a contiguous fp32 [", weight.size(0), "]");
  }
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = weight.size(0);
  auto out = torch::empty({rows, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  const int64_t blocks = (out_features + kBlockRows - 1) / kBlockRows;
  const int64_t grain = std::max<int64_t>(1, kMinTaskElements / (kBlockRows * std::max<int64_t>(1, in_features)));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t block = b0; block < b1; ++block) {
      const int64_t j0 = block * kBlockRows, j1 = std::min(out_features, j0 + kBlockRows);
      for (int64_t r = 0; r < rows; r += kMaxRows) {
        const float* xr = xp + r * x_stride;
        float* outr = op + r * out_features;
        switch (std::min<int64_t>(kMaxRows, rows - r)) {
          case 4: rows_times_weight<4>(xr, x_stride, wp, in_features, out_features, j0, j1, bp, outr); break;
          case 3: rows_times_weight<3>(xr, x_stride, wp, in_features, out_features, j0, j1, bp, outr); break;
          case 2: rows_times_weight<2>(xr, x_stride, wp, in_features, out_features, j0, j1, bp, outr); break;
          default: rows_times_weight<1>(xr, x_stride, wp, in_features, out_features, j0, j1, bp, outr); break;
        }
      }
    }
  });
  return out;
}
