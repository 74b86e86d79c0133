// y = x @ W.T (+ bias) with W kept quantized in memory: x bfloat16 (M, K), y bfloat16 (M, N), float32
// accumulation. W is int8 or int4 codes with float16 scales (int4: and mins) per group of g input channels:
//   int8: w = d * q          q in [-128, 127]; g = K (one scale per output channel) or g = 32 (GGUF Q8_0)
//   int4: w = d * q + m      q in [0, 15]; g = 32 (GGUF Q4_0: m = -8 d; Q4_1) or 64, 128, 256
//
// Layout ("kernel order", written by tokenloom/quant/layout.py, LAYOUT_VERSION 2): each row's K inputs,
// zero-padded to Kp = K rounded up to 64, are cut into chunks of 64 = two 32-input blocks A, B.
// Position p (0..63) of a chunk holds input e(p) = 32 ((p >> 2) & 1) + 4 (p >> 3) + (p & 3), so that
// positions 4j..4j+3 are four consecutive inputs of block j % 2:
//   int8: byte p = q[e(p)];   int4: byte i (0..31) = q[e(i)] | q[e(32 + i)] << 4.
// x is permuted to the same order once per call. A lane of either dot-product instruction then sums
// one block only, so with g = 32 one vector of per-lane block scales scales a whole chunk: vpdpbusd's
// int32 lane j (positions 4j..4j+3) [dA, dB, dA, dB, ...], vdpbf16ps's float lane j (positions 2j,
// 2j+1) [dA, dA, dB, dB, ...]. For int4 and Q8_0 this is a pure byte shuffle of GGUF's blocks.
//
// int4 codes are dotted in bf16, where they are exact: OR-ing a nibble into the bits of 128.0 makes
// 128 + q with no conversion instruction, and dot(x, 128 + q) d + (m - 128 d) sum(x) = dot(x, d q + m),
// with sum(x) per group computed once per call. int8 codes would need three conversions per 16 to
// reach bf16, so on the few-row path x is quantized to int8 instead (see QX) and vpdpbusd multiplies
// 64 codes per instruction; tried for int4 too, where it was no faster than the bf16 path.
//
// Two paths:
//   M <= 8 (decode, speculative verification): each weight row is streamed once and dotted with all M
//     rows of x, weights never expanded (int4 reads ~1/3.5 of bf16's bytes). Rows are prefetched in
//     software: hardware prefetchers stop at 4 KiB pages, which halved the bandwidth.
//   M > 8 (prefill, large decode batches): a tile of 32 output channels is expanded to bf16 in a
//     thread-local buffer (int8 per channel: the codes, exact; grouped: d q + m rounded to bf16 once),
//     then a 4x4 register-blocked dot-product kernel reuses it for all M rows with x exact in bf16.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#include "avx512.h"
#define TOKENLOOM_QGEMM 1
#endif

#include "dtype.h"
#include "kernels.h"

namespace {

constexpr int kMaxSkinnyRows = 8;
constexpr int64_t kTile = 32;  // output channels expanded per tile on the many-row path
constexpr int64_t kPrefetchSteps = 4;  // prefetch distance, in steps of NR rows

inline int64_t chunk_input(int64_t p) { return 32 * ((p >> 2) & 1) + 4 * (p >> 3) + (p & 3); }

#ifdef TOKENLOOM_QGEMM

struct QWeight {
  const uint8_t* codes;  // (N, row_bytes): Kp (int8) or Kp / 2 (int4) bytes per row
  int64_t row_bytes;
  const at::Half* scales;  // (N, G)
  const at::Half* mins;    // (N, G) int4 only, else nullptr
  int64_t N, K, G, g;
};

enum Mode { kPerRow = 0, kPairs = 1, kGroups = 2 };  // one scale per row | g == 32 | g = 64, 128, 256

// Chunk c of a row -> v0, v1 (bf16 codes as int vectors): int8 exact q; int4 128 + q.
template <int BITS>
inline void decode(const uint8_t* row, int64_t c, __m512i& v0, __m512i& v1) {
  if constexpr (BITS == 4) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 32)));
    const __m512i magic = _mm512_set1_epi16(0x4300);  // bf16 128.0: its low 7 mantissa bits are free
    v0 = _mm512_ternarylogic_epi32(w, _mm512_set1_epi16(0x000F), magic, 0xEA);  // (w & 0xF) | magic
    v1 = _mm512_or_si512(_mm512_srli_epi16(w, 4), magic);
  } else {
    const uint8_t* p = row + c * 64;
    auto widen = [p](int i) {
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i))));
    };
    v0 = (__m512i)_mm512_cvtne2ps_pbh(widen(1), widen(0));  // the second operand fills the low half
    v1 = (__m512i)_mm512_cvtne2ps_pbh(widen(3), widen(2));
  }
}

