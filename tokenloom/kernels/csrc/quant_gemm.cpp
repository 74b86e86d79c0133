// y = x @ W.T (+ bias) with W kept quantized in memory: x bfloat16 (M, K), y bfloat16 (M, N), float32
// accumulation. W is int8 or int4 codes with float16 scales (int4: and mins) per group of g input channels:
//   int8: w = d * q          q in [-128, 127]; g = K (one scale per output channel) or g = 32 (GGUF Q8_0)
//   int4: w = d * q + m      q in [0, 15]; g = 32 (GGUF Q4_0: m = -8 d; Q4_1) or 64, 128, 256
//
// Layout (written by tokenloom/quant/layout.py, LAYOUT_VERSION 3); K is zero-padded to Kp, a multiple of 64.
//   int8, rows apart: each row's Kp inputs in chunks of 64 = two 32-input blocks A, B; position p (0..63)
//     of a chunk holds input e(p) = 32 ((p >> 2) & 1) + 4 (p >> 3) + (p & 3), so that positions 4j..4j+3
//     (vpdpbusd's int32 lane j) are four consecutive inputs of block j % 2 and, with g = 32, one vector of
//     per-lane block scales [dA, dB, dA, dB, ...] scales a whole chunk. x is permuted to the same order.
//   int4, blocks of 16 output channels (the last may hold r < 16): step s of a block (inputs 8s..8s+7)
//     is 4r bytes, byte 4j + c = q[j][8s + c] | q[j][8s + 4 + c] << 4 for the block's channel j. One
//     64-byte load and a mask give, for 16 channels at once, their codes of inputs 8s..8s+3 (low nibbles)
//     and 8s+4..8s+7 (high), so vpdpbusd's int32 lane j accumulates channel j: no horizontal sums, and a
//     group's scales and mins (stored blocked too: r consecutive values per group) are one vector load.
//
// Three paths (route 0 "auto" chooses; 1 "vnni" forces the first two, 2 "expand" the third, for tests):
//   Few rows (decode, speculative verification): each weight byte is read once and dotted with all M rows
//     of x, the codes never expanded. x is quantized like llama.cpp's Q8 activations: int8 per 32 inputs
//     (int8: per 64-input chunk), xq = round(x / dx) with dx = max |x| / 127, so that vpdpbusd multiplies
//     64 codes by 64 xq per instruction; int4's zero point adds m times the group's sum of dx xq.
//     Weights are prefetched in software (hardware prefetchers stop at 4 KiB pages), except int8's with 1-3
//     rows of x, which reads its weight rows one after another in address order instead. (Quantizing x takes
//     far fewer instructions than widening the codes to bf16: docs/performance-notes.md#quantized-matmul.)
//   int4 up to quant_panel_max_rows() (measured at start-up, tokenloom/quant/routing.py): the same kernel
//     over panels of kSkinnyMaxRows rows, each 16-channel block of W dotted with every panel while in L1.
//   Beyond, up to quant_tile_max_rows() (batched decode, verification, small prefill chunks; int8 from
//     int8_tile_min_rows rows): qtile.h, 16 output channels at a time decoded into a cache-resident tile of
//     8-bit codes and dotted with all M rows by vpdpbusd, 4 rows against 2 tiles per pass: W read from
//     memory once per call.
//   M > quant_tile_max_rows() (prefill): the weight is expanded to bf16 (int8 per channel: the codes, exact,
//     the scale applied to each dot product; grouped: d q + m rounded to bf16 once), up to 16 MiB of it at
//     once (all of a SmolLM2 layer) in a reused buffer, then one oneDNN matmul over all M rows (at::linear:
//     AMX where the CPU has it), which outruns the VNNI tiles once enough rows pay for the expansion.
// quant_tile_max_rows() starts from a default for the build's CPU features (see its definition); the engine
// sets it at start-up from a measurement of both routes (tokenloom/quant/routing.py), which it logs.
#include <torch/types.h>  // not torch/extension.h (pybind11, torch::nn): ~3x the compile time per file
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#include "avx512.h"
#include "qtile.h"
#define TOKENLOOM_QGEMM 1
#endif

#include <atomic>

#include "dtype.h"
#include "kernels.h"

namespace {

enum Route : int64_t { kAuto = 0, kVnni = 1, kExpand = 2 };
constexpr int64_t kExpandBytes = int64_t{16} << 20;  // bf16 weight expanded per oneDNN call on that path
constexpr int64_t kBlock = kInt4Block;  // int4 output channels per block (16)
constexpr int64_t kPrefetchSteps = 4;  // int8 prefetch distance, in steps of NR rows
constexpr int64_t kPrefetchBytes = 8192;  // int4 prefetch distance (tuned: docs/performance-notes.md#quantized-matmul)

inline int64_t chunk_input(int64_t p) { return 32 * ((p >> 2) & 1) + 4 * (p >> 3) + (p & 3); }

#ifdef TOKENLOOM_QGEMM

struct QWeight {
  const uint8_t* codes;  // (N, row_bytes): Kp (int8) or Kp / 2 (int4) bytes per row
  int64_t row_bytes;
  const at::Half* scales;  // (N, G); int4: blocked (layout.py)
  const at::Half* mins;    // (N, G) int4 only, else nullptr
  int64_t N, K, G, g;
};

inline float half_to_float(at::Half h) { return _cvtsh_ss(h.x); }

inline __m512 bf16_lo_to_ps(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16)); }
inline __m512 bf16_hi_to_ps(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16)); }

