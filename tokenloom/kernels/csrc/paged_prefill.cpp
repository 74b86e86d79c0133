// Paged prefill attention for CPU: a chunk of new tokens per sequence attends causally over the sequence's
// cached K/V (its prefix and the chunk itself, already written), read in place through the block table.
//
// q:            (T, Hq, D)                 the step's flat tokens, RoPE applied; only the listed chunks are read
// k/v_cache:    (num_blocks, block_size, Hkv, D), contiguous; q's dtype, or int8 codes
// k/v_scale:    (num_blocks, block_size, Hkv) float16, only with int8 codes: value = code * scale;
//               per token and head (contiguous) or per head (zero block and token strides)
// block_tables: (S, max_blocks) int64      block ids of each chunk's sequence, in order
// q_starts:     (S,) int64                 row of q where chunk s begins
// q_lens:       (S,) int64                 tokens in chunk s
// seq_lens:     (S,) int64                 context length after the chunk: query j sits at position
//                                          seq_lens[s] - q_lens[s] + j and sees keys (p - window, p]
// out:          (T, Hq, D)                 rows of the listed chunks are written, the others left alone
// softcap:      0, or Gemma 2's attention logit cap: each scaled score s -> softcap * tanh(s / softcap) before
//               the mask and the online softmax (one more pass over a tile's scores, only when set)
//
// Flash-attention style: one work item is (query tile of kQTile tokens, kv head) of one chunk, all G =
// Hq / Hkv query heads of that KV head together (each K/V tile is widened once for kQTile * G rows). Keys
// go by in tiles of kKeys positions (one 512-bit vector of float32 scores per query row), each position's
// row found through the block table, widened to float32 (an INT8 row times its scale: dequantized per
// row, as paged_decode does), K transposed to (D, kKeys) so a row's 16 scores are D broadcast FMAs. The
// softmax is online (running max m and sum l per row, the accumulator rescaled when m grows); scores,
// softmax and accumulation are float32. The prefix is never copied: the SDPA path gathered the whole
// context per chunk and layer, then masked it (attention/sdpa.py).
//
// float32 FMAs rather than vdpbf16ps: the K tile is shared by kQTile * G rows, so the dot products are a
// small GEMM whose operands sit in L1 either way; the transposed float32 tile needs no horizontal sums.
#include <torch/types.h>  // not torch/extension.h (pybind11, torch::nn): ~3x the compile time per file
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define TOKENLOOM_PREFILL_AVX512 1
#endif

#include "dtype.h"
#include "kernels.h"

namespace {

constexpr int64_t kKeys = 16;    // key positions per tile: 16 float32 scores per query row
constexpr int64_t kQTile = 32;   // query tokens per work item (x G heads = the tile's rows)
constexpr int64_t kRowGroup = 8; // query rows scored together: eight independent FMA chains per K load

// One chunk's work, from the argument tensors.
struct Chunk {
  int64_t seq, q_start, q_len, ctx;
};

#ifdef TOKENLOOM_PREFILL_AVX512
// exp(x) of 16 lanes: dtype.h's exp_fast (Cephes, relative error ~2e-7) in AVX-512 intrinsics.
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// cap * tanh(s / cap) of 16 lanes: dtype.h's softcap_inplace in AVX-512 intrinsics (tanh |y| = (1 - e) / (1 + e),
// e = exp(-2|y|) <= 1, then y's sign bit put back).
inline __m512 softcap512(__m512 s, float cap) {
  const __m512 y = _mm512_mul_ps(s, _mm512_set1_ps(1.f / cap));
  const __m512 e = exp512(_mm512_mul_ps(_mm512_abs_ps(y), _mm512_set1_ps(-2.f)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(static_cast<int32_t>(0x80000000u)));
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign)), _mm512_set1_ps(cap));
}