inline __m512 dp(__m512 acc, const c10::BFloat16* x, __m512i v) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x), (__m512bh)v);
}

inline float half_to_float(at::Half h) { return _cvtsh_ss(h.x); }

// A float16 scale broadcast to 16 floats: broadcast the 16 bits, then convert the vector (two
// instructions; converting the scalar first and broadcasting it takes four, once per chunk and row).
inline __m512 scale_all(const at::Half* d) {
  int16_t bits;
  std::memcpy(&bits, d, 2);
  return _mm512_cvtph_ps(_mm256_set1_epi16(bits));
}

// [dA, dB, dA, dB, ...] from two consecutive float16 scales: vpdpbusd's lane j sums block j % 2.
inline __m512 scale_pair(const at::Half* d) {
  int32_t two;
  std::memcpy(&two, d, 4);
  return _mm512_cvtph_ps(_mm256_set1_epi32(two));
}

// [dA, dA, dB, dB, ...]: vdpbf16ps's lane j sums positions 2j, 2j + 1, of block (j / 2) % 2.
inline __m512 scale_pair_bf16(const at::Half* d) {
  int32_t two;
  std::memcpy(&two, d, 4);
  const __m256i ab = _mm256_set1_epi32(two);
  return _mm512_cvtph_ps(_mm256_unpacklo_epi16(ab, ab));
}

// x for the few-row path. int4: bf16 in kernel order, dotted with the codes by vdpbf16ps, and its float
// sums per weight group. int8: quantized like llama.cpp's Q8 activations, per row m and chunk c (64
// inputs) xq = round(x / dx) in [-127, 127] with dx = max |x| / 127, so that vpdpbusd multiplies 64
// codes by 64 xq per instruction with no widening of the codes (widening int8 to bf16 took three
// conversions per 16 codes: 1.2-1.75x slower per call with the weights in cache, 11% slower at 4
// streams end to end; single-stream decode is bound by memory either way).
struct QX {
  const c10::BFloat16* xp;  // int4: (M, Kp)
  const float* sum;         // int4: (M, Gp)
  const int8_t* q;          // int8: (M, Kp)
  const float* d;           // int8: (M, nchunks)
  const int32_t* corr;      // int8: (M, nchunks, 16) -128 * each int32 lane's sum of xq (see codes_u8)
  int64_t Kp, nchunks, Gp;
};

// Chunk c of an int8 row -> its 64 codes as the unsigned bytes vpdpbusd needs: q + 128 (q ^ 0x80), the
// +128 taken back by starting the dot product from QX::corr.
inline __m512i codes_u8(const uint8_t* row, int64_t c) {
  return _mm512_xor_si512(_mm512_loadu_si512(row + c * 64), _mm512_set1_epi8(static_cast<char>(0x80)));
}

