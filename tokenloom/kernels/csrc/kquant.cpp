// y = x @ W.T (+ bias) with W a GGUF K-quant (Q4_K, Q5_K, Q6_K) or Q5_0 tensor kept in memory as its file
// stores it: x bfloat16 (M, K), y bfloat16 (M, N), float32 accumulation.
//
// Storage: each row of W is its GGUF blocks, (N, K / QK * type_size) uint8 (QK = 256 for the K-quants, 32
// for Q5_0): exactly the file's bytes, and the same storage the quantized embedding gathers rows from
// (quant/embedding.py). The K-quants' blocks are kept as they are: their bits are already laid out in 32-
// and 64-byte runs, so a superblock decodes to 256 byte codes in natural input order with a handful of
// shifts, masks and lane shuffles per 64 codes (below), shared by all M rows of x on the few-row path.
// Q5_0's 22-byte blocks are repacked, same bytes, into three planes per row (quant/kquant.py
// q50_to_planar): all d (2 B each), all qh (4 B), all qs (16 B). Two blocks' codes are then one 32-byte
// load and one 64-bit mask, their scales one 4-byte load, instead of unaligned loads across 44 bytes.
//
// Block formats (ggml-quants.c; values w = what gguf.quants.dequantize returns):
//   Q4_K (144 B / 256): d f16 | dmin f16 | scales[12] (8 six-bit scales sc, 8 six-bit mins m) | qs[128]
//     w = d sc_s q - dmin m_s for sub-block s of 32; qs[32j + l]: low nibble element 64j + l, high 64j + 32 + l
//   Q5_K (176 B / 256): as Q4_K with qh[32] before qs: bit 2j of qh[l] is element 64j + l's fifth bit,
//     bit 2j + 1 element 64j + 32 + l's
//   Q6_K (210 B / 256): ql[128] | qh[64] | sc int8[16] | d f16; w = d sc_t (q - 32), t = sub-block of 16;
//     half h of 128: ql[64h + l] low nibble element 128h + l, ql[64h + 32 + l] low 128h + 32 + l, their high
//     nibbles 128h + 64 + l and 128h + 96 + l; qh[32h + l] bits 0-1, 2-3, 4-5, 6-7 the same four elements'
//     top two bits
//   Q5_0 (22 B / 32): d f16 | qh u32 | qs[16]; w = d (q - 16); qs[j] low nibble element j, high j + 16;
//     bit j of qh element j's fifth bit. Stored as planes: row = d[nb] | qh[nb] | qs[nb] (nb = K / 32)
//
// Routes (kquant_routes() lists those compiled in; `route` forces one, for tests and benchmarks):
//   1 "vnni"     AVX512-VNNI. Up to 3 rows (tile_min_rows; decode, speculative verification): each weight byte
//                read once and dotted with all M rows of x, per row of W. x is quantized like llama.cpp's Q8_0
//                activations: int8 per 32 inputs, xq = round(x / dx), dx = max |x| / 127, so that one
//                vpdpbusd multiplies 64 codes by 64 xq. The K-quants' integer sub-block scales multiply the
//                int32 lane sums (vpmulld); zero points (Q6_K's 32, Q4_K/Q5_K's mins) multiply x's sums per
//                16 inputs, Q5_0's 16 starts the dot product from -16 times x's sums per 4.
//                More rows (batched decode and verification): qtile.h, 16 rows of W decoded by the same
//                decoders into a cache-resident tile of 16 channels per vpdpbusd lane, dotted with all M
//                rows of x, 4 rows by 2 tiles per pass (Q4_K/Q5_K/Q5_0: float scales once per 32 inputs; Q6_K: its int8
//                sub-scales per 16 by vpmulld, float once per 32).
//   2 "avx512"   the weight decoded to bfloat16 (the same AVX-512 decoders, d sc q - m rounded to bf16 once),
//                kExpandBytes at a time, then one oneDNN matmul (at::linear) over all M rows: prefill chunks
//                and large decode batches, where the expansion is paid once for many rows.
//   3 "portable" as 2 with a plain C++ decoder: any CPU.
//   0 auto: 1 when M <= quant_tile_max_rows() (quant_gemm.cpp: chosen for the CPU, set from Python) and the
//     CPU has AVX512-VNNI (as compiled: -march=native, i.e. the build machine's features, whatever its
//     vendor), else 2 where it has AVX512-BW/DQ/VL and F16C,
//     else 3.
#include <torch/types.h>  // not torch/extension.h (pybind11, torch::nn): ~3x the compile time per file
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && defined(__F16C__)
#include "avx512.h"
#define TOKENLOOM_KQ_AVX512 1
#if defined(__AVX512VNNI__)
#include "qtile.h"
#define TOKENLOOM_KQ_VNNI 1
#endif
#endif

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "dtype.h"
#include "kernels.h"

