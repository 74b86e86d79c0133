// Paged decode attention for CPU: one query token per sequence, K/V read in place through block tables.
//
// q:            (B, Hq, D)                 one new token per sequence, RoPE applied
// k/v_cache:    (num_blocks, block_size, Hkv, D), contiguous; q's dtype, or int8 codes
// k/v_scale:    (num_blocks, block_size, Hkv) float16, only with int8 codes: value = code * scale;
//               per token and head (contiguous) or per head (zero block and token strides)
// block_tables: (B, max_blocks) int64      block ids of each sequence, in order
// seq_lens:     (B,) int64                 context length of each sequence, the new token included
// out:          (B, Hq, D)
// softcap:      0, or Gemma 2's attention logit cap: each scaled score s -> softcap * tanh(s / softcap)
//               before the softmax (dtype.h softcap_inplace; a pass over the scores only when set)
//
// Work is split over (sequence, kv head) pairs, a long context's between threads too (plan_pieces: its
// pieces' partial softmaxes are combined); the G = Hq / Hkv query heads that share a KV head are
// processed together so each K/V row is read from memory once. Scores and the softmax are in float32.
// With an INT8 cache a row's scale is applied once per row, not per element: q . (c * s) = s * (q . c),
// and p * (c * s) = (p * s) * c.
//
// Three kernels: a portable one (any dtype, any head size, either cache) and, on AVX-512 with a head size
// of 64, 128 or 256, a fast one for bfloat16 q and cache and a fast one for INT8 codes. The portable
// kernel reduced every q . k horizontally, a dozen shuffles per token and query head, and at 64
// sequences attention took half of each decode step; the fast ones dot four tokens at once and reduce
// them together.
#include <torch/types.h>  // not torch/extension.h (pybind11, torch::nn): ~3x the compile time per file
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include "avx512.h"
#define TOKENLOOM_PAGED_BF16 1
#endif

#include "dtype.h"
#include "kernels.h"

// Widen one row of D values to float32 (vectorisable; see dtype.h).
template <typename cache_t>
static inline void widen(const cache_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// s[i] = exp(s[i] - max(s)) in place, for one query head's n scores; returns their sum (and the max in
// *max_out where given).
static inline float exp_minus_max(float* s, int64_t n, float* max_out = nullptr) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
  if (max_out != nullptr) *max_out = m;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    s[i] = exp_fast(s[i] - m);
    sum += s[i];
  }
  return sum;
}

// kD > 0 fixes the head size at compile time (fully unrolled, vectorised inner loops); 0 = runtime size.
// cache_t: scalar_t, or int8_t with float16 scales (k_scale/v_scale non-null): token t's scale of head h
// at (t's slot) * scale_stride + h, scale_stride = Hkv per token and head, 0 per head.
template <typename scalar_t, typename cache_t, int64_t kD>
static void paged_decode_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Half* k_scale, const at::Half* v_scale, int64_t scale_stride,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out,
                                double scale, int64_t sliding_window, double softcap) {
  const int64_t B = q.size(0), Hq = q.size(1), D = kD > 0 ? kD : q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = Hq / Hkv;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t token_stride = Hkv * D, block_stride = block_size * token_stride;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kp = k_cache.data_ptr<cache_t>();
  const cache_t* vp = v_cache.data_ptr<cache_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), row(D), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t len = lens[b];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      const int64_t n = len - first;
      scores.assign(G * n, 0.f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_float(qp[(b * Hq + h * G + g) * D + d]) * fscale;
      // Walk the context block by block (no per-token division): tokens [t0, t0 + block_size) of
      // block bt[t0 / block_size], clipped to [first, len).
      const int64_t t_begin = first - first % block_size;
      // scores[g, t] = q_g . k_t
      for (int64_t t0 = t_begin; t0 < len; t0 += block_size) {
        const int64_t block = bt[b * max_blocks + t0 / block_size];
        const cache_t* kbase = kp + block * block_stride + h * D;
        for (int64_t t = std::max(t0, first), hi = std::min(t0 + block_size, len); t < hi; ++t) {
          widen(kbase + (t - t0) * token_stride, row.data(), D);
          const float ks = k_scale ? static_cast<float>(k_scale[(block * block_size + t - t0) * scale_stride + h]) : 1.f;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qg[d] * row[d];
            scores[g * n + (t - first)] = s * ks;
          }
        }
      }
      if (cap > 0.f) softcap_inplace(scores.data(), G * n, cap);
      // softmax over t, per query head
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        const float inv = 1.f / exp_minus_max(sg, n);
        for (int64_t i = 0; i < n; ++i) sg[i] *= inv;
      }
      // acc[g] = sum_t p[g, t] * v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = t_begin; t0 < len; t0 += block_size) {
        const int64_t block = bt[b * max_blocks + t0 / block_size];
        const cache_t* vbase = vp + block * block_stride + h * D;
        for (int64_t t = std::max(t0, first), hi = std::min(t0 + block_size, len); t < hi; ++t) {
          widen(vbase + (t - t0) * token_stride, row.data(), D);
          const float vs = v_scale ? static_cast<float>(v_scale[(block * block_size + t - t0) * scale_stride + h]) : 1.f;
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * n + (t - first)] * vs;
            float* ag = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          op[(b * Hq + h * G + g) * D + d] = from_float<scalar_t>(acc[g * D + d]);
    }
  });
}

