// float32 <-> storage-type conversions the compiler can vectorise (the c10 operators are scalar calls).
#pragma once
#include <torch/types.h>  // not torch/extension.h (pybind11, torch::nn): ~3x the compile time per file

#include <cmath>
#include <cstdint>
#include <bit>

template <typename T>
static inline float to_float(T v) { return static_cast<float>(v); }

template <>
inline float to_float<c10::BFloat16>(c10::BFloat16 v) {
  // bfloat16 is the top half of a float32.
  return std::bit_cast<float>(static_cast<uint32_t>(v.x) << 16);
}

template <typename T>
static inline T from_float(float f) { return static_cast<T>(f); }

template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float f) {
  // Round to nearest even, as c10::BFloat16(float) and torch's own kernels do; NaN stays NaN.
  const uint32_t u = std::bit_cast<uint32_t>(f);
  uint16_t bits = f != f ? uint16_t(0x7FC0) : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return c10::BFloat16(bits, c10::BFloat16::from_bits());
}

// Round a float32 through T and back: reproduces the rounding of an intermediate stored in T.
template <typename T>
static inline float round_to(float f) { return to_float<T>(from_float<T>(f)); }

// exp(x) for float32 in plain arithmetic the compiler vectorises (libm's expf is a scalar call).
// Cephes' expf: x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial, 2^n through the
// exponent bits. Relative error about 2e-7 (float rounding); inputs are clamped to the finite range.
static inline float exp_fast(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
  // Round to nearest by the 1.5 * 2^23 trick: floorf() would not vectorise without -ffast-math.
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

// tanh(y) = sign(y) (1 - e) / (1 + e) with e = exp(-2|y|) in (0, 1], so nothing overflows and loops over it
// vectorise (libm's tanhf is a scalar call). Absolute error about 2e-7 (exp_fast's).
static inline float tanh_fast(float y) {
  const float e = exp_fast(-2.f * std::fabs(y));
  const float t = (1.f - e) / (1.f + e);
  return y < 0.f ? -t : t;
}

// s[i] -> cap * tanh(s[i] / cap) for n scores in place: Gemma 2's attention logit soft-capping, applied to the
// scaled scores before the mask and softmax (transformers' Gemma2 eager attention). The absolute error of a
// capped score is about cap * 2e-7 (tanh_fast's), which the softmax turns into a relative error of the same
// size in the probabilities.
static inline void softcap_inplace(float* s, int64_t n, float cap) {
  const float inv = 1.f / cap;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) s[i] = cap * tanh_fast(s[i] * inv);
}
