// Writing new tokens' K and V into the paged cache (flat slots, see attention/paged_kv.py), K and V in
// one call. The INT8 form quantizes on the way, codes = round-half-even(x / scale) clamped to
// [-127, 127], with float16 scales of one of two kinds:
//   per token and head (contiguous scale tensors): scale = max|x| / 127 clamped to [2^-24, 65504] and
//     rounded to float16 first, stored at the token's slot;
//   per head (scale tensors with zero block and token strides): the head's fixed scale, nothing stored.
// It also returns what the cache now holds (codes * scale in x's dtype), which prefill chunks attend
// over. Bit-identical to paged_kv.quantize_kv / dequantize_kv (the oracle): the same float32 operations
// in the same order, no fast-math.
#include <torch/types.h>  // not torch/extension.h (pybind11, torch::nn): ~3x the compile time per file
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>

#include "dtype.h"
#include "kernels.h"

namespace {

// k, v (T, Hkv, D) against a cache (num_blocks, block_size, Hkv, D), and every slot in range (once).
void check_inputs(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& slots) {
  for (const auto& [x, cache] : {std::pair{&k, &k_cache}, std::pair{&v, &v_cache}}) {
    TORCH_CHECK(x->dim() == 3 && x->is_contiguous(), "kv write: new K/V must be contiguous (T, Hkv, D)");
    TORCH_CHECK(cache->dim() == 4 && cache->is_contiguous() && cache->size(2) == x->size(1) &&
                    cache->size(3) == x->size(2),
                "kv write: cache (num_blocks, block_size, Hkv, D) must match the new K/V");
  }
  TORCH_CHECK(k.sizes() == v.sizes() && k_cache.sizes() == v_cache.sizes(), "kv write: K and V shapes differ");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == k.size(0) &&
                  slots.is_contiguous(),
              "kv write: one int64 slot per token");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.size(0); ++t)
    TORCH_CHECK(s[t] >= 0 && s[t] < num_slots, "kv write: slot ", s[t], " out of range");
}

// `fixed`: scales holds one scale per head (H,), read, never written.
template <typename scalar_t>
void quantize_rows(const scalar_t* x, int8_t* codes, at::Half* scales, bool fixed, scalar_t* out,
                   const int64_t* slots, int64_t T, int64_t H, int64_t D) {
  at::parallel_for(0, T * H, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / H, h = i % H;
      const scalar_t* row = x + i * D;
      at::Half s16 = fixed ? scales[h] : at::Half(0.f);
      if (!fixed) {
        float amax = 0.f;
        for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(to_float(row[d])));
        s16 = at::Half(std::clamp(amax / 127.0f, 5.9604644775390625e-08f, 65504.0f));
      }
      const float s = static_cast<float>(s16);
      const int64_t dst = slots[t] * H + h;
      int8_t* c = codes + dst * D;
      scalar_t* o = out + i * D;
      for (int64_t d = 0; d < D; ++d) {
        const float q = std::clamp(std::nearbyint(to_float(row[d]) / s), -127.f, 127.f);
        c[d] = static_cast<int8_t>(q);
        o[d] = from_float<scalar_t>(q * s);
      }
      if (!fixed) scales[dst] = s16;
    }
  });
}

template <typename scalar_t>
void copy_rows(const scalar_t* x, scalar_t* cache, const int64_t* slots, int64_t T, int64_t row) {
  for (int64_t t = 0; t < T; ++t) std::copy(x + t * row, x + (t + 1) * row, cache + slots[t] * row);
}

}  // namespace

// k, v (T, Hkv, D) -> k_cache, v_cache at `slots`; all in the model dtype.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots) {
  check_inputs(k, v, k_cache, v_cache, slots);
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "write_kv: new K/V and cache dtypes differ");
  const int64_t T = k.size(0), row = k.size(1) * k.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    copy_rows(k.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(), T, row);
    copy_rows(v.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(), T, row);
  });
}

// k, v (T, Hkv, D) float -> int8 codes in k_cache / v_cache at `slots`, with float16 scales
// (num_blocks, block_size, Hkv): per token (contiguous, written at `slots`) or per head (zero block and
// token strides, read only); returns the dequantized (T, Hkv, D) K and V.
std::tuple<at::Tensor, at::Tensor> write_kv_int8(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                                                 at::Tensor v_cache, at::Tensor k_scale, at::Tensor v_scale,
                                                 const at::Tensor& slots) {
  check_inputs(k, v, k_cache, v_cache, slots);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar, "write_kv_int8: int8 caches");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "write_kv_int8: K and V dtypes differ");
  const bool fixed = scales_per_head(k_scale);
  for (const at::Tensor& s : {k_scale, v_scale}) {
    TORCH_CHECK(s.scalar_type() == at::kHalf && s.dim() == 3 && s.size(0) * s.size(1) == num_slots &&
                    s.size(2) == k.size(1),
                "write_kv_int8: scales must be float16 (num_blocks, block_size, Hkv)");
    TORCH_CHECK(s.is_contiguous() || scales_per_head(s), "write_kv_int8: scales must be contiguous (per token) or "
                "an (Hkv,) vector expanded over blocks and tokens (per head)");
    TORCH_CHECK(scales_per_head(s) == fixed, "write_kv_int8: K and V scales must be of one kind");
  }
  at::Tensor ko = at::empty_like(k), vo = at::empty_like(v);
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_int8", [&] {
    const int64_t* s = slots.data_ptr<int64_t>();
    quantize_rows(k.data_ptr<scalar_t>(), k_cache.data_ptr<int8_t>(), k_scale.data_ptr<at::Half>(), fixed,
                  ko.data_ptr<scalar_t>(), s, T, H, D);
    quantize_rows(v.data_ptr<scalar_t>(), v_cache.data_ptr<int8_t>(), v_scale.data_ptr<at::Half>(), fixed,
                  vo.data_ptr<scalar_t>(), s, T, H, D);
  });
  return {ko, vo};
}