// --- int8, few rows ---------------------------------------------------------------------------------

enum Mode { kPerRow = 0, kPairs = 1, kGroups = 2 };  // one scale per row | g == 32 | g = 64, 128, 256

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

// int8 x, per row m and chunk c (64 inputs): xq = round(x / dx) in [-127, 127], dx = max |x| / 127
// (rather than widening the int8 codes to bf16: docs/performance-notes.md#quantized-matmul).
struct QX {
  const int8_t* q;       // (M, Kp)
  const float* d;        // (M, nchunks)
  const int32_t* corr;   // (M, nchunks, 16) -128 * each int32 lane's sum of xq (see codes_u8)
  int64_t Kp, nchunks;
};

// Chunk c of an int8 row -> its 64 codes as the unsigned bytes vpdpbusd needs: q + 128 (q ^ 0x80), the
// +128 taken back by starting the dot product from QX::corr.
inline __m512i codes_u8(const uint8_t* row, int64_t c) {
  return _mm512_xor_si512(_mm512_loadu_si512(row + c * 64), _mm512_set1_epi8(static_cast<char>(0x80)));
}

// out[r][m] = dot(x[m], w[n0 + r]) for NR output channels and all M rows. Per chunk and row of x one
// vpdpbusd, int32 lane j summing positions 4j..4j+3 (block j % 2), made float and times dx, then scaled
// into the row's accumulator by the chunk's weight scales (with g = 32 a vector holding each lane's block
// scale; one scale per row is applied at the end instead). NR rows at once share the horizontal sums.
// M <= 3: the NR weight rows one after another, so that W streams in address order for the hardware
// prefetcher (as skinny_gemm.cpp's few rows do), no software prefetch. Interleaved, with the prefetch, one
// row of x ran at half the bf16 kernel's bytes per second out of cache; from 4 rows of x interleaving
// wins again (docs/performance-notes.md#quantized-matmul).
template <int M>
constexpr bool kSequentialInt8 = M <= 3;

template <int M, int NR, int MODE>
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
    if constexpr (!kSequentialInt8<M>)
      _mm_prefetch(reinterpret_cast<const char*>(rows[r] + kPrefetchSteps * NR * w.row_bytes + c * 64), _MM_HINT_T0);
    const __m512i u = codes_u8(rows[r], c);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512i init = _mm512_loadu_si512(x.corr + (m * nchunks + c) * 16);
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(init, u, _mm512_loadu_si512(x.q + m * x.Kp + c * 64)));
      const __m512 dx = _mm512_set1_ps(x.d[m * nchunks + c]);
      acc[r][m] = _mm512_fmadd_ps(dot, MODE == kPerRow ? dx : _mm512_mul_ps(dw, dx), acc[r][m]);
    }
  };
  auto weight_scale = [&](int64_t c, int r) __attribute__((always_inline)) {
    __m512 dw = _mm512_setzero_ps();
    if constexpr (MODE == kPairs) dw = scale_pair(ds[r] + 2 * c);
    if constexpr (MODE == kGroups) dw = scale_all(ds[r] + (c >> shift));
    return dw;
  };
  if constexpr (kSequentialInt8<M>) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r)
      for (int64_t c = 0; c < full; ++c) chunk(c, r, weight_scale(c, r));
  } else {
    for (int64_t c = 0; c < full; ++c) {
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) chunk(c, r, weight_scale(c, r));
    }
  }
  if (full < nchunks) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) chunk(full, r, scale_all(ds[r] + 2 * full));
  }
  if constexpr (MODE == kPerRow) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m512 s = _mm512_set1_ps(half_to_float(ds[r][0]));
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_mul_ps(acc[r][m], s);
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

template <int M, int NR, int MODE>
inline void store_rows(const QWeight& w, int64_t n0, const QX& x, const c10::BFloat16* bias, c10::BFloat16* y) {
  float out[NR][M];
  dot_rows<M, NR, MODE>(w, n0, x, out);
  for (int r = 0; r < NR; ++r) {
    const float b = bias != nullptr ? to_float(bias[n0 + r]) : 0.f;
    for (int m = 0; m < M; ++m) y[m * w.N + n0 + r] = from_float<c10::BFloat16>(out[r][m] + b);
  }
}

template <int M, int MODE>
void skinny_int8_mode(const QWeight& w, const QX& x, const c10::BFloat16* bias, c10::BFloat16* y) {
  constexpr int NR = M <= 2 ? 4 : 2;  // rows per step: NR * M accumulators in registers
  // Chunks of at least ~128 KiB of codes: smaller jobs stay on the calling thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / w.row_bytes / NR);
  const int64_t steps = w.N / NR;
  at::parallel_for(0, steps, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) store_rows<M, NR, MODE>(w, i * NR, x, bias, y);
  });
  for (int64_t n = steps * NR; n < w.N; ++n) store_rows<M, 1, MODE>(w, n, x, bias, y);
}

