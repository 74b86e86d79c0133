// Many rows of x against a quantized weight, without expanding the weight to bf16: batched decode and
// speculative verification (9 to a few hundred rows), where the few-row kernels would read W once per 8
// rows and the expand-to-bf16 path writes and re-reads a bf16 copy of W every call (without AMX that
// costs more than the matmul it feeds: docs/performance-notes.md#quantized-batching).
//
// Every quantized format (int8 per channel or per 32, int4 / Q4_0 / Q4_1, the K-quants and Q5_0) is seen
// here as a *tile* of 16 output channels: unsigned 8-bit codes u with w = scale_t u + zp_t per group t of
// gs inputs (gs = 16, 32, ... or the whole row), in steps of 4 inputs x 16 channels = 64 bytes, so that
// vpdpbusd's int32 lane j accumulates channel j (no horizontal sums). Each format's `fill` decodes one
// block of 16 rows of W into that tile once per call (int4: its blocks' nibbles split into bytes; int8 and
// the K-quants: rows transposed 16 x 16 dwords at a time), into a buffer that stays in L1/L2 while all M
// rows of x are dotted with it, 4 or 6 rows (rows_all) against 2 tiles per pass: each weight byte comes
// from memory once.
//
// x is quantized as the few-row kernels do (int8 per 32 inputs, dx = max |x| / 127) and the zero points
// multiply dx times the sum of xq over their group, so y is exactly W dequantized times x quantized.
// Per 32 inputs, row and tile: 8 vpdpbusd, then an int->float conversion and two or three float ops
// (which bound groups of 32, GGUF's Q4_0..Q8_0: docs/performance-notes.md#quantized-batching).
//
// Include only where AVX512-F, -BW, -VL and -VNNI are compiled in (the including file's guard).
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "avx512.h"
#include "dtype.h"
#include "kernels.h"  // scratch: per-thread buffers (the parallel_for workers and the caller each keep theirs)

