// A dense layer for a batch of a few rows (a decode step's): y = x W^T + b, fp32.
//
// With a few rows a dense layer is bound by reading its weight: each weight
// element is used once per row. oneDNN's packed GEMM is tuned for many rows.
// This reads the weight once per step from a layout of its own, panels of
// one vector's width of output features, each panel contiguous over the
// input features:
//
//   W [out, in]  ->  panels [ceil(out / L), in, L]      (L = lanes of a vector; the last panel zero-padded)
//   panel p, row k: W[p*L .. p*L+L-1, k]
//
//   for a group of C panels and R rows of x (C x R vector accumulators, no lane sums):
//     for k in 0 .. in-1:  acc[r][c] += broadcast(x[r, k]) * panel[p+c][k]
//
// Each panel is one sequential stream, so the hardware prefetchers keep a
// core fed: on the built-in model's layers one core read the weights at
// 23 GB/s this way (bench.dense_rows), against 12 GB/s from the checkpoint
// layout (rows of 256 floats, four at a time) and 10 GB/s for oneDNN. Panel groups are
// split across the threads; a batch of more than 8 rows passes over a group
// again, while its panels are still in the caches.
//
// The products add in the order of k, as a plain dot product does; results
// match torch.nn.functional.linear to float32 rounding, not bit for bit.
// No -ffast-math: a NaN in a row of x reaches that row's outputs.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
// Rows of x per pass over a panel group.
constexpr int kMaxRows = 8;
// Weight elements a task should read at least, so that splitting a small layer across the threads
// costs less than the fork.
constexpr int64_t kMinTaskElements = 32768;

// out[r, p*L .. ] = x[r] . W[p*L .. ]^T + bias for R rows of x and C panels from p0.
template <int R, int C>
void panels_times_rows(const float* x, int64_t x_stride, const float* panels, int64_t in_features, int64_t p0,
                       int64_t out_features, const float* bias, float* out) {
  Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Vec(0.f);
  const float* w = panels + p0 * in_features * kLanes;
  for (int64_t k = 0; k < in_features; ++k) {
    Vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = Vec::loadu(w + (c * in_features + k) * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec xv(x[r * x_stride + k]);
      for (int c = 0; c < C; ++c) acc[r][c] = at::vec::fmadd(xv, wv[c], acc[r][c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    const int64_t j = (p0 + c) * kLanes;
    const int count = static_cast<int>(std::min<int64_t>(kLanes, out_features - j));
    const Vec b = bias ? Vec::loadu(bias + j, count) : Vec(0.f);
    for (int r = 0; r < R; ++r) (acc[r][c] + b).store(out + r * out_features + j, count);
  }
}

// Panels q0 .. q1 for R rows: groups of C panels (fewer rows, more panels at once: at most 16 accumulators).
template <int R>
void rows_pass(const float* x, int64_t x_stride, const float* panels, int64_t in_features, int64_t q0, int64_t q1,
               int64_t out_features, const float* bias, float* out) {
  constexpr int C = R <= 2 ? 4 : (R <= 4 ? 3 : 2);
  int64_t p = q0;
  for (; p + C <= q1; p += C) panels_times_rows<R, C>(x, x_stride, panels, in_features, p, out_features, bias, out);
  for (; p < q1; ++p) panels_times_rows<R, 1>(x, x_stride, panels, in_features, p, out_features, bias, out);
}

}  // namespace

// weight [out, in] contiguous fp32 -> its panels [ceil(out / L), in, L].
torch::Tensor pack_rows_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "pack_rows_weight: weight must be a 2-D fp32 CPU tensor, got ", weight.sizes(), " ",
              weight.scalar_type());
  const int64_t out_features = weight.size(0), in_features = weight.size(1);
  const int64_t num_panels = (out_features + kLanes - 1) / kLanes;
  auto padded = torch::zeros({num_panels * kLanes, in_features}, weight.options());
  padded.narrow(0, 0, out_features).copy_(weight);
  return padded.view({num_panels, kLanes, in_features}).transpose(1, 2).contiguous();
}

// x: [rows, in] (rows may be strided, in contiguous); panels from pack_rows_weight; bias: [out] or empty.
// Returns a new contiguous [rows, out]. The checks are pd_kernels.checks.check_linear_args's, here so that
// a dense layer can call this without a Python wrapper's microseconds per call.
torch::Tensor linear_rows(const torch::Tensor& x, const torch::Tensor& panels, const c10::optional<torch::Tensor>& bias,
                          int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3, "linear_rows: x must be 2-D and panels 3-D, got ", x.sizes(),
              " and ", panels.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat, "linear_rows: fp32 only");
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "linear_rows: CPU tensors only");
  TORCH_CHECK(x.stride(1) == 1, "linear_rows: x's last dim must be contiguous");
  TORCH_CHECK(panels.is_contiguous() && panels.size(2) == kLanes &&
                  panels.size(0) == (out_features + kLanes - 1) / kLanes && out_features > 0,
              "linear_rows: panels must be pack_rows_weight's for ", out_features, " outputs, got ", panels.sizes());
  TORCH_CHECK(panels.size(1) == x.size(1), "linear_rows: weight has ", panels.size(1), " input features, x has ",
              x.size(1));
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->dim() == 1 &&
                    bias->size(0) == out_features,
                "linear_rows: bias must be a contiguous fp32 [", out_features, "]");
  }
  const int64_t rows = x.size(0), in_features = x.size(1), num_panels = panels.size(0);
  auto out = torch::empty({rows, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  const int64_t grain = std::max<int64_t>(1, kMinTaskElements / (kLanes * std::max<int64_t>(1, in_features)));
  at::parallel_for(0, num_panels, grain, [&](int64_t q0, int64_t q1) {
    for (int64_t r = 0; r < rows; r += kMaxRows) {
      const float* xr = xp + r * x_stride;
      float* outr = op + r * out_features;
      switch (std::min<int64_t>(kMaxRows, rows - r)) {
        case 8: rows_pass<8>(xr, x_stride, wp, in_features, q0, q1, out_features, bp, outr); break;
        case 7: rows_pass<7>(xr, x_stride, wp, in_features, q0, q1, out_features, bp, outr); break;
        case 6: rows_pass<6>(xr, x_stride, wp, in_features, q0, q1, out_features, bp, outr); break;
        case 5: rows_pass<5>(xr, x_stride, wp, in_features, q0, q1, out_features, bp, outr); break;
        case 4: rows_pass<4>(xr, x_stride, wp, in_features, q0, q1, out_features, bp, outr); break;
        case 3: rows_pass<3>(xr, x_stride, wp, in_features, q0, q1, out_features, bp, outr); break;
        case 2: rows_pass<2>(xr, x_stride, wp, in_features, q0, q1, out_features, bp, outr); break;
        default: rows_pass<1>(xr, x_stride, wp, in_features, q0, q1, out_features, bp, outr); break;
      }
    }
  });
  return out;
}
