// y = x @ w.T (+ bias) for a few rows of x: the matmuls of decode steps and speculative verification.
//
// With M <= kSkinnyMaxRows rows the product is bound by streaming w from memory, where oneDNN's bf16
// GEMM falls short and ATen's GEMV serves M == 1 alone (docs/performance-notes.md#few-row-matmul).
// Here each weight row is read once and dotted with all M rows of x, with AVX512-BF16 dot products
// (vdpbf16ps: bf16 pairs multiplied exactly, summed in float32) where the CPU has them, plain float32
// arithmetic otherwise. Every output is computed the same way whatever M is and whichever block of weight
// rows it falls in, so a token's result does not depend on how many tokens share its step.
#include <torch/types.h>  // not torch/extension.h (pybind11, torch::nn): ~3x the compile time per file
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#include <immintrin.h>
#include "avx512.h"
#define TOKENLOOM_DPBF16 1
#endif

#include "dtype.h"
#include "kernels.h"

namespace {

#ifdef TOKENLOOM_DPBF16
// How a block of weight rows is read. One accumulator chain per output (row of x, weight row), summed over
// the 32-wide slices of K in order, then reduced four weight rows at a time by hsum4 (avx512.h), in which one
// sum's additions do not depend on the other three: every output gets the same arithmetic in either order,
// for every M, block and thread split.
// - M <= 2: the block's rows one after another, x reloaded for each (cheap at 1-2 rows), so the weights
//   stream sequentially, as the hardware prefetcher likes best, and a software prefetch kSequentialPrefetchBytes
//   ahead keeps more of the stream in flight than it does.
// - M >= 3: the block's rows side by side, each slice of x loaded once into registers for all of them;
//   reloading x for every weight row made the kernel compute-bound from 3-4 rows on. Reading NB rows at
//   once defeats the hardware prefetcher, so the kernel prefetches the memory ahead itself, in order.
// docs/performance-notes.md#few-row-matmul has the measurements.
template <int M>
constexpr bool kSequential = M <= 2;
// Weight rows per block: NB x M accumulators, the M slices of x and one weight vector fit the 32 zmm
// registers (M = 6: 24 + 6 + 1); a multiple of 4 where it can be, for hsum4.
template <int M>
constexpr int kRowsPerBlock = M <= 6 ? 4 : M == 7 ? 3 : 2;
// The interleaved blocks prefetch the memory this many weight rows ahead of the block (at least one block).
constexpr int kPrefetchRows = 4;
// The sequential order (1-2 rows) requests each line this many bytes ahead of its load, into L1. The hardware
// prefetcher alone left a one-row decode step of SmolLM2-135M's 30 layers at 5.0-5.6 ms (~40 GB/s); 8 KiB
// ahead took it to 4.1-4.3 ms and its LM head from 1.0-1.2 to 0.71-0.78 ms; 2 and 4 KiB did less, 6 KiB about
// as much, 12-16 KiB and prefetcht1 (into L2) at 8-64 KiB less (docs/performance-notes.md#few-row-matmul).
constexpr int64_t kSequentialPrefetchBytes = 8192;

// Four float32 -> bfloat16, rounded to nearest even as from_float (dtype.h) does; NaN -> 0x7FC0.
inline __m128i to_bf16x4(__m128 v) {
  const __m128i u = _mm_castps_si128(v);
  const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
  const __m128i r = _mm_srli_epi32(_mm_add_epi32(u, _mm_add_epi32(lsb, _mm_set1_epi32(0x7FFF))), 16);
  return _mm_mask_blend_epi32(_mm_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm_set1_epi32(0x7FC0));
}

template <bool kTail>
inline __m512bh load_bf16x32(const c10::BFloat16* p, __mmask32 mask) {
  // At the tail of K the masked-off lanes load as zeros and add nothing.
  return (__m512bh)(kTail ? _mm512_maskz_loadu_epi16(mask, p) : _mm512_loadu_si512(p));
}

// y[m, n0 + j] for j < nb (<= NB) and every m < M: the dot products of weight rows n0 .. n0 + nb - 1 with the
// rows of x (M, K). Rows past nb repeat the last one (their sums are discarded), so the loops have no branches.
template <int M>
inline void dot_block(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y,
                      int64_t n0, int nb, int64_t N, int64_t K) {
  constexpr int NB = kRowsPerBlock<M>;
  const c10::BFloat16* wr[NB];
  for (int j = 0; j < NB; ++j) wr[j] = w + (n0 + std::min(j, nb - 1)) * K;
  const int64_t k_full = K / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (K - k_full)) - 1);
  __m512 acc[NB][M];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  if constexpr (kSequential<M>) {
    auto row_slice = [&]<bool kTail>(int j, int64_t k) {
      // An address, not a pointer: past the last rows it lies outside w, where a prefetch is harmless.
      _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<std::uintptr_t>(wr[j] + k) + kSequentialPrefetchBytes),
                   _MM_HINT_T0);
      const __m512bh wv = load_bf16x32<kTail>(wr[j] + k, tail);
      for (int m = 0; m < M; ++m) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], load_bf16x32<kTail>(x + m * K + k, tail), wv);
    };
    for (int j = 0; j < NB; ++j) {
      for (int64_t k = 0; k < k_full; k += 32) row_slice.template operator()<false>(j, k);
      if (k_full < K) row_slice.template operator()<true>(j, k_full);
    }
  } else {
    // The memory kPrefetchRows rows past the block, in address order: one line per weight vector loaded, so
    // successive blocks prefetch successive stretches.
    // (An address, not a pointer: past the last block it lies outside w, where a prefetch is harmless.)
    const std::uintptr_t ahead =
        reinterpret_cast<std::uintptr_t>(w) + static_cast<std::uintptr_t>((n0 + std::max(NB, kPrefetchRows)) * K * 2);
    auto slice = [&]<bool kTail>(int64_t k) {
      __m512bh xv[M];
      for (int m = 0; m < M; ++m) xv[m] = load_bf16x32<kTail>(x + m * K + k, tail);
      for (int j = 0; j < NB; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + (k / 32 * NB + j) * 64), _MM_HINT_T0);
        const __m512bh wv = load_bf16x32<kTail>(wr[j] + k, tail);
        for (int m = 0; m < M; ++m) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], xv[m], wv);
      }
    };
    for (int64_t k = 0; k < k_full; k += 32) slice.template operator()<false>(k);
    if (k_full < K) slice.template operator()<true>(k_full);
  }
  const __m512 zero = _mm512_setzero_ps();
  for (int j = 0; j < nb; j += 4) {
    const __mmask8 keep = static_cast<__mmask8>((1u << std::min(4, nb - j)) - 1);
    __m128 b = _mm_setzero_ps();
    if (bias != nullptr) {  // bf16 is the top half of a float32
      const __m128i raw = _mm_maskz_loadu_epi16(keep, bias + n0 + j);
      b = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(raw), 16));
    }
    for (int m = 0; m < M; ++m) {
      auto at = [&](int i) { return j + i < NB ? acc[j + i][m] : zero; };
      const __m128 s = _mm_add_ps(hsum4(at(0), at(1), at(2), at(3)), b);
      _mm_mask_cvtepi32_storeu_epi16(y + m * N + n0 + j, keep, to_bf16x4(s));
    }
  }
}
#endif