// One key tile for nr <= kRowGroup query rows (row r0 + i: query token (r0 + i) / G of the tile, at
// position pos0 + (r0 + i) / G): q at qf (nr, kD) scaled, kt (kD, kKeys), vf (kKeys, kD) with zero rows past
// nk; updates the rows' running max m, sum l and accumulator acc (nr, kD). The scores of all nr rows
// are kept in registers (nr independent FMA chains per K load), the accumulator one vector at a time
// across the tile's 16 keys.
template <int64_t kD>
inline void tile_rows_avx512(const float* qf, const float* kt, const float* vf, int64_t nr, int64_t r0, int64_t G,
                             int64_t pos0, int64_t t0, int64_t nk, int64_t window, float cap, float* m, float* l,
                             float* acc) {
  __m512 s[kRowGroup];
  for (int64_t i = 0; i < kRowGroup; ++i) s[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < kD; ++d) {
    const __m512 k = _mm512_loadu_ps(kt + d * kKeys);
    for (int64_t i = 0; i < kRowGroup; ++i)
      if (i < nr) s[i] = _mm512_fmadd_ps(_mm512_set1_ps(qf[i * kD + d]), k, s[i]);
  }
  if (cap > 0.f)
    for (int64_t i = 0; i < nr; ++i) s[i] = softcap512(s[i], cap);
  for (int64_t i = 0; i < nr; ++i) {
    const int64_t p = pos0 + (r0 + i) / G;
    const int64_t first = window > 0 ? std::max(t0, p - window + 1) : t0;  // allowed keys: [first, last]
    const int64_t last = std::min(t0 + nk - 1, p);
    if (last < first) continue;
    const __mmask16 ok = static_cast<__mmask16>(((1u << (last - first + 1)) - 1u) << (first - t0));
    const float m_new = std::max(m[i], _mm512_mask_reduce_max_ps(ok, s[i]));
    const float alpha = m[i] == -std::numeric_limits<float>::infinity() ? 0.f : exp_fast(m[i] - m_new);
    const __m512 pv = _mm512_maskz_mov_ps(ok, exp512(_mm512_sub_ps(s[i], _mm512_set1_ps(m_new))));
    m[i] = m_new;
    l[i] = l[i] * alpha + _mm512_reduce_add_ps(pv);
    alignas(64) float pj[kKeys];
    _mm512_store_ps(pj, pv);
    const __m512 av = _mm512_set1_ps(alpha);
    float* a = acc + i * kD;
    for (int64_t v = 0; v < kD / 16; ++v) {
      __m512 x = _mm512_mul_ps(_mm512_loadu_ps(a + 16 * v), av);
      for (int64_t j = first - t0; j <= last - t0; ++j)
        x = _mm512_fmadd_ps(_mm512_set1_ps(pj[j]), _mm512_loadu_ps(vf + j * kD + 16 * v), x);
      _mm512_storeu_ps(a + 16 * v, x);
    }
  }
}
#endif

// kD > 0 fixes the head size at compile time (unrolled inner loops); 0 = runtime size q.size(2).
template <typename scalar_t, typename cache_t, int64_t kD>
void prefill_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Half* k_scale,
                    const at::Half* v_scale, int64_t scale_stride, const int64_t* bt, int64_t max_blocks,
                    const std::vector<Chunk>& chunks, at::Tensor& out, float fscale, int64_t window, float cap) {
  const int64_t Hq = q.size(1), D = kD > 0 ? kD : q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2), G = Hq / Hkv;
  const int64_t token_stride = Hkv * D;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kp = k_cache.data_ptr<cache_t>();
  const cache_t* vp = v_cache.data_ptr<cache_t>();
  scalar_t* op = out.data_ptr<scalar_t>();

  std::vector<std::pair<int64_t, int64_t>> tiles;  // (chunk, first query of the tile)
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c)
    for (int64_t j0 = 0; j0 < chunks[c].q_len; j0 += kQTile) tiles.emplace_back(c, j0);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, static_cast<int64_t>(tiles.size()) * Hkv, 1, [&](int64_t begin, int64_t end) {
    const int64_t max_rows = kQTile * G;
    std::vector<float> qf(max_rows * D), acc(max_rows * D), m(max_rows), l(max_rows);
    std::vector<float> kt(D * kKeys), vf(kKeys * D);
    for (int64_t item = begin; item < end; ++item) {
      const auto [c, j0] = tiles[item / Hkv];
      const int64_t h = item % Hkv;
      const Chunk& ch = chunks[c];
      const int64_t nq = std::min(kQTile, ch.q_len - j0), rows = nq * G;
      const int64_t pos0 = ch.ctx - ch.q_len + j0;  // position of the tile's first query
      // Row r = (query token r / G, head h * G + r % G), scaled by the softmax scale once here.
      for (int64_t r = 0; r < rows; ++r) {
        const scalar_t* src = qp + ((ch.q_start + j0 + r / G) * Hq + h * G + r % G) * D;
        float* dst = qf.data() + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] = to_float(src[d]) * fscale;
      }
      std::fill(acc.begin(), acc.begin() + rows * D, 0.f);
      std::fill(m.begin(), m.begin() + rows, neg_inf);
      std::fill(l.begin(), l.begin() + rows, 0.f);
      // Keys [lo, hi): what the tile's first query's window reaches, up to its last query.
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0, hi = pos0 + nq;
      const int64_t* table = bt + ch.seq * max_blocks;
      for (int64_t t0 = lo; t0 < hi; t0 += kKeys) {
        const int64_t nk = std::min(kKeys, hi - t0);
        // Widen the tile: K transposed into kt (D, kKeys), V into vf (kKeys, D); missing keys are zeros.
        for (int64_t j = 0; j < kKeys; ++j) {
          if (j >= nk) {
            for (int64_t d = 0; d < D; ++d) kt[d * kKeys + j] = 0.f;
            std::fill(vf.begin() + j * D, vf.begin() + (j + 1) * D, 0.f);
            continue;
          }
          const int64_t t = t0 + j, slot = table[t / block_size] * block_size + t % block_size;
          const cache_t* krow = kp + slot * token_stride + h * D;
          const cache_t* vrow = vp + slot * token_stride + h * D;
          const float ks = k_scale ? static_cast<float>(k_scale[slot * scale_stride + h]) : 1.f;
          const float vs = v_scale ? static_cast<float>(v_scale[slot * scale_stride + h]) : 1.f;
          float* vdst = vf.data() + j * D;
          for (int64_t d = 0; d < D; ++d) kt[d * kKeys + j] = to_float(krow[d]) * ks;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) vdst[d] = to_float(vrow[d]) * vs;
        }
#ifdef TOKENLOOM_PREFILL_AVX512
        if constexpr (kD > 0) {
          for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup)
            tile_rows_avx512<kD>(qf.data() + r0 * D, kt.data(), vf.data(), std::min(kRowGroup, rows - r0), r0, G, pos0,
                                 t0, nk, window, cap, m.data() + r0, l.data() + r0, acc.data() + r0 * D);
          continue;
        }
