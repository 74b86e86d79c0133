// Fused elementwise kernels for the CPU: residual add + RMSNorm (and Gemma's float32-scaled one), SiLU-and-mul
// and GELU(tanh)-and-mul, rotary embedding, the greedy argmax, a grammar's token bitmask.
//
// Each reproduces the torch reference in models/layers.py operation by operation, rounding every
// intermediate the reference stores to the tensor dtype, so bfloat16 results match it bit for bit
// in the common case (float32 accumulation order may differ in the last place).
#include <torch/types.h>  // not torch/extension.h (pybind11, torch::nn): ~3x the compile time per file
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
#include "rows.h"

// Rows per parallel chunk such that a chunk holds at least ~32k elements. Smaller jobs (a decode
// step's few rows) run on the calling thread: a 2-thread OpenMP region for microseconds of work costs
// more than it saves, and stalls whole when another thread of the process (the HTTP event loop)
// holds one of the cores.
static inline int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, (int64_t{1} << 15) / row_elems); }

// normed = weight * round(x * rsqrt(mean(x^2) + eps)), computed in float32 (rows.h add_rms_norm_row).
// With `residual`: x = round(x + residual) first, and that sum is returned as the new residual.
template <typename T>
static void add_rms_norm_kernel(const T* x, const T* res, const T* w, T* out, T* new_res, int64_t rows, int64_t H,
                                float eps) {
  at::parallel_for(0, rows, grain_rows(H), [&](int64_t begin, int64_t end) {
    std::vector<float> h(H);
    for (int64_t r = begin; r < end; ++r)
      add_rms_norm_row<T>(x + r * H, res == nullptr ? nullptr : res + r * H, w, out + r * H,
                          res == nullptr ? nullptr : new_res + r * H, H, eps, h.data());
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

// Gemma's RMSNorm: out = round(h * rsqrt(mean(h^2) + eps) * scale), all in float32, with h = x, or
// h = round(x + residual) returned as the new residual; `scale` is (1 + w) in float32 (models/gemma.py
// GemmaRMSNorm: (1 + w) rounded to bfloat16 would lose w's low bits). The operations and their order are
// F.rms_norm(h.float(), scale)'s; only the sum of squares may add in another order (float32, last place).
// x: rows of H values, row r at x + (r / heads) * s0 + (r % heads) * s1: the (T, H) hidden states, or
// the (T, heads, D) per-head q or k of a fused qkv projection's view (strided tokens).
template <typename T>
static void scaled_rms_norm_kernel(const T* x, int64_t s0, int64_t s1, int64_t heads, const T* res,
                                   const float* scale, T* out, T* new_res, int64_t rows, int64_t H, float eps) {
  at::parallel_for(0, rows, grain_rows(H), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(H);
    float* __restrict__ h = buf.data();
    for (int64_t r = begin; r < end; ++r) {
      const T* __restrict__ xr = x + (r / heads) * s0 + (r % heads) * s1;
      if (res != nullptr) {
        const T* __restrict__ rr = res + r * H;
        T* __restrict__ nr = new_res + r * H;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) h[i] = round_to<T>(to_float(xr[i]) + to_float(rr[i]));
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) nr[i] = from_float<T>(h[i]);
      } else {
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) h[i] = to_float(xr[i]);
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += h[i] * h[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      T* __restrict__ o = out + r * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) o[i] = from_float<T>(h[i] * inv * scale[i]);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> scaled_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                   const at::Tensor& scale, double eps) {
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "scaled_rms_norm: x must be (T, H) or (T, heads, H)");
  TORCH_CHECK(x.stride(-1) == 1, "scaled_rms_norm: x's last dimension must be contiguous");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 1 &&
              scale.size(0) == x.size(-1), "scaled_rms_norm: scale must be (H,) float32");
  const int64_t H = x.size(-1), heads = x.dim() == 3 ? x.size(1) : 1, rows = x.numel() / H;
  const int64_t s0 = x.size(0) > 1 ? x.stride(0) : heads * H, s1 = x.dim() == 3 ? x.stride(1) : H;
  TORCH_CHECK(!residual.has_value() || (x.is_contiguous() && residual->is_contiguous() &&
              residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type()),
              "scaled_rms_norm: a residual needs contiguous x and residual of one shape and dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor new_res = residual.has_value() ? at::empty_like(x) : x;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "scaled_rms_norm", [&] {
    scaled_rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), s0, s1, heads,
                                     residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr,
                                     scale.data_ptr<float>(), out.data_ptr<scalar_t>(),
                                     residual.has_value() ? new_res.data_ptr<scalar_t>() : nullptr, rows, H,
                                     static_cast<float>(eps));
  });
  return {out, new_res};
}

