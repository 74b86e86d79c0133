// qtile.h's tiles dotted by AMX instead of vpdpbusd, where the CPU has it (Intel Sapphire Rapids and
// later); two dots, chosen at start-up with the row count from which each is used (quant/routing.py).
//
// AMX-INT8: one tdpbsud multiplies 16 rows of x by a tile's 16 channels over 32 inputs (16 x 16 x 32
// multiply-adds, 128 vpdpbusd's worth) in the matrix unit, leaving the vector units only the float work
// per 32 inputs that the VNNI kernel does too.
//
// The tile codes need no new layout: qtile's steps of 4 inputs x 16 channels (64 bytes, channel j's four
// codes in dword j) are exactly tdpbsud's B operand (K/4 rows of 16 dwords, unsigned bytes), and xq
// (M, Kp) int8 row-major is its A operand (16 rows of x, SPAN signed bytes each). C (16 x 16 int32) holds
// each row's int32 sum per channel over the span: the same integers as `dot`'s isum, scaled into float by
// the same operations in the same order, so every output equals the VNNI kernel's bit for bit
// (tests/test_quant_amx.py): the route changes speed, never tokens.
//
// Rows of x go 16 at a time; the last block's rows past M read the caller's padding (qtile::linear sizes
// its buffers for whole blocks) and are computed but never stored. Spans are issued in pairs on two sets
// of tiles (0-2 and 3-5), so the second tdpbsud runs while the first one's sums are scaled.
//
// AMX-BF16 (bf16_rows): each tile's codes decoded once more, into the weight itself (scale
// times code plus zero point, rounded to bf16: the expand route's numbers) in tdpbf16ps's layout, in the
// cache, and multiplied by x as it is (bf16, not quantized) with float sums kept in the tiles over all K:
// no float work per 32 inputs at all, the cost the int8 dot cannot shed with one scale per 32 inputs.
// Unlike the expand route, the bf16 weight never leaves the cache (the expand route writes and re-reads a
// bf16 copy of every layer through memory each call).
//
// Integer sub-scales (Q6_K) stay on vpdpbusd (their int32 work per 16 inputs would need the sums of every
// 16 inputs out of the tiles; not built). Include only where AMX-TILE, -INT8 and -BF16 and AVX512-BF16 are
// compiled in (qtile.h's guard).
#pragma once
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace qtile::amx {

constexpr int64_t kBlockRows = 16;  // rows of x per tdpbsud: a tile's 16 rows

// Linux gives a process AMX's 8 KiB of tile state only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction faults. Asked once per process.
inline bool permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) Config {  // ldtilecfg's 64-byte operand, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The configuration is per thread, and oneDNN's AMX kernels load their own between our calls: every
// parallel task loads ours before its first tile instruction.
inline void load(const Config& c) {
  // Not _tile_loadconfig: GCC 12's asm for it declares only 8 bytes of the operand read, and the other
  // 56 bytes' stores were dropped as dead (ldtilecfg then faulted on a garbage configuration).
  asm volatile("ldtilecfg %0" ::"m"(c));
}

// Tiles 0 and 3: x (16 rows x SPAN bytes); 1 and 4: codes (SPAN / 4 rows x 64 bytes); 2 and 5: the sums
// (16 x 16 int32).
template <int SPAN>
inline void configure() {
  Config c;
  for (int t : {0, 3}) c.rows[t] = kBlockRows, c.colsb[t] = SPAN;
  for (int t : {1, 4}) c.rows[t] = SPAN / 4, c.colsb[t] = 64;
  for (int t : {2, 5}) c.rows[t] = kBlockRows, c.colsb[t] = 64;
  load(c);
}

// One span's sums (c: 16 rows x 16 channels, int32) into the rows' outputs, as `dot` does it: times dx and
// the group's scale into acc (LONG: times dx into gacc); at a group's end, gacc times its scale (LONG) and
// the zero point times each row's sum of x into acc. x's arrays start at the block's first row.
template <int SPAN, bool LONG>
__attribute__((always_inline)) inline void span_out(const int32_t* c, int64_t k0, const Tile& t, const Shape& s,
                                                    const float* dr, const float* sr, int64_t dstride, int64_t G,
                                                    __m512 (&acc)[kBlockRows], __m512 (&gacc)[LONG ? kBlockRows : 1]) {
  const int64_t gs = LONG ? s.gs : SPAN;
  const int64_t g = k0 / gs;
  const __m512 sv = _mm512_loadu_ps(t.scale + g * kCh);
#pragma GCC unroll 16
  for (int r = 0; r < kBlockRows; ++r) {
    const __m512 d = _mm512_set1_ps(dr[r * dstride + k0 / 32]);
    const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512(c + r * kCh));
    if constexpr (LONG) gacc[r] = _mm512_fmadd_ps(v, d, gacc[r]);
    else acc[r] = _mm512_fmadd_ps(v, _mm512_mul_ps(sv, d), acc[r]);
  }
  if ((k0 + SPAN) % gs != 0) return;
  const __m512 zv = _mm512_loadu_ps(t.zp + g * kCh);
#pragma GCC unroll 16
  for (int r = 0; r < kBlockRows; ++r) {
    if constexpr (LONG) {
      acc[r] = _mm512_fmadd_ps(gacc[r], sv, acc[r]);
      gacc[r] = _mm512_setzero_ps();
    }
    acc[r] = _mm512_fmadd_ps(zv, _mm512_set1_ps(sr[r * G + g]), acc[r]);
  }
}