#endif
        for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
          const int64_t nr = std::min(kRowGroup, rows - r0);
          // s[i][j] = q_(r0 + i) . k_(t0 + j): D broadcast FMAs per row into 16 lanes.
          float s[kRowGroup][kKeys] = {};
          for (int64_t d = 0; d < D; ++d) {
            const float* k = kt.data() + d * kKeys;
            for (int64_t i = 0; i < kRowGroup; ++i) {
              const float qd = i < nr ? qf[(r0 + i) * D + d] : 0.f;
#pragma omp simd
              for (int64_t j = 0; j < kKeys; ++j) s[i][j] += qd * k[j];
            }
          }
          if (cap > 0.f)
            for (int64_t i = 0; i < nr; ++i) softcap_inplace(s[i], kKeys, cap);
          for (int64_t i = 0; i < nr; ++i) {
            const int64_t r = r0 + i, p = pos0 + r / G;
            // Allowed keys of position p: t <= p, t > p - window, and inside the tile.
            const int64_t first = window > 0 ? std::max(t0, p - window + 1) : t0;
            const int64_t last = std::min(t0 + nk - 1, p);  // inclusive
            if (last < first) continue;
            float tile_max = neg_inf;
            for (int64_t j = first - t0; j <= last - t0; ++j) tile_max = std::max(tile_max, s[i][j]);
            const float m_new = std::max(m[r], tile_max);
            const float alpha = m[r] == neg_inf ? 0.f : exp_fast(m[r] - m_new);
            float pj[kKeys];
            float psum = 0.f;
#pragma omp simd reduction(+ : psum)
            for (int64_t j = 0; j < kKeys; ++j) {
              const bool ok = j >= first - t0 && j <= last - t0;
              pj[j] = ok ? exp_fast(s[i][j] - m_new) : 0.f;
              psum += pj[j];
            }
            m[r] = m_new;
            l[r] = l[r] * alpha + psum;
            float* a = acc.data() + r * D;
            if (alpha != 1.f) {
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
            }
            for (int64_t j = first - t0; j <= last - t0; ++j) {
              const float w = pj[j];
              const float* v = vf.data() + j * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
            }
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        scalar_t* dst = op + ((ch.q_start + j0 + r / G) * Hq + h * G + r % G) * D;
        const float inv = 1.f / l[r];  // l > 0: every query sees at least itself
        const float* a = acc.data() + r * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = from_float<scalar_t>(a[d] * inv);
      }
    }
  });
}