namespace qtile {

constexpr int64_t kCh = 16;   // output channels per tile: vpdpbusd's 16 int32 lanes
constexpr int64_t kRows = 4;       // rows of x per microkernel call, against two tiles: up to 3 x 2 x 4 accumulators
constexpr int64_t kRowsShort = 6;  // the same for groups of 16 or 32 inputs: 2 x 2 x 6 (rows_all)

struct Tile {
  const uint8_t* codes;  // (Kp / 4) steps of 4 inputs x 16 channels, 64 bytes each
  const float* scale;    // (G, 16): group t's scale of each channel; integer sub-scales: (K / 256, 16)
  const float* zp;       // (G, 16): its zero point (w = scale u + zp); unused with integer sub-scales
  const int32_t* isc;    // integer sub-scales only: (G, 16) group t's sub-scale of each channel
};

// Integer sub-scales (Q6_K: w = d sc_t (u - 32), sc_t int8 per 16 inputs, d float per 256): `zcode` > 0
// says the tile holds them, gs = 16, K a multiple of 256 (= Kp), and w = scale_s isc_t (u - zcode) for
// superblock s of 256 inputs and group t of 16. The sub-scales and the zero code then stay in int32
// (vpmulld) and only each 32 inputs' sum meets float (its dx), instead of float work every 16 inputs:
// that work, not vpdpbusd, bounded Q6_K's tiles (slower than bf16 at 16-64 rows before).
struct Shape {
  int64_t N, K, Kp;  // outputs, inputs, inputs padded to whole 64s (x and tile codes are zero there)
  int64_t gs, G;     // inputs per scale group (16, 32 or a multiple of 32; Kp for one scale per row) and groups
  int32_t zcode = 0;  // > 0: integer sub-scales with this zero code (above)
};

struct X {
  const int8_t* q;   // (M, Kp) xq
  const float* dx;   // (M, Kp / 32)
  const float* xs;   // (M, G): dx * sum of xq over each group
  const int32_t* xz; // (M, Kp / 16): -zcode * sum of xq over each 16 inputs (integer sub-scales only)
  int64_t Kp, G;
};

// Each fill asks into L2 the rows kPrefetchAhead channels past its own (the tile after the pair: fill_pair fills
// two tiles, then computes them, so the pair's other tile comes too soon to wait for), a share of their lines as
// it reads its own. Asked all at once at the start of a fill (~430 lines for Q6_K at K = 2048), most were lost
// to full miss queues and the fill waited on memory (docs/performance-notes.md#quantized-batching).
constexpr int64_t kPrefetchAhead = 2 * kCh;
inline void prefetch_l2(const void* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }

// In place: r[i] dword c -> r[c] dword i (a 16 x 16 transpose of 32-bit values): 16 vectors of one
// channel's 64 codes each become 16 steps of 4 inputs x 16 channels. Always inlined: called out of line (as
// GCC chose for Q5_0's fill) the 16 vectors went through the stack, ~20% of that tile route's time.
__attribute__((always_inline)) inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int q = 0; q < 16; q += 4) {  // per 128-bit lane L: column 4L + j of rows q..q+3 in u[q + j]
    u[q] = _mm512_unpacklo_epi64(t[q], t[q + 2]);
    u[q + 1] = _mm512_unpackhi_epi64(t[q], t[q + 2]);
    u[q + 2] = _mm512_unpacklo_epi64(t[q + 1], t[q + 3]);
    u[q + 3] = _mm512_unpackhi_epi64(t[q + 1], t[q + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i a = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), b = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
    const __m512i c = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88), d = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
    r[j] = _mm512_shuffle_i32x4(a, c, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(b, d, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(a, c, 0xDD);
    r[12 + j] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
}

inline __m512 bf16x16(const c10::BFloat16* p, __mmask16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

// x (M, K) -> xb (Mp, Kp) bf16, zeros past K and in rows M..Mp-1 (AMX reads whole blocks of 16 rows).
inline void pad_rows(const c10::BFloat16* x, int64_t M, int64_t K, int64_t Mp, int64_t Kp, c10::BFloat16* xb) {
  for (int64_t m = 0; m < M; ++m) {
    std::memcpy(xb + m * Kp, x + m * K, K * sizeof(c10::BFloat16));
    std::memset(xb + m * Kp + K, 0, (Kp - K) * sizeof(c10::BFloat16));
  }
  std::memset(xb + M * Kp, 0, (Mp - M) * Kp * sizeof(c10::BFloat16));
}

// One row of x (K) -> its xq (Kp) int8 (zeros from K), dx (Kp / 32), xs (G) per group of gs inputs and
// xz (Kp / 16) -zcode times the integer sums per 16 inputs. Three passes over each batch of up to 64 x 32
// inputs (x stays in L1): every 32 inputs' max |x|, then dx = max / 127 and 1 / dx sixteen at a time, then
// the codes and sums. Written as one pass (max, divide, scale, sum per 32 inputs) each 32 inputs' chain of
// horizontal max, two divisions and the scaling held the next ones back: ~50 cycles per 32 inputs, ~10% of
// a 32-row Q4_1 decode step on Zen 4, all on the calling thread. The results are the one-pass version's.
inline void quantize_row(const c10::BFloat16* __restrict x, const Shape& s, int8_t* __restrict xq,
                         float* __restrict dx, float* __restrict xs, int32_t* __restrict xz) {
  constexpr int64_t kBatch = 64;  // 32-input chunks per batch
  alignas(64) float amax[kBatch], inv[kBatch];
  std::fill(xs, xs + s.G, 0.f);
  auto load = [&](int64_t k, __m512& f0, __m512& f1) {
    const int64_t n = std::clamp<int64_t>(s.K - k, 0, 32);
    const __mmask32 kk = n == 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1;
    f0 = bf16x16(x + k, static_cast<__mmask16>(kk));
    f1 = bf16x16(x + k + 16, static_cast<__mmask16>(kk >> 16));
  };
  for (int64_t c0 = 0; c0 < s.Kp / 32; c0 += kBatch) {
    const int64_t nc = std::min(kBatch, s.Kp / 32 - c0);
    for (int64_t c = 0; c < nc; ++c) {
      __m512 f0, f1;
      load((c0 + c) * 32, f0, f1);
      amax[c] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(f0), _mm512_abs_ps(f1)));
    }
    for (int64_t c = 0; c < nc; c += 16) {
      const __mmask16 m = nc - c >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (nc - c)) - 1);
      const __m512 d = _mm512_div_ps(_mm512_maskz_loadu_ps(m, amax + c), _mm512_set1_ps(127.f));
      _mm512_mask_storeu_ps(dx + c0 + c, m, d);
      const __mmask16 pos = _mm512_mask_cmp_ps_mask(m, d, _mm512_setzero_ps(), _CMP_GT_OQ);  // NaN: 0
      _mm512_storeu_ps(inv + c, _mm512_maskz_div_ps(pos, _mm512_set1_ps(1.f), d));
    }
    for (int64_t c = 0; c < nc; ++c) {
      const int64_t k = (c0 + c) * 32;
      __m512 f0, f1;
      load(k, f0, f1);
      const __m512 iv = _mm512_set1_ps(inv[c]);
      // round to nearest even; |x| / d <= 127 stays in int8
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(f0, iv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(f1, iv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + k), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + k + 16), _mm512_cvtsepi32_epi8(q1));
      const int32_t sum0 = _mm512_reduce_add_epi32(q0), sum1 = _mm512_reduce_add_epi32(q1);
      const float d = dx[c0 + c];
      const int64_t g0 = k / s.gs, g1 = (k + 16) / s.gs;  // groups past K (padding) have no sum to take
      if (g0 < s.G) xs[g0] += d * static_cast<float>(sum0);
      if (g1 < s.G) xs[g1] += d * static_cast<float>(sum1);
      if (xz != nullptr) {  // integer sub-scales only
        xz[k / 16] = -s.zcode * sum0;
        xz[k / 16 + 1] = -s.zcode * sum1;
      }
    }
  }
}