// out[r][m] = dot(x[m], w[n0 + r]) for NR output channels and all M rows. Per chunk and row of x:
//   int4: two vdpbf16ps from zero, float lane j summing positions 2j, 2j+1 (block (j / 2) % 2);
//   int8: one vpdpbusd, int32 lane j summing positions 4j..4j+3 (block j % 2), made float and times dx;
// then scaled into the row's accumulator by the chunk's weight scales (with g = 32 a vector holding each
// lane's block scale; one scale per row is applied at the end instead). NR rows at once share the
// horizontal sums and the scalar work.
template <int M, int NR, int BITS, int MODE>
__attribute__((always_inline)) inline void dot_rows(const QWeight& w, int64_t n0, const QX& x, float (*out)[M]) {
  const int64_t nchunks = x.nchunks;
  // kPairs: a chunk without block B (K / 32 odd) has no second scale to read; it is done last, apart.
  const int64_t full = MODE == kPairs && (w.G & 1) ? nchunks - 1 : nchunks;
  const int shift = MODE == kGroups ? __builtin_ctzll(w.g / 64) : 0;  // chunk -> group
  const uint8_t* rows[NR];
  const at::Half* ds[NR];
  __m512 acc[NR][M];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) {
    rows[r] = w.codes + (n0 + r) * w.row_bytes;
    ds[r] = w.scales + (n0 + r) * w.G;
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  }
  auto chunk = [&](int64_t c, int r, __m512 dw) __attribute__((always_inline)) {
    _mm_prefetch(reinterpret_cast<const char*>(rows[r] + kPrefetchSteps * NR * w.row_bytes + c * 8 * BITS), _MM_HINT_T0);
    if constexpr (BITS == 4) {
      __m512i v0, v1;
      decode<4>(rows[r], c, v0, v1);
      const c10::BFloat16* xc = x.xp + c * 64;
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m512 dot = dp(dp(_mm512_setzero_ps(), xc + m * x.Kp, v0), xc + m * x.Kp + 32, v1);
        acc[r][m] = MODE == kPerRow ? _mm512_add_ps(dot, acc[r][m]) : _mm512_fmadd_ps(dot, dw, acc[r][m]);
      }
    } else {
      const __m512i u = codes_u8(rows[r], c);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m512i init = _mm512_loadu_si512(x.corr + (m * nchunks + c) * 16);
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(init, u, _mm512_loadu_si512(x.q + m * x.Kp + c * 64)));
        const __m512 dx = _mm512_set1_ps(x.d[m * nchunks + c]);
        acc[r][m] = _mm512_fmadd_ps(dot, MODE == kPerRow ? dx : _mm512_mul_ps(dw, dx), acc[r][m]);
      }
    }
  };
  for (int64_t c = 0; c < full; ++c) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      __m512 dw = _mm512_setzero_ps();
      if constexpr (MODE == kPairs) dw = BITS == 4 ? scale_pair_bf16(ds[r] + 2 * c) : scale_pair(ds[r] + 2 * c);
      if constexpr (MODE == kGroups) dw = scale_all(ds[r] + (c >> shift));
      chunk(c, r, dw);
    }
  }
  if (full < nchunks) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) chunk(full, r, scale_all(ds[r] + 2 * full));
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) {
    if constexpr (MODE == kPerRow) {
      const __m512 s = _mm512_set1_ps(half_to_float(ds[r][0]));
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_mul_ps(acc[r][m], s);
    }
    if constexpr (BITS == 4) {
      // int4's zero-point term: sum over groups of (m - 128 d) * sum(x in group), added lane-wise.
      const at::Half* mn = w.mins + (n0 + r) * w.G;
      for (int64_t i = 0; i < w.G; i += 16) {
        const __mmask16 k = w.G - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (w.G - i)) - 1);
        const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, ds[r] + i));
        const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mn + i));
        const __m512 mp = _mm512_fmadd_ps(dv, _mm512_set1_ps(-128.f), mv);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(mp, _mm512_loadu_ps(x.sum + m * x.Gp + i), acc[r][m]);
      }
    }
  }
  const __m512 z = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    float s4[4];
    if constexpr (NR == 4) _mm_storeu_ps(s4, hsum4(acc[0][m], acc[1][m], acc[2][m], acc[3][m]));
    else if constexpr (NR == 2) _mm_storeu_ps(s4, hsum4(acc[0][m], acc[1][m], z, z));
    else s4[0] = _mm512_reduce_add_ps(acc[0][m]);
    for (int r = 0; r < NR; ++r) out[r][m] = s4[r];
  }
}