// Rows m0 .. m0 + rows - 1 (rows <= 16; x valid for 16 rows from m0) of y for one tile's channels.
template <int SPAN, bool LONG>
inline void block(const Tile& t, const Out& o, const Shape& s, const X& x, int64_t m0, int64_t rows, c10::BFloat16* y) {
  alignas(64) int32_t sums[2][kBlockRows * kCh];
  const int8_t* xa = x.q + m0 * x.Kp;
  const int64_t dstride = x.Kp / 32, G = x.G;
  const float* dr = x.dx + m0 * dstride;
  const float* sr = x.xs + m0 * G;
  // acc: the rows' outputs; gacc (LONG only): the group's sum of each 32 inputs times dx. acc must stay in
  // registers: on the stack (a load and a store per multiply-add) AMX ran no faster than vpdpbusd.
  __m512 acc[kBlockRows], gacc[LONG ? kBlockRows : 1];
#pragma GCC unroll 16
  for (int r = 0; r < kBlockRows; ++r) acc[r] = _mm512_setzero_ps();
  if constexpr (LONG) {
#pragma GCC unroll 16
    for (int r = 0; r < kBlockRows; ++r) gacc[r] = _mm512_setzero_ps();
  }
  const int64_t kend = s.G * s.gs;  // spans past the last group (x's padding to Kp) are not computed, as in `dot`
  int64_t k0 = 0;
  for (; k0 + 2 * SPAN <= kend; k0 += 2 * SPAN) {
    _tile_loadd(0, xa + k0, x.Kp);
    _tile_loadd(1, t.codes + k0 * kCh, 64);
    _tile_zero(2);
    _tile_dpbsud(2, 0, 1);
    _tile_loadd(3, xa + k0 + SPAN, x.Kp);
    _tile_loadd(4, t.codes + (k0 + SPAN) * kCh, 64);
    _tile_zero(5);
    _tile_dpbsud(5, 3, 4);
    _tile_stored(2, sums[0], 64);
    span_out<SPAN, LONG>(sums[0], k0, t, s, dr, sr, dstride, G, acc, gacc);
    _tile_stored(5, sums[1], 64);
    span_out<SPAN, LONG>(sums[1], k0 + SPAN, t, s, dr, sr, dstride, G, acc, gacc);
  }
  if (k0 < kend) {  // an odd number of spans
    _tile_loadd(0, xa + k0, x.Kp);
    _tile_loadd(1, t.codes + k0 * kCh, 64);
    _tile_zero(2);
    _tile_dpbsud(2, 0, 1);
    _tile_stored(2, sums[0], 64);
    span_out<SPAN, LONG>(sums[0], k0, t, s, dr, sr, dstride, G, acc, gacc);
  }
  // All 16 unrolled, rows past the end skipped: indexing acc by a run-time row count would put it in memory.
#pragma GCC unroll 16
  for (int r = 0; r < kBlockRows; ++r)
    if (r < rows) _mm256_mask_storeu_epi16(y + (m0 + r) * s.N + o.n0, o.k, ps_to_bf16(_mm512_add_ps(acc[r], o.bias)));
}