// x (M, K) -> X: xq (M, Kp), dx (M, Kp / 32), xs (M, G), xz (M, Kp / 16) (quantize_row), the rows split
// between the threads (~8K inputs per task at least: the other thread waited through it, idle, before).
inline void quantize(const c10::BFloat16* x, int64_t M, const Shape& s, int8_t* xq, float* dx, float* xs,
                     int32_t* xz) {
  at::parallel_for(0, M, std::max<int64_t>(1, 8192 / s.Kp), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(x + m * s.K, s, xq + m * s.Kp, dx + m * (s.Kp / 32), xs + m * s.G,
                   xz == nullptr ? nullptr : xz + m * (s.Kp / 16));
  });
}

// acc[c][r] lane j = dot(x[m0 + r], channel j of tile c) for CB tiles and R rows of x. Per step of 4 inputs:
// CB weight loads and R broadcasts of xq feed CB x R vpdpbusd (two tiles per pass: one load per vpdpbusd
// was the limit with one). SPAN inputs (16 or 32; dx is per 32) are summed in int32, unrolled; groups of
// SPAN inputs (LONG false) scale those sums straight into acc, longer groups (LONG) sum each 32 inputs
// times dx first (gacc), then apply the group's scales once.
template <int R, int CB, int SPAN, bool LONG>
__attribute__((always_inline)) inline void dot(const Tile* t, const Shape& s, const X& x, int64_t m0,
                                               __m512 (&acc)[CB][R]) {
  const int8_t* xr[R];
  const float* dr[R];
  const float* sr[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    xr[r] = x.q + (m0 + r) * x.Kp;
    dr[r] = x.dx + (m0 + r) * (x.Kp / 32);
    sr[r] = x.xs + (m0 + r) * x.G;
  }
  const uint8_t* wc[CB];
#pragma GCC unroll 2
  for (int c = 0; c < CB; ++c) wc[c] = t[c].codes;
#pragma GCC unroll 8
  for (int c = 0; c < CB; ++c)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
  const int64_t gs = LONG ? s.gs : SPAN;
  for (int64_t g = 0; g < s.G; ++g) {
    __m512 gacc[CB][R];
    if constexpr (LONG) {
#pragma GCC unroll 8
      for (int c = 0; c < CB; ++c)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) gacc[c][r] = _mm512_setzero_ps();
    }
    __m512 sv[CB];
#pragma GCC unroll 2
    for (int c = 0; c < CB; ++c) sv[c] = _mm512_loadu_ps(t[c].scale + g * kCh);
    for (int64_t k0 = g * gs; k0 < (g + 1) * gs; k0 += SPAN) {
      __m512i isum[CB][R];
#pragma GCC unroll 8
      for (int c = 0; c < CB; ++c)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) isum[c][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int k = 0; k < SPAN; k += 4) {
        __m512i w[CB];
#pragma GCC unroll 2
        for (int c = 0; c < CB; ++c) w[c] = _mm512_loadu_si512(wc[c] + (k0 + k) * 16);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512i xb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr[r] + k0 + k));