template <int M, int NR, int BITS, int MODE>
inline void store_rows(const QWeight& w, int64_t n0, const QX& x, const c10::BFloat16* bias, c10::BFloat16* y) {
  float out[NR][M];
  dot_rows<M, NR, BITS, MODE>(w, n0, x, out);
  for (int r = 0; r < NR; ++r) {
    const float b = bias != nullptr ? to_float(bias[n0 + r]) : 0.f;
    for (int m = 0; m < M; ++m) y[m * w.N + n0 + r] = from_float<c10::BFloat16>(out[r][m] + b);
  }
}

template <int M, int BITS, int MODE>
void skinny_mode(const QWeight& w, const QX& x, const c10::BFloat16* bias, c10::BFloat16* y) {
  constexpr int NR = M <= 2 ? 4 : 2;  // rows per step: NR * M accumulators in registers
  // Chunks of at least ~128 KiB of codes: smaller jobs stay on the calling thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / w.row_bytes / NR);
  const int64_t steps = w.N / NR;
  at::parallel_for(0, steps, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) store_rows<M, NR, BITS, MODE>(w, i * NR, x, bias, y);
  });
  for (int64_t n = steps * NR; n < w.N; ++n) store_rows<M, 1, BITS, MODE>(w, n, x, bias, y);
}

template <int M, int BITS>
void skinny(const QWeight& w, const QX& x, const c10::BFloat16* bias, c10::BFloat16* y) {
  if (w.G == 1) skinny_mode<M, BITS, kPerRow>(w, x, bias, y);
  else if (w.g == 32) skinny_mode<M, BITS, kPairs>(w, x, bias, y);
  else skinny_mode<M, BITS, kGroups>(w, x, bias, y);
}

// --- many rows: expand a tile, then a register-blocked bf16 kernel ----------------------------------

inline __m512 bf16_lo_to_ps(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16)); }
inline __m512 bf16_hi_to_ps(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16)); }