#ifdef TOKENLOOM_PAGED_BF16
// The cache slots of sequence b's attended context, in order: tokens [first, len) with first = len -
// sliding_window (0 without a window); slots (len - first,).
static inline void context_slots(const int64_t* bt, int64_t max_blocks, int64_t block_size, int64_t b, int64_t len,
                                 int64_t sliding_window, std::vector<int64_t>& slots) {
  const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
  slots.resize(len - first);
  for (int64_t t = first; t < len; ++t) slots[t - first] = bt[b * max_blocks + t / block_size] * block_size + t % block_size;
}

// The work items (sequence b, KV head h) = b * Hkv + h, cut into one run per thread at equal shares of
// the context tokens to read rather than of the items: at::parallel_for's equal counts gave the thread
// holding one 4,000-token sequence among 63 of ~190 tokens 1.6x the other's work, and the step waited for
// it (benchmarks/decode_attention.py --long-len 4000). An item costs its attended tokens plus kItemCost for
// the rest of its work (q, softmax, output). With `split`, a cut that falls inside an item's context more
// than max(kMinPiece, share / 16) tokens from both of its ends splits that item between threads; without,
// or nearer an end, the cut moves to the nearer end. One long context among fewer items than threads (one
// user: Hkv items; SmolLM2 has 3 for 2 threads) otherwise leaves a thread idle for most of the call
// (flash-decoding's split of the keys). A thread's run of pieces: tokens [t0, t1) of an item's n attended
// tokens; a piece that is not the whole item writes a partial result (unnormalised output, max and sum
// of its scores per query head) to slot `part`, and the item's pieces are combined once every thread is
// done (combine_partials).
constexpr int64_t kItemCost = 16;
constexpr int64_t kMinPiece = 64;
struct Piece {
  int64_t item, t0, t1, part;  // part: -1 for a whole item
};
struct SplitItem {
  int64_t item, first_part, parts;  // its pieces' slots first_part .. first_part + parts - 1, in token order
};
struct PiecePlan {
  std::vector<std::vector<Piece>> runs;  // per thread, in item and token order
  std::vector<SplitItem> splits;
  int64_t parts = 0;  // partial slots
};

// `max_piece` > 0 (with `split`) also cuts every piece into pieces of at most that many tokens, for a kernel
// whose scratch grows with a piece's tokens (the INT8 cache's widened rows).
static PiecePlan plan_pieces(const int64_t* lens, int64_t B, int64_t Hkv, int64_t sliding_window, bool split,
                             int64_t max_piece = 0) {
  const int64_t items = B * Hkv;
  auto tokens = [&](int64_t item) {
    const int64_t len = lens[item / Hkv];
    return sliding_window > 0 ? std::min(len, sliding_window) : len;
  };
  std::vector<int64_t> start(items + 1, 0);  // item i's work is [start[i], start[i + 1]): tokens, then kItemCost
  for (int64_t i = 0; i < items; ++i) start[i + 1] = start[i] + tokens(i) + kItemCost;
  const int64_t total = start[items];
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total / (kMinPiece + kItemCost)));
  const int64_t share = total / T, near = std::max<int64_t>(kMinPiece, share / 16);
  // cut[p] = (item, token) where thread p's run starts; (items, 0) ends the last.
  std::vector<std::pair<int64_t, int64_t>> cut(T + 1, {items, 0});
  cut[0] = {0, 0};
  int64_t i = 0;
  for (int64_t p = 1; p < T; ++p) {
    const int64_t c = total * p / T;
    while (i < items && start[i + 1] <= c) ++i;
    if (i == items) break;
    const int64_t t = c - start[i], n = tokens(i);
    if (split && t >= near && n - t >= near) cut[p] = {i, t};
    else cut[p] = t <= (n + kItemCost) / 2 ? std::make_pair(i, int64_t{0}) : std::make_pair(i + 1, int64_t{0});
  }
  PiecePlan plan;
  plan.runs.resize(T);
  for (int64_t p = 0; p < T; ++p) {
    const auto [i0, t0] = cut[p];
    const auto [i1, t1] = cut[p + 1];
    for (int64_t it = i0; it < items && (it < i1 || (it == i1 && t1 > 0)); ++it) {
      const int64_t a = it == i0 ? t0 : 0, b = it == i1 ? t1 : tokens(it);
      if (a >= b) continue;
      if (split && max_piece > 0 && b - a > max_piece) {
        const int64_t k = (b - a + max_piece - 1) / max_piece;  // k pieces of near-equal length
        for (int64_t j = 0; j < k; ++j) plan.runs[p].push_back({it, a + (b - a) * j / k, a + (b - a) * (j + 1) / k, plan.parts++});
        continue;
      }
      plan.runs[p].push_back({it, a, b, (a == 0 && b == tokens(it)) ? -1 : plan.parts++});
    }
  }
  for (int64_t p = 0; p < T; ++p)  // the slots of one item are consecutive: threads run in item order
    for (const Piece& pc : plan.runs[p])
      if (pc.part >= 0) {
        if (plan.splits.empty() || plan.splits.back().item != pc.item) plan.splits.push_back({pc.item, pc.part, 0});
        ++plan.splits.back().parts;
      }
  return plan;
}