// Weight rows [n0, n1) of the product: the part of it one thread computes.
template <int M>
void skinny_block_rows(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y,
                       int64_t N, int64_t K, int64_t n0, int64_t n1) {
#ifdef TOKENLOOM_DPBF16
  constexpr int NB = kRowsPerBlock<M>;
  for (int64_t n = n0; n < n1; n += NB)
    dot_block<M>(x, w, bias, y, n, static_cast<int>(std::min<int64_t>(NB, n1 - n)), N, K);
#else
  for (int64_t n = n0; n < n1; ++n) {
    const c10::BFloat16* wr = w + n * K;
    for (int m = 0; m < M; ++m) {
      const c10::BFloat16* xr = x + m * K;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < K; ++j) s += to_float(xr[j]) * to_float(wr[j]);
      y[m * N + n] = from_float<c10::BFloat16>(s + (bias != nullptr ? to_float(bias[n]) : 0.f));
    }
  }
#endif
}

template <int M>
void skinny_kernel(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y,
                   int64_t N, int64_t K) {
  // Chunks of at least ~256 KiB of weights: smaller jobs stay on the calling thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (K * 2));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) { skinny_block_rows<M>(x, w, bias, y, N, K, begin, end); });
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

void skinny_rows(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y, int64_t M,
                 int64_t N, int64_t K, int64_t n0, int64_t n1) {
  with_rows(M, [&]<int R>() { skinny_block_rows<R>(x, w, bias, y, N, K, n0, n1); });
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
