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
// Flash-attention style, two paths:
// - AVX-512 with a head size of 64, 128 or 256 (every model tokenloom serves): one work item is (KV head, 64
//   consecutive rows of the chunk), a row being (query token, query head of the KV head's group), so a tile
//   holds whole and partial tokens alike and every lane does work. The tile's queries are transposed once
//   into Q^T (D, 64) and kept there: scores come out as S^T (keys, 64 rows) = K . Q^T, one 512-bit vector
//   holding 16 rows' scores for one key, so the online softmax (running max m, sum l, the accumulator's
//   rescale) runs across rows in vector lanes with no horizontal reduction, and the causal / window mask is
//   a lane compare of each row's position against the key's. The output accumulates transposed, O^T (D, 64)
//   += V^T . P^T. Both products are register-blocked 4 x 4 (four keys or four head dims by four vectors of
//   16 rows: 16 accumulators, each loaded operand feeding four FMAs). Keys go by in blocks of kBlockKeys,
//   each position's K/V row found through the block table. Two routes: bf16 queries and cache (with
//   AVX512-BF16) multiply bf16 pairs by vdpbf16ps, K read in place and V interleaved in pairs, P rounded to
//   bf16 for the P.V product (as PyTorch's CPU flash kernel does); everything else widens the block's rows
//   to float32 once for all 64 rows (an INT8 row times its scale, as paged_decode dequantizes) for FMAs.
// - otherwise (no AVX-512, other head sizes): a portable loop over tiles of kQTile tokens, 16 keys at a time,
//   one row's scores per 16-lane vector (the compiler vectorises the inner loops).
// Scores, softmax and accumulation are float32 on every path. The prefix is never copied: the SDPA path
// gathered the whole context per chunk and layer, then masked it (attention/sdpa.py).
#include <torch/types.h>  // not torch/extension.h (pybind11, torch::nn): ~3x the compile time per file
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TOKENLOOM_PREFILL_AVX512 1
#if defined(__AVX512BF16__)
#define TOKENLOOM_PREFILL_BF16 1
#endif
#endif

#include "dtype.h"
#include "kernels.h"