template <int SPAN, bool LONG>
inline void rows_all(const Tile* t, const Out* o, int cb, const Shape& s, const X& x, int64_t M, c10::BFloat16* y) {
  for (int c = 0; c < cb; ++c)
    for (int64_t m0 = 0; m0 < M; m0 += kBlockRows)
      block<SPAN, LONG>(t[c], o[c], s, x, m0, std::min(kBlockRows, M - m0), y);
}

// --- the bf16 dot -----------------------------------------------------------------------------------

constexpr int64_t kStep = 32;  // inputs per tdpbf16ps: 16 rows of B, two bf16 of one channel each per dword

// Tiles 0-1: x (16 rows x 32 bf16) of two blocks of rows; 2-3: the weight (16 rows of 2 inputs x 16
// channels) of two tiles; 4-7: the float sums of the four (block, tile) pairs.
inline void configure_bf16() {
  Config c;
  for (int t = 0; t < 8; ++t) c.rows[t] = kBlockRows, c.colsb[t] = 64;
  load(c);
}

// Index vectors of bf16_fill: rep[h] lane l = channel 4h + l / 4 (a quarter of a code step widened to 16
// floats is channels 4h..4h+3 x 4 inputs, so it takes its channels' scales four times over); even / odd:
// the dwords holding inputs 0-1 / 2-3 of channels 0-7, then (from the second vector) of channels 8-15.
struct Bf16Index {
  alignas(64) int32_t rep[4][16];
  alignas(64) int32_t even[16];
  alignas(64) int32_t odd[16];
};
inline constexpr Bf16Index kBf16Index = [] {
  Bf16Index i{};
  for (int h = 0; h < 4; ++h)
    for (int l = 0; l < 16; ++l) i.rep[h][l] = 4 * h + l / 4;
  for (int j = 0; j < 16; ++j) i.even[j] = 2 * j, i.odd[j] = 2 * j + 1;
  return i;
}();

// Code steps [st0, st1) of tile t (4 inputs each) -> its bf16 weight wb ((Kp / 2) rows x 64 bytes: row i
// holds inputs 2i and 2i + 1 of the 16 channels, one dword each), w = scale_g u + zp_g rounded to nearest
// even; zeros from `kend` (inputs past the last group, whose scales the tile does not hold).
inline void bf16_fill(const Tile& t, const Shape& s, int64_t kend, c10::BFloat16* wb, int64_t st0, int64_t st1) {
  const __m512i ev = _mm512_load_si512(kBf16Index.even), od = _mm512_load_si512(kBf16Index.odd);
  const int64_t spg = s.gs / 4;  // steps per group
  for (int64_t st = st0; st < st1;) {
    if (4 * st >= kend) {
      __m512i* row = reinterpret_cast<__m512i*>(wb + st * 2 * 32);
      _mm512_store_si512(row, _mm512_setzero_si512());
      _mm512_store_si512(row + 1, _mm512_setzero_si512());
      ++st;
      continue;
    }
    const int64_t g = st / spg, stop = std::min(st1, (g + 1) * spg);  // a group at a time: one division
    __m512 sc[4], zc[4];
    const __m512 sv = _mm512_loadu_ps(t.scale + g * kCh), zv = _mm512_loadu_ps(t.zp + g * kCh);
#pragma GCC unroll 4
    for (int h = 0; h < 4; ++h) {
      const __m512i idx = _mm512_load_si512(kBf16Index.rep[h]);
      sc[h] = _mm512_permutexvar_ps(idx, sv);
      zc[h] = _mm512_permutexvar_ps(idx, zv);
    }
    for (; st < stop; ++st) {
      const uint8_t* q = t.codes + st * 64;
      __m512 w[4];
#pragma GCC unroll 4
      for (int h = 0; h < 4; ++h) {  // widened straight from memory (an extract from a register is a shuffle)
        const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h)));
        w[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), sc[h], zc[h]);
      }
      // cvtne2ps(a, b): b's 16 values, then a's. lo: channels 0-7 (dword 2c + i/2 = channel c's pair i/2), hi: 8-15.
      const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]), hi = (__m512i)_mm512_cvtne2ps_pbh(w[3], w[2]);
      __m512i* row = reinterpret_cast<__m512i*>(wb + st * 2 * 32);
      _mm512_store_si512(row, _mm512_permutex2var_epi32(lo, ev, hi));      // inputs 4s, 4s + 1
      _mm512_store_si512(row + 1, _mm512_permutex2var_epi32(lo, od, hi));  // inputs 4s + 2, 4s + 3
    }
  }
}