#pragma GCC unroll 2
          for (int c = 0; c < CB; ++c) isum[c][r] = _mm512_dpbusd_epi32(isum[c][r], w[c], xb);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 d = _mm512_set1_ps(dr[r][k0 / 32]);
#pragma GCC unroll 2
        for (int c = 0; c < CB; ++c) {
          if constexpr (LONG) gacc[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[c][r]), d, gacc[c][r]);
          else acc[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[c][r]), _mm512_mul_ps(sv[c], d), acc[c][r]);
        }
      }
    }
#pragma GCC unroll 2
    for (int c = 0; c < CB; ++c) {
      const __m512 zv = _mm512_loadu_ps(t[c].zp + g * kCh);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        if constexpr (LONG) acc[c][r] = _mm512_fmadd_ps(gacc[c][r], sv[c], acc[c][r]);
        acc[c][r] = _mm512_fmadd_ps(zv, _mm512_set1_ps(sr[r][g]), acc[c][r]);
      }
    }
  }
}

// As `dot`, for tiles with integer sub-scales (Shape::zcode). Per 16 inputs, row and tile: the int32 sum
// starts at -zcode * (sum of xq) (the zero code, shared by the tiles), gets 4 vpdpbusd, then times the
// channels' sub-scales (vpmulld); two such make a 32-input sum (|.| <= 2 * 16 * 127 * 32 * 128 < 2^24),
// converted once and times its dx into gacc; per 256 inputs gacc times the channels' d into acc.
// acc stays out of the register file's hot set: it is touched once per 256 inputs.
template <int R, int CB>
__attribute__((always_inline)) inline void dot_isub(const Tile* t, const Shape& s, const X& x, int64_t m0,
                                                    __m512 (&acc)[CB][R]) {
  const int8_t* xr[R];
  const float* dr[R];
  const int32_t* zr[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    xr[r] = x.q + (m0 + r) * x.Kp;
    dr[r] = x.dx + (m0 + r) * (x.Kp / 32);
    zr[r] = x.xz + (m0 + r) * (x.Kp / 16);
  }
#pragma GCC unroll 8
  for (int c = 0; c < CB; ++c)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
  for (int64_t k256 = 0; k256 < s.K; k256 += 256) {
    __m512 gacc[CB][R];
#pragma GCC unroll 8
    for (int c = 0; c < CB; ++c)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) gacc[c][r] = _mm512_setzero_ps();
    for (int64_t k32 = k256; k32 < k256 + 256; k32 += 32) {
      __m512i iacc[CB][R];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const int64_t k0 = k32 + 16 * h;
        __m512i isum[CB][R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512i z = _mm512_set1_epi32(zr[r][k0 / 16]);
#pragma GCC unroll 2
          for (int c = 0; c < CB; ++c) isum[c][r] = z;
        }
#pragma GCC unroll 4
        for (int k = 0; k < 16; k += 4) {
          __m512i w[CB];
#pragma GCC unroll 2
          for (int c = 0; c < CB; ++c) w[c] = _mm512_loadu_si512(t[c].codes + (k0 + k) * 16);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m512i xb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr[r] + k0 + k));
#pragma GCC unroll 2
            for (int c = 0; c < CB; ++c) isum[c][r] = _mm512_dpbusd_epi32(isum[c][r], w[c], xb);
          }
        }
#pragma GCC unroll 2
        for (int c = 0; c < CB; ++c) {
          const __m512i sc = _mm512_loadu_si512(t[c].isc + (k0 / 16) * kCh);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m512i p = _mm512_mullo_epi32(isum[c][r], sc);
            iacc[c][r] = h == 0 ? p : _mm512_add_epi32(iacc[c][r], p);
          }
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 d = _mm512_set1_ps(dr[r][k32 / 32]);
#pragma GCC unroll 2
        for (int c = 0; c < CB; ++c) gacc[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[c][r]), d, gacc[c][r]);
      }
    }