template <int M>
void skinny_int8(const QWeight& w, const QX& x, const c10::BFloat16* bias, c10::BFloat16* y) {
  if (w.G == 1) skinny_int8_mode<M, kPerRow>(w, x, bias, y);
  else if (w.g == 32) skinny_int8_mode<M, kPairs>(w, x, bias, y);
  else skinny_int8_mode<M, kGroups>(w, x, bias, y);
}

// --- int4, few rows ---------------------------------------------------------------------------------

// x for the int4 few-row path, in natural input order.
struct X4 {
  const int8_t* q;    // (M, Kp) xq per 32 inputs
  const float* d;     // (M, Kp / 32) dx
  const float* sum;   // (M, G) sums of the quantized x per weight group
  int64_t Kp, G;
};

// One block (r <= 16 output channels from n0) against all M rows of x: out[m] lane j = dot(x[m], w[n0 + j]).
// Per 32 inputs and row m: eight vpdpbusd from zero (16 channels x 4 inputs each), made float and times
// dx; per weight group: times the channels' scales, plus their mins times the group's sum of x.
template <int M>
__attribute__((always_inline)) inline void int4_block(const QWeight& w, int64_t n0, const X4& x, __m512 (&acc)[M]) {
  const int64_t r = std::min<int64_t>(kBlock, w.N - n0), step = 4 * r;  // bytes per 8 inputs
  const uint8_t* base = w.codes + n0 * w.row_bytes;
  const at::Half* db = w.scales + n0 * w.G;  // the block's scales: G groups of r
  const at::Half* mb = w.mins + n0 * w.G;
  const __mmask64 kc = r == kBlock ? ~__mmask64(0) : (__mmask64(1) << step) - 1;
  const __mmask16 ks = static_cast<__mmask16>((1u << r) - 1);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t subs = w.g / 32;
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t t = 0; t < w.G; ++t) {
    __m512 gacc[M];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) gacc[m] = _mm512_setzero_ps();
    for (int64_t u = 0; u < subs; ++u) {
      const int64_t k0 = t * w.g + u * 32;
      __m512i isum[M];
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) isum[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        const uint8_t* p = base + (k0 / 8 + s) * step;
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes), _MM_HINT_T0);
        const __m512i z = _mm512_maskz_loadu_epi8(kc, p);
        const __m512i lo = _mm512_and_si512(z, low), hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), low);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          int32_t a, b;  // xq of inputs k0 + 8s .. +3 and +4 .. +7, each broadcast to all lanes
          std::memcpy(&a, x.q + m * x.Kp + k0 + 8 * s, 4);
          std::memcpy(&b, x.q + m * x.Kp + k0 + 8 * s + 4, 4);
          isum[m] = _mm512_dpbusd_epi32(isum[m], lo, _mm512_set1_epi32(a));
          isum[m] = _mm512_dpbusd_epi32(isum[m], hi, _mm512_set1_epi32(b));
        }
      }
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m)
        gacc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_set1_ps(x.d[m * (x.Kp / 32) + k0 / 32]), gacc[m]);
    }
    _mm_prefetch(reinterpret_cast<const char*>(db + t * r) + kPrefetchBytes / 8, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(mb + t * r) + kPrefetchBytes / 8, _MM_HINT_T0);
    const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(ks, db + t * r));
    const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(ks, mb + t * r));
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
      acc[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x.sum[m * x.G + t]), _mm512_fmadd_ps(gacc[m], dv, acc[m]));
  }
}

// Rows of x in panels of kSkinnyMaxRows (the last R = 1..kSkinnyMaxRows), each block of W dotted with every
// panel while it is in L1: W read from memory once per call at any row count. With M <= kSkinnyMaxRows one
// panel, the few-row kernel. A row's outputs do not depend on the panel it falls in (each row's chain is its
// own), so M rows give bit for bit what M calls of one row give.
template <int R>
void skinny_int4(const QWeight& w, const X4& x, int64_t M, const c10::BFloat16* bias, c10::BFloat16* y) {
  constexpr int P = static_cast<int>(kSkinnyMaxRows);
  const int64_t nblocks = (w.N + kBlock - 1) / kBlock;
  const int64_t full = (M - R) / P;  // panels of P rows before the last, of R
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / (kBlock * w.row_bytes));  // ~128 KiB of codes
  auto panel = [&]<int Rows>(int64_t n0, int64_t m0, __mmask16 k, __m512 bv) {
    const X4 xp{x.q + m0 * x.Kp, x.d + m0 * (x.Kp / 32), x.sum + m0 * x.G, x.Kp, x.G};
    __m512 acc[Rows];
    int4_block<Rows>(w, n0, xp, acc);
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m)
      _mm256_mask_storeu_epi16(y + (m0 + m) * w.N + n0, k, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m], bv)));
  };
  at::parallel_for(0, nblocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBlock;
      const __mmask16 k = static_cast<__mmask16>((1u << std::min<int64_t>(kBlock, w.N - n0)) - 1);
      const __m512 bv = bias == nullptr ? _mm512_setzero_ps()
          : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, bias + n0)), 16));
      for (int64_t p = 0; p < full; ++p) panel.template operator()<P>(n0, p * P, k, bv);
      panel.template operator()<R>(n0, full * P, k, bv);
    }
  });
}