template <typename scalar_t, typename cache_t>
void dispatch_head_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Half* ks,
                       const at::Half* vs, int64_t ss, const int64_t* bt, int64_t max_blocks,
                       const std::vector<Chunk>& chunks, at::Tensor& out, float scale, int64_t window, float cap) {
  switch (q.size(2)) {
    case 64: return prefill_kernel<scalar_t, cache_t, 64>(q, k_cache, v_cache, ks, vs, ss, bt, max_blocks, chunks, out, scale, window, cap);
    case 128: return prefill_kernel<scalar_t, cache_t, 128>(q, k_cache, v_cache, ks, vs, ss, bt, max_blocks, chunks, out, scale, window, cap);
    case 256: return prefill_kernel<scalar_t, cache_t, 256>(q, k_cache, v_cache, ks, vs, ss, bt, max_blocks, chunks, out, scale, window, cap);
    default: return prefill_kernel<scalar_t, cache_t, 0>(q, k_cache, v_cache, ks, vs, ss, bt, max_blocks, chunks, out, scale, window, cap);
  }
}

}  // namespace

void paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                   const at::Tensor& block_tables, const at::Tensor& q_starts, const at::Tensor& q_lens,
                   const at::Tensor& seq_lens, double scale, int64_t sliding_window, at::Tensor out, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && out.sizes() == q.sizes(),
              "paged_prefill: q and out (T, Hq, D), cache (N, bs, Hkv, D)");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_prefill: contiguous inputs");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_prefill: k and v cache dtypes differ");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "paged_prefill: out and q dtypes differ");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "paged_prefill: q and cache head sizes differ");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || q.scalar_type() == k_cache.scalar_type(), "paged_prefill: q and cache dtypes differ");
  TORCH_CHECK(int8 == (k_scale.has_value() && v_scale.has_value()), "paged_prefill: scales go with an int8 cache");
  const bool per_head = int8 && scales_per_head(*k_scale);
  if (int8) {
    for (const at::Tensor& s : {*k_scale, *v_scale}) {
      TORCH_CHECK(s.scalar_type() == at::kHalf && s.dim() == 3 && s.size(0) == k_cache.size(0) &&
                      s.size(1) == k_cache.size(1) && s.size(2) == k_cache.size(2),
                  "paged_prefill: scales must be float16 (num_blocks, block_size, Hkv)");
      TORCH_CHECK(per_head ? scales_per_head(s) : s.is_contiguous(),
                  "paged_prefill: K and V scales must both be contiguous (per token) or both per head");
    }
  }
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "paged_prefill: query heads not a multiple of kv heads");
  for (const at::Tensor* t : {&block_tables, &q_starts, &q_lens, &seq_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->device().is_cpu(), "paged_prefill: int64 CPU tables");
  const int64_t S = q_starts.numel();
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == S && q_lens.numel() == S && seq_lens.numel() == S,
              "paged_prefill: one block table row, q start, q length and context length per chunk");
  TORCH_CHECK(sliding_window >= 0, "paged_prefill: sliding_window must be >= 0 (0: none)");
  TORCH_CHECK(softcap >= 0, "paged_prefill: softcap must be >= 0 (0: none)");
  auto bt = block_tables.contiguous();
  auto qs = q_starts.contiguous(), ql = q_lens.contiguous(), sl = seq_lens.contiguous();
  const int64_t max_blocks = bt.size(1), bs = k_cache.size(1);
  std::vector<Chunk> chunks;
  for (int64_t s = 0; s < S; ++s) {
    const Chunk c{s, qs.data_ptr<int64_t>()[s], ql.data_ptr<int64_t>()[s], sl.data_ptr<int64_t>()[s]};
    // Every index the kernel forms stays inside q and the block table row.
    TORCH_CHECK(c.q_len >= 1 && c.q_start >= 0 && c.q_start + c.q_len <= q.size(0) && c.ctx >= c.q_len &&
                    c.ctx <= max_blocks * bs,
                "paged_prefill: chunk ", s, " out of range (q_start ", c.q_start, ", q_len ", c.q_len, ", ctx ", c.ctx, ")");
    chunks.push_back(c);
  }
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t num_blocks = k_cache.size(0);
  for (int64_t i = 0; i < bt.numel(); ++i)
    TORCH_CHECK(btp[i] >= 0 && btp[i] < num_blocks, "paged_prefill: block id ", btp[i], " out of range");
  const at::Half* ks = int8 ? k_scale->data_ptr<at::Half>() : nullptr;
  const at::Half* vs = int8 ? v_scale->data_ptr<at::Half>() : nullptr;
  const int64_t ss = per_head ? 0 : k_cache.size(2);  // scale of token slot s, head h: [s * ss + h]
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill", [&] {
    if (int8)
      dispatch_head_dim<scalar_t, int8_t>(q, k_cache, v_cache, ks, vs, ss, btp, max_blocks, chunks, out, fscale, sliding_window, cap);
    else
      dispatch_head_dim<scalar_t, scalar_t>(q, k_cache, v_cache, nullptr, nullptr, 0, btp, max_blocks, chunks, out, fscale,
                                            sliding_window, cap);
  });
}