#pragma GCC unroll 2
    for (int c = 0; c < CB; ++c) {
      const __m512 dv = _mm512_loadu_ps(t[c].scale + (k256 / 256) * kCh);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[c][r] = _mm512_fmadd_ps(gacc[c][r], dv, acc[c][r]);
    }
  }
}

struct Out {
  int64_t n0;
  __mmask16 k;  // the tile's channels (a last tile may hold fewer than 16)
  __m512 bias;
};

// SPAN 0: integer sub-scales (dot_isub).
template <int R, int CB, int SPAN, bool LONG>
static inline void rows_out(const Tile* t, const Out* o, const Shape& s, const X& x, int64_t m0, c10::BFloat16* y) {
  __m512 acc[CB][R];
  if constexpr (SPAN == 0) dot_isub<R, CB>(t, s, x, m0, acc);
  else dot<R, CB, SPAN, LONG>(t, s, x, m0, acc);
  for (int c = 0; c < CB; ++c)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      _mm256_mask_storeu_epi16(y + (m0 + r) * s.N + o[c].n0, o[c].k, ps_to_bf16(_mm512_add_ps(acc[c][r], o[c].bias)));
}

template <int CB, int SPAN, bool LONG>
static inline void rows_all(const Tile* t, const Out* o, const Shape& s, const X& x, int64_t M, c10::BFloat16* y) {
  // Groups of 16 or 32 inputs keep CB x R accumulators and as many int32 sums: 6 rows (24 of the 32
  // registers with two tiles) reuse each weight load 6 times; the long-group and integer sub-scale paths
  // keep a third set (gacc), which at 6 rows would spill, so they take 4.
  constexpr int kR = (SPAN == 0 || LONG) ? kRows : kRowsShort;
  int64_t m0 = 0;
  for (; m0 + kR <= M; m0 += kR) rows_out<kR, CB, SPAN, LONG>(t, o, s, x, m0, y);
  switch (M - m0) {
    case 1: rows_out<1, CB, SPAN, LONG>(t, o, s, x, m0, y); break;
    case 2: rows_out<2, CB, SPAN, LONG>(t, o, s, x, m0, y); break;
    case 3: rows_out<3, CB, SPAN, LONG>(t, o, s, x, m0, y); break;
    case 4: if constexpr (kR > 4) rows_out<4, CB, SPAN, LONG>(t, o, s, x, m0, y); break;
    case 5: if constexpr (kR > 5) rows_out<5, CB, SPAN, LONG>(t, o, s, x, m0, y); break;
    default: break;
  }
}

// A parallel task's tile buffers for a pair of tiles: codes (2 x Kp / 4 steps x 64 bytes), scale and zp
// (2 x G x 16 floats), isc (2 x G x 16 int32, integer sub-scales only) and wb (2 x Kp x 16 bf16, the
// AMX-BF16 dot's decoded weight only). Per thread, shared by every call: a thread runs one task at a time.
struct PairBuffers {
  uint8_t* codes;
  float* scale;
  float* zp;
  int32_t* isc;
  c10::BFloat16* wb;
};
inline PairBuffers pair_buffers(const Shape& s, bool isub, bool bf16) {
  thread_local std::vector<uint8_t> codes;
  thread_local std::vector<float> scale, zp;
  thread_local std::vector<int32_t> isc;
  thread_local std::vector<c10::BFloat16> wb;
  return {scratch(codes, 2 * s.Kp * kCh), scratch(scale, 2 * s.G * kCh), scratch(zp, 2 * s.G * kCh),
          isub ? scratch(isc, 2 * s.G * kCh) : nullptr, bf16 ? scratch(wb, 2 * s.Kp * kCh) : nullptr};
}