namespace {

enum QType : int64_t { kQ5_0 = 6, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };  // ggml's type ids
enum Route : int64_t { kAuto = 0, kVnni = 1, kAvx512 = 2, kPortable = 3 };

constexpr int64_t kExpandBytes = int64_t{16} << 20;  // bf16 weight expanded per oneDNN call (as quant_gemm.cpp)

struct TypeInfo {
  int64_t qk, type_size;
};

inline TypeInfo type_info(int64_t qtype) {
  switch (qtype) {
    case kQ5_0: return {32, 22};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: TORCH_CHECK(false, "kquant: unsupported GGUF type id ", qtype);
  }
}

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);  // one instruction; c10's conversion is a dozen
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// Q4_K / Q5_K's 12 scale bytes -> 8 scales (bytes 0-7) and 8 mins (bytes 8-15), as llama.cpp unpacks them.
inline void k4_scales(const uint8_t* s, uint8_t out[16]) {
  uint32_t u[4];
  std::memcpy(u, s, 12);
  constexpr uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
  u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
  const uint32_t mins_lo = u[1] & m1;
  u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
  u[2] = mins_lo;
  u[0] &= m1;
  std::memcpy(out, u, 16);
}

// Block i of a planar Q5_0 row of nb blocks -> the GGUF block (22 bytes) at blk.
inline const uint8_t* q50_block(const uint8_t* row, int64_t nb, int64_t i, uint8_t* blk) {
  std::memcpy(blk, row + 2 * i, 2);
  std::memcpy(blk + 2, row + 2 * nb + 4 * i, 4);
  std::memcpy(blk + 6, row + 6 * nb + 16 * i, 16);
  return blk;
}

// --- portable decoding: one block -> its codes u and per-16-element a, b with w = a u - b -------------------

// Codes of one block (256 or 32 of them) in natural order; a[t], b[t] for elements 16t .. 16t + 15.
void decode_portable(int64_t qtype, const uint8_t* p, uint8_t* u, float* a, float* b) {
  if (qtype == kQ5_0) {
    const float d = f16_at(p);
    uint32_t qh;
    std::memcpy(&qh, p + 2, 4);
    for (int j = 0; j < 16; ++j) {
      u[j] = static_cast<uint8_t>((p[6 + j] & 0x0F) | (((qh >> j) & 1) << 4));
      u[j + 16] = static_cast<uint8_t>((p[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
    a[0] = a[1] = d;
    b[0] = b[1] = 16.f * d;
    return;
  }
  if (qtype == kQ6_K) {
    const uint8_t* ql = p;
    const uint8_t* qh = p + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    const float d = f16_at(p + 208);
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) {
        const uint8_t hb = qh[32 * h + l];
        uint8_t* o = u + 128 * h;
        o[l] = static_cast<uint8_t>((ql[64 * h + l] & 0x0F) | ((hb & 3) << 4));
        o[l + 32] = static_cast<uint8_t>((ql[64 * h + l + 32] & 0x0F) | (((hb >> 2) & 3) << 4));
        o[l + 64] = static_cast<uint8_t>((ql[64 * h + l] >> 4) | (((hb >> 4) & 3) << 4));
        o[l + 96] = static_cast<uint8_t>((ql[64 * h + l + 32] >> 4) | (((hb >> 6) & 3) << 4));
      }
    for (int t = 0; t < 16; ++t) {
      a[t] = d * static_cast<float>(sc[t]);
      b[t] = 32.f * a[t];
    }
    return;
  }
  // Q4_K, Q5_K
  const float d = f16_at(p), dmin = f16_at(p + 2);
  uint8_t sm[16];
  k4_scales(p + 4, sm);
  const bool five = qtype == kQ5_K;
  const uint8_t* qh = p + 16;
  const uint8_t* qs = p + (five ? 48 : 16);
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) {
      uint8_t lo = qs[32 * j + l] & 0x0F, hi = qs[32 * j + l] >> 4;
      if (five) {
        lo = static_cast<uint8_t>(lo | (((qh[l] >> (2 * j)) & 1) << 4));
        hi = static_cast<uint8_t>(hi | (((qh[l] >> (2 * j + 1)) & 1) << 4));
      }
      u[64 * j + l] = lo;
      u[64 * j + 32 + l] = hi;
    }
  for (int t = 0; t < 16; ++t) {
    a[t] = d * static_cast<float>(sm[t / 2]);
    b[t] = dmin * static_cast<float>(sm[8 + t / 2]);
  }
}

// Rows [n0, n0 + nc) of W -> bf16 (nc, K) at dst, w = a u - b rounded once.
void expand_portable(int64_t qtype, const uint8_t* blocks, int64_t row_bytes, int64_t K, int64_t n0, int64_t nc,
                     c10::BFloat16* dst) {
  const TypeInfo ti = type_info(qtype);
  uint8_t u[256], blk[22];
  float a[16], b[16];
  for (int64_t n = n0; n < n0 + nc; ++n) {
    const uint8_t* row = blocks + n * row_bytes;
    c10::BFloat16* out = dst + (n - n0) * K;
    for (int64_t i = 0; i < K / ti.qk; ++i) {
      decode_portable(qtype, qtype == kQ5_0 ? q50_block(row, K / 32, i, blk) : row + i * ti.type_size, u, a, b);
      for (int64_t e = 0; e < ti.qk; ++e)
        out[i * ti.qk + e] = from_float<c10::BFloat16>(a[e / 16] * static_cast<float>(u[e]) - b[e / 16]);
    }
  }
}

#ifdef TOKENLOOM_KQ_AVX512

// --- AVX-512 decoding: a superblock's 256 codes (Q5_0: two blocks' 64) in natural order, 64 per vector -----

inline __m512i q4k_codes_half(const uint8_t* qs64, __m512i& second) {
  // qs[0..63]: low nibbles of bytes 0-31 / 32-63 are elements 0-31 / 64-95, high nibbles 32-63 / 96-127.
  const __m512i v = _mm512_loadu_si512(qs64), m = _mm512_set1_epi8(0x0F);
  const __m512i lo = _mm512_and_si512(v, m), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
  second = _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));  // elements 64-127
  return _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));    // elements 0-63
}