// Each split item's output from its pieces' partials (per query head g of its G: acc (D), max m, sum l):
// out = sum_j exp(m_j - m) acc_j / sum_j exp(m_j - m) l_j, m = max_j m_j. A slot holds G * (D + 2)
// floats: acc (G, D), then the G maxima, then the G sums.
static void combine_partials(const PiecePlan& plan, int64_t Hkv, int64_t G, int64_t D, const float* partials,
                             c10::BFloat16* out) {
  const int64_t slot = G * (D + 2);  // (G, D) acc, then G maxima, then G sums
  std::vector<float> w;  // each piece's weight exp(m_j - m)
  for (const SplitItem& s : plan.splits) {
    const int64_t b = s.item / Hkv, h = s.item % Hkv, Hq = Hkv * G;
    for (int64_t g = 0; g < G; ++g) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < s.parts; ++j) m = std::max(m, partials[(s.first_part + j) * slot + G * D + g]);
      float l = 0.f;
      w.resize(s.parts);
      for (int64_t j = 0; j < s.parts; ++j) {
        const float* ps = partials + (s.first_part + j) * slot;
        w[j] = std::exp(ps[G * D + g] - m);
        l += w[j] * ps[G * D + G + g];
      }
      c10::BFloat16* o = out + (b * Hq + h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) {
        float acc = 0.f;
        for (int64_t j = 0; j < s.parts; ++j) acc += w[j] * partials[(s.first_part + j) * slot + g * D + d];
        o[d] = from_float<c10::BFloat16>(acc / l);
      }
    }
  }
}

// A row of K or V (2 * kD bytes in bf16, kD as INT8 codes) sits apart from the next one, over blocks and
// over heads within a token: the hardware prefetcher does not follow them, so each row's kBytes are
// requested into L1 kAhead rows before it is used, and into L2 kAheadL2 rows before (tuned:
// docs/performance-notes.md#paged-decode-attention).
constexpr int64_t kAhead = 16;
constexpr int64_t kAheadL2 = 64;
// always_inline: a call left in attend_heads_bf16's loops clobbers the accumulators' registers, which then
// spill on every row (one more instantiation once sent this one out of line: 0.65x the inlined build).
template <int64_t kBytes, _mm_hint kHint = _MM_HINT_T0>
__attribute__((always_inline)) static inline void prefetch_row(const void* row) {
  for (int64_t b = 0; b < kBytes; b += 64) _mm_prefetch(static_cast<const char*>(row) + b, kHint);
}

// The rows a call of attend_heads_bf16 reads, in the order it reads them, and what its thread reads next:
// rows[p] for p < n is K row p, n <= p < 2n V row p - n, then up to `total` the K rows of the thread's next
// call. The prefetches run along it, so the V pass's first rows and the next call's are in flight before
// they are needed: the gaps between passes and items are where a stream of requests otherwise starts
// again from nothing. A table of pointers, not a function of p: with three ranges to tell apart per row,
// GCC split the loops by range and dropped the prefetches from the hottest piece. Ask for the rows kAhead
// (into L1) and kAheadL2 (into L2) positions past p.
template <int64_t kBytes>
__attribute__((always_inline)) static inline void prefetch_ahead(const c10::BFloat16* const* rows, int64_t total,
                                                                 int64_t p) {
  if (p + kAhead < total) prefetch_row<kBytes>(rows[p + kAhead]);
  if (p + kAheadL2 < total) prefetch_row<kBytes, _MM_HINT_T1>(rows[p + kAheadL2]);
}

// rows (see prefetch_ahead) for n context tokens of one KV head: K rows at k + slots[i] * stride, V rows at
// v + slots[i] * stride, then the next call's nn K rows at next_k + next_slots[i] * stride; returns 2n + nn.
static inline int64_t row_table(const c10::BFloat16* k, const c10::BFloat16* v, const int64_t* slots, int64_t n,
                                int64_t stride, const c10::BFloat16* next_k, const int64_t* next_slots, int64_t nn,
                                std::vector<const c10::BFloat16*>& rows) {
  rows.resize(2 * n + nn);
  for (int64_t i = 0; i < n; ++i) {
    rows[i] = k + slots[i] * stride;
    rows[n + i] = v + slots[i] * stride;
  }
  for (int64_t i = 0; i < nn; ++i) rows[2 * n + i] = next_k + next_slots[i] * stride;
  return 2 * n + nn;
}

