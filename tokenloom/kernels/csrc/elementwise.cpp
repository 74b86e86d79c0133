// Fused elementwise kernels for the CPU: residual add + RMSNorm, SiLU-and-mul, rotary embedding.
//
// Each reproduces the torch reference in models/layers.py operation by operation, rounding every
// intermediate the reference stores to the tensor dtype, so bfloat16 results match it bit for bit
// in the common case (float32 accumulation order may differ in the last place).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "dtype.h"
#include "kernels.h"

// Rows per parallel chunk such that a chunk holds at least ~32k elements. Smaller jobs (a decode
// step's few rows) run on the calling thread: a 2-thread OpenMP region for microseconds of work costs
// more than it saves, and stalls whole when another thread of the process (the HTTP event loop)
// holds one of the cores.
static inline int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, (int64_t{1} << 15) / row_elems); }

// normed = weight * round(x * rsqrt(mean(x^2) + eps)), computed in float32.
// With `residual`: x = round(x + residual) first, and that sum is returned as the new residual.
template <typename T>
static void add_rms_norm_kernel(const T* x, const T* res, const T* w, T* out, T* new_res, int64_t rows, int64_t H,
                                float eps) {
  at::parallel_for(0, rows, grain_rows(H), [&](int64_t begin, int64_t end) {
    std::vector<float> h(H);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * H;
      float ss = 0.f;
      if (res != nullptr) {
        const T* rr = res + r * H;
        T* nr = new_res + r * H;
        for (int64_t i = 0; i < H; ++i) {
          float v = round_to<T>(to_float(xr[i]) + to_float(rr[i]));
          nr[i] = from_float<T>(v);
          h[i] = v;
        }
      } else {
        for (int64_t i = 0; i < H; ++i) h[i] = to_float(xr[i]);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += h[i] * h[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      T* orow = out + r * H;
      for (int64_t i = 0; i < H; ++i) orow[i] = from_float<T>(to_float(w[i]) * round_to<T>(h[i] * inv));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "add_rms_norm: contiguous inputs");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "add_rms_norm: x and weight dtypes differ");
  const int64_t H = x.size(-1), rows = x.numel() / H;
  at::Tensor out = at::empty_like(x);
  at::Tensor new_res = residual.has_value() ? at::empty_like(x) : x;
  if (residual.has_value()) TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "add_rms_norm: residual shape");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(),
                                  residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr,
                                  weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                  residual.has_value() ? new_res.data_ptr<scalar_t>() : nullptr, rows, H,
                                  static_cast<float>(eps));
  });
  return {out, new_res};
}

// (T, 2I) [gate | up] -> (T, I): round(silu(gate)) * up, as F.silu(gate) * up does in T.
template <typename T>
static void silu_and_mul_kernel(const T* in, T* out, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, grain_rows(2 * I), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(I);
    float* __restrict__ f = buf.data();
    for (int64_t r = begin; r < end; ++r) {
      const T* __restrict__ gate = in + r * 2 * I;
      const T* __restrict__ up = gate + I;
      T* __restrict__ o = out + r * I;
      // Three simple passes vectorise where one fused loop over the storage type does not.
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) f[i] = to_float(gate[i]);
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) f[i] = round_to<T>(f[i] / (1.f + exp_fast(-f[i]))) * to_float(up[i]);
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = from_float<T>(f[i]);
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 2 == 0, "silu_and_mul: contiguous (..., 2I) input");
  const int64_t I = x.size(-1) / 2, rows = x.numel() / x.size(-1);
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  at::Tensor out = at::empty(sizes, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_kernel<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, I);
  });
  return out;
}

// Neox-style RoPE in place: x (T, H, D) with row stride `row_stride`; cos/sin (T, D) already in T.
// x1' = round(round(x1 * c) + round(-x2 * s)),  x2' = round(round(x2 * c) + round(x1 * s))
template <typename T>
static void rope_kernel(T* x, int64_t row_stride, const T* cos, const T* sin, int64_t tokens, int64_t H, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, tokens, grain_rows(H * D), [&](int64_t begin, int64_t end) {
    std::vector<float> c(D), s(D), a(half), b(half);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < D; ++i) {
        c[i] = to_float(cos[t * D + i]);
        s[i] = to_float(sin[t * D + i]);
      }
      for (int64_t h = 0; h < H; ++h) {
        T* __restrict__ v1 = x + t * row_stride + h * D;
        T* __restrict__ v2 = v1 + half;
        float* __restrict__ pa = a.data();
        float* __restrict__ pb = b.data();
        const float* __restrict__ pc = c.data();
        const float* __restrict__ ps = s.data();
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
  });
}

// q: (T, Hq, D), k: (T, Hkv, D) views into the fused qkv projection (rows may be strided).
void rotary_inplace(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(1) == k.size(2),
              "rotary_inplace: heads must be dense within a token");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == q.scalar_type(), "rotary_inplace: cos/sin");
  const int64_t T = q.size(0), D = q.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_inplace", [&] {
    rope_kernel<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), T, q.size(1), D);
    rope_kernel<scalar_t>(k.data_ptr<scalar_t>(), k.stride(0), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), T, k.size(1), D);
  });
}

// Structured outputs: a grammar's token bitmask over the rows it constrains. For each listed row r,
// logits[r, j] = -inf where bit (j % 32) of bitmask[r, j / 32] is 0; columns past the bitmask's W * 32 are
// masked too. logits (R, V) float32 with unit column stride; bitmask (R, W) int32 contiguous; rows (n,)
// int64, each in [0, R). With AVX-512: one masked store of -inf per 16 logits (nothing written where all 16
// are allowed); the scalar loop does the tail and is the whole kernel elsewhere.
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "apply_token_bitmask: float32 (R, V) logits with unit column stride");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() &&
              bitmask.size(0) == logits.size(0), "apply_token_bitmask: contiguous int32 (R, W) bitmask");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "apply_token_bitmask: int64 (n,) rows");
  const int64_t R = logits.size(0), V = logits.size(1), W = bitmask.size(1), n = rows.size(0);
  const int64_t covered = std::min<int64_t>(V, W * 32), ls = logits.stride(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < R, "apply_token_bitmask: row out of range");
  float* lp = logits.data_ptr<float>();
  const uint32_t* mp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, grain_rows(V), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* __restrict__ l = lp + rp[i] * ls;
      const uint32_t* __restrict__ m = mp + rp[i] * W;
      int64_t j = 0;
#ifdef __AVX512F__
      const __m512 minus_inf = _mm512_set1_ps(ninf);
      for (; j + 16 <= covered; j += 16) {  // j is a multiple of 16: its 16 bits sit in one word
        const __mmask16 masked = static_cast<__mmask16>(~(m[j >> 5] >> (j & 31)) & 0xffffu);
        if (masked) _mm512_mask_storeu_ps(l + j, masked, minus_inf);
      }
#endif
      for (; j < covered; ++j)
        if (!((m[j >> 5] >> (j & 31)) & 1u)) l[j] = ninf;
      for (; j < V; ++j) l[j] = ninf;
    }
  });
}