inline void codes_k4(const uint8_t* qs, __m512i u[4]) {
  u[0] = q4k_codes_half(qs, u[1]);
  u[2] = q4k_codes_half(qs + 64, u[3]);
}

inline void codes_k5(const uint8_t* qh, const uint8_t* qs, __m512i u[4]) {
  codes_k4(qs, u);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
  const __m512i hh = _mm512_inserti64x4(_mm512_castsi256_si512(h), h, 1);
  const __m512i sixteen = _mm512_set1_epi8(16);
  for (int j = 0; j < 4; ++j) {  // vector j: bit 2j of qh for its first 32 codes, bit 2j + 1 for the rest
    const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << (2 * j))),
                                           _mm256_set1_epi8(static_cast<char>(1 << (2 * j + 1))), 1);
    u[j] = _mm512_mask_add_epi8(u[j], _mm512_test_epi8_mask(hh, bit), u[j], sixteen);
  }
}

inline void codes_q6k(const uint8_t* p, __m512i u[4]) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {
    const __m512i v = _mm512_loadu_si512(p + 64 * h);  // low nibbles: elements 0-63 of the half, high: 64-127
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
    // [qh, qh >> 2]: the 16-bit shifts leak bits across bytes only outside the 0x30 masks below
    const __m512i h2 = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 2), 1);
    u[2 * h] = _mm512_or_si512(_mm512_and_si512(v, m4), _mm512_and_si512(_mm512_slli_epi16(h2, 4), m30));
    u[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), _mm512_and_si512(h2, m30));
  }
}

// One Q5_0 block (its qs[16] and qh) -> its 32 codes.
inline __m256i codes_q50_block(const uint8_t* qs_p, const uint8_t* qh_p) {
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs_p));
  const __m128i m = _mm_set1_epi8(0x0F);
  const __m256i nib = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(qs, m)),
                                              _mm_and_si128(_mm_srli_epi16(qs, 4), m), 1);
  uint32_t qh;
  std::memcpy(&qh, qh_p, 4);
  return _mm256_mask_add_epi8(nib, static_cast<__mmask32>(qh), nib, _mm256_set1_epi8(16));
}

// Two consecutive Q5_0 blocks of a planar row (their 32 bytes of qs, 8 of qh) -> their 64 codes: both
// blocks' nibbles split at once, their two qh one 64-bit mask of the codes that get 16.
inline __m512i codes_q50_pair(const uint8_t* qs, const uint8_t* qh) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));  // qs of A, qs of B
  const __m256i m = _mm256_set1_epi8(0x0F);
  const __m512i lh = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, m)),
                                        _mm256_and_si256(_mm256_srli_epi16(v, 4), m), 1);  // A lo, B lo, A hi, B hi
  const __m512i nib = _mm512_shuffle_i64x2(lh, lh, _MM_SHUFFLE(3, 1, 2, 0));            // A lo, A hi, B lo, B hi
  uint64_t h;
  std::memcpy(&h, qh, 8);
  return _mm512_mask_add_epi8(nib, static_cast<__mmask64>(h), nib, _mm512_set1_epi8(16));
}