// Tiles are computed two at a time: pair p is tiles 2p and 2p + 1 (channels 32p ..), the last one alone
// where the layer has an odd number of tiles.
inline int64_t num_pairs(const Shape& s) { return (s.N + 2 * kCh - 1) / (2 * kCh); }
// ~2 M multiply-adds per parallel task at least, so that small layers stay on the calling thread.
inline int64_t pair_grain(const Shape& s, int64_t M) {
  return std::max<int64_t>(1, (int64_t{1} << 21) / (M * s.Kp * 2 * kCh));
}

// Pair p's tiles decoded by `fill` into b (see linear) with their outputs' channels, store mask and bias;
// returns how many (1 or 2).
template <typename Fill>
inline int fill_pair(Fill& fill, const Shape& s, const c10::BFloat16* bias, int64_t p, const PairBuffers& b,
                     Tile (&t)[2], Out (&o)[2]) {
  int cb = 0;
  for (; cb < 2 && (2 * p + cb) * kCh < s.N; ++cb) {
    const int64_t n0 = (2 * p + cb) * kCh, r = std::min(kCh, s.N - n0);
    t[cb] = fill(n0, r, b.codes + cb * s.Kp * kCh, b.scale + cb * s.G * kCh, b.zp + cb * s.G * kCh,
                 b.isc == nullptr ? nullptr : b.isc + cb * s.G * kCh);
    o[cb].n0 = n0;
    o[cb].k = static_cast<__mmask16>((1u << r) - 1);
    o[cb].bias = bias == nullptr ? _mm512_setzero_ps() : bf16x16(bias + n0, o[cb].k);
  }
  return cb;
}

// The kernel for the shape's groups: integer sub-scales (Q6_K), 16 inputs, 32 (GGUF's Q4_0 .. Q8_0, Q4_K,
// Q5_K, Q5_0), longer. ISUB is a template argument, not a branch on s.zcode: with the integer path's code in
// the same function, GCC compiled the other formats' loops about 1.3-2x slower (int8 per channel at 16-64
// rows, measured on Zen 4), so each caller instantiates only the path its format takes.
template <int CB, bool ISUB>
static inline void rows_for(const Tile* t, const Out* o, const Shape& s, const X& x, int64_t M, c10::BFloat16* y) {
  if constexpr (ISUB) rows_all<CB, 0, false>(t, o, s, x, M, y);
  else if (s.gs == 16) rows_all<CB, 16, false>(t, o, s, x, M, y);
  else if (s.gs == 32) rows_all<CB, 32, false>(t, o, s, x, M, y);
  else rows_all<CB, 32, true>(t, o, s, x, M, y);
}

}  // namespace qtile

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TOKENLOOM_QTILE_AMX 1
#include "qtile_amx.h"
#endif