// x (M, K) -> xq (M, Kp) int8 and dx (M, Kp / 32) per 32 inputs (K a multiple of 32; the rest unused),
// and sum (M, G): per weight group of g inputs, the sum of the quantized x, dx * sum(xq). The zero point
// m then multiplies the same x as the codes do, and y is exactly W dequantized times x quantized: with
// the exact sum of x instead, the error of the code term (d q, all of one sign) would not cancel
// against m's, and the kernel's error at K = 1536 was twice as large.
void quantize_x32(const c10::BFloat16* x, int64_t M, int64_t K, int64_t Kp, int64_t g, int64_t G, int8_t* xq,
                  float* dx, float* sum) {
  std::fill(sum, sum + M * G, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; k += 32) {
      const __m512i v = _mm512_loadu_si512(x + m * K + k);
      const __m512 f0 = bf16_lo_to_ps(v), f1 = bf16_hi_to_ps(v);
      const float d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(f0), _mm512_abs_ps(f1))) / 127.f;
      dx[m * (Kp / 32) + k / 32] = d;
      const __m512 inv = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
      // Round to nearest even; |x| / d <= 127 stays in int8.
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(f0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(f1, inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + m * Kp + k), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + m * Kp + k + 16), _mm512_cvtsepi32_epi8(q1));
      sum[m * G + k / g] += d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
    }
  }
}

// --- many rows: expand a tile, then a register-blocked bf16 kernel ----------------------------------

// Chunk c of an int8 row -> its 64 codes as bf16, exact, in two vectors.
inline void decode_int8(const uint8_t* row, int64_t c, __m512i& v0, __m512i& v1) {
  const uint8_t* p = row + c * 64;
  auto widen = [p](int i) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i))));
  };
  v0 = (__m512i)_mm512_cvtne2ps_pbh(widen(1), widen(0));  // the second operand fills the low half
  v1 = (__m512i)_mm512_cvtne2ps_pbh(widen(3), widen(2));
}

// int8 row n of W -> Kp bf16 values in kernel order, into dst. Returns the scale still to apply to the
// row's dot products (per channel: the exact codes, scale d), else 1 (per 32: d q rounded to bf16).
float expand_row_int8(const QWeight& w, int64_t n, int64_t Kp, c10::BFloat16* dst) {
  const uint8_t* row = w.codes + n * w.row_bytes;
  const at::Half* d = w.scales + n * w.G;
  const bool exact = w.G == 1;
  for (int64_t c = 0; c < Kp / 64; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(row + 4 * w.row_bytes + c * 64), _MM_HINT_T0);
    __m512i v0, v1;
    decode_int8(row, c, v0, v1);
    if (exact) {
      _mm512_storeu_si512(dst + c * 64, v0);
      _mm512_storeu_si512(dst + c * 64 + 32, v1);
      continue;
    }
    // Positions 4j..4j+3 belong to block j % 2: blocks A A A A B B B B ... along the 16 float lanes.
    // Block B's group (a missing B in the last chunk reads A's: its codes and x are zero).
    const int64_t ga = c * 64 / w.g, gb = std::min<int64_t>((c * 64 + 32) / w.g, w.G - 1);
    const __m512 dv = _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(half_to_float(d[ga])), _mm512_set1_ps(half_to_float(d[gb])));
    for (int h = 0; h < 2; ++h) {
      const __m512i v = h ? v1 : v0;
      const __m512 lo = _mm512_mul_ps(bf16_lo_to_ps(v), dv), hi = _mm512_mul_ps(bf16_hi_to_ps(v), dv);
      _mm512_storeu_si512(dst + c * 64 + h * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
  return exact ? half_to_float(d[0]) : 1.f;
}

// The int4 block from channel n0 -> its r rows of d q + m rounded to bf16, natural input order, into
// dst (r, Kp), inputs K..Kp zero. Per step s, unpacklo/hi_epi32 of the low and high nibbles put, in
// 128-bit lane i, channels (4i, 4i+1) and (4i+2, 4i+3) as 8 consecutive codes each.
void expand_block_int4(const QWeight& w, int64_t n0, int64_t Kp, c10::BFloat16* dst) {
  const int64_t r = std::min<int64_t>(kBlock, w.N - n0), step = 4 * r;
  const uint8_t* base = w.codes + n0 * w.row_bytes;
  const at::Half* db = w.scales + n0 * w.G;
  const at::Half* mb = w.mins + n0 * w.G;
  const __mmask64 kc = r == kBlock ? ~__mmask64(0) : (__mmask64(1) << step) - 1;
  const __mmask16 ks = static_cast<__mmask16>((1u << r) - 1);
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512i idx[8];  // part p = 2i + h: lanes 0-7 channel 4i + 2h, lanes 8-15 channel 4i + 2h + 1
  for (int p = 0; p < 8; ++p) {
    const int c0 = 4 * (p / 2) + 2 * (p % 2);
    idx[p] = _mm512_setr_epi32(c0, c0, c0, c0, c0, c0, c0, c0, c0 + 1, c0 + 1, c0 + 1, c0 + 1, c0 + 1, c0 + 1, c0 + 1, c0 + 1);
  }
  for (int64_t t = 0; t < w.G; ++t) {
    const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(ks, db + t * r));
    const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(ks, mb + t * r));
    __m512 dp[8], mp[8];
    for (int p = 0; p < 8; ++p) {
      dp[p] = _mm512_permutexvar_ps(idx[p], dv);
      mp[p] = _mm512_permutexvar_ps(idx[p], mv);
    }
    for (int64_t s = t * w.g / 8; s < (t + 1) * w.g / 8; ++s) {
      const __m512i z = _mm512_maskz_loadu_epi8(kc, base + s * step);
      const __m512i lo = _mm512_and_si512(z, low), hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), low);
      const __m512i uv[2] = {_mm512_unpacklo_epi32(lo, hi), _mm512_unpackhi_epi32(lo, hi)};
      auto part = [&](int p, __m128i bytes) {  // 16 codes: channels c0, c0 + 1, 8 inputs each
        const int64_t c0 = 4 * (p / 2) + 2 * (p % 2);
        if (c0 >= r) return;
        const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), dp[p], mp[p]);
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + c0 * Kp + 8 * s), _mm256_castsi256_si128(h));
        if (c0 + 1 < r) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (c0 + 1) * Kp + 8 * s), _mm256_extracti128_si256(h, 1));
      };
      for (int h = 0; h < 2; ++h) {
        part(h, _mm512_castsi512_si128(uv[h]));
        part(2 + h, _mm512_extracti32x4_epi32(uv[h], 1));
        part(4 + h, _mm512_extracti32x4_epi32(uv[h], 2));
        part(6 + h, _mm512_extracti32x4_epi32(uv[h], 3));
      }
    }
  }
  for (int64_t j = 0; j < r; ++j)
    std::fill(dst + j * Kp + w.K, dst + (j + 1) * Kp, c10::BFloat16(0.f));
}