// Rows [n0, n0 + nc) of W -> bf16 (nc, K) at dst with the AVX-512 decoders.
void expand_avx512(int64_t qtype, const uint8_t* blocks, int64_t row_bytes, int64_t K, int64_t n0, int64_t nc,
                   c10::BFloat16* dst) {
  const TypeInfo ti = type_info(qtype);
  alignas(64) float a[16], b[16];
  uint8_t blk[22];
  for (int64_t n = n0; n < n0 + nc; ++n) {
    const uint8_t* row = blocks + n * row_bytes;
    c10::BFloat16* out = dst + (n - n0) * K;
    for (int64_t i = 0; i < K / ti.qk; ++i) {
      const uint8_t* p = qtype == kQ5_0 ? q50_block(row, K / 32, i, blk) : row + i * ti.type_size;
      __m512i u[4];
      int vecs = 4;
      if (qtype == kQ5_0) {
        u[0] = _mm512_castsi256_si512(codes_q50_block(p + 6, p + 2));
        const float d = f16_at(p);
        a[0] = a[1] = d;
        b[0] = b[1] = 16.f * d;
        vecs = 1;
      } else {
        // a, b as the portable decoder computes them
        if (qtype == kQ6_K) {
          const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
          const float d = f16_at(p + 208);
          for (int t = 0; t < 16; ++t) { a[t] = d * static_cast<float>(sc[t]); b[t] = 32.f * a[t]; }
          codes_q6k(p, u);
        } else {
          const float d = f16_at(p), dmin = f16_at(p + 2);
          uint8_t sm[16];
          k4_scales(p + 4, sm);
          for (int t = 0; t < 16; ++t) {
            a[t] = d * static_cast<float>(sm[t / 2]);
            b[t] = dmin * static_cast<float>(sm[8 + t / 2]);
          }
          if (qtype == kQ4_K) codes_k4(p + 16, u);
          else codes_k5(p + 16, p + 48, u);
        }
      }
      const int quarters = qtype == kQ5_0 ? 2 : 4;
      for (int v = 0; v < vecs; ++v)
        for (int q = 0; q < quarters; ++q) {
          const int t = 4 * v + q;
          __m128i bytes;
          switch (q) {
            case 0: bytes = _mm512_extracti32x4_epi32(u[v], 0); break;
            case 1: bytes = _mm512_extracti32x4_epi32(u[v], 1); break;
            case 2: bytes = _mm512_extracti32x4_epi32(u[v], 2); break;
            default: bytes = _mm512_extracti32x4_epi32(u[v], 3); break;
          }
          const __m512 w = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), _mm512_set1_ps(a[t]),
                                           _mm512_set1_ps(b[t]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * ti.qk + 16 * t), ps_to_bf16(w));
        }
    }
  }
}

#endif  // TOKENLOOM_KQ_AVX512

#ifdef TOKENLOOM_KQ_VNNI

// --- few rows: x quantized to int8, vpdpbusd against the decoded codes --------------------------------------

inline __m512 bf16x16_to_ps(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// x quantized for the few-row kernels: int8 per 32 inputs in natural order, K padded to Kp = whole
// 64-input vectors (zeros). Per 32 rather than llama.cpp's per 256 for the K-quants: max |x| over 256
// inputs is a coarser step, and at the tolerance the Q4_1 / Q8_0 kernels are held to (tests/test_quant.py)
// the error was too close to the bound; the price is a float multiply-add per 64 inputs instead of an add.
struct XQ {
  const int8_t* q;      // (M, Kp)
  const float* dl;      // (M, Kp / 4) dx of each int32 lane's 32-input block
  const float* s16;     // (M, Kp / 16) dx * sum of xq per 16 inputs (the zero points' factor)
  const int32_t* corr;  // Q5_0: (M, Kp / 4) -16 * each lane's sum of xq
  int64_t Kp;
};

// x (M, K) -> XQ (K a multiple of 32); dx = max |x| / 127, xq = round(x / dx) to nearest even.
void quantize_x(const c10::BFloat16* x, int64_t M, int64_t K, int64_t Kp, int8_t* xq, float* dl, float* s16,
                int32_t* corr) {
  for (int64_t m = 0; m < M; ++m) {
    int8_t* q = xq + m * Kp;
    std::fill(q + K, q + Kp, int8_t{0});
    for (int64_t j = K / 4; j < Kp / 4; ++j) { dl[m * (Kp / 4) + j] = 0.f; corr[m * (Kp / 4) + j] = 0; }
    for (int64_t j = K / 16; j < Kp / 16; ++j) s16[m * (Kp / 16) + j] = 0.f;
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
      const __m512 f0 = bf16x16_to_ps(x + m * K + k0), f1 = bf16x16_to_ps(x + m * K + k0 + 16);
      const float d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(f0), _mm512_abs_ps(f1))) / 127.f;
      const __m512 inv = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(f0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(f1, inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0 + 16), _mm512_cvtsepi32_epi8(q1));
      s16[m * (Kp / 16) + k0 / 16] = d * static_cast<float>(_mm512_reduce_add_epi32(q0));
      s16[m * (Kp / 16) + k0 / 16 + 1] = d * static_cast<float>(_mm512_reduce_add_epi32(q1));
      // lane sums of 4: vpdpbusd of ones against the 32 codes just stored (lanes 0-7)
      const __m256i lanes = _mm512_castsi512_si256(_mm512_dpbusd_epi32(
          _mm512_setzero_si512(), _mm512_set1_epi8(1), _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k0)))));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(corr + m * (Kp / 4) + k0 / 4), _mm256_mullo_epi32(lanes, _mm256_set1_epi32(-16)));
      _mm256_storeu_ps(dl + m * (Kp / 4) + k0 / 4, _mm256_set1_ps(d));
    }
  }
}