// The gated activations, (T, 2I) [gate | up] -> (T, I): round(act(gate)) * up, as act(gate) * up does in T.
// SwiGLU: act = silu (F.silu); Gemma's GeGLU: act = gelu_tanh (F.gelu(approximate="tanh")),
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) with tanh_fast (absolute error ~2e-7 before the rounding).
template <typename T, typename Act>
static void gated_and_mul_kernel(const T* in, T* out, int64_t rows, int64_t I, Act act) {
  at::parallel_for(0, rows, grain_rows(2 * I), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(I);
    for (int64_t r = begin; r < end; ++r) gated_and_mul_row<T>(in + r * 2 * I, out + r * I, I, act, buf.data());
  });
}

template <typename Act>
static at::Tensor gated_and_mul(const at::Tensor& x, const char* name, Act act) {
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 2 == 0, name, ": contiguous (..., 2I) input");
  const int64_t I = x.size(-1) / 2, rows = x.numel() / x.size(-1);
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  at::Tensor out = at::empty(sizes, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gated_and_mul", [&] {
    gated_and_mul_kernel<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, I, act);
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  return gated_and_mul(x, "silu_and_mul", [](float g) { return silu(g); });
}

at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  return gated_and_mul(x, "gelu_tanh_and_mul", [](float g) {
    return 0.5f * g * (1.f + tanh_fast(0.7978845608028654f * (g + 0.044715f * g * g * g)));
  });
}

// Neox-style RoPE in place: x (T, H, D) with row stride `row_stride`; cos/sin (T, D) already in T.
// x1' = round(round(x1 * c) + round(-x2 * s)),  x2' = round(round(x2 * c) + round(x1 * s))
template <typename T>
static void rope_kernel(T* x, int64_t row_stride, const T* cos, const T* sin, int64_t tokens, int64_t H, int64_t D) {
  at::parallel_for(0, tokens, grain_rows(H * D), [&](int64_t begin, int64_t end) {
    std::vector<float> c(D), s(D), a(D / 2), b(D / 2);
    for (int64_t t = begin; t < end; ++t)
      rope_token<T>(x + t * row_stride, cos + t * D, sin + t * D, H, D, c.data(), s.data(), a.data(), b.data());
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

// Greedy sampling: (R, V) float32 logits -> (R,) int64 index of each row's largest value, the first one on
// ties, as torch's argmax (docs/performance-notes.md#greedy-sampling: torch reduces one long row on one
// thread, ~150 us for Gemma 3's 262,144 logits on Zen 4). 16 lanes each keep their running maximum and its
// first index; a row with a NaN answers as torch does (the first NaN's index), found by a scalar pass.
at::Tensor first_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 && logits.size(1) > 0,
              "first_argmax: float32 (R, V) logits, V > 0, unit column stride");
  const int64_t R = logits.size(0), V = logits.size(1), ls = logits.stride(0);
  at::Tensor out = at::empty({R}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, grain_rows(V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict__ l = lp + r * ls;
      int64_t j = 0, best = 0;
      float best_v = l[0];
      bool nan = false;
#ifdef __AVX512F__
      if (V >= 16) {
        __m512 vmax = _mm512_loadu_ps(l);
        __m512i vidx = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        __m512i cur = vidx;
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 unordered = _mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q);
        for (j = 16; j + 16 <= V; j += 16) {
          cur = _mm512_add_epi32(cur, step);
          const __m512 v = _mm512_loadu_ps(l + j);
          const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);  // strictly greater: first index wins
          unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
          vmax = _mm512_mask_mov_ps(vmax, gt, v);
          vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
        }
        nan = unordered != 0;
        alignas(64) float mv[16];
        alignas(64) int32_t mi[16];
        _mm512_store_ps(mv, vmax);
        _mm512_store_si512(mi, vidx);
        best_v = mv[0], best = mi[0];
        for (int k = 1; k < 16; ++k)
          if (mv[k] > best_v || (mv[k] == best_v && mi[k] < best)) best_v = mv[k], best = mi[k];
      }
#endif
      for (; j < V; ++j) {  // the tail (all of V without AVX-512)
        if (l[j] > best_v) best_v = l[j], best = j;
        nan |= l[j] != l[j];
      }
      nan |= best_v != best_v;
      if (nan) {  // torch's max: a NaN is the largest value, the first one wins
        for (int64_t k = 0; k < V; ++k)
          if (l[k] != l[k]) { best = k; break; }
      }
      op[r] = best;
    }
  });
  return out;
}