// Rows [n0, n0 + nc) of W expanded to bf16 (nc, Kp) at wd (n0 a multiple of kBlock): int4 blocks in
// natural input order, int8 rows in kernel order; row_scale[0, nc) gets the scale still to apply to each
// row's dot products (int8 per channel: d, its codes exact; otherwise 1).
template <int BITS>
void expand_span(const QWeight& w, int64_t n0, int64_t nc, int64_t Kp, c10::BFloat16* wd, float* row_scale) {
  if constexpr (BITS == 4) {
    for (int64_t j = 0; j < nc; j += kBlock) expand_block_int4(w, n0 + j, Kp, wd + j * Kp);
    std::fill(row_scale, row_scale + nc, 1.f);
  } else {
    for (int64_t j = 0; j < nc; ++j) row_scale[j] = expand_row_int8(w, n0 + j, Kp, wd + j * Kp);
  }
}

// y = x @ dequant(W).T (+ bias) through oneDNN: W expanded kExpandBytes at a time into a reused buffer
// (a whole layer of SmolLM2 in one piece; a 128k-token LM head of a 4096-wide model in 64 pieces),
// each piece one at::linear over all M rows. xp (M, Kp) is x padded and ordered as the expanded rows.
template <int BITS>
at::Tensor expanded_linear(const QWeight& w, const at::Tensor& xt, int64_t Kp, const c10::optional<at::Tensor>& bias) {
  const int64_t M = xt.size(0);
  const int64_t chunk = std::max<int64_t>(kBlock, kExpandBytes / (Kp * 2) / kBlock * kBlock);
  const int64_t nc_max = std::min(w.N, chunk);
  thread_local std::vector<c10::BFloat16> wd_buf;
  thread_local std::vector<float> rs_buf;
  c10::BFloat16* wd = scratch(wd_buf, nc_max * Kp);
  float* rs = scratch(rs_buf, nc_max);
  const bool per_channel = BITS == 8 && w.G == 1;  // y = (x . q) d: the scale applies to the dot product
  const auto bf16 = xt.options();
  at::Tensor y = nc_max == w.N ? at::Tensor() : at::empty({M, w.N}, bf16);
  for (int64_t n0 = 0; n0 < w.N; n0 += nc_max) {
    const int64_t nc = std::min(nc_max, w.N - n0);
    at::parallel_for(0, (nc + kBlock - 1) / kBlock, 1, [&](int64_t begin, int64_t end) {
      const int64_t j = begin * kBlock;
      expand_span<BITS>(w, n0 + j, std::min(end * kBlock, nc) - j, Kp, wd + j * Kp, rs + j);
    });
    const at::Tensor wt = at::from_blob(wd, {nc, Kp}, bf16);
    const c10::optional<at::Tensor> b = bias.has_value() ? c10::optional<at::Tensor>(bias->narrow(0, n0, nc)) : c10::nullopt;
    at::Tensor part;
    if (!per_channel) {
      part = at::linear(xt, wt, b);
    } else {
      at::Tensor yf = at::linear(xt, wt).to(at::kFloat).mul_(at::from_blob(rs, {nc}, bf16.dtype(at::kFloat)));
      if (b.has_value()) yf.add_(*b);
      part = yf.to(at::kBFloat16);
    }
    if (nc == w.N) return part;
    y.narrow(1, n0, nc).copy_(part);
  }
  return y;
}