// Lane-index vectors: vector v's int32 lane l takes entry idx[v][l] of a 16-entry scale vector.
struct LaneIdx {
  __m512i k4[4], q6[4], mins;
  LaneIdx() {
    alignas(64) int32_t t[16];
    for (int v = 0; v < 4; ++v) {
      for (int l = 0; l < 16; ++l) t[l] = 2 * v + l / 8;  // 32-input sub-block of the lane
      k4[v] = _mm512_load_si512(t);
      for (int l = 0; l < 16; ++l) t[l] = 4 * v + l / 4;  // 16-input sub-block of the lane
      q6[v] = _mm512_load_si512(t);
    }
    for (int l = 0; l < 16; ++l) t[l] = 8 + l / 2;  // Q4_K/Q5_K: the min of 16 inputs' sub-block
    mins = _mm512_load_si512(t);
  }
};

// out[m] = dot(x[m], w[n]) for one row n of a K-quant weight, all M rows of x. Per superblock: the codes
// decoded once; per 64 inputs and row of x one vpdpbusd, the lanes times their integer sub-block scales
// (vpmulld), made float and times their block's dx; then times d, plus the zero points (Q4_K/Q5_K: -dmin m,
// Q6_K: -32 d sc per 16 inputs) times x's sums per 16.
template <int M, int64_t QT>
__attribute__((always_inline)) inline void row_kquant(const uint8_t* row, int64_t nsb, int64_t type_size,
                                                      const XQ& x, const LaneIdx& li, float* out) {
  __m512 acc[M];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nsb; ++i) {
    const uint8_t* p = row + i * type_size;
    _mm_prefetch(reinterpret_cast<const char*>(p + 2048), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + 2048 + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + 2048 + 128), _MM_HINT_T0);
    __m512i u[4], sc[4];  // codes, per-lane integer scales
    __m512 zp;            // zero-point factor of each 16 inputs, float
    float d;
    if constexpr (QT == kQ6_K) {
      codes_q6k(p, u);
      const __m512i s = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)));
      for (int v = 0; v < 4; ++v) sc[v] = _mm512_permutexvar_epi32(li.q6[v], s);
      d = f16_at(p + 208);
      zp = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(-32.f * d));  // w = d sc (q - 32)
    } else {
      alignas(16) uint8_t sm[16];
      k4_scales(p + 4, sm);
      const __m512i s = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(sm)));
      for (int v = 0; v < 4; ++v) sc[v] = _mm512_permutexvar_epi32(li.k4[v], s);
      zp = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutexvar_epi32(li.mins, s)), _mm512_set1_ps(-f16_at(p + 2)));
      if constexpr (QT == kQ4_K) codes_k4(p + 16, u);
      else codes_k5(p + 16, p + 48, u);
      d = f16_at(p);
    }
    const __m512 dv = _mm512_set1_ps(d);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const int8_t* xq = x.q + m * x.Kp + i * 256;
      const float* dl = x.dl + m * (x.Kp / 4) + i * 64;
      __m512 sb = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[v], _mm512_loadu_si512(xq + 64 * v));
        sb = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(sc[v], dot)), _mm512_loadu_ps(dl + 16 * v), sb);
      }
      acc[m] = _mm512_fmadd_ps(zp, _mm512_loadu_ps(x.s16 + m * (x.Kp / 16) + i * 16), _mm512_fmadd_ps(sb, dv, acc[m]));
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

// out[m] = dot(x[m], w[n]) for one (planar) row of a Q5_0 weight: two blocks (64 inputs) per step.
template <int M>
__attribute__((always_inline)) inline void row_q50(const uint8_t* row, int64_t K, const XQ& x, float* out) {
  __m512 acc[M];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t nb = K / 32;
  const uint8_t* dp = row;  // the row's planes
  const uint8_t* hp = row + 2 * nb;
  const uint8_t* qp = row + 6 * nb;
  for (int64_t b = 0; b < nb; b += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(qp + 16 * b + 1024), _MM_HINT_T0);
    const bool two = b + 1 < nb;
    const __m512i u = two ? codes_q50_pair(qp + 16 * b, hp + 4 * b)
                          : _mm512_zextsi256_si512(codes_q50_block(qp + 16 * b, hp + 4 * b));
    // [dA x 8, dB x 8] as float16 bits, then one conversion (a lone last block: dB = 0)
    int16_t da, db = 0;
    std::memcpy(&da, dp + 2 * b, 2);
    if (two) std::memcpy(&db, dp + 2 * b + 2, 2);
    const __m512 dw = _mm512_cvtph_ps(_mm256_mask_blend_epi16(0xFF00, _mm256_set1_epi16(da), _mm256_set1_epi16(db)));
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const int64_t lane0 = m * (x.Kp / 4) + b * 8;
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_loadu_si512(x.corr + lane0), u, _mm512_loadu_si512(x.q + m * x.Kp + b * 32));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_loadu_ps(x.dl + lane0)), acc[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

template <int M>
void skinny_kquant(int64_t qtype, const uint8_t* blocks, int64_t row_bytes, int64_t N, int64_t K, const XQ& x,
                   const c10::BFloat16* bias, c10::BFloat16* y) {
  static const LaneIdx li;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / row_bytes);  // ~128 KiB of weight per task
  const TypeInfo ti = type_info(qtype);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float out[M];
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = blocks + n * row_bytes;
      switch (qtype) {
        case kQ4_K: row_kquant<M, kQ4_K>(row, K / 256, ti.type_size, x, li, out); break;
        case kQ5_K: row_kquant<M, kQ5_K>(row, K / 256, ti.type_size, x, li, out); break;
        case kQ6_K: row_kquant<M, kQ6_K>(row, K / 256, ti.type_size, x, li, out); break;
        default: row_q50<M>(row, K, x, out); break;
      }
      const float bv = bias != nullptr ? to_float(bias[n]) : 0.f;
      for (int m = 0; m < M; ++m) y[m * N + n] = from_float<c10::BFloat16>(out[m] + bv);
    }
  });
}