// kG query heads that share one KV head, over n context tokens whose K and V rows are bfloat16 at rows[i],
// rows[n + i] (D = kD a multiple of 32); head g's query at qg + g * kD, its output at og + g * kD:
//   scores: q_g . k_t by vdpbf16ps (bf16 products are exact in float32), four tokens per hsum4, times
//           the softmax scale (and with kScaled each token's K scale ks[t]: q . (c s) = s (q . c));
//   softmax: float32, normalised once at the end (out = sum_t e_t v_t / sum_t e_t);
//   values: each bf16 row of V splits into its even and odd elements as float32 (a shift and a mask),
//           which accumulate apart (weighted e_t, or e_t vs[t] with kScaled) and are interleaved back once.
// Each K and V row is loaded once for all kG heads (one head at a time re-read every row G times from
// L1/L2; docs/performance-notes.md#paged-decode-attention), and requested ahead of its use along rows[0,
// total) (prefetch_ahead). Every head's arithmetic is the same, in the same order, whatever kG is. `sc` is
// scratch for kG * n scores.
// With a partial slot `pt` (a piece of a split item, plan_pieces): its (kG, kD) float outputs are left
// unnormalised at pt, the scores' maxima at pt + G * kD and their sums at pt + G * (kD + 1) (G: the
// slot's heads, from head g0 of the group), instead of og.
struct Partial {
  float* pt;
  int64_t G, g0;
};
template <int64_t kD, bool kScaled, int kG>
static inline void attend_heads_bf16(const c10::BFloat16* qg, const c10::BFloat16* const* rows, int64_t total,
                                     const float* ks, const float* vs, int64_t n, float fscale, float cap, float* sc,
                                     c10::BFloat16* og, const Partial* partial = nullptr) {
  constexpr int64_t V = kD / 32;  // 512-bit vectors per bf16 row
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m512bh qv[kG][V];
  for (int g = 0; g < kG; ++g)
    for (int64_t v = 0; v < V; ++v) qv[g][v] = (__m512bh)_mm512_loadu_si512(qg + g * kD + 32 * v);
  auto dots = [&](int64_t i, __m512* a) {  // a[g] = the kG partial dot products of token i
    const c10::BFloat16* k = rows[i];
    prefetch_ahead<kD * 2>(rows, total, i);
    for (int g = 0; g < kG; ++g) a[g] = _mm512_setzero_ps();
    for (int64_t v = 0; v < V; ++v) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(k + 32 * v);
      for (int g = 0; g < kG; ++g) a[g] = _mm512_dpbf16_ps(a[g], kv, qv[g][v]);
    }
  };
  const __m128 fs = _mm_set1_ps(fscale);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    __m512 a0[kG], a1[kG], a2[kG], a3[kG];
    dots(i, a0);
    dots(i + 1, a1);
    dots(i + 2, a2);
    dots(i + 3, a3);
    for (int g = 0; g < kG; ++g) {
      __m128 s4 = _mm_mul_ps(hsum4(a0[g], a1[g], a2[g], a3[g]), fs);
      if constexpr (kScaled) s4 = _mm_mul_ps(s4, _mm_loadu_ps(ks + i));
      _mm_storeu_ps(sc + g * n + i, s4);
    }
  }
  for (; i < n; ++i) {
    __m512 a[kG];
    dots(i, a);
    for (int g = 0; g < kG; ++g) sc[g * n + i] = _mm512_reduce_add_ps(a[g]) * fscale * (kScaled ? ks[i] : 1.f);
  }
  if (cap > 0.f) softcap_inplace(sc, kG * n, cap);  // Gemma 2: sc holds the kG heads' n scores each
  float sum[kG], mx[kG];
  for (int g = 0; g < kG; ++g) sum[g] = exp_minus_max(sc + g * n, n, &mx[g]);
  __m512 even[kG][V], odd[kG][V];
  for (int g = 0; g < kG; ++g)
    for (int64_t v = 0; v < V; ++v) even[g][v] = odd[g][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const c10::BFloat16* row = rows[n + j];
    prefetch_ahead<kD * 2>(rows, total, n + j);
    __m512 p[kG];
    for (int g = 0; g < kG; ++g) p[g] = _mm512_set1_ps(kScaled ? sc[g * n + j] * vs[j] : sc[g * n + j]);
    for (int64_t v = 0; v < V; ++v) {
      const __m512i x = _mm512_loadu_si512(row + 32 * v);
      const __m512 xe = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      const __m512 xo = _mm512_castsi512_ps(_mm512_and_si512(x, odd_mask));
      for (int g = 0; g < kG; ++g) {
        even[g][v] = _mm512_fmadd_ps(p[g], xe, even[g][v]);
        odd[g][v] = _mm512_fmadd_ps(p[g], xo, odd[g][v]);
      }
    }
  }
  if (partial != nullptr) {
    const int64_t G = partial->G;
    for (int g = 0; g < kG; ++g) {
      float* pa = partial->pt + (partial->g0 + g) * kD;
      for (int64_t v = 0; v < V; ++v) {
        alignas(64) float e[16], o[16];
        _mm512_store_ps(e, even[g][v]);
        _mm512_store_ps(o, odd[g][v]);
        for (int j = 0; j < 16; ++j) {
          pa[32 * v + 2 * j] = e[j];
          pa[32 * v + 2 * j + 1] = o[j];
        }
      }
      partial->pt[G * kD + partial->g0 + g] = mx[g];
      partial->pt[G * (kD + 1) + partial->g0 + g] = sum[g];
    }
    return;
  }
  for (int g = 0; g < kG; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / sum[g]);
    for (int64_t v = 0; v < V; ++v) {
      alignas(64) float e[16], o[16];
      _mm512_store_ps(e, _mm512_mul_ps(even[g][v], inv));
      _mm512_store_ps(o, _mm512_mul_ps(odd[g][v], inv));
      for (int j = 0; j < 16; ++j) {  // bf16 lane pair j of the row: elements 2j (low half), 2j + 1
        og[g * kD + 32 * v + 2 * j] = from_float<c10::BFloat16>(e[j]);
        og[g * kD + 32 * v + 2 * j + 1] = from_float<c10::BFloat16>(o[j]);
      }
    }
  }
}

