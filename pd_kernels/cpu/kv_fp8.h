// KV page elements other than fp32: reading a row of them as floats, and storing floats into FP8.
//
// The kernels read keys and values of any of these element types into an fp32 row (L1-resident,
// head_dim floats) and compute in fp32; the scales (pd_kernels/fp8.py) are folded in by the caller.
//
//   float   as is
//   Bf16    the top half of an fp32: u32 = u16 << 16
//   E5m2    the top byte of an fp16: u16 = u8 << 8, then fp16 -> fp32 (F16C where built with it)
//   E4m3    sign, then exponent and mantissa moved into an fp16 with its exponent bias 8 short, so
//           fp16 -> fp32 (F16C) gives the value / 2^8, exact, e4m3's subnormals included (they are
//           fp16 normals); the callers fold the 2^8 into their scales (kRowFactor). S.1111.111,
//           e4m3fn's one NaN code, reads as NaN
//
// Storing follows torch's fp32 -> fp8 cast: saturated to the finite range (the caller divides by
// the scale first), rounded to nearest, ties to even, NaN to the format's NaN.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace pd_cpu {

struct Bf16;
struct E4m3;
struct E5m2;

// load_row's floats are the values divided by this: the caller multiplies it into its scale.
template <typename T>
constexpr float kRowFactor = std::is_same_v<T, E4m3> ? 256.f : 1.f;

struct Bf16 { uint16_t bits; };
struct E4m3 { uint8_t bits; };
struct E5m2 { uint8_t bits; };

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// fp16 bits -> float, exactly (subnormals, infinities and NaN included), without F16C.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000 | (mantissa << 13));
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

inline uint16_t e4m3_half_bits(uint8_t b) {
  return static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7f) << 7));
}

// The value / kRowFactor<E4m3>, as load_row gives it.
inline float e4m3_to_float(uint8_t b) {
  if ((b & 0x7f) == 0x7f) return std::numeric_limits<float>::quiet_NaN();
  return half_to_float(e4m3_half_bits(b));
}

inline float e5m2_to_float(uint8_t b) { return half_to_float(static_cast<uint16_t>(b << 8)); }

// dst[0 .. n) = src's row as floats divided by kRowFactor<T>; n is a multiple of 8 (pd_kernels.checks: head_dim).
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (std::is_same_v<T, Bf16>) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) dst[d] = bits_float(static_cast<uint32_t>(s[d]) << 16);
  } else {
    static_assert(std::is_same_v<T, E4m3> || std::is_same_v<T, E5m2>, "a KV element type");
    const uint8_t* s = reinterpret_cast<const uint8_t*>(src);
#if defined(__F16C__)
    int64_t d = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    // e4m3: thirty-two at a time, the integer work on 16-bit lanes of one register, NaN codes found
    // with a mask compare; the rest sixteen at a time.
    if constexpr (std::is_same_v<T, E4m3>) {
      const __m512 nan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
      for (; d + 32 <= n; d += 32) {
        const __m512i shifted =
            _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + d))), 7);
        const __m512i half = _mm512_add_epi16(shifted, _mm512_and_si512(shifted, _mm512_set1_epi16(0x4000)));
        const __mmask32 nans = _mm512_cmpeq_epi16_mask(_mm512_and_si512(shifted, _mm512_set1_epi16(0x3f80)),
                                                        _mm512_set1_epi16(0x3f80));
        _mm512_storeu_ps(dst + d, _mm512_mask_mov_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(half)),
                                                     static_cast<__mmask16>(nans), nan));
        _mm512_storeu_ps(dst + d + 16, _mm512_mask_mov_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1)),
                                                          static_cast<__mmask16>(nans >> 16), nan));
      }
    }
    // Sixteen at a time, NaN codes found with a mask compare: half the instructions of the AVX2 loop.
    for (; d + 16 <= n; d += 16) {
      const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + d)));
      if constexpr (std::is_same_v<T, E5m2>) {
        _mm512_storeu_ps(dst + d, _mm512_cvtph_ps(_mm256_slli_epi16(bytes, 8)));
      } else {
        // bits << 7 puts the magnitude in fp16's bits 13..7 and the sign in bit 14; adding bit 14 to
        // itself carries the sign into bit 15 and clears bit 14.
        const __m256i shifted = _mm256_slli_epi16(bytes, 7);
        const __m256i half = _mm256_add_epi16(shifted, _mm256_and_si256(shifted, _mm256_set1_epi16(0x4000)));
        const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(shifted, _mm256_set1_epi16(0x3f80)),
                                                      _mm256_set1_epi16(0x3f80));
        _mm512_storeu_ps(dst + d, _mm512_mask_mov_ps(_mm512_cvtph_ps(half), nan,
                                                     _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN())));
      }
    }
#endif
    for (; d < n; d += 8) {
      __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + d)));
      if constexpr (std::is_same_v<T, E5m2>) {
        _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_slli_epi16(bytes, 8)));
      } else {
        const __m128i magnitude = _mm_and_si128(bytes, _mm_set1_epi16(0x7f));
        const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x80)), 8),
                                          _mm_slli_epi16(magnitude, 7));
        __m256 values = _mm256_cvtph_ps(half);
        const __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7f))));
        values = _mm256_blendv_ps(values, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), nan);
        _mm256_storeu_ps(dst + d, values);
      }
    }
#else
    for (int64_t d = 0; d < n; ++d) dst[d] = std::is_same_v<T, E5m2> ? e5m2_to_float(s[d]) : e4m3_to_float(s[d]);
#endif
  }
}

// float -> FP8 bits, as torch casts: round to nearest even, saturated (|x| past the largest finite
// value stores that value's code), NaN to the NaN code. Bias: the fp32 exponent minus kBias's.
// E4m3: 4 exponent bits, 3 mantissa bits, smallest normal 2^-6, largest 448, NaN 0x7f.
// E5m2: 5 exponent bits, 2 mantissa bits, smallest normal 2^-14, largest 57344, NaN 0x7f (torch's).
template <typename T>
inline uint8_t float_to_fp8(float x) {
  constexpr bool e4 = std::is_same_v<T, E4m3>;
  constexpr int kMantissa = e4 ? 3 : 2, kShift = 23 - kMantissa, kBias = e4 ? 120 : 112;
  constexpr uint32_t kMaxBits = e4 ? 0x43e00000u : 0x47600000u;  // 448, 57344
  constexpr uint32_t kMinNormal = e4 ? 0x3c800000u : 0x38800000u;  // 2^-6, 2^-14
  constexpr float kSubnormalSteps = e4 ? 512.f : 65536.f;  // 1 / the subnormal step (2^-9, 2^-16)
  constexpr uint8_t kMaxCode = e4 ? 0x7e : 0x7b;
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7f;
  if (magnitude >= kMaxBits) return sign | kMaxCode;
  if (magnitude < kMinNormal) {  // the subnormal range: a multiple of the step, rounded to even
    return sign | static_cast<uint8_t>(std::nearbyint(bits_float(magnitude) * kSubnormalSteps));
  }
  const uint32_t rounded = (magnitude + ((1u << (kShift - 1)) - 1) + ((magnitude >> kShift) & 1)) >> kShift;
  return sign | static_cast<uint8_t>(rounded - (static_cast<uint32_t>(kBias) << kMantissa));
}

}  // namespace pd_cpu