// --- many rows: qtile.h's tiles ----------------------------------------------------------------------------

// The rows [n0, n0 + r) of W -> a qtile tile: each 64 inputs' codes of the 16 rows, decoded as above,
// transposed to steps of 4 inputs x 16 channels; the sub-block scales and zero points made float
// (Q4_K / Q5_K: d sc and -dmin m per 32 inputs; Q5_0: d and -16 d per 32), except Q6_K's: its int8
// sub-scales per 16 stay integers (isc, zero code 32: qtile::Shape::zcode) and only d (per 256) is float.
template <int64_t QT>
qtile::Tile fill_kquant(const uint8_t* blocks, int64_t row_bytes, int64_t N, int64_t K, int64_t n0, int64_t r,
                        uint8_t* codes, float* scale, float* zp, int32_t* isc) {
  constexpr int64_t C = qtile::kCh;
  // Row n0 + qtile::kPrefetchAhead + j's bytes into L2 a share at a time as row n0 + j's are decoded.
  constexpr int64_t A = qtile::kPrefetchAhead;
  const int64_t ahead = A * row_bytes;
  // The scales, like the codes, are read per channel and transposed 16 x 16 dwords (channel j's 16 values
  // -> lane j of 16 vectors): a few vector ops per channel instead of 16 to 32 scalar strided stores, which
  // cost the fill about as much as its codes (the fill is most of a tile's time at 8 to 16 rows).
  if constexpr (QT == kQ5_0) {
    const int64_t nb = K / 32;
    const int64_t lines = (row_bytes + 63) / 64, steps = (nb + 1) / 2;
    for (int64_t b = 0; b < nb; b += 2) {
      // The share of each row's lines (all three planes) this step prefetches. Computed here, once per
      // step: inside the channel loop the compiler kept both 64-bit divisions per channel, which cost the
      // fill about as much as its decoding (perf: ~30% of the tile route's samples at 5 rows).
      const int64_t l0 = b / 2 * lines / steps, l1 = (b / 2 + 1) * lines / steps;
      __m512i v[16];
      for (int64_t j = 0; j < C; ++j) {
        const uint8_t* row = blocks + (n0 + j) * row_bytes;
        if (n0 + A + j < N)
          for (int64_t l = l0; l < l1; ++l) qtile::prefetch_l2(row + ahead + 64 * l);
        v[j] = j >= r ? _mm512_setzero_si512()
             : b + 1 < nb ? codes_q50_pair(row + 6 * nb + 16 * b, row + 2 * nb + 4 * b)
                          : _mm512_zextsi256_si512(codes_q50_block(row + 6 * nb + 16 * b, row + 2 * nb + 4 * b));
      }
      qtile::transpose16(v);
      for (int l = 0; l < 16; ++l) _mm512_storeu_si512(codes + (b / 2 * 16 + l) * 64, v[l]);
    }
    for (int64_t t0 = 0; t0 < nb; t0 += 16) {  // 16 blocks' d (float16, the d plane) of each channel
      const int64_t nt = std::min<int64_t>(16, nb - t0);
      const __mmask16 kt = static_cast<__mmask16>((1u << nt) - 1);
      __m512i v[16];
      for (int64_t j = 0; j < C; ++j)
        v[j] = j >= r ? _mm512_setzero_si512()
                      : _mm512_castps_si512(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(kt, blocks + (n0 + j) * row_bytes + 2 * t0)));
      qtile::transpose16(v);
      for (int64_t t = 0; t < nt; ++t) {
        const __m512 d = _mm512_castsi512_ps(v[t]);
        _mm512_storeu_ps(scale + (t0 + t) * C, d);
        _mm512_storeu_ps(zp + (t0 + t) * C, _mm512_mul_ps(d, _mm512_set1_ps(-16.f)));
      }
    }
  } else {
    const int64_t type_size = QT == kQ6_K ? 210 : QT == kQ5_K ? 176 : 144;
    for (int64_t i = 0; i < K / 256; ++i) {
      __m512i u[16][4];
      __m512i sv[16];  // channel j's scales: Q6_K int32 sc[0..15]; Q4_K/Q5_K float d sc[0..7], -dmin m[0..7]
      alignas(64) float d6[16];  // Q6_K: each channel's d
      for (int64_t j = 0; j < C; ++j) {
        if (j >= r) {
          for (int v = 0; v < 4; ++v) u[j][v] = _mm512_setzero_si512();
          sv[j] = _mm512_setzero_si512();
          d6[j] = 0.f;
          continue;
        }
        const uint8_t* p = blocks + (n0 + j) * row_bytes + i * type_size;
        if (n0 + A + j < N) {  // every line superblock i of that row touches
          for (int64_t o = 0; o < type_size; o += 64) qtile::prefetch_l2(p + ahead + o);
          qtile::prefetch_l2(p + ahead + type_size - 1);
        }
        if constexpr (QT == kQ6_K) {
          codes_q6k(p, u[j]);
          sv[j] = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)));
          d6[j] = f16_at(p + 208);
        } else {
          alignas(16) uint8_t sm[16];
          k4_scales(p + 4, sm);
          const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(sm))));
          const __m512 dd = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(f16_at(p)), _mm512_set1_ps(-f16_at(p + 2)));
          sv[j] = _mm512_castps_si512(_mm512_mul_ps(f, dd));
          if constexpr (QT == kQ4_K) codes_k4(p + 16, u[j]);
          else codes_k5(p + 16, p + 48, u[j]);
        }
      }
      qtile::transpose16(sv);  // sv[t] lane j: channel j's value t
      if constexpr (QT == kQ6_K) {  // scale (K / 256, 16): d; isc (K / 16, 16): sc
        _mm512_storeu_ps(scale + i * C, _mm512_load_ps(d6));
        for (int t = 0; t < 16; ++t) _mm512_storeu_si512(isc + (i * 16 + t) * C, sv[t]);
      } else {  // scale, zp (K / 32, 16)
        for (int t = 0; t < 8; ++t) {
          _mm512_storeu_si512(scale + (i * 8 + t) * C, sv[t]);
          _mm512_storeu_si512(zp + (i * 8 + t) * C, sv[8 + t]);
        }
      }
      for (int v = 0; v < 4; ++v) {
        __m512i col[16];
        for (int j = 0; j < 16; ++j) col[j] = u[j][v];
        qtile::transpose16(col);
        for (int l = 0; l < 16; ++l) _mm512_storeu_si512(codes + (i * 64 + 16 * v + l) * 64, col[l]);
      }
    }
  }
  return {codes, scale, zp, isc};
}