// All G query heads of one KV head (q at qg, out at og, head after head), in chunks of as many heads as
// the registers hold: 4 at D = 64 (4 heads x 4 tokens of score accumulators + 8 query vectors), 2 at
// 128, 1 at 256. rows as attend_heads_bf16's; a chunk before the last prefetches no further than its V
// rows (the next chunk reads the same K rows again, just read).
// `pt`: a piece's partial slot (attend_heads_bf16), or null to write og.
template <int64_t kD, bool kScaled>
static inline void attend_group_bf16(int64_t G, const c10::BFloat16* qg, const c10::BFloat16* const* rows,
                                     int64_t total, const float* ks, const float* vs, int64_t n, float fscale,
                                     float cap, float* sc, c10::BFloat16* og, float* pt = nullptr) {
  constexpr int kMax = kD <= 64 ? 4 : kD <= 128 ? 2 : 1;
  for (int64_t g = 0; g < G;) {
    const int64_t r = std::min<int64_t>(G - g, kMax);
    const c10::BFloat16* q = qg + g * kD;
    c10::BFloat16* o = og + g * kD;
    const int64_t t = g + r < G ? 2 * n : total;
    const Partial part{pt, G, g};
    const Partial* pp = pt == nullptr ? nullptr : &part;
    switch (r) {
      case 4: if constexpr (kMax >= 4) attend_heads_bf16<kD, kScaled, 4>(q, rows, t, ks, vs, n, fscale, cap, sc, o, pp); break;
      case 3: if constexpr (kMax >= 3) attend_heads_bf16<kD, kScaled, 3>(q, rows, t, ks, vs, n, fscale, cap, sc, o, pp); break;
      case 2: if constexpr (kMax >= 2) attend_heads_bf16<kD, kScaled, 2>(q, rows, t, ks, vs, n, fscale, cap, sc, o, pp); break;
      default: attend_heads_bf16<kD, kScaled, 1>(q, rows, t, ks, vs, n, fscale, cap, sc, o, pp); break;
    }
    g += r;
  }
}

// bfloat16 q and cache, D = kD a multiple of 32: one thread's run of pieces, each (sequence, kv head) reading
// its K/V rows in place, once for all the G query heads that share them. q: row b at qp + b * q_stride (heads
// dense within it); out (B, Hq, D); a split item's piece writes its partial slot instead.
template <int64_t kD>
static void run_pieces_bf16(const std::vector<Piece>& run, const c10::BFloat16* qp, int64_t q_stride,
                            const c10::BFloat16* kp, const c10::BFloat16* vp, const int64_t* bt, int64_t max_blocks,
                            const int64_t* lens, int64_t block_size, int64_t Hq, int64_t Hkv, int64_t sliding_window,
                            float fscale, float cap, float* partials, c10::BFloat16* op) {
  const int64_t G = Hq / Hkv, token_stride = Hkv * kD;
  // The slots of the piece's sequence and of the next piece's (the same sequence's next KV head or part,
  // or the next sequence's first), so that its K rows are requested while this piece's V rows are read.
  std::vector<int64_t> slots, next_slots;
  std::vector<const c10::BFloat16*> rows;
  std::vector<float> scores;
  for (size_t j = 0; j < run.size(); ++j) {
    const Piece& pc = run[j];
    const int64_t b = pc.item / Hkv, h = pc.item % Hkv;
    if (j == 0) context_slots(bt, max_blocks, block_size, b, lens[b], sliding_window, slots);
    else if (run[j - 1].item / Hkv != b) std::swap(slots, next_slots);  // next_slots held b's
    const Piece* next = j + 1 < run.size() ? &run[j + 1] : nullptr;
    if (next != nullptr && next->item / Hkv != b)
      context_slots(bt, max_blocks, block_size, next->item / Hkv, lens[next->item / Hkv], sliding_window, next_slots);
    const std::vector<int64_t>& ns = next == nullptr || next->item / Hkv == b ? slots : next_slots;
    const int64_t n = pc.t1 - pc.t0, nh = next == nullptr ? 0 : next->item % Hkv;
    const int64_t nn = next == nullptr ? 0 : next->t1 - next->t0;
    scores.resize(G * n);
    const int64_t total = row_table(kp + h * kD, vp + h * kD, slots.data() + pc.t0, n, token_stride, kp + nh * kD,
                                    nn == 0 ? nullptr : ns.data() + next->t0, nn, rows);
    attend_group_bf16<kD, false>(G, qp + b * q_stride + h * G * kD, rows.data(), total, nullptr, nullptr, n, fscale,
                                 cap, scores.data(), op + (b * Hq + h * G) * kD,
                                 pc.part < 0 ? nullptr : partials + pc.part * G * (kD + 2));
  }
}

