// y = x @ w.T (+ bias) for a few rows of x: the matmuls of decode steps and speculative verification.
//
// With M <= kSkinnyMaxRows rows the product is bound by streaming w from memory, where oneDNN's bf16
// GEMM falls short and ATen's GEMV serves M == 1 alone (docs/performance-notes.md#few-row-matmul).
// Here each weight row is read once and dotted with all M rows of x (held in L1), with AVX512-BF16 dot
// products (vdpbf16ps: bf16 pairs multiplied exactly, summed in float32) where the CPU has them, plain
// float32 arithmetic otherwise. Every output row is computed the same way whatever M is, so a token's
// result does not depend on how many tokens share its step.
#include <torch/types.h>  // not torch/extension.h (pybind11, torch::nn): ~3x the compile time per file
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define TOKENLOOM_DPBF16 1
#endif

#include "dtype.h"
#include "kernels.h"

namespace {

// out[m] = dot(x[m, :K], w[:K]) for m < M, float32 accumulation.
template <int M>
inline void dot_rows(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t K, float* out) {
  int64_t k = 0;
#ifdef TOKENLOOM_DPBF16
  // Two accumulators per row, fed alternately: one dot-product chain per row would wait on the
  // instruction's latency at every step.
  __m512 acc0[M], acc1[M];
  for (int m = 0; m < M; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
  for (; k + 64 <= K; k += 64) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w + k));
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w + k + 32));
    for (int m = 0; m < M; ++m) {
      const c10::BFloat16* xr = x + m * ldx + k;
      acc0[m] = _mm512_dpbf16_ps(acc0[m], (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(xr)), w0);
      acc1[m] = _mm512_dpbf16_ps(acc1[m], (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(xr + 32)), w1);
    }
  }
  for (; k + 32 <= K; k += 32) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w + k));
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(x + m * ldx + k));
      acc0[m] = _mm512_dpbf16_ps(acc0[m], xv, wv);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m]));
#else
  for (int m = 0; m < M; ++m) out[m] = 0.f;
#endif
  for (int m = 0; m < M; ++m) {  // the tail (all of K without AVX512-BF16)
    float s = 0.f;
    const c10::BFloat16* xr = x + m * ldx;
#pragma omp simd reduction(+ : s)
    for (int64_t j = k; j < K; ++j) s += to_float(xr[j]) * to_float(w[j]);
    out[m] += s;
  }
}

template <int M>
void skinny_kernel(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y,
                   int64_t N, int64_t K) {
  // Chunks of at least ~256 KiB of weights: smaller jobs stay on the calling thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (K * 2));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float out[M];
    for (int64_t n = begin; n < end; ++n) {
      dot_rows<M>(x, K, w + n * K, K, out);
      const float b = bias != nullptr ? to_float(bias[n]) : 0.f;
      for (int m = 0; m < M; ++m) y[m * N + n] = from_float<c10::BFloat16>(out[m] + b);
    }
  });
}

}  // namespace

// Rows up to which a dense layer that also has a prepacked oneDNN copy takes skinny_linear instead (1: only
// single rows; models/dense_routing.py measures it per CPU at start-up). Process-wide, as the packed copies.
static std::atomic<int64_t> g_skinny_packed_max_rows{1};

int64_t skinny_packed_max_rows() { return g_skinny_packed_max_rows.load(std::memory_order_relaxed); }

void set_skinny_packed_max_rows(int64_t rows) {
  TORCH_CHECK(rows >= 1 && rows <= kSkinnyMaxRows, "set_skinny_packed_max_rows: 1..", kSkinnyMaxRows, " rows");
  g_skinny_packed_max_rows.store(rows, std::memory_order_relaxed);
}

bool skinny_available() {
#ifdef TOKENLOOM_DPBF16
  return true;
#else
  return false;
#endif
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: x (M, K) and w (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "skinny_linear: bfloat16 only");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kSkinnyMaxRows, "skinny_linear: 1..", kSkinnyMaxRows, " rows");
  TORCH_CHECK(w.is_contiguous(), "skinny_linear: contiguous weight");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = w.size(0);
  const c10::BFloat16* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N && bias->is_contiguous(), "skinny_linear: bias");
    b = bias->data_ptr<c10::BFloat16>();
  }
  at::Tensor y = at::empty({M, N}, xc.options());
  const auto* xp = xc.data_ptr<c10::BFloat16>();
  const auto* wp = w.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  with_rows(M, [&]<int R>() { skinny_kernel<R>(xp, wp, b, yp, N, K); });
  return y;
}