// Row n of W -> Kp bf16 values in kernel order, into dst. Returns the scale still to apply to the
// row's dot products (int8 per channel keeps the exact codes), else 1.
template <int BITS>
float expand_row(const QWeight& w, int64_t n, int64_t Kp, c10::BFloat16* dst) {
  const uint8_t* row = w.codes + n * w.row_bytes;
  const at::Half* d = w.scales + n * w.G;
  const at::Half* mn = BITS == 4 ? w.mins + n * w.G : nullptr;
  const bool exact = BITS == 8 && w.G == 1;
  const __m512 off = _mm512_set1_ps(BITS == 4 ? 128.f : 0.f);
  for (int64_t c = 0; c < Kp / 64; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(row + 4 * w.row_bytes + c * 8 * BITS), _MM_HINT_T0);
    __m512i v0, v1;
    decode<BITS>(row, c, v0, v1);
    if (exact) {
      _mm512_storeu_si512(dst + c * 64, v0);
      _mm512_storeu_si512(dst + c * 64 + 32, v1);
      continue;
    }
    // Positions 4j..4j+3 belong to block j % 2: blocks A A A A B B B B ... along the 16 float lanes.
    // Block B's group (a missing B in the last chunk reads A's: its codes and x are zero).
    const int64_t ga = c * 64 / w.g, gb = std::min<int64_t>((c * 64 + 32) / w.g, w.G - 1);
    const __mmask16 is_b = 0xF0F0;
    const __m512 dv = _mm512_mask_blend_ps(is_b, _mm512_set1_ps(half_to_float(d[ga])), _mm512_set1_ps(half_to_float(d[gb])));
    __m512 mv = _mm512_setzero_ps();
    if constexpr (BITS == 4)
      mv = _mm512_mask_blend_ps(is_b, _mm512_set1_ps(half_to_float(mn[ga])), _mm512_set1_ps(half_to_float(mn[gb])));
    for (int h = 0; h < 2; ++h) {
      const __m512i v = h ? v1 : v0;
      const __m512 lo = _mm512_fmadd_ps(_mm512_sub_ps(bf16_lo_to_ps(v), off), dv, mv);  // d q + m, q exact
      const __m512 hi = _mm512_fmadd_ps(_mm512_sub_ps(bf16_hi_to_ps(v), off), dv, mv);
      _mm512_storeu_si512(dst + c * 64 + h * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
  return exact ? half_to_float(d[0]) : 1.f;
}

// out[r][0..3] = dot(x[r], wt[0..3]) for RB rows of x and 4 expanded weight rows; both (., Kp).
template <int RB>
inline void micro(const c10::BFloat16* x, const c10::BFloat16* wt, int64_t Kp, float out[][4]) {
  __m512 acc[RB][4];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < Kp; k += 32) {
    __m512i wv[4];
    for (int c = 0; c < 4; ++c) wv[c] = _mm512_loadu_si512(wt + c * Kp + k);
    for (int r = 0; r < RB; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * Kp + k);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, (__m512bh)wv[c]);
    }
  }
  for (int r = 0; r < RB; ++r) _mm_storeu_ps(out[r], hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

template <int BITS>
void tiled(const QWeight& w, int64_t M, const c10::BFloat16* xp, int64_t Kp, const c10::BFloat16* bias,
           c10::BFloat16* y) {
  const int64_t ntiles = (w.N + kTile - 1) / kTile;
  at::parallel_for(0, ntiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<c10::BFloat16> wt(kTile * Kp);  // this thread's expanded tile, (kTile, Kp)
    float scale[kTile];
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * kTile, nt = std::min(kTile, w.N - n0);
      for (int64_t j = 0; j < nt; ++j) scale[j] = expand_row<BITS>(w, n0 + j, Kp, wt.data() + j * Kp);
      const int64_t ntp = (nt + 3) / 4 * 4;  // pad to whole 4-column blocks with zero rows
      std::memset(static_cast<void*>(wt.data() + nt * Kp), 0, (ntp - nt) * Kp * sizeof(c10::BFloat16));
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int rb = static_cast<int>(std::min<int64_t>(4, M - m0));
        for (int64_t c0 = 0; c0 < ntp; c0 += 4) {
          float out[4][4];
          const c10::BFloat16* xr = xp + m0 * Kp;
          const c10::BFloat16* wr = wt.data() + c0 * Kp;
          switch (rb) {
            case 1: micro<1>(xr, wr, Kp, out); break;
            case 2: micro<2>(xr, wr, Kp, out); break;
            case 3: micro<3>(xr, wr, Kp, out); break;
            default: micro<4>(xr, wr, Kp, out); break;
          }
          for (int r = 0; r < rb; ++r)
            for (int64_t c = 0; c < 4 && c0 + c < nt; ++c) {
              const int64_t n = n0 + c0 + c;
              const float b = bias != nullptr ? to_float(bias[n]) : 0.f;
              y[(m0 + r) * w.N + n] = from_float<c10::BFloat16>(out[r][c] * scale[c0 + c] + b);
            }
        }
      }
    }
  });
}