// INT8 codes, D = kD a multiple of 32. Per (sequence, kv head): the context's K and V codes are widened
// once into scratch, exactly (8-bit integers fit the 8-bit significand of bfloat16 and float32), with each
// token's K and V scale beside them (the head's fixed scale, or the token's own); then for the query heads:
//   bfloat16 q: the bfloat16 kernel's arithmetic over the scratch rows (attend_group_bf16, scaled);
//   other q dtypes: float32 rows, q . k by FMAs, four tokens per hsum4, times the token's K scale;
//           values sum_t (e_t vs_t) v_t, normalised once at the end.
// Widening once per (sequence, kv head) into bfloat16 scratch, rather than per query head or into float32,
// is what makes it fast (docs/performance-notes.md#paged-decode-attention).
template <typename scalar_t, int64_t kD>
static void paged_decode_int8(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Half* k_scale, const at::Half* v_scale, int64_t scale_stride,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out,
                              double scale, int64_t sliding_window, double softcap) {
  constexpr bool kBF16 = std::is_same_v<scalar_t, c10::BFloat16>;
  using row_t = std::conditional_t<kBF16, c10::BFloat16, float>;  // what the codes widen to
  constexpr int64_t V = kD / 16;  // float vectors per row
  const int64_t B = q.size(0), Hq = q.size(1), block_size = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = Hq / Hkv, max_blocks = block_tables.size(1);
  const int64_t token_stride = Hkv * kD;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const int8_t* kp = k_cache.data_ptr<int8_t>();
  const int8_t* vp = v_cache.data_ptr<int8_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);

  // (n, kD) int8 rows at `base` + slots[i] * token_stride -> (n, kD) row_t
  auto widen_rows = [&](const int8_t* base, const int64_t* slots, int64_t n, row_t* dst) {
    for (int64_t i = 0; i < n; ++i) {
      const int8_t* row = base + slots[i] * token_stride;
      if (i + kAhead < n) prefetch_row<kD>(base + slots[i + kAhead] * token_stride);  // scattered, as bf16 rows
      if (i + kAheadL2 < n) prefetch_row<kD, _MM_HINT_T1>(base + slots[i + kAheadL2] * token_stride);
      for (int64_t v = 0; v < V; v += 2) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * v))));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * v + 16))));
        if constexpr (kBF16) {
          _mm512_storeu_si512(dst + i * kD + 16 * v, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        } else {
          _mm512_storeu_ps(dst + i * kD + 16 * v, lo);
          _mm512_storeu_ps(dst + i * kD + 16 * v + 16, hi);
        }
      }
    }
  };

  // bfloat16 q splits long contexts as the bfloat16 kernel does (plan_pieces), and into pieces of at most
  // kScratch bytes of widened K and V rows: a whole 4,000-token context's (1 MB at D = 64) left L2 and
  // went to memory and back, ~2.4x the time per row of short contexts. Other q dtypes take whole items.
  constexpr int64_t kScratch = 256 * 1024;
  const PiecePlan plan = plan_pieces(lens, B, Hkv, sliding_window, /*split=*/kBF16, kScratch / (2 * kD * 2));
  std::vector<float> partials(plan.parts * G * (kD + 2));
  at::parallel_for(0, static_cast<int64_t>(plan.runs.size()), 1, [&](int64_t p0, int64_t p1) {
    std::vector<int64_t> all;
    std::vector<row_t> kf, vf;
    std::vector<const c10::BFloat16*> rows;  // bfloat16 q: the scratch rows for attend_group_bf16
    std::vector<float> ks, vs, scores, qf(kD);
    for (int64_t th = p0; th < p1; ++th) {
      for (const Piece& pc : plan.runs[th]) {
        const int64_t b = pc.item / Hkv, h = pc.item % Hkv;
        context_slots(bt, max_blocks, block_size, b, lens[b], sliding_window, all);
        const int64_t* slots = all.data() + pc.t0;
        const int64_t n = pc.t1 - pc.t0;
        ks.resize(n);
        vs.resize(n);
        for (int64_t i = 0; i < n; ++i) {
          ks[i] = static_cast<float>(k_scale[slots[i] * scale_stride + h]);
          vs[i] = static_cast<float>(v_scale[slots[i] * scale_stride + h]);
        }
        kf.resize(n * kD);
        vf.resize(n * kD);
        widen_rows(kp + h * kD, slots, n, kf.data());
        widen_rows(vp + h * kD, slots, n, vf.data());
        scores.resize(G * n);
        if constexpr (kBF16) {
          // Scratch rows, in L1/L2 after widening: nothing of the next item's to request (its codes are
          // requested by widen_rows).
          rows.resize(2 * n);
          for (int64_t i = 0; i < n; ++i) {
            rows[i] = kf.data() + i * kD;
            rows[n + i] = vf.data() + i * kD;
          }
          attend_group_bf16<kD, true>(G, qp + (b * Hq + h * G) * kD, rows.data(), 2 * n, ks.data(), vs.data(), n,
                                      fscale, cap, scores.data(), op + (b * Hq + h * G) * kD,
                                      pc.part < 0 ? nullptr : partials.data() + pc.part * G * (kD + 2));
        } else {
          for (int64_t g = 0; g < G; ++g) {
            const scalar_t* qg = qp + (b * Hq + h * G + g) * kD;
            for (int64_t d = 0; d < kD; ++d) qf[d] = to_float(qg[d]) * fscale;
            __m512 qv[V];
            for (int64_t v = 0; v < V; ++v) qv[v] = _mm512_loadu_ps(qf.data() + 16 * v);
            auto dot = [&](int64_t i) {
              const float* k = kf.data() + i * kD;
              __m512 a = _mm512_mul_ps(_mm512_loadu_ps(k), qv[0]);
              for (int64_t v = 1; v < V; ++v) a = _mm512_fmadd_ps(_mm512_loadu_ps(k + 16 * v), qv[v], a);
              return a;
            };
            float* sc = scores.data();
            int64_t i = 0;
            for (; i + 4 <= n; i += 4)
              _mm_storeu_ps(sc + i, _mm_mul_ps(hsum4(dot(i), dot(i + 1), dot(i + 2), dot(i + 3)),
                                             _mm_loadu_ps(ks.data() + i)));
            for (; i < n; ++i) sc[i] = _mm512_reduce_add_ps(dot(i)) * ks[i];
            if (cap > 0.f) softcap_inplace(sc, n, cap);
            const float sum = exp_minus_max(sc, n);
            __m512 acc[V];
            for (int64_t v = 0; v < V; ++v) acc[v] = _mm512_setzero_ps();
            for (int64_t j = 0; j < n; ++j) {
              const __m512 p = _mm512_set1_ps(sc[j] * vs[j]);
              const float* row = vf.data() + j * kD;
              for (int64_t v = 0; v < V; ++v) acc[v] = _mm512_fmadd_ps(p, _mm512_loadu_ps(row + 16 * v), acc[v]);
            }
            const __m512 inv = _mm512_set1_ps(1.f / sum);
            scalar_t* og = op + (b * Hq + h * G + g) * kD;
            for (int64_t v = 0; v < V; ++v) {
              alignas(64) float o[16];
              _mm512_store_ps(o, _mm512_mul_ps(acc[v], inv));
              for (int j = 0; j < 16; ++j) og[16 * v + j] = from_float<scalar_t>(o[j]);
            }
          }
        }
      }
    }
  });
  if constexpr (kBF16) combine_partials(plan, Hkv, G, kD, partials.data(), op);
}
#endif  // TOKENLOOM_PAGED_BF16