// x (M, K) -> xp (M, Kp), zero-padded; in kernel order (int8: one two-source permute per 64-input
// chunk) or as it is (int4).
void pad_x(const c10::BFloat16* x, int64_t M, int64_t K, int64_t Kp, bool permute, c10::BFloat16* xp) {
  if (!permute) return qtile::pad_rows(x, M, K, M, Kp, xp);
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

// xp (M, Kp) bf16 in kernel order -> xq (M, Kp) int8, dx (M, Kp / 64) per 64-input chunk, and corr
// (M, Kp / 64, 16): -128 * each int32 lane's sum of xq (see codes_u8).
void quantize_x64(const c10::BFloat16* xp, int64_t M, int64_t Kp, int8_t* xq, float* dx, int32_t* corr) {
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

// --- many rows: qtile.h's tiles ----------------------------------------------------------------------

// The int8 rows [n0, n0 + r) -> a tile in natural input order: chunk c's dword l (four consecutive inputs,
// 32 (l & 1) + 4 (l >> 1) onwards) of the 16 rows, transposed, is the tile's step 16 c + 8 (l & 1) + (l >> 1).
// Codes q + 128, unsigned, the 128 taken back by the zero point -128 d.
qtile::Tile fill_int8(const QWeight& w, int64_t Kp, int64_t n0, int64_t r, uint8_t* codes, float* scale, float* zp) {
  constexpr int64_t A = qtile::kPrefetchAhead;  // into L2 ahead, a line as each of this tile's is read
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t c = 0; c < Kp / 64; ++c) {
    __m512i v[16];
    for (int j = 0; j < 16; ++j) {
      if (n0 + A + j < w.N) qtile::prefetch_l2(w.codes + (n0 + A + j) * w.row_bytes + c * 64);
      v[j] = j < r ? _mm512_xor_si512(_mm512_loadu_si512(w.codes + (n0 + j) * w.row_bytes + c * 64), flip)
                   : _mm512_setzero_si512();
    }
    qtile::transpose16(v);
    for (int l = 0; l < 16; ++l) _mm512_storeu_si512(codes + (c * 16 + 8 * (l & 1) + (l >> 1)) * 64, v[l]);
  }
  // Scale t of the 16 channels: a gather of 32 bits at each channel's float16 scale t (the low half is it;
  // the high half, the next scale, is not used). The last tile gathers nothing past the tensor: scalar.
  if (n0 + qtile::kCh < w.N) {
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int>(2 * w.G)));
    const char* base = reinterpret_cast<const char*>(w.scales + n0 * w.G);
    for (int64_t t = 0; t < w.G; ++t) {
      const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(at, base + 2 * t, 1)));
      _mm512_storeu_ps(scale + t * qtile::kCh, d);
      _mm512_storeu_ps(zp + t * qtile::kCh, _mm512_mul_ps(d, _mm512_set1_ps(-128.f)));
    }
    return {codes, scale, zp, nullptr};
  }
  for (int64_t t = 0; t < w.G; ++t)
    for (int64_t j = 0; j < qtile::kCh; ++j) {
      const float d = j < r ? half_to_float(w.scales[(n0 + j) * w.G + t]) : 0.f;
      scale[t * qtile::kCh + j] = d;
      zp[t * qtile::kCh + j] = -128.f * d;
    }
  return {codes, scale, zp, nullptr};
}

// The int4 block from n0 (r channels) -> a tile: its step s (8 inputs, 16 channels per vpdpbusd lane
// already) split into low nibbles (inputs 8s..8s+3: tile step 2s) and high (tile step 2s + 1); its blocked
// float16 scales and mins made float.
qtile::Tile fill_int4(const QWeight& w, int64_t Kp, int64_t n0, int64_t r, uint8_t* codes, float* scale, float* zp) {
  const uint8_t* base = w.codes + n0 * w.row_bytes;
  constexpr int64_t A = qtile::kPrefetchAhead;  // into L2 ahead, a line as each of this block's is read
  const __mmask64 kc = r == kBlock ? ~__mmask64(0) : (__mmask64(1) << (4 * r)) - 1;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t s8 = 0; s8 < Kp / 8; ++s8) {
    if (n0 + A < w.N) qtile::prefetch_l2(base + A * w.row_bytes + s8 * 4 * r);
    const __m512i z = _mm512_maskz_loadu_epi8(kc, base + s8 * 4 * r);
    _mm512_storeu_si512(codes + 2 * s8 * 64, _mm512_and_si512(z, low));
    _mm512_storeu_si512(codes + (2 * s8 + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(z, 4), low));
  }
  const at::Half* db = w.scales + n0 * w.G;
  const at::Half* mb = w.mins + n0 * w.G;
  const __mmask16 ks = static_cast<__mmask16>((1u << r) - 1);
  for (int64_t t = 0; t < w.G; ++t) {
    _mm512_storeu_ps(scale + t * kBlock, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(ks, db + t * r)));
    _mm512_storeu_ps(zp + t * kBlock, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(ks, mb + t * r)));
  }
  return {codes, scale, zp, nullptr};
}

