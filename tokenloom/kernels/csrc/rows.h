// One row's work of the elementwise kernels (elementwise.cpp), shared with the decode stack's threaded step
// (decode_stack.cpp), which runs them on its own threads: the same code, so the same values bit for bit.
#pragma once
#include <cmath>
#include <cstdint>

#include "dtype.h"

// normed = weight * round(x * rsqrt(mean(x^2) + eps)), computed in float32; H values, h: H floats of scratch.
// With `res`: x = round(x + res) first, and that sum is written to new_res (when not null).
template <typename T>
inline void add_rms_norm_row(const T* xr, const T* rr, const T* w, T* orow, T* nr, int64_t H, float eps, float* h) {
  float ss = 0.f;
  if (rr != nullptr) {
    for (int64_t i = 0; i < H; ++i) {
      const float v = round_to<T>(to_float(xr[i]) + to_float(rr[i]));
      if (nr != nullptr) nr[i] = from_float<T>(v);
      h[i] = v;
    }
  } else {
    for (int64_t i = 0; i < H; ++i) h[i] = to_float(xr[i]);
  }
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += h[i] * h[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) orow[i] = from_float<T>(to_float(w[i]) * round_to<T>(h[i] * inv));
}

// (2I) [gate | up] -> (I): round(act(gate)) * up; f: I floats of scratch. Three simple passes vectorise
// where one fused loop over the storage type does not.
template <typename T, typename Act>
inline void gated_and_mul_row(const T* gate, T* o, int64_t I, Act act, float* f) {
  const T* up = gate + I;
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) f[i] = to_float(gate[i]);
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) f[i] = round_to<T>(act(f[i])) * to_float(up[i]);
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) o[i] = from_float<T>(f[i]);
}

// SwiGLU's activation, F.silu.
inline float silu(float g) { return g / (1.f + exp_fast(-g)); }

// Neox-style RoPE in place on one token's H heads of D values (heads dense), with that token's cos/sin (D):
// x1' = round(round(x1 * c) + round(-x2 * s)),  x2' = round(round(x2 * c) + round(x1 * s)).
// c, s: D floats of scratch; a, b: D / 2 each.
template <typename T>
inline void rope_token(T* x, const T* cos, const T* sin, int64_t H, int64_t D, float* c, float* s, float* a, float* b) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) {
    c[i] = to_float(cos[i]);
    s[i] = to_float(sin[i]);
  }
  for (int64_t h = 0; h < H; ++h) {
    T* __restrict__ v1 = x + h * D;
    T* __restrict__ v2 = v1 + half;
    float* __restrict__ pa = a;
    float* __restrict__ pb = b;
    const float* __restrict__ pc = c;
    const float* __restrict__ ps = s;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_float(v1[i]), x2 = to_float(v2[i]);
      pa[i] = round_to<T>(x1 * pc[i]) + round_to<T>(-x2 * ps[i]);
      pb[i] = round_to<T>(x2 * pc[i + half]) + round_to<T>(x1 * ps[i + half]);
    }
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      v1[i] = from_float<T>(pa[i]);
      v2[i] = from_float<T>(pb[i]);
    }
  }
}