bool DecodeAttention::supports(int64_t head_dim) {
#ifdef TOKENLOOM_PAGED_BF16
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
#else
  return false;
#endif
}

DecodeAttention::DecodeAttention(const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t Hq, int64_t Hkv,
                                 int64_t D, int64_t block_size, int64_t sliding_window)
    : bt_(block_tables.contiguous()), lens_(seq_lens.contiguous()), Hq_(Hq), Hkv_(Hkv), D_(D),
      block_size_(block_size), window_(sliding_window) {
  TORCH_CHECK(supports(D), "DecodeAttention: head size ", D, " has no bfloat16 kernel in this build");
  TORCH_CHECK(bt_.scalar_type() == at::kLong && lens_.scalar_type() == at::kLong && bt_.dim() == 2 &&
                  lens_.dim() == 1 && bt_.size(0) == lens_.size(0),
              "DecodeAttention: int64 (B, max_blocks) block tables and (B,) lengths");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "DecodeAttention: query heads not a multiple of kv heads");
#ifdef TOKENLOOM_PAGED_BF16
  plan_ = std::make_shared<const PiecePlan>(plan_pieces(lens_.data_ptr<int64_t>(), lens_.size(0), Hkv, window_,
                                                        /*split=*/true));
  partials_.resize(plan_->parts * (Hq / Hkv) * (D + 2));
#endif
}

int64_t DecodeAttention::runs() const {
#ifdef TOKENLOOM_PAGED_BF16
  return static_cast<int64_t>(plan_->runs.size());
#else
  return 0;
#endif
}