at::Tensor tile_kquant(int64_t qtype, const at::Tensor& x, const uint8_t* blocks, int64_t row_bytes, int64_t N,
                       int64_t K, const c10::BFloat16* bias) {
  const int64_t gs = qtype == kQ6_K ? 16 : 32;
  const qtile::Shape s{N, K, (K + 63) / 64 * 64, gs, K / gs, qtype == kQ6_K ? 32 : 0};
  auto run = [&]<int64_t QT>() {
    return qtile::linear<QT == kQ6_K>(x, s, bias, [&](int64_t n0, int64_t r, uint8_t* codes, float* scale, float* zp,
                                                       int32_t* isc) {
      return fill_kquant<QT>(blocks, row_bytes, N, K, n0, r, codes, scale, zp, isc);
    });
  };
  switch (qtype) {
    case kQ4_K: return run.template operator()<kQ4_K>();
    case kQ5_K: return run.template operator()<kQ5_K>();
    case kQ6_K: return run.template operator()<kQ6_K>();
    default: return run.template operator()<kQ5_0>();
  }
}

#endif  // TOKENLOOM_KQ_VNNI

// The vnni route's first row count served by the tiles rather than the few-row kernels. The few-row
// kernels' float work is per 64 inputs per row of x and of W (vpmulld, conversion, FMA for each vpdpbusd),
// the tiles' per 32 inputs per row of x and 16 of W, but the tiles pay a decode and 16 x 16 transpose per
// call. Measured on Zen 4 out of cache (docs/performance-notes.md#quantized-batching), since the fill asks
// for the next pair's rows into L2 as it goes: the K-quants' tiles win from 4 rows (1.32-1.52x bf16 against
// the few-row kernels' 1.16-1.46x; at 3 rows the few-row kernels, 1.40-1.85x against 1.34-1.70x), and so
// do Q5_0's since its fill lost two divisions per channel and its transposes were inlined (at 4 rows, 2048 x
// 2048 layers, one thread: tiles 353-358 us a layer out of cache, 304-314 in cache, against its few-row
// kernel's 425-437 and 345; at 3 rows the few-row kernel, 284 against 302-305 in cache).
inline int64_t tile_min_rows() { return std::min<int64_t>(4, kSkinnyMaxRows + 1); }