// x (M, K) -> xp (M, Kp) in kernel order, zero-padded: one two-source permute per 64-input chunk.
void permute_x(const c10::BFloat16* x, int64_t M, int64_t K, int64_t Kp, c10::BFloat16* xp) {
  alignas(64) int16_t src[64];
  for (int p = 0; p < 64; ++p) src[p] = static_cast<int16_t>(chunk_input(p));
  const __m512i idx_lo = _mm512_load_si512(src), idx_hi = _mm512_load_si512(src + 32);
  for (int64_t m = 0; m < M; ++m) {
    const c10::BFloat16* xr = x + m * K;
    for (int64_t c = 0; c < Kp; c += 64) {
      auto load = [&](int64_t off) {  // 32 inputs from c + off, zeros past K
        const int64_t n = std::clamp<int64_t>(K - c - off, 0, 32);
        return _mm512_maskz_loadu_epi16(n == 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1, xr + c + off);
      };
      const __m512i a = load(0), b = load(32);
      _mm512_storeu_si512(xp + m * Kp + c, _mm512_permutex2var_epi16(a, idx_lo, b));
      _mm512_storeu_si512(xp + m * Kp + c + 32, _mm512_permutex2var_epi16(a, idx_hi, b));
    }
  }
}

// Per row and group of g inputs (g a multiple of 32), the float32 sum of x: (M, Gp), zero-padded.
void group_sums(const c10::BFloat16* x, int64_t M, int64_t K, int64_t g, int64_t Gp, float* out) {
  std::fill(out, out + M * Gp, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    const c10::BFloat16* xr = x + m * K;
    for (int64_t k = 0; k < K; k += 32) {
      const __m512i v = _mm512_loadu_si512(xr + k);  // 32 bf16 -> two float vectors
      const __m512 s = _mm512_add_ps(bf16_lo_to_ps(v), bf16_hi_to_ps(v));
      out[m * Gp + k / g] += _mm512_reduce_add_ps(s);
    }
  }
}

// xp (M, Kp) bf16 in kernel order -> xq (M, Kp) int8, dx (M, Kp / 64) per 64-input chunk, and corr
// (M, Kp / 64, 16): -128 * each int32 lane's sum of xq (see codes_u8).
void quantize_x(const c10::BFloat16* xp, int64_t M, int64_t Kp, int8_t* xq, float* dx, int32_t* corr) {
  const int64_t nchunks = Kp / 64;
  for (int64_t i = 0; i < M * nchunks; ++i) {
    const c10::BFloat16* src = xp + i * 64;
    const __m512i a = _mm512_loadu_si512(src), b = _mm512_loadu_si512(src + 32);
    const __m512 f[4] = {bf16_lo_to_ps(a), bf16_hi_to_ps(a), bf16_lo_to_ps(b), bf16_hi_to_ps(b)};
    const __m512 amax = _mm512_max_ps(_mm512_max_ps(_mm512_abs_ps(f[0]), _mm512_abs_ps(f[1])),
                                      _mm512_max_ps(_mm512_abs_ps(f[2]), _mm512_abs_ps(f[3])));
    const float d = _mm512_reduce_max_ps(amax) / 127.f;
    dx[i] = d;
    const __m512 inv = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
    for (int j = 0; j < 4; ++j)  // round to nearest even; |x| / d <= 127 (+ rounding) stays in int8
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i * 64 + 16 * j),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(f[j], inv))));
    const __m512i lane_sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1),
                                                  _mm512_loadu_si512(xq + i * 64));
    _mm512_storeu_si512(corr + i * 16, _mm512_mullo_epi32(lane_sums, _mm512_set1_epi32(-128)));
  }
}

// Scratch that lives as long as the calling thread: a decode step calls this ~120 times, and two
// tensor allocations per call cost as much as the permute itself.
template <typename T>
T* scratch(std::vector<T>& buf, int64_t n) {
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

#endif  // TOKENLOOM_QGEMM

}  // namespace

