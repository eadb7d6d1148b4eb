// The decoder layer's small-op chains on CPU, one pass each over their rows
// instead of one aten op per step of the chain (fp32):
//
//   rms_norm      out = w * x * rsqrt(mean(x^2) + eps)          (with residual: x += residual first, both returned)
//   rotary        q, k rotated in rotate-half (NeoX) style at their positions, into new tensors
//   silu_and_mul  out = silu(gate) * up, gate_up = [gate | up]
//   store_kv      k_cache[slot / bs, slot % bs] = key (same for v); negative slots skipped; any strides
//                 with head_dim contiguous; into FP8 pages, Q(key / k_scale) saturated (kv_fp8.h)
//
// Rows are split across threads with at::parallel_for; a grain keeps small
// batches on one thread, where a fork would cost more than the work. The
// arithmetic follows the torch reference step by step (fp32, same order of
// the per-row reduction up to vectorisation), and no -ffast-math, so a NaN
// reaches its row's output.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include "kv_fp8.h"

#include <cmath>
#include <cstring>

namespace {

// Rows per task: enough work per thread that forking pays for itself.
int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

inline void norm_row(const float* x, const float* w, float eps, int64_t n, float* out) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += x[d] * x[d];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) out[d] = w[d] * (x[d] * inv);
}

// o = silu(g) * u over one row, exp vectorised with ATen's Vectorized (Sleef's expf,
// the one torch's own kernels use); a plain std::exp loop stays scalar without -ffast-math.
inline void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
  using Vec = at::vec::Vectorized<float>;
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) {
    const Vec gv = Vec::loadu(g + d);
    (gv / (Vec(1.f) + gv.neg().exp()) * Vec::loadu(u + d)).store(o + d);
  }
  for (; d < n; ++d) o[d] = g[d] / (1.f + std::exp(-g[d])) * u[d];
}

}  // namespace

// x: [rows, n] (rows may be strided, n contiguous); weight: [n]. Returns a new contiguous [rows, n].
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  auto x2 = x.reshape({rows, n});
  auto out = torch::empty({rows, n}, x.options());
  const float* xp = x2.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x2.stride(0);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * xs, wp, feps, n, op + r * n);
  });
  return out.view(x.sizes());
}

// x, residual: [rows, n] contiguous. Returns (norm(x + residual), x + residual), both new.
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                        const torch::Tensor& weight, double eps) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  auto sum = torch::empty_like(x);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* a = xp + r * n;
      const float* b = rp + r * n;
      float* s = sp + r * n;
#pragma omp simd
      for (int64_t d = 0; d < n; ++d) s[d] = a[d] + b[d];
      norm_row(s, wp, feps, n, op + r * n);
    }
  });
  return {out, sum};
}

// q: [tokens, heads, hd], k: [tokens, kv_heads, hd] (any strides, hd contiguous); positions: int64 [tokens];
// cos_sin: fp32 [max_pos, hd] (cos in the first half, sin in the second). Returns new contiguous (q, k).
std::vector<torch::Tensor> rotary(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& positions,
                                  const torch::Tensor& cos_sin) {
  const int64_t tokens = q.size(0), hq = q.size(1), hk = k.size(1), hd = q.size(2), half = hd / 2;
  auto q_out = torch::empty({tokens, hq, hd}, q.options());
  auto k_out = torch::empty({tokens, hk, hd}, k.options());
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cs = cos_sin.data_ptr<float>();
  const int64_t cs_stride = cos_sin.stride(0);
  auto rotate = [&](const torch::Tensor& src, torch::Tensor& dst, int64_t t, int64_t heads) {
    const float* c = cs + pos[t] * cs_stride;
    const float* s = c + half;
    const float* base = src.data_ptr<float>() + t * src.stride(0);
    float* out = dst.data_ptr<float>() + t * heads * hd;
    for (int64_t h = 0; h < heads; ++h) {
      const float* x = base + h * src.stride(1);
      float* y = out + h * hd;
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) {
        y[d] = x[d] * c[d] - x[d + half] * s[d];
        y[d + half] = x[d + half] * c[d] + x[d] * s[d];
      }
    }
  };
  at::parallel_for(0, tokens, grain((hq + hk) * hd), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate(q, q_out, t, hq);
      rotate(k, k_out, t, hk);
    }
  });
  return {q_out, k_out};
}