bool route_compiled(int64_t route) {
  switch (route) {
#ifdef TOKENLOOM_KQ_VNNI
    case kVnni: return true;
#endif
#ifdef TOKENLOOM_KQ_AVX512
    case kAvx512: return true;
#endif
    case kPortable: return true;
    default: return false;
  }
}

// y = x @ dequant(W).T (+ bias) by expanding W to bf16 kExpandBytes at a time, then at::linear.
at::Tensor expanded(int64_t qtype, const at::Tensor& x, const uint8_t* blocks, int64_t row_bytes, int64_t N,
                    int64_t K, const c10::optional<at::Tensor>& bias, bool avx512) {
  const int64_t M = x.size(0);
  const int64_t chunk = std::max<int64_t>(16, kExpandBytes / (K * 2) / 16 * 16);
  const int64_t nc_max = std::min(N, chunk);
  thread_local std::vector<c10::BFloat16> wd_buf;
  c10::BFloat16* wd = scratch(wd_buf, nc_max * K);
  at::Tensor y = nc_max == N ? at::Tensor() : at::empty({M, N}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += nc_max) {
    const int64_t nc = std::min(nc_max, N - n0);
    at::parallel_for(0, nc, 16, [&](int64_t begin, int64_t end) {
#ifdef TOKENLOOM_KQ_AVX512
      if (avx512) {
        expand_avx512(qtype, blocks, row_bytes, K, n0 + begin, end - begin, wd + begin * K);
        return;
      }
#endif
      (void)avx512;
      expand_portable(qtype, blocks, row_bytes, K, n0 + begin, end - begin, wd + begin * K);
    });
    const at::Tensor wt = at::from_blob(wd, {nc, K}, x.options());
    const c10::optional<at::Tensor> b = bias.has_value() ? c10::optional<at::Tensor>(bias->narrow(0, n0, nc)) : c10::nullopt;
    at::Tensor part = at::linear(x, wt, b);
    if (nc == N) return part;
    y.narrow(1, n0, nc).copy_(part);
  }
  return y;
}

}  // namespace

std::vector<std::string> kquant_routes() {
  std::vector<std::string> r;
  if (route_compiled(kVnni)) r.emplace_back("vnni");
  if (route_compiled(kAvx512)) r.emplace_back("avx512");
  r.emplace_back("portable");
  return r;
}

at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t route,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "kquant_linear: x must be (M, K) bfloat16");
  const TypeInfo ti = type_info(qtype);
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "kquant_linear: blocks must be contiguous (N, row bytes) uint8");
  TORCH_CHECK(K % ti.qk == 0 && blocks.size(1) == K / ti.qk * ti.type_size,
              "kquant_linear: blocks (", N, ", ", blocks.size(1), ") do not hold ", K, " inputs per row");
  TORCH_CHECK(route >= kAuto && route <= kPortable, "kquant_linear: route must be 0..3");
  TORCH_CHECK(route == kAuto || route_compiled(route), "kquant_linear: route ", route, " is not compiled in");
  const c10::BFloat16* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N && bias->is_contiguous(), "kquant_linear: bias");
    b = bias->data_ptr<c10::BFloat16>();
  }
  if (M == 0 || N == 0) return at::empty({M, N}, x.options());
  if (route == kAuto)
    route = route_compiled(kVnni) && M <= quant_tile_max_rows() ? kVnni : route_compiled(kAvx512) ? kAvx512 : kPortable;
  const at::Tensor xc = x.contiguous();
  const auto* wb = blocks.data_ptr<uint8_t>();
  if (route != kVnni) return expanded(qtype, xc, wb, blocks.size(1), N, K, bias, route == kAvx512);
#ifdef TOKENLOOM_KQ_VNNI
  if (M >= tile_min_rows()) return tile_kquant(qtype, xc, wb, blocks.size(1), N, K, b);
  const int64_t Kp = (K + 63) / 64 * 64;
  thread_local std::vector<int8_t> xq_buf;
  thread_local std::vector<float> dl_buf, s_buf;
  thread_local std::vector<int32_t> corr_buf;
  int8_t* xq = scratch(xq_buf, M * Kp);
  float* dl = scratch(dl_buf, M * Kp / 4);
  float* s16 = scratch(s_buf, M * Kp / 16);
  int32_t* corr = scratch(corr_buf, M * Kp / 4);
  at::Tensor y = at::empty({M, N}, x.options());
  quantize_x(xc.data_ptr<c10::BFloat16>(), M, K, Kp, xq, dl, s16, corr);
  const XQ xqs{xq, dl, s16, corr, Kp};
  with_rows(M, [&]<int R>() { skinny_kquant<R>(qtype, wb, blocks.size(1), N, K, xqs, b, y.data_ptr<c10::BFloat16>()); });
  return y;
#else
  (void)b;
  TORCH_CHECK(false, "kquant_linear: the vnni route is not compiled in");
#endif
}