bool quant_available() {
#ifdef TOKENLOOM_QGEMM
  return true;
#else
  return false;
#endif
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t bits, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "quant_linear: x must be (M, K) bfloat16");
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8");
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous(), "quant_linear: contiguous 2-d codes");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kHalf && scales.is_contiguous(), "quant_linear: float16 scales (N, G)");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = scales.size(1);
  TORCH_CHECK(scales.size(0) == N && G >= 1 && K % G == 0, "quant_linear: scales must be (N, G) with G dividing K");
  const int64_t g = K / G;
  const int64_t Kp = (K + 63) / 64 * 64, Gp = (G + 15) / 16 * 16;  // K padded to whole chunks
  if (bits == 8) {
    TORCH_CHECK(codes.scalar_type() == at::kChar && codes.size(1) == Kp, "quant_linear: int8 codes (N, Kp)");
    TORCH_CHECK(G == 1 || g == 32 || g % 64 == 0, "quant_linear: int8 groups must be the whole row, 32 or a multiple of 64");
  } else {
    TORCH_CHECK(codes.scalar_type() == at::kByte && codes.size(1) * 2 == Kp, "quant_linear: int4 codes (N, Kp/2) uint8");
    TORCH_CHECK(K % 32 == 0 && (g == 32 || g % 64 == 0 || G == 1), "quant_linear: int4 needs K a multiple of 32 and groups of 32 or a multiple of 64");
    TORCH_CHECK(mins.has_value() && mins->sizes() == scales.sizes() && mins->scalar_type() == at::kHalf &&
                mins->is_contiguous(), "quant_linear: int4 needs float16 mins shaped like the scales");
  }
  const c10::BFloat16* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N && bias->is_contiguous(), "quant_linear: bias");
    b = bias->data_ptr<c10::BFloat16>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
#ifdef TOKENLOOM_QGEMM
  const at::Tensor xc = x.contiguous();
  thread_local std::vector<c10::BFloat16> xp_buf;
  thread_local std::vector<float> xsum_buf;
  c10::BFloat16* xpp = scratch(xp_buf, M * Kp);
  permute_x(xc.data_ptr<c10::BFloat16>(), M, K, Kp, xpp);
  QWeight w{static_cast<const uint8_t*>(codes.data_ptr()), codes.size(1), scales.data_ptr<at::Half>(),
            bits == 4 ? mins->data_ptr<at::Half>() : nullptr, N, K, G, g};
  auto* yp = y.data_ptr<c10::BFloat16>();
  if (M > kMaxSkinnyRows) {
    if (bits == 4) tiled<4>(w, M, xpp, Kp, b, yp);
    else tiled<8>(w, M, xpp, Kp, b, yp);
    return y;
  }
  // The few-row path: int4 dots the permuted bf16 x and needs its sums per group; int8 quantizes it.
  const int64_t nchunks = Kp / 64;
  QX qx{xpp, nullptr, nullptr, nullptr, nullptr, Kp, nchunks, Gp};
  if (bits == 4) {
    float* xs = scratch(xsum_buf, M * Gp);
    group_sums(xc.data_ptr<c10::BFloat16>(), M, K, g, Gp, xs);
    qx.sum = xs;
  } else {
    thread_local std::vector<int8_t> xq_buf;
    thread_local std::vector<float> dx_buf;
    thread_local std::vector<int32_t> corr_buf;
    int8_t* xq = scratch(xq_buf, M * Kp);
    float* dx = scratch(dx_buf, M * nchunks);
    int32_t* corr = scratch(corr_buf, M * nchunks * 16);
    quantize_x(xpp, M, Kp, xq, dx, corr);
    qx.q = xq;
    qx.d = dx;
    qx.corr = corr;
  }
#define TL_SKINNY(MM)                                                   \
  case MM:                                                              \
    if (bits == 4) skinny<MM, 4>(w, qx, b, yp);                         \
    else skinny<MM, 8>(w, qx, b, yp);                                   \
    break;
  switch (M) {
    TL_SKINNY(1) TL_SKINNY(2) TL_SKINNY(3) TL_SKINNY(4) TL_SKINNY(5) TL_SKINNY(6) TL_SKINNY(7)
    default: TL_SKINNY(8)
  }
#undef TL_SKINNY
  return y;
#else
  TORCH_CHECK(false, "quant_linear: built without AVX512-BF16 (use the torch path)");
#endif
}