namespace {

// The portable path's tiles.
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

// 2^x of 16 lanes for the online softmax, whose scores are kept in log2 units (the scale folded into the
// scores times log2 e): x = n + f, f in [-0.5, 0.5], 2^f by a degree-5 polynomial (relative error ~2e-6),
// 2^n applied by vscalefps (which gives 0 for very negative n, no clamping needed). Half exp512's
// instructions: the softmax is a quarter of the bf16 route's work per score.
inline __m512 exp2_512(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

constexpr float kLog2e = 1.44269504088896341f;

constexpr int64_t kTileRows = 64;   // rows per work item: 4 vectors of 16 lanes
constexpr int64_t kBlockKeys = 32;  // key positions widened and scored per block
constexpr int kStep = 4;            // keys (scores) or head dims (output) per register block

// S^T rows j0.. of a key block: sT[j][lane] = k_j . q_lane over kD for NV vectors of 16 lanes. kf is the
// block's K widened to float32 (kBlockKeys, kD), zero past its nk keys; qT (kD, kTileRows), pre-scaled.
template <int64_t kD, int NV>
inline void scores_t(const float* qT, const float* kf, int64_t nk, float* sT) {
  for (int64_t j0 = 0; j0 < nk; j0 += kStep) {  // rows past nk are zeros in kf: computed, never read
    __m512 s[kStep][NV];
    for (int j = 0; j < kStep; ++j)
      for (int v = 0; v < NV; ++v) s[j][v] = _mm512_setzero_ps();
    const float* k = kf + j0 * kD;
    for (int64_t d = 0; d < kD; ++d) {
      __m512 qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = _mm512_load_ps(qT + d * kTileRows + 16 * v);
      for (int j = 0; j < kStep; ++j) {
        const __m512 kd = _mm512_set1_ps(k[j * kD + d]);
        for (int v = 0; v < NV; ++v) s[j][v] = _mm512_fmadd_ps(kd, qv[v], s[j][v]);
      }
    }
    for (int j = 0; j < kStep; ++j)
      for (int v = 0; v < NV; ++v) _mm512_store_ps(sT + (j0 + j) * kTileRows + 16 * v, s[j][v]);
  }
}

// O^T (kD, kTileRows) = O^T * alpha (per lane) + V^T . P^T over the block's nk keys, four head dims by NV
// vectors at a time. vf (kBlockKeys, kD) float32, pT (kBlockKeys, kTileRows) with masked lanes zero.
template <int64_t kD, int NV>
inline void accumulate_t(const float* pT, const float* vf, int64_t nk, const __m512* alpha, float* oT) {
  for (int64_t d0 = 0; d0 < kD; d0 += kStep) {
    __m512 o[kStep][NV];
    for (int d = 0; d < kStep; ++d)
      for (int v = 0; v < NV; ++v) o[d][v] = _mm512_mul_ps(_mm512_load_ps(oT + (d0 + d) * kTileRows + 16 * v), alpha[v]);
    for (int64_t j = 0; j < nk; ++j) {
      __m512 pv[NV];
      for (int v = 0; v < NV; ++v) pv[v] = _mm512_load_ps(pT + j * kTileRows + 16 * v);
      const float* vr = vf + j * kD + d0;
      for (int d = 0; d < kStep; ++d) {
        const __m512 w = _mm512_set1_ps(vr[d]);
        for (int v = 0; v < NV; ++v) o[d][v] = _mm512_fmadd_ps(w, pv[v], o[d][v]);
      }
    }
    for (int d = 0; d < kStep; ++d)
      for (int v = 0; v < NV; ++v) _mm512_store_ps(oT + (d0 + d) * kTileRows + 16 * v, o[d][v]);
  }
}

#ifdef TOKENLOOM_PREFILL_BF16
// The bf16 route (bf16 queries and cache): vdpbf16ps multiplies bf16 pairs exactly and sums them in float32,
// so one instruction does two head dims (scores) or two keys (output) of the float32 route's FMAs.
// qT2 (kD / 2, kTileRows) words (q_d | q_d+1 << 16), unscaled; krows: each key's cache row, read as words
// (k_d | k_d+1 << 16) and broadcast; sT gets the scores times fscale (the softmax scale in log2 units).
template <int64_t kD, int NV>
inline void scores_t_bf16(const uint32_t* qT2, const uint32_t* const* krows, int64_t nk, float fscale, float* sT) {
  const __m512 sc = _mm512_set1_ps(fscale);
  for (int64_t j0 = 0; j0 < nk; j0 += kStep) {  // krows past nk point at a zero row
    __m512 s[kStep][NV];
    for (int j = 0; j < kStep; ++j)
      for (int v = 0; v < NV; ++v) s[j][v] = _mm512_setzero_ps();
    for (int64_t dp = 0; dp < kD / 2; ++dp) {
      __m512i qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = _mm512_load_si512(qT2 + dp * kTileRows + 16 * v);
      for (int j = 0; j < kStep; ++j) {
        const __m512i kd = _mm512_set1_epi32(static_cast<int32_t>(krows[j0 + j][dp]));
        for (int v = 0; v < NV; ++v) s[j][v] = _mm512_dpbf16_ps(s[j][v], (__m512bh)kd, (__m512bh)qv[v]);
      }
    }
    for (int j = 0; j < kStep; ++j)
      for (int v = 0; v < NV; ++v) _mm512_store_ps(sT + (j0 + j) * kTileRows + 16 * v, _mm512_mul_ps(s[j][v], sc));
  }
}

// O^T = O^T * alpha + V^T . P^T over nk2 key pairs: pT2 (nk2, kTileRows) words (p_2i | p_2i+1 << 16) per
// lane, vpair (nk2, kD) words (v_2i,d | v_2i+1,d << 16).
template <int64_t kD, int NV>
inline void accumulate_t_bf16(const uint32_t* pT2, const uint32_t* vpair, int64_t nk2, const __m512* alpha, float* oT) {
  for (int64_t d0 = 0; d0 < kD; d0 += kStep) {
    __m512 o[kStep][NV];
    for (int d = 0; d < kStep; ++d)
      for (int v = 0; v < NV; ++v) o[d][v] = _mm512_mul_ps(_mm512_load_ps(oT + (d0 + d) * kTileRows + 16 * v), alpha[v]);
    for (int64_t jj = 0; jj < nk2; ++jj) {
      __m512i pv[NV];
      for (int v = 0; v < NV; ++v) pv[v] = _mm512_load_si512(pT2 + jj * kTileRows + 16 * v);
      const uint32_t* vr = vpair + jj * kD + d0;
      for (int d = 0; d < kStep; ++d) {
        const __m512i w = _mm512_set1_epi32(static_cast<int32_t>(vr[d]));
        for (int v = 0; v < NV; ++v) o[d][v] = _mm512_dpbf16_ps(o[d][v], (__m512bh)w, (__m512bh)pv[v]);
      }
    }
    for (int d = 0; d < kStep; ++d)
      for (int v = 0; v < NV; ++v) _mm512_store_ps(oT + (d0 + d) * kTileRows + 16 * v, o[d][v]);
  }
}

// Two bf16 rows a, b of kD elements -> kD words (a_d | b_d << 16).
template <int64_t kD>
inline void interleave_rows(const uint16_t* a, const uint16_t* b, uint32_t* out) {
  alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                   24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
  for (int64_t c = 0; c < kD; c += 32) {
    const __m512i x = _mm512_loadu_si512(a + c), y = _mm512_loadu_si512(b + c);
    _mm512_store_si512(out + c, _mm512_permutex2var_epi16(x, lo, y));
    _mm512_store_si512(out + c + 16, _mm512_permutex2var_epi16(x, hi, y));
  }
}

// 16 lanes of P for keys j, j + 1 -> words (bf16(p_j) | bf16(p_j+1) << 16): both rounded into one vector
// (p_j's 16 values, then p_j+1's), then interleaved.
inline __m512i pair_bf16(__m512 p0, __m512 p1) {
  alignas(64) static constexpr uint16_t kMix[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_permutexvar_epi16(_mm512_load_si512(kMix), (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
}
#endif

// Scratch of one thread, 64-byte aligned: Q^T and O^T (kD, kTileRows), K and V blocks (kBlockKeys, kD),
// S^T / P^T (kBlockKeys, kTileRows) and, for the bf16 route, P^T in key pairs (kBlockKeys / 2, kTileRows)
// words. The bf16 route keeps Q^T and V as words in qT and vf (half their float32 size).
struct TileScratch {
  std::vector<__m512> store;
  float *qT, *oT, *kf, *vf, *sT;
  uint32_t* pT2;
  explicit TileScratch(int64_t D)
      : store((2 * D * kTileRows + 2 * kBlockKeys * D + kBlockKeys * kTileRows + kBlockKeys / 2 * kTileRows) / 16) {
    qT = reinterpret_cast<float*>(store.data());
    oT = qT + D * kTileRows;
    kf = oT + D * kTileRows;
    vf = kf + kBlockKeys * D;
    sT = vf + kBlockKeys * D;
    pT2 = reinterpret_cast<uint32_t*>(sT + kBlockKeys * kTileRows);
  }
};

// kPairs: the bf16 route (vdpbf16ps on bf16 pairs); otherwise float32 FMAs on widened rows.
template <typename scalar_t, typename cache_t, int64_t kD, int NV, bool kPairs>
void tile_avx512(const scalar_t* qp, const cache_t* kp, const cache_t* vp, const at::Half* k_scale,
                 const at::Half* v_scale, int64_t scale_stride, const int64_t* table, int64_t block_size,
                 int64_t Hq, int64_t Hkv, const Chunk& ch, int64_t h, int64_t r_begin, int64_t nrows, float fscale,
                 int64_t window, float cap, TileScratch& w, scalar_t* op) {
  const int64_t G = Hq / Hkv, token_stride = Hkv * kD, first_pos = ch.ctx - ch.q_len;
  // Lane r: row r_begin + r = (token (r_begin + r) / G of the chunk, head h * G + (r_begin + r) % G).
  // Its keys: [lowest allowed position, own position]; padded lanes allow none (position -1).
  alignas(64) int32_t pos[kTileRows], low[kTileRows];
  uint32_t* qT2 = reinterpret_cast<uint32_t*>(w.qT);
  // Scores in log2 units (the softmax takes 2^x): scaled by fscale * log2 e; a soft cap goes back to
  // natural units for its tanh.
  const float qscale = fscale * kLog2e;
  for (int64_t r = 0; r < 16 * NV; ++r) {
    const bool real = r < nrows;
    const int64_t p = first_pos + (r_begin + r) / G;
    pos[r] = real ? static_cast<int32_t>(p) : -1;
    low[r] = real && window > 0 ? static_cast<int32_t>(std::max<int64_t>(0, p - window + 1)) : 0;
    const scalar_t* src = qp + ((ch.q_start + (r_begin + r) / G) * Hq + h * G + (r_begin + r) % G) * kD;
    for (int64_t d = 0; d < kD; ++d) w.oT[d * kTileRows + r] = 0.f;
    if constexpr (kPairs) {
      const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
      for (int64_t dp = 0; dp < kD / 2; ++dp)
        qT2[dp * kTileRows + r] = real ? bits[2 * dp] | static_cast<uint32_t>(bits[2 * dp + 1]) << 16 : 0u;
    } else {
      for (int64_t d = 0; d < kD; ++d) w.qT[d * kTileRows + r] = real ? to_float(src[d]) * qscale : 0.f;
    }
  }
  __m512i posv[NV], lowv[NV];
  __m512 m[NV], l[NV];
  for (int v = 0; v < NV; ++v) {
    posv[v] = _mm512_load_si512(pos + 16 * v);
    lowv[v] = _mm512_load_si512(low + 16 * v);
    m[v] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    l[v] = _mm512_setzero_ps();
  }
  // Keys [lo, hi): from the lowest position any lane's window reaches to the last lane's own position.
  const int64_t last_pos = first_pos + (r_begin + nrows - 1) / G, first_row_pos = first_pos + r_begin / G;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_row_pos - window + 1) : 0, hi = last_pos + 1;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) static constexpr uint16_t kZeroRow[256] = {};  // a missing key of the bf16 route (kD <= 256)
  const uint32_t* krows[kBlockKeys];
  uint32_t* vpair = reinterpret_cast<uint32_t*>(w.vf);
  for (int64_t t0 = lo; t0 < hi; t0 += kBlockKeys) {
    const int64_t nk = std::min(kBlockKeys, hi - t0);
    auto slot_of = [&](int64_t t) { return table[t / block_size] * block_size + t % block_size; };
    if constexpr (kPairs) {  // K read in place, V rows interleaved in pairs; missing keys are zero rows
      const uint16_t* rows[kBlockKeys];
      for (int64_t j = 0; j < kBlockKeys; ++j)
        rows[j] = j < nk ? reinterpret_cast<const uint16_t*>(kp + slot_of(t0 + j) * token_stride + h * kD) : kZeroRow;
      for (int64_t j = 0; j < kBlockKeys; ++j) krows[j] = reinterpret_cast<const uint32_t*>(rows[j]);
      for (int64_t j = 0; j < nk; j += 2) {
        const uint16_t* a = reinterpret_cast<const uint16_t*>(vp + slot_of(t0 + j) * token_stride + h * kD);
        const uint16_t* b =
            j + 1 < nk ? reinterpret_cast<const uint16_t*>(vp + slot_of(t0 + j + 1) * token_stride + h * kD) : kZeroRow;
        interleave_rows<kD>(a, b, vpair + (j / 2) * kD);
      }
      scores_t_bf16<kD, NV>(qT2, krows, nk, qscale, w.sT);
    } else {  // widen the block to float32; K rows past nk are zeros (scored, unused)
      for (int64_t j = 0; j < kBlockKeys; ++j) {
        float* kd = w.kf + j * kD;
        float* vd = w.vf + j * kD;
        if (j >= nk) {
          std::fill(kd, kd + kD, 0.f);
          continue;
        }
        const int64_t slot = slot_of(t0 + j);
        const cache_t* krow = kp + slot * token_stride + h * kD;
        const cache_t* vrow = vp + slot * token_stride + h * kD;
        const float ks = k_scale ? static_cast<float>(k_scale[slot * scale_stride + h]) : 1.f;
        const float vs = v_scale ? static_cast<float>(v_scale[slot * scale_stride + h]) : 1.f;
#pragma omp simd
        for (int64_t d = 0; d < kD; ++d) kd[d] = to_float(krow[d]) * ks;
#pragma omp simd
        for (int64_t d = 0; d < kD; ++d) vd[d] = to_float(vrow[d]) * vs;
      }
      scores_t<kD, NV>(w.qT, w.kf, nk, w.sT);
    }
    // Online softmax across lanes: new max, rescale factor alpha = 2^(m_old - m_new), then P^T (masked lanes
    // 0). A block every lane sees whole (below the tile's first position, inside every window) needs no
    // mask: padded lanes then score zeros into their own lanes, which are never written out.
    const bool whole = t0 + nk - 1 <= first_row_pos && (window <= 0 || t0 >= last_pos - window + 1);
    __m512 alpha[NV];
    for (int v = 0; v < NV; ++v) {
      __mmask16 ok[kBlockKeys];
      __m512 mx = m[v];
      for (int64_t j = 0; j < nk; ++j) {
        const __m512i t = _mm512_set1_epi32(static_cast<int32_t>(t0 + j));
        ok[j] = whole ? static_cast<__mmask16>(0xFFFF)
                      : _mm512_cmple_epi32_mask(t, posv[v]) & _mm512_cmple_epi32_mask(lowv[v], t);
        float* s = w.sT + j * kTileRows + 16 * v;
        __m512 sv = _mm512_load_ps(s);
        if (cap > 0.f) {
          sv = _mm512_mul_ps(softcap512(_mm512_mul_ps(sv, _mm512_set1_ps(1.f / kLog2e)), cap), _mm512_set1_ps(kLog2e));
          _mm512_store_ps(s, sv);
        }
        mx = _mm512_mask_max_ps(mx, ok[j], mx, sv);
      }
      // A lane with no allowed key yet keeps m = -inf: subtract 0 there instead (its p and l stay 0).
      const __m512 ref = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(mx, neg_inf, _CMP_NEQ_OQ), mx);
      alpha[v] = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m[v], neg_inf, _CMP_NEQ_OQ), exp2_512(_mm512_sub_ps(m[v], ref)));
      __m512 sum = _mm512_setzero_ps();
      auto p_of = [&](int64_t j) {
        return _mm512_maskz_mov_ps(ok[j], exp2_512(_mm512_sub_ps(_mm512_load_ps(w.sT + j * kTileRows + 16 * v), ref)));
      };
      if constexpr (kPairs) {
        for (int64_t j = 0; j < nk; j += 2) {
          const __m512i pp = pair_bf16(p_of(j), j + 1 < nk ? p_of(j + 1) : _mm512_setzero_ps());
          _mm512_store_si512(w.pT2 + (j / 2) * kTileRows + 16 * v, pp);
          // l sums the weights as rounded, so each row's weights sum to exactly 1 after the division.
          sum = _mm512_add_ps(sum, _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(pp, 16)),
                                                 _mm512_castsi512_ps(_mm512_and_si512(pp, _mm512_set1_epi32(-65536)))));
        }
      } else {
        for (int64_t j = 0; j < nk; ++j) {
          const __m512 p = p_of(j);
          _mm512_store_ps(w.sT + j * kTileRows + 16 * v, p);
          sum = _mm512_add_ps(sum, p);
        }
      }
      l[v] = _mm512_fmadd_ps(l[v], alpha[v], sum);
      m[v] = mx;
    }
    if constexpr (kPairs)
      accumulate_t_bf16<kD, NV>(w.pT2, vpair, (nk + 1) / 2, alpha, w.oT);
    else
      accumulate_t<kD, NV>(w.sT, w.vf, nk, alpha, w.oT);
  }
  alignas(64) float inv[kTileRows];
  for (int v = 0; v < NV; ++v)  // l > 0 on real lanes: every query sees at least itself
    _mm512_store_ps(inv + 16 * v, _mm512_div_ps(_mm512_set1_ps(1.f), l[v]));
  for (int64_t r = 0; r < nrows; ++r) {
    scalar_t* dst = op + ((ch.q_start + (r_begin + r) / G) * Hq + h * G + (r_begin + r) % G) * kD;
    for (int64_t d = 0; d < kD; ++d) dst[d] = from_float<scalar_t>(w.oT[d * kTileRows + r] * inv[r]);
  }
}