void DecodeAttention::run(int64_t r, const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* k_cache,
                          const c10::BFloat16* v_cache, c10::BFloat16* out, double scale, double softcap) {
#ifdef TOKENLOOM_PAGED_BF16
  const std::vector<Piece>& pieces = plan_->runs[r];
  auto go = [&]<int64_t kD>() {
    run_pieces_bf16<kD>(pieces, q, q_stride, k_cache, v_cache, bt_.data_ptr<int64_t>(), bt_.size(1),
                        lens_.data_ptr<int64_t>(), block_size_, Hq_, Hkv_, window_, static_cast<float>(scale),
                        static_cast<float>(softcap), partials_.data(), out);
  };
  switch (D_) {
    case 64: go.template operator()<64>(); break;
    case 128: go.template operator()<128>(); break;
    default: go.template operator()<256>(); break;
  }
#endif
}

void DecodeAttention::combine(c10::BFloat16* out) const {
#ifdef TOKENLOOM_PAGED_BF16
  combine_partials(*plan_, Hkv_, Hq_ / Hkv_, D_, partials_.data(), out);
#endif
}

template <typename scalar_t, typename cache_t>
static void dispatch_head_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Half* ks, const at::Half* vs, int64_t ss, const at::Tensor& bt,
                              const at::Tensor& lens, at::Tensor& out, double scale, int64_t sliding_window, double softcap) {
  switch (q.size(2)) {
    case 64: paged_decode_kernel<scalar_t, cache_t, 64>(q, k_cache, v_cache, ks, vs, ss, bt, lens, out, scale, sliding_window, softcap); break;
    case 128: paged_decode_kernel<scalar_t, cache_t, 128>(q, k_cache, v_cache, ks, vs, ss, bt, lens, out, scale, sliding_window, softcap); break;
    default: paged_decode_kernel<scalar_t, cache_t, 0>(q, k_cache, v_cache, ks, vs, ss, bt, lens, out, scale, sliding_window, softcap);
  }
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        int64_t sliding_window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "paged_decode: q (B, Hq, D), cache (N, bs, Hkv, D)");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: contiguous inputs");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_decode: k and v cache dtypes differ");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || q.scalar_type() == k_cache.scalar_type(), "paged_decode: q and cache dtypes differ");
  TORCH_CHECK(int8 == (k_scale.has_value() && v_scale.has_value()), "paged_decode: scales go with an int8 cache");
  const bool per_head = int8 && scales_per_head(*k_scale);
  if (int8) {
    for (const at::Tensor& s : {*k_scale, *v_scale}) {
      TORCH_CHECK(s.scalar_type() == at::kHalf && s.dim() == 3 && s.size(0) == k_cache.size(0) &&
                      s.size(1) == k_cache.size(1) && s.size(2) == k_cache.size(2),
                  "paged_decode: scales must be float16 (num_blocks, block_size, Hkv)");
      TORCH_CHECK(per_head ? scales_per_head(s) : s.is_contiguous(),
                  "paged_decode: K and V scales must both be contiguous (per token) or both per head");
    }
  }
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "paged_decode: query heads not a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "paged_decode: int64 tables");
  TORCH_CHECK(softcap >= 0, "paged_decode: softcap must be >= 0 (0: none)");
  auto bt = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  at::Tensor out = at::empty_like(q);
  const at::Half* ks = int8 ? k_scale->data_ptr<at::Half>() : nullptr;
  const at::Half* vs = int8 ? v_scale->data_ptr<at::Half>() : nullptr;
  if (!int8 && q.scalar_type() == at::kBFloat16 && DecodeAttention::supports(q.size(2))) {
    DecodeAttention attn(bt, lens, q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), sliding_window);
    const auto* qp = q.data_ptr<c10::BFloat16>();
    const auto* kp = k_cache.data_ptr<c10::BFloat16>();
    const auto* vp = v_cache.data_ptr<c10::BFloat16>();
    auto* op = out.data_ptr<c10::BFloat16>();
    at::parallel_for(0, attn.runs(), 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) attn.run(r, qp, q.size(1) * q.size(2), kp, vp, op, scale, softcap);
    });
    attn.combine(op);
    return out;
  }
  const int64_t ss = per_head ? 0 : k_cache.size(2);  // scale of token slot s, head h: [s * ss + h]
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
#ifdef TOKENLOOM_PAGED_BF16
    if (int8) {
      switch (q.size(2)) {
        case 64: return paged_decode_int8<scalar_t, 64>(q, k_cache, v_cache, ks, vs, ss, bt, lens, out, scale, sliding_window, softcap);
        case 128: return paged_decode_int8<scalar_t, 128>(q, k_cache, v_cache, ks, vs, ss, bt, lens, out, scale, sliding_window, softcap);
        case 256: return paged_decode_int8<scalar_t, 256>(q, k_cache, v_cache, ks, vs, ss, bt, lens, out, scale, sliding_window, softcap);
        default: break;  // other head sizes: the portable kernel
      }
    }
#endif
    if (int8)
      dispatch_head_dim<scalar_t, int8_t>(q, k_cache, v_cache, ks, vs, ss, bt, lens, out, scale, sliding_window, softcap);
    else
      dispatch_head_dim<scalar_t, scalar_t>(q, k_cache, v_cache, ks, vs, 0, bt, lens, out, scale, sliding_window, softcap);
  });
  return out;
}