// gate_up: [rows, 2 * n] contiguous. Returns silu(gate_up[:, :n]) * gate_up[:, n:], [rows, n].
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * 2 * n;
      const float* u = g + n;
      float* o = op + r * n;
      silu_mul_row(g, u, o, n);
    }
  });
  return out;
}

// key, value: [tokens, kv_heads, hd] (rows may be strided, each token's heads contiguous);
// k_cache, v_cache: [num_blocks, block_size, kv_heads, hd] views whose (kv_heads, hd) is contiguous.
namespace {

// Quantized per element: x (fp32, or bf16 made fp32) / scale, then rounded as torch's cast rounds
// (pd_kernels.fp8.quantize).
template <typename T, typename S>
void store_fp8_rows(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& k_cache,
                    torch::Tensor& v_cache, const int64_t* slots, float k_scale, float v_scale) {
  const int64_t tokens = key.size(0), heads = key.size(1), head_dim = key.size(2), block_size = k_cache.size(1);
  auto store = [&](const torch::Tensor& src, torch::Tensor& cache, float scale, int64_t t, int64_t slot) {
    uint8_t* dst = static_cast<uint8_t*>(cache.data_ptr()) + (slot / block_size) * cache.stride(0) +
                   (slot % block_size) * cache.stride(1);
    const S* from = static_cast<const S*>(src.data_ptr()) + t * src.stride(0);
    float row[256];  // pd_kernels.checks.MAX_HEAD_DIM
    for (int64_t h = 0; h < heads; ++h) {
      pd_cpu::load_row<S>(from + h * src.stride(1), row, head_dim);
      for (int64_t d = 0; d < head_dim; ++d) dst[h * cache.stride(2) + d] = pd_cpu::float_to_fp8<T>(row[d] / scale);
    }
  };
  at::parallel_for(0, tokens, grain(2 * heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      store(key, k_cache, k_scale, t, slots[t]);
      store(value, v_cache, v_scale, t, slots[t]);
    }
  });
}

}  // namespace

void store_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& k_cache, torch::Tensor& v_cache,
              const torch::Tensor& slot_mapping, double k_scale, double v_scale) {
  TORCH_CHECK(key.size(2) <= 256, "store_kv: head_dim ", key.size(2), " is over 256");
  const int64_t* slot_ids = slot_mapping.data_ptr<int64_t>();
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  const bool bf16 = key.scalar_type() == at::kBFloat16;
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
    return bf16 ? store_fp8_rows<pd_cpu::E4m3, pd_cpu::Bf16>(key, value, k_cache, v_cache, slot_ids, ks, vs)
                : store_fp8_rows<pd_cpu::E4m3, float>(key, value, k_cache, v_cache, slot_ids, ks, vs);
  }
  if (k_cache.scalar_type() == at::kFloat8_e5m2) {
    return bf16 ? store_fp8_rows<pd_cpu::E5m2, pd_cpu::Bf16>(key, value, k_cache, v_cache, slot_ids, ks, vs)
                : store_fp8_rows<pd_cpu::E5m2, float>(key, value, k_cache, v_cache, slot_ids, ks, vs);
  }
  // Any strides with head_dim contiguous: one copy per token where both sides' heads lie back to back,
  // else one per head (a pool with heads outermost within a block).
  const int64_t tokens = key.size(0), heads = key.size(1), head_dim = key.size(2), block_size = k_cache.size(1);
  const int64_t row = heads * head_dim;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  // The cache's element type is the rows': fp32, bf16 or fp16, copied as bytes.
  const int64_t item = key.element_size();
  auto copy = [&](const torch::Tensor& src, torch::Tensor& cache, int64_t t, int64_t slot) {
    char* dst = static_cast<char*>(cache.data_ptr()) +
                ((slot / block_size) * cache.stride(0) + (slot % block_size) * cache.stride(1)) * item;
    const char* from = static_cast<const char*>(src.data_ptr()) + t * src.stride(0) * item;
    if (cache.stride(2) == head_dim && src.stride(1) == head_dim) {
      std::memcpy(dst, from, row * item);
      return;
    }
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(dst + h * cache.stride(2) * item, from + h * src.stride(1) * item, head_dim * item);
  };
  at::parallel_for(0, tokens, grain(2 * row), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      copy(key, k_cache, t, slots[t]);
      copy(value, v_cache, t, slots[t]);
    }
  });
}