template <typename scalar_t, typename cache_t, int64_t kD>
void prefill_kernel_avx512(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Half* k_scale, const at::Half* v_scale, int64_t scale_stride, const int64_t* bt,
                           int64_t max_blocks, const std::vector<Chunk>& chunks, at::Tensor& out, float fscale,
                           int64_t window, float cap) {
  const int64_t Hq = q.size(1), block_size = k_cache.size(1), Hkv = k_cache.size(2), G = Hq / Hkv;
#ifdef TOKENLOOM_PREFILL_BF16
  constexpr bool kPairs = std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>;
#else
  constexpr bool kPairs = false;
#endif
  std::vector<std::pair<int64_t, int64_t>> rows;  // (chunk, first row of the tile), a tile's cost growing with r0
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c)
    for (int64_t r0 = 0; r0 < chunks[c].q_len * G; r0 += kTileRows) rows.emplace_back(c, r0);
  // parallel_for hands each thread one contiguous range of items: taking tiles from both ends in turn (first,
  // last, second, second to last...) gives every range a mix of cheap and dear ones (a fresh 512-token
  // chunk's last tile sees 512 keys, its first 22).
  std::vector<std::pair<int64_t, int64_t>> tiles;
  for (size_t a = 0, b = rows.size(); a < b;) {
    tiles.push_back(rows[a++]);
    if (a < b) tiles.push_back(rows[--b]);
  }
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kp = k_cache.data_ptr<cache_t>();
  const cache_t* vp = v_cache.data_ptr<cache_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, static_cast<int64_t>(tiles.size()) * Hkv, 1, [&](int64_t begin, int64_t end) {
    TileScratch w(kD);
    for (int64_t item = begin; item < end; ++item) {
      const auto [c, r0] = tiles[item / Hkv];
      const int64_t h = item % Hkv;
      const Chunk& ch = chunks[c];
      const int64_t nrows = std::min(kTileRows, ch.q_len * G - r0);
      const int64_t* table = bt + ch.seq * max_blocks;
#define TOKENLOOM_TILE(NV)                                                                                            \
  tile_avx512<scalar_t, cache_t, kD, NV, kPairs>(qp, kp, vp, k_scale, v_scale, scale_stride, table, block_size, Hq, Hkv, ch, h, \
                                         r0, nrows, fscale, window, cap, w, op)
      switch ((nrows + 15) / 16) {  // vectors of 16 lanes the tile needs
        case 1: TOKENLOOM_TILE(1); break;
        case 2: TOKENLOOM_TILE(2); break;
        case 3: TOKENLOOM_TILE(3); break;
        default: TOKENLOOM_TILE(4); break;
      }
#undef TOKENLOOM_TILE
    }
  });
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
#ifdef TOKENLOOM_PREFILL_AVX512
  switch (q.size(2)) {
    case 64: return prefill_kernel_avx512<scalar_t, cache_t, 64>(q, k_cache, v_cache, ks, vs, ss, bt, max_blocks, chunks, out, scale, window, cap);
    case 128: return prefill_kernel_avx512<scalar_t, cache_t, 128>(q, k_cache, v_cache, ks, vs, ss, bt, max_blocks, chunks, out, scale, window, cap);
    case 256: return prefill_kernel_avx512<scalar_t, cache_t, 256>(q, k_cache, v_cache, ks, vs, ss, bt, max_blocks, chunks, out, scale, window, cap);
    default: return prefill_kernel<scalar_t, cache_t, 0>(q, k_cache, v_cache, ks, vs, ss, bt, max_blocks, chunks, out, scale, window, cap);
  }
#else
  switch (q.size(2)) {
    case 64: return prefill_kernel<scalar_t, cache_t, 64>(q, k_cache, v_cache, ks, vs, ss, bt, max_blocks, chunks, out, scale, window, cap);
    case 128: return prefill_kernel<scalar_t, cache_t, 128>(q, k_cache, v_cache, ks, vs, ss, bt, max_blocks, chunks, out, scale, window, cap);
    case 256: return prefill_kernel<scalar_t, cache_t, 256>(q, k_cache, v_cache, ks, vs, ss, bt, max_blocks, chunks, out, scale, window, cap);
    default: return prefill_kernel<scalar_t, cache_t, 0>(q, k_cache, v_cache, ks, vs, ss, bt, max_blocks, chunks, out, scale, window, cap);
  }
#endif
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
