// The int8 GEMM of a W8A8 layer, out[M, N] (int32) = xq[M, K] . w[N, K]^T, for hosts where torch._int_mm
// has no fast path.
//
// torch._int_mm on CPU calls oneDNN's s8s8s32 GEMM only where the host has AVX512-VNNI; elsewhere it runs a
// plain triple loop. On a 2-core AMD EPYC with AVX2 (no VNNI) that loop made an INT8 layer 36x slower than
// the same layer in fp32 (about 0.9 G multiply-adds a second on one core), so pd_kernels/int8.py sends the
// GEMM here on such hosts.
//
// The products are exact: each int8 pair widens to int16, multiplies, and adds in pairs into int32 lanes
// (vpmaddwd), so the result equals torch._int_mm's bit for bit whatever the order. |x|, |w| <= 127 (the
// quantizer clamps to +-127), so a pair sum is at most 32,258 and K up to 130,000 cannot overflow int32.
//
//   for each group of C rows of w (out features) and R rows of xq:
//     for k in steps of 16:  acc[r][c] += madd(widen(xq[r, k:k+16]), widen(w[c, k:k+16]))   (8 int32 lanes)
//     out[r, c] = sum of acc[r][c]'s lanes (+ the last K % 16 products, scalar)
//
// R = 2 and C = 4 hold 8 accumulators, 2 rows of xq and a row of w in 11 of AVX2's 16 registers; w's group
// (4 x K bytes) stays in L1 while every row of xq passes over it. Groups of w are split across the threads.
// The DEFAULT build (no AVX2) runs the same blocking in plain loops.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define PD_INT8_AVX2 1
#endif

#include <algorithm>
#include <cstdint>

namespace {

constexpr int kRows = 2;
constexpr int kCols = 4;
// Multiply-adds a task should hold at least, so that splitting a small GEMM costs less than the fork.
constexpr int64_t kMinTaskMacs = 1 << 18;

#ifdef PD_INT8_AVX2
inline __m256i widen(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline int32_t lanes_sum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}
#endif

// out[r, c] for R rows of x from x (stride K) and C rows of w from w (stride K); out's row stride is ldo.
template <int R, int C>
void block(const int8_t* x, const int8_t* w, int64_t K, int32_t* out, int64_t ldo) {
  int32_t sums[R][C];
  int64_t k = 0;
#ifdef PD_INT8_AVX2
  __m256i acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_si256();
  for (; k + 16 <= K; k += 16) {
    __m256i xv[R];
    for (int r = 0; r < R; ++r) xv[r] = widen(x + r * K + k);
    for (int c = 0; c < C; ++c) {
      const __m256i wv = widen(w + c * K + k);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(xv[r], wv));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r][c] = lanes_sum(acc[r][c]);
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r][c] = 0;
#endif
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        sums[r][c] += static_cast<int32_t>(x[r * K + k]) * static_cast<int32_t>(w[c * K + k]);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = sums[r][c];
}

template <int C>
void rows_of(const int8_t* x, int64_t M, const int8_t* w, int64_t K, int32_t* out, int64_t N) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) block<kRows, C>(x + m * K, w, K, out + m * N, N);
  if (m < M) block<1, C>(x + m * K, w, K, out + m * N, N);
}

void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2, name, ": expected 2 dimensions, got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == torch::kChar, name, ": expected int8, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, ": must be contiguous, strides ", t.strides());
  TORCH_CHECK(t.device().is_cpu(), name, ": must be on the CPU");
}

}  // namespace

torch::Tensor int8_gemm(const torch::Tensor& xq, const torch::Tensor& w) {
  check(xq, "xq");
  check(w, "w");
  const int64_t M = xq.size(0), K = xq.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "w: in_features ", w.size(1), " differs from xq's ", K);
  auto out = torch::empty({M, N}, xq.options().dtype(torch::kInt));
  if (M == 0 || N == 0) return out;
  const int8_t* xp = xq.data_ptr<int8_t>();
  const int8_t* wp = w.data_ptr<int8_t>();
  int32_t* op = out.data_ptr<int32_t>();
  const int64_t groups = (N + kCols - 1) / kCols;
  const int64_t grain = std::max<int64_t>(1, kMinTaskMacs / std::max<int64_t>(1, M * K * kCols));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n = g * kCols;
      const int8_t* wg = wp + n * K;
      switch (std::min<int64_t>(kCols, N - n)) {
        case 4: rows_of<4>(xp, M, wg, K, op + n, N); break;
        case 3: rows_of<3>(xp, M, wg, K, op + n, N); break;
        case 2: rows_of<2>(xp, M, wg, K, op + n, N); break;
        default: rows_of<1>(xp, M, wg, K, op + n, N); break;
      }
    }
  });
  return out;
}
