// Vectorisable float exp, sigmoid and sqrt for the CPU backend's inner loops (tested in cpu_ops_test.cpp).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__SSE__)
#include <immintrin.h>
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#endif

#ifdef __FAST_MATH__
#error "cpu_math.h rounds with the 1.5 * 2^23 trick, which -ffast-math would fold away"
#endif

namespace mpigpt::cpu {

// glibc's expf is a scalar call unless the build uses -ffast-math, which the reference backend must
// not; these inline, branch-free versions let GCC vectorise the softmax, cross-entropy, GELU and SiLU
// loops while staying within a couple of ulp of the exact functions. Branch-free matters: with the
// default -ftrapping-math GCC will not if-convert a select whose arms compute, so only min/max-shaped
// selects appear below.

// e^x: Cephes expf range reduction and polynomial (relative error ~1e-7 over the normal range).
// The input is clamped to [-104, 89] and the scale 2^n applied as two factors 2^(n/2) 2^(n-n/2), so
// that results below the normal range round gradually to 0 and above it overflow to +inf, as libm
// does, without a branch; NaN propagates.
inline float vexp(float x) {
  x = x < -104.0f ? -104.0f : x;
  x = x > 89.0f ? 89.0f : x;
  // n = round(x / ln2) by adding and removing 1.5 * 2^23 (exact for |x / ln2| < 2^22).
  const float fx = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  // r = x - n ln2 in two pieces (ln2 = 0.693359375 - 2.12194440e-4) so that r keeps full precision.
  const float r = (x - fx * 0.693359375f) + fx * 2.12194440e-4f;
  const float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  const int32_t n = int32_t(fx), h = n / 2;
  const uint32_t b1 = uint32_t(h + 127) << 23, b2 = uint32_t(n - h + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, sizeof s1);
  std::memcpy(&s2, &b2, sizeof s2);
  return p * s1 * s2;
}

// 1 / (1 + e^{-x}): relative error ~2e-7 everywhere, the tail x << 0 included (0 below x = -88.7).
inline float vsigmoid(float x) { return 1.0f / (1.0f + vexp(-x)); }

// sigmoid(x) and 1 - sigmoid(x) without cancellation: s = 1/(1+e), 1-s = e s with e = e^{-x}. e is
// capped at 1e30 so that e s stays finite (= 1) in the far tail; that moves s by < 1e-30 absolute.
inline void vsigmoid2(float x, float& s, float& one_minus_s) {
  float e = vexp(-x);
  e = e > 1e30f ? 1e30f : e;
  s = 1.0f / (1.0f + e);
  one_minus_s = e * s;
}

// x[i] = sqrt(x[i]) for i < n, correctly rounded (bitwise std::sqrt). GCC vectorises a std::sqrt
// loop only under -fno-math-errno (it must otherwise keep the errno call for negative inputs),
// which the build does not pass, so the vector instructions are spelled out.
inline void sqrt_inplace(float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_sqrt_ps(_mm256_loadu_ps(x + i)));
#endif
#if defined(__SSE__)
  for (; i + 4 <= n; i += 4) _mm_storeu_ps(x + i, _mm_sqrt_ps(_mm_loadu_ps(x + i)));
#elif defined(__ARM_NEON) && defined(__aarch64__)
  for (; i + 4 <= n; i += 4) vst1q_f32(x + i, vsqrtq_f32(vld1q_f32(x + i)));
#endif
  for (; i < n; ++i) x[i] = std::sqrt(x[i]);
}

}  // namespace mpigpt::cpu