at::Tensor tile_linear(const QWeight& w, const at::Tensor& x, int64_t Kp, int64_t bits, const c10::BFloat16* bias) {
  // One scale per row: a single group of all Kp inputs (x is zero past K).
  const qtile::Shape s{w.N, w.K, Kp, w.G == 1 ? Kp : w.g, w.G};
  if (bits == 4)
    return qtile::linear(x, s, bias, [&](int64_t n0, int64_t r, uint8_t* codes, float* scale, float* zp, int32_t*) {
      return fill_int4(w, Kp, n0, r, codes, scale, zp);
    });
  return qtile::linear(x, s, bias, [&](int64_t n0, int64_t r, uint8_t* codes, float* scale, float* zp, int32_t*) {
    return fill_int8(w, Kp, n0, r, codes, scale, zp);
  });
}

#endif  // TOKENLOOM_QGEMM

// Auto routes: the VNNI tiles up to this many rows, then W expanded to bf16 for oneDNN. Where the CPU
// has AMX (as compiled: -march=native) oneDNN's tiles outrun VNNI from a few rows; without it the VNNI
// tiles win at every batched-decode size measured (docs/performance-notes.md#quantized-batching).
#if defined(__AMX_BF16__)
constexpr int64_t kDefaultTileMaxRows = 2 * kSkinnyMaxRows;
#else
constexpr int64_t kDefaultTileMaxRows = kPackedMaxRows;
#endif
std::atomic<int64_t> tile_max_rows{kDefaultTileMaxRows};
// int4: the few-row kernel in panels up to this many rows (then the tiles); one panel until measured.
std::atomic<int64_t> panel_max_rows{kSkinnyMaxRows};

// int8's first row count served by the tiles rather than the few-row kernel. Its float work is per 64
// inputs per row of x and of W (an int32 -> float conversion and an FMA per vpdpbusd, the 128-offset
// correction), the tiles' per 32 inputs per row of x and 16 of W. Measured on Zen 4 (the 2-core EPYC, no
// AMX; SmolLM2's four linears x 30 out of cache, forced routes alternating, docs/performance-notes.md
// #quantized-batching): per channel the tiles 1.08-1.33x faster at 4-8 rows on two threads (1.17-1.41x on
// one; the few-row kernel 1.2-1.5x faster at 2-3), Q8_0's groups of 32 (two scales per chunk) from 7 rows
// (1.04 / 1.16x at 7 / 8; at 6 0.95-0.99x), and so its 49152-row LM head (1.18x at 7, 1.38x at 8). Other
// group sizes as before.
int64_t int8_tile_min_rows(int64_t G, int64_t g) {
  const int64_t first = G == 1 ? 4 : g == 32 ? 7 : kSkinnyMaxRows + 1;
  return std::min<int64_t>(first, kSkinnyMaxRows + 1);
}

}  // namespace

bool quant_available() {
#ifdef TOKENLOOM_QGEMM
  return true;
#else
  return false;
#endif
}

int64_t quant_tile_max_rows() { return tile_max_rows.load(std::memory_order_relaxed); }

int64_t quant_panel_max_rows() { return panel_max_rows.load(std::memory_order_relaxed); }

void set_quant_panel_max_rows(int64_t rows) {
  TORCH_CHECK(rows >= kSkinnyMaxRows, "quant_panel_max_rows must be at least ", kSkinnyMaxRows);
  panel_max_rows.store(rows, std::memory_order_relaxed);
}

int64_t quant_tile_min_rows(int64_t bits, int64_t groups, int64_t group_size) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_tile_min_rows: bits must be 4 or 8");
  TORCH_CHECK(groups >= 1 && group_size >= 1, "quant_tile_min_rows: groups and group size must be positive");
  return bits == 8 ? int8_tile_min_rows(groups, group_size) : quant_panel_max_rows() + 1;
}

namespace {
std::atomic<int64_t> tile_dot{0};  // vpdpbusd until the start-up measurement (or a test) says otherwise
std::atomic<int64_t> tile_dot_from{0};

bool amx_usable() {
#ifdef TOKENLOOM_QTILE_AMX
  return qtile::amx::permitted();
#else
  return false;
#endif
}
}  // namespace

std::vector<std::string> quant_tile_dots() {
  std::vector<std::string> d{"vnni"};
  if (amx_usable()) d.insert(d.end(), {"amx-int8", "amx-bf16"});
  return d;
}

int64_t quant_tile_dot() { return tile_dot.load(std::memory_order_relaxed); }

int64_t quant_tile_dot_from() { return tile_dot_from.load(std::memory_order_relaxed); }

