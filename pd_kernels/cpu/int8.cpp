// W8A8 INT8 dense layers around torch._int_mm (pd_kernels/int8.py): the two passes over rows that
// surround the int8 GEMM, each one loop instead of a chain of aten ops.
//
// quantize_rows_int8: each fp32 row's absmax, then the row times 127 / absmax rounded to the nearest
// integer, ties to even (nearbyint in the default rounding mode, as torch.round). A row holding a NaN or
// an infinity gets a NaN scale and zeros, so its outputs are NaN, as the torch chain gives them (the
// fault stays in that row: one request's).
//
// scale_int32_rows: out[i, j] = acc[i, j] * a_scale[i] * w_scale[j] (+ bias[j]), fp32.
//
// On 2 threads of an AMD EPYC these took the place of 7 and 3 aten ops (pd_kernels/int8.py's reference
// path), whose per-op cost dominated a decode step's layers (python -m bench.quant).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr float kInt8Max = 127.0f;
constexpr float kMinScale = 1e-10f;
// Rows per task: a row is a few hundred to a few thousand elements.
constexpr int64_t kGrainRows = 8;

void check_rows(const torch::Tensor& t, const char* name, c10::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 2, name, ": expected 2 dimensions, got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, name, ": expected ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, ": must be contiguous, strides ", t.strides());
  TORCH_CHECK(t.device().is_cpu(), name, ": must be on the CPU");
}

}  // namespace

std::vector<torch::Tensor> quantize_rows_int8(const torch::Tensor& x) {
  check_rows(x, "x", torch::kFloat);
  const int64_t rows = x.size(0), cols = x.size(1);
  auto q = torch::empty({rows, cols}, x.options().dtype(torch::kChar));
  auto scale = torch::empty({rows, 1}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, rows, kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * cols;
      int8_t* out = qp + r * cols;
      float amax = 0.0f, poison = 0.0f;  // poison: NaN where the row holds a NaN or an infinity
#pragma omp simd reduction(max : amax) reduction(+ : poison)
      for (int64_t j = 0; j < cols; ++j) {
        amax = std::max(amax, std::fabs(row[j]));
        poison += row[j] * 0.0f;
      }
      if (std::isnan(poison)) {
        sp[r] = std::numeric_limits<float>::quiet_NaN();
        std::fill(out, out + cols, int8_t{0});
        continue;
      }
      const float s = std::max(amax / kInt8Max, kMinScale);
      const float inv = 1.0f / s;
      sp[r] = s;
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) {
        // |row[j] * inv| <= 127 up to one rounding; the clamp guards that last ulp.
        const float v = std::nearbyint(row[j] * inv);
        out[j] = static_cast<int8_t>(std::min(kInt8Max, std::max(-kInt8Max, v)));
      }
    }
  });
  return {q, scale};
}

torch::Tensor scale_int32_rows(const torch::Tensor& acc, const torch::Tensor& a_scale, const torch::Tensor& w_scale,
                               const c10::optional<torch::Tensor>& bias) {
  check_rows(acc, "acc", torch::kInt);
  const int64_t rows = acc.size(0), cols = acc.size(1);
  TORCH_CHECK(a_scale.scalar_type() == torch::kFloat && a_scale.is_contiguous() && a_scale.numel() == rows,
              "a_scale: expected a contiguous fp32 [", rows, ", 1], got ", a_scale.sizes());
  TORCH_CHECK(w_scale.scalar_type() == torch::kFloat && w_scale.is_contiguous() && w_scale.numel() == cols,
              "w_scale: expected a contiguous fp32 [", cols, "], got ", w_scale.sizes());
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == cols,
                "bias: expected a contiguous fp32 [", cols, "], got ", bias->sizes());
    bp = bias->data_ptr<float>();
  }
  auto out = torch::empty({rows, cols}, acc.options().dtype(torch::kFloat));
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* asp = a_scale.data_ptr<float>();
  const float* wsp = w_scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int32_t* in = ap + r * cols;
      float* o = op + r * cols;
      const float s = asp[r];
      if (bp != nullptr) {
#pragma omp simd
        for (int64_t j = 0; j < cols; ++j) o[j] = static_cast<float>(in[j]) * s * wsp[j] + bp[j];
      } else {
#pragma omp simd
        for (int64_t j = 0; j < cols; ++j) o[j] = static_cast<float>(in[j]) * s * wsp[j];
      }
    }
  });
  return out;
}
