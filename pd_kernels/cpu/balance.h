// Tasks of unequal cost over the compute threads. at::parallel_for hands each thread an equal,
// contiguous range of tasks; a causal prefill's query tiles cost 1, 2, 3 ... blocks of keys, so
// with two threads the second got three quarters of the work. Here each task goes to the thread
// with the least work so far, the costliest first (LPT: within 4/3 of the best split).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace pd_cpu {

// Calls fn(tasks) once per thread with that thread's share of [0, costs.size()): every task in
// exactly one share, the shares' summed costs as equal as LPT makes them. The calls run
// concurrently, so a share's scratch memory can live in fn.
template <typename Fn>
void parallel_balanced(const std::vector<int64_t>& costs, const Fn& fn) {
  const int64_t n = static_cast<int64_t>(costs.size());
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), n);
  if (parts <= 1) {
    std::vector<int64_t> all(n);
    std::iota(all.begin(), all.end(), 0);
    if (n > 0) fn(all);
    return;
  }
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return costs[x] > costs[y]; });
  std::vector<std::vector<int64_t>> bins(parts);
  std::vector<int64_t> load(parts, 0);
  for (int64_t t : order) {
    const int64_t b = std::min_element(load.begin(), load.end()) - load.begin();
    bins[b].push_back(t);
    load[b] += costs[t];
  }
  // One bin per thread: a range of `parts` with grain 1 gives each thread one index.
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) fn(bins[b]);
  });
}

}  // namespace pd_cpu
