// Shared by the cpu backend's attention kernels (included inside their anonymous namespaces' files).
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace pd_cpu {

// p[t] = exp(s[t] - m) for t < n, m being the row's max (NaN if any s[t] is); returns the sum.
// Vectorised with ATen's exp_u20 (range reduction, then a degree-5 polynomial: within 20 ulp), the
// exponential torch's own CPU flash attention uses, which the reference's SDPA runs; std::exp alone
// stays scalar. At head dim 32 a score's exponential costs as much as its dot product, and exp_u20
// made the prefill kernel 10-15% faster than Sleef's expf (u10) did at 488 keys. It clamps its
// input, so NaN would not survive it: a NaN or +inf max (the reference's softmax gives that row
// NaN) is answered here, and NaN in, NaN out still holds.
inline float exp_shifted(float* s, int64_t n, float m) {
  using Vec = at::vec::Vectorized<float>;
  if (std::isnan(m) || m == std::numeric_limits<float>::infinity()) {
    std::fill(s, s + n, std::numeric_limits<float>::quiet_NaN());
    return std::numeric_limits<float>::quiet_NaN();
  }
  const Vec shift(m);
  Vec sums(0.f);
  int64_t t = 0;
  for (; t + Vec::size() <= n; t += Vec::size()) {
    const Vec e = (Vec::loadu(s + t) - shift).exp_u20();
    e.store(s + t);
    sums = sums + e;
  }
  float lanes[Vec::size()];
  sums.store(lanes);
  float sum = 0.f;
  for (int64_t i = 0; i < Vec::size(); ++i) sum += lanes[i];
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return sum;
}

}  // namespace pd_cpu
