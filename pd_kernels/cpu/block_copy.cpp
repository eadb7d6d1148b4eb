// Whole KV blocks copied between block-major pools, one streamed copy per block:
//
//   dst[dst_ids[i]] = src[src_ids[i]]     for every i
//
// The host tier's promotions and demotions (pd/engine/tiers/host.py): aten's
// index_copy_ walks a block in strided element chunks and costs a quarter of
// a memcpy's bandwidth more at 64 KiB blocks. Any dtype: bytes are bytes.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <vector>

namespace {

// The fewest blocks a thread takes: fewer are copied on the calling thread, where waking
// another costs more than it saves.
constexpr int64_t kBlocksPerTask = 4;

// A block is copied with streaming (non-temporal) stores: it is written whole
// and read later by attention, so filling the cache with it on the way (and
// reading each destination line first, as plain stores do) only costs
// bandwidth. glibc's memcpy streams only copies larger than most of the L3.
void stream_copy(char* to, const char* from, size_t bytes) {
  if (reinterpret_cast<uintptr_t>(to) % 32 != 0 || bytes % 32 != 0) {
    std::memcpy(to, from, bytes);
    return;
  }
#if defined(__AVX2__)
  for (size_t i = 0; i < bytes; i += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(to + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + i)));
  }
#else
  for (size_t i = 0; i < bytes; i += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i)));
  }
#endif
}

}  // namespace

void copy_blocks(const torch::Tensor& src, const std::vector<int64_t>& src_ids, torch::Tensor& dst,
                 const std::vector<int64_t>& dst_ids) {
  TORCH_CHECK(src.device().is_cpu() && dst.device().is_cpu(), "copy_blocks: CPU tensors only");
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), "copy_blocks: contiguous pools only");
  TORCH_CHECK(src.dtype() == dst.dtype(), "copy_blocks: the pools' dtypes differ");
  TORCH_CHECK(src.dim() >= 1 && dst.dim() >= 1 && src.size(0) > 0 && dst.size(0) > 0, "copy_blocks: empty pool");
  TORCH_CHECK(src[0].numel() == dst[0].numel(), "copy_blocks: the pools' blocks differ in size");
  TORCH_CHECK(src_ids.size() == dst_ids.size(), "copy_blocks: the two lists of block ids differ in length");
  const int64_t n = static_cast<int64_t>(src_ids.size());
  const int64_t* s = src_ids.data();
  const int64_t* d = dst_ids.data();
  const size_t row = static_cast<size_t>(src[0].numel()) * src.element_size();
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(dst.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(s[i] >= 0 && s[i] < src.size(0) && d[i] >= 0 && d[i] < dst.size(0), "copy_blocks: block id out of range");
  }
  // Blocks split over torch's intra-op threads, as its own copy_ splits a tensor: one core's loads
  // and stores do not fill the memory bandwidth. Each thread fences its own streamed stores.
  at::parallel_for(0, n, kBlocksPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      stream_copy(to + d[i] * row, from + s[i] * row, row);
    }
    _mm_sfence();  // the streamed stores are visible before the caller goes on
  });
}
