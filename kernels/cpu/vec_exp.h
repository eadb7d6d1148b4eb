// Shared by the cpu backend's attention kernels (included inside their anonymous namespaces' files).
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstdint>

namespace pd_cpu {

// p[t] = exp(s[t] - m) for t < n; returns the sum. NaN in, NaN out. Vectorised with
// ATen's Vectorized (Sleef's expf, as torch's own softmax); std::exp alone stays scalar.
inline float exp_shifted(float* s, int64_t n, float m) {
  using Vec = at::vec::Vectorized<float>;
  const Vec shift(m);
  Vec sums(0.f);
  int64_t t = 0;
  for (; t + Vec::size() <= n; t += Vec::size()) {
    const Vec e = (Vec::loadu(s + t) - shift).exp();
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