namespace qtile {

#ifdef TOKENLOOM_QTILE_AMX
// The AMX block kernel for the shape's groups (as rows_for: 16 inputs, 32, longer), its tiles configured.
inline void amx_rows_for(const Tile* t, const Out* o, int cb, const Shape& s, const X& x, int64_t M, c10::BFloat16* y) {
  if (s.gs == 16) amx::rows_all<16, false>(t, o, cb, s, x, M, y);
  else if (s.gs == 32) amx::rows_all<32, false>(t, o, cb, s, x, M, y);
  else amx::rows_all<32, true>(t, o, cb, s, x, M, y);
}

// linear's AMX-BF16 dot: each pair of tiles filled as for the other dots, decoded to bf16 (amx::bf16_fill,
// during the first pass over x) and multiplied by x padded to (Mp, Kp) bf16, 32 rows x 2 tiles per pass.
template <typename Fill>
at::Tensor bf16_linear(const at::Tensor& x, const Shape& s, const c10::BFloat16* bias, int64_t Mp, Fill&& fill) {
  const int64_t M = x.size(0);
  thread_local std::vector<c10::BFloat16> xb_buf;
  c10::BFloat16* xb = scratch(xb_buf, Mp * s.Kp);
  pad_rows(x.data_ptr<c10::BFloat16>(), M, s.K, Mp, s.Kp, xb);
  at::Tensor y = at::empty({M, s.N}, x.options());
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t kend = s.G * s.gs;
  at::parallel_for(0, num_pairs(s), pair_grain(s, M), [&](int64_t begin, int64_t end) {
    const PairBuffers b = pair_buffers(s, /*isub=*/false, /*bf16=*/true);
    c10::BFloat16* const wb[2] = {b.wb, b.wb + s.Kp * kCh};
    amx::configure_bf16();
    for (int64_t p = begin; p < end; ++p) {
      Tile t[2];
      Out o[2];
      if (fill_pair(fill, s, bias, p, b, t, o) == 2) amx::bf16_rows<2>(wb, t, kend, o, s, xb, M, yp);
      else amx::bf16_rows<1>(wb, t, kend, o, s, xb, M, yp);
    }
    _tile_release();
  });
  return y;
}
#endif

// y (M, N) bf16 = x @ W.T (+ bias). `fill(n0, r, codes, scale, zp, isc)` decodes channels [n0, n0 + r)
// (r <= 16) into a Tile, in the per-thread buffers it is given: codes (Kp / 4 steps x 64 bytes), scale, zp
// (G x 16 floats each) and isc (G x 16 int32, for integer sub-scales); channels r..15 of them may hold
// anything (their outputs are never stored).
// ISUB: the shape has integer sub-scales (s.zcode > 0, Q6_K); see rows_for. The tiles are dotted as
// quant_tile_dot() (set at start-up from a measurement) says from quant_tile_dot_from() rows on, where AMX
// is compiled in, integer sub-scales excepted: by vpdpbusd (0), AMX-INT8 (1) or AMX-BF16 on the tiles
// decoded to bf16 (2, x not quantized); by vpdpbusd below.
template <bool ISUB = false, typename Fill>
at::Tensor linear(const at::Tensor& x, const Shape& s, const c10::BFloat16* bias, Fill&& fill) {
  TORCH_CHECK(ISUB == (s.zcode > 0), "qtile::linear: ISUB must say whether the shape has integer sub-scales");
  const int64_t M = x.size(0);
#ifdef TOKENLOOM_QTILE_AMX
  const int64_t dot = ISUB || M < quant_tile_dot_from() ? 0 : quant_tile_dot();
  // AMX reads x in whole blocks of 16 rows: the buffers cover them (rows past M are never stored).
  const int64_t Mp = dot > 0 ? (M + amx::kBlockRows - 1) / amx::kBlockRows * amx::kBlockRows : M;
  if (dot == 2) return bf16_linear(x, s, bias, Mp, fill);
  const bool amx = dot == 1;
#else
  const int64_t Mp = M;
#endif
  thread_local std::vector<int8_t> xq_buf;
  thread_local std::vector<float> dx_buf, xs_buf;
  thread_local std::vector<int32_t> xz_buf;
  int8_t* xq = scratch(xq_buf, Mp * s.Kp);
  float* dx = scratch(dx_buf, Mp * s.Kp / 32);
  float* xs = scratch(xs_buf, Mp * s.G);
  int32_t* xz = ISUB ? scratch(xz_buf, M * s.Kp / 16) : nullptr;
  quantize(x.data_ptr<c10::BFloat16>(), M, s, xq, dx, xs, xz);
  const X xv{xq, dx, xs, xz, s.Kp, s.G};
  at::Tensor y = at::empty({M, s.N}, x.options());
  auto* yp = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, num_pairs(s), pair_grain(s, M), [&](int64_t begin, int64_t end) {
    const PairBuffers b = pair_buffers(s, ISUB, /*bf16=*/false);
#ifdef TOKENLOOM_QTILE_AMX
    if (amx) s.gs == 16 ? amx::configure<16>() : amx::configure<32>();
#endif
    for (int64_t p = begin; p < end; ++p) {
      Tile t[2];
      Out o[2];
      const int cb = fill_pair(fill, s, bias, p, b, t, o);
#ifdef TOKENLOOM_QTILE_AMX
      if (amx) {
        amx_rows_for(t, o, cb, s, xv, M, yp);
        continue;
      }
#endif
      if (cb == 2) rows_for<2, ISUB>(t, o, s, xv, M, yp);
      else rows_for<1, ISUB>(t, o, s, xv, M, yp);
    }
#ifdef TOKENLOOM_QTILE_AMX
    if (amx) _tile_release();
#endif
  });
  return y;
}

}  // namespace qtile