void set_quant_tile_dot_from(int64_t rows) {
  TORCH_CHECK(rows >= 0, "set_quant_tile_dot_from: rows must be >= 0, got ", rows);
  tile_dot_from.store(rows, std::memory_order_relaxed);
}

void set_quant_tile_dot(int64_t dot) {
  TORCH_CHECK(dot >= 0 && dot <= 2, "set_quant_tile_dot: 0 (vnni), 1 (amx-int8) or 2 (amx-bf16), got ", dot);
  TORCH_CHECK(dot == 0 || amx_usable(), "set_quant_tile_dot: this build or CPU has no AMX "
              "(or the kernel refused the process its tile state)");
  tile_dot.store(dot, std::memory_order_relaxed);
}

void set_quant_tile_max_rows(int64_t rows) {
  TORCH_CHECK(rows >= kSkinnyMaxRows, "quant_tile_max_rows must be at least ", kSkinnyMaxRows);
  tile_max_rows.store(rows, std::memory_order_relaxed);
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t bits, const c10::optional<at::Tensor>& bias,
                        int64_t route) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "quant_linear: x must be (M, K) bfloat16");
  TORCH_CHECK(route >= kAuto && route <= kExpand, "quant_linear: route must be 0 (auto), 1 (vnni) or 2 (expand)");
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8");
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous(), "quant_linear: contiguous 2-d codes");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kHalf && scales.is_contiguous(), "quant_linear: float16 scales (N, G)");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = scales.size(1);
  TORCH_CHECK(scales.size(0) == N && G >= 1 && K % G == 0, "quant_linear: scales must be (N, G) with G dividing K");
  const int64_t g = K / G;
  const int64_t Kp = (K + kQuantChunk - 1) / kQuantChunk * kQuantChunk;  // K padded to whole chunks
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
  if (M == 0 || N == 0) return at::empty({M, N}, x.options());
#ifdef TOKENLOOM_QGEMM
  const at::Tensor xc = x.contiguous();
  const c10::BFloat16* xd = xc.data_ptr<c10::BFloat16>();
  QWeight w{static_cast<const uint8_t*>(codes.data_ptr()), codes.size(1), scales.data_ptr<at::Half>(),
            bits == 4 ? mins->data_ptr<at::Half>() : nullptr, N, K, G, g};
  if (route == kAuto) route = M <= quant_tile_max_rows() ? kVnni : kExpand;
  if (route == kExpand) {  // the weight expanded once per call, then oneDNN: AMX where the CPU has it
    thread_local std::vector<c10::BFloat16> xp_buf;
    c10::BFloat16* xpp = scratch(xp_buf, M * Kp);
    pad_x(xd, M, K, Kp, /*permute=*/bits == 8, xpp);
    const at::Tensor xt = at::from_blob(xpp, {M, Kp}, x.options());
    return bits == 4 ? expanded_linear<4>(w, xt, Kp, bias) : expanded_linear<8>(w, xt, Kp, bias);
  }
  if (M >= (bits == 4 ? quant_panel_max_rows() + 1 : int8_tile_min_rows(G, g))) return tile_linear(w, xc, Kp, bits, b);
  at::Tensor y = at::empty({M, N}, x.options());
  auto* yp = y.data_ptr<c10::BFloat16>();
  // The few-row paths quantize x: int4 per 32 inputs in natural order (in panels past kSkinnyMaxRows rows),
  // int8 per 64 in kernel order.
  if (bits == 4) {
    thread_local std::vector<int8_t> xq_buf;
    thread_local std::vector<float> dx_buf, sum_buf;
    int8_t* xq = scratch(xq_buf, M * Kp);
    float* dx = scratch(dx_buf, M * Kp / 32);
    float* xs = scratch(sum_buf, M * G);
    quantize_x32(xd, M, K, Kp, g, G, xq, dx, xs);
    const X4 x4{xq, dx, xs, Kp, G};
    with_rows((M - 1) % kSkinnyMaxRows + 1, [&]<int R>() { skinny_int4<R>(w, x4, M, b, yp); });
    return y;
  }
  const int64_t nchunks = Kp / 64;
  thread_local std::vector<int8_t> xq_buf;
  thread_local std::vector<float> dx_buf;
  thread_local std::vector<int32_t> corr_buf;
  thread_local std::vector<c10::BFloat16> xp_buf;
  c10::BFloat16* xpp = scratch(xp_buf, M * Kp);
  pad_x(xd, M, K, Kp, /*permute=*/true, xpp);
  int8_t* xq = scratch(xq_buf, M * Kp);
  float* dx = scratch(dx_buf, M * nchunks);
  int32_t* corr = scratch(corr_buf, M * nchunks * 16);
  quantize_x64(xpp, M, Kp, xq, dx, corr);
  const QX qx{xq, dx, corr, Kp, nchunks};
  with_rows(M, [&]<int R>() { skinny_int8<R>(w, qx, b, yp); });
  return y;
#else
  (void)route;
  TORCH_CHECK(false, "quant_linear: built without AVX512-BF16 (use the torch path)");
#endif
}