// Rows m0.. of y (RB blocks of 16; rows past M not stored) for CB tiles whose bf16 weights are wb[c];
// xb: x as bf16 padded to Kp (zeros) with whole blocks of rows, row stride Kp. DECODE: the pass also
// decodes each 32 inputs of the tiles t into wb just before multiplying them, so that the tile loads find
// them in L1 (decoded all at once, 2 x 18 KiB for a 576-input pair and more for wider layers, the weight
// loads came from L2 and took about a third of the time at 16 rows).
template <int RB, int CB, bool DECODE>
inline void bf16_blocks(c10::BFloat16* const* wb, const Tile* t, int64_t kend, const Out* o, const Shape& s,
                        const c10::BFloat16* xb, int64_t m0, int64_t M, c10::BFloat16* y) {
  const int64_t stride = s.Kp * 2;  // bytes per row of x
  _tile_zero(4);
  if constexpr (CB > 1) _tile_zero(5);
  if constexpr (RB > 1) _tile_zero(6);
  if constexpr (RB > 1 && CB > 1) _tile_zero(7);
  for (int64_t k0 = 0; k0 < s.Kp; k0 += kStep) {
    if constexpr (DECODE)
      for (int c = 0; c < CB; ++c) bf16_fill(t[c], s, kend, wb[c], k0 / 4, (k0 + kStep) / 4);
    _tile_loadd(0, xb + m0 * s.Kp + k0, stride);
    _tile_loadd(2, wb[0] + k0 * kCh, 64);
    _tile_dpbf16ps(4, 0, 2);
    if constexpr (CB > 1) {
      _tile_loadd(3, wb[1] + k0 * kCh, 64);
      _tile_dpbf16ps(5, 0, 3);
    }
    if constexpr (RB > 1) {
      _tile_loadd(1, xb + (m0 + kBlockRows) * s.Kp + k0, stride);
      _tile_dpbf16ps(6, 1, 2);
      if constexpr (CB > 1) _tile_dpbf16ps(7, 1, 3);
    }
  }
  alignas(64) float sums[4][kBlockRows * kCh];
  _tile_stored(4, sums[0], 64);
  if constexpr (CB > 1) _tile_stored(5, sums[1], 64);
  if constexpr (RB > 1) _tile_stored(6, sums[2], 64);
  if constexpr (RB > 1 && CB > 1) _tile_stored(7, sums[3], 64);
  for (int b = 0; b < RB; ++b)
    for (int c = 0; c < CB; ++c)
      for (int64_t r = 0; r < kBlockRows && m0 + b * kBlockRows + r < M; ++r)
        _mm256_mask_storeu_epi16(y + (m0 + b * kBlockRows + r) * s.N + o[c].n0, o[c].k,
                                 ps_to_bf16(_mm512_add_ps(_mm512_load_ps(sums[2 * b + c] + r * kCh), o[c].bias)));
}

// All M rows for CB tiles t: the first pass (32 rows, or 16) decodes the tiles into wb as it goes, the
// others read wb.
template <int CB>
inline void bf16_rows(c10::BFloat16* const* wb, const Tile* t, int64_t kend, const Out* o, const Shape& s,
                      const c10::BFloat16* xb, int64_t M, c10::BFloat16* y) {
  if (M > kBlockRows) bf16_blocks<2, CB, true>(wb, t, kend, o, s, xb, 0, M, y);
  else bf16_blocks<1, CB, true>(wb, t, kend, o, s, xb, 0, M, y);
  int64_t m0 = 2 * kBlockRows;
  for (; m0 + kBlockRows < M; m0 += 2 * kBlockRows) bf16_blocks<2, CB, false>(wb, t, kend, o, s, xb, m0, M, y);
  if (m0 < M) bf16_blocks<1, CB, false>(wb, t, kend, o, s, xb, m0, M, y);
}

}  // namespace qtile::amx
