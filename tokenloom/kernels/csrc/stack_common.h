// What the two decode stacks (decode_stack.cpp, gemma_stack.cpp) share: a linear layer as they call it
// (FusedLinear: the kernel the Python layer's forward would call, with the same arguments, so a stack's
// result is the Python model's), the q/k/v views of a fused projection, and one layer's cache write and
// paged decode attention, as attention/cpu.py CPUBackend does them.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>

#include <tuple>
#include <vector>

#include "kernels.h"

// x @ w.T (+ bias) with w already in oneDNN's blocked layout: the op Linear.forward calls for a packed
// weight (torch.ops.mkldnn._linear_pointwise), reached through the dispatcher as ATen has no C++ API
// for it.
inline at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}

// The layer kinds, as the Python layers: models/layers.py Linear (dense bfloat16, bits 16), quant/linear.py
// QuantLinear (bits 8 or 4), quant/kquant.py KQuantLinear (GGUF blocks of `qtype`: FusedLinear::kquant) and
// quant/parts.py PartsLinear (several of these on the same x, outputs concatenated: FusedLinear::concat).
struct FusedLinear {
  static constexpr int64_t kKQuant = 0, kParts = -1;  // `bits` of the two kinds without a bit width

  at::Tensor weight;                    // dense: (N, K) bfloat16; quantized: the codes in kernel layout;
                                        // K-quant: (N, row bytes) uint8 GGUF blocks
  c10::optional<at::Tensor> scales;     // quantized: (N, G) float16
  c10::optional<at::Tensor> mins;       // int4: (N, G) float16
  c10::optional<at::Tensor> bias;       // (N,) bfloat16
  int64_t bits;                         // 16: dense bfloat16; 8 or 4: weight-only quantized; kKQuant; kParts
  c10::optional<at::Tensor> packed;     // dense: Linear.packed, the weight in oneDNN's blocked layout
  int64_t qtype = 0;                    // K-quant: the GGUF type
  int64_t route = 0;                    // quantized and K-quant: the kernel's route id (0: auto), the layer's
  std::vector<FusedLinear> parts;       // kParts: the layers whose outputs are concatenated

  FusedLinear(at::Tensor weight_, c10::optional<at::Tensor> scales_, c10::optional<at::Tensor> mins_,
              c10::optional<at::Tensor> bias_, int64_t bits_, c10::optional<at::Tensor> packed_, int64_t route_ = 0)
      : weight(std::move(weight_)), scales(std::move(scales_)), mins(std::move(mins_)), bias(std::move(bias_)),
        bits(bits_), packed(std::move(packed_)), route(route_) {
    TORCH_CHECK(bits == 16 || !packed.has_value(), "FusedLinear: only a dense layer has a packed weight");
    TORCH_CHECK(bits == 16 || bits == 8 || bits == 4, "FusedLinear: bits must be 16, 8 or 4");
    TORCH_CHECK(bits == 16 || scales.has_value(), "FusedLinear: a quantized layer needs its scales");
    TORCH_CHECK(bits != 16 || (weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.dim() == 2),
                "FusedLinear: a dense layer needs a contiguous (N, K) bfloat16 weight");
  }

  // KQuantLinear: its (N, row bytes) blocks as kquant_linear takes them (Q5_0 already in planes).
  static FusedLinear kquant(at::Tensor blocks, int64_t qtype, int64_t route, c10::optional<at::Tensor> bias) {
    TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
                "FusedLinear.kquant: contiguous (N, row bytes) uint8 blocks");
    FusedLinear f(at::empty({0, 0}, at::kBFloat16), c10::nullopt, c10::nullopt, std::move(bias), 16, c10::nullopt, route);
    f.weight = std::move(blocks);
    f.bits = kKQuant;
    f.qtype = qtype;
    return f;
  }

  // PartsLinear: each part on the same x, outputs concatenated along the features.
  static FusedLinear concat(std::vector<FusedLinear> parts) {
    TORCH_CHECK(!parts.empty(), "FusedLinear.concat: no parts");
    FusedLinear f(at::empty({0, 0}, at::kBFloat16), c10::nullopt, c10::nullopt, c10::nullopt, 16, c10::nullopt);
    f.bits = kParts;
    f.parts = std::move(parts);
    return f;
  }

  // Whether operator() serves m rows by skinny_linear (a dense bfloat16 layer at few enough rows).
  bool skinny(int64_t m) const {
    return bits == 16 && m >= 1 && m <= (packed.has_value() ? skinny_packed_max_rows() : kSkinnyMaxRows);
  }

  at::Tensor operator()(const at::Tensor& x) const {
    if (bits == kParts) {
      std::vector<at::Tensor> outs;
      outs.reserve(parts.size());
      for (const FusedLinear& p : parts) outs.push_back(p(x));
      return at::cat(outs, -1);
    }
    if (bits == kKQuant) return kquant_linear(x, weight, qtype, route, bias);
    if (bits != 16) return quant_linear(x, weight, *scales, mins, bits, bias, route);
    // The choice Linear.forward makes: skinny up to skinny_packed_max_rows() rows where there is a packed
    // copy (measured per CPU), up to kSkinnyMaxRows where there is none; packed up to kPackedMaxRows.
    const int64_t m = x.size(0);
    if (skinny(m)) return skinny_linear(x, weight, bias);
    if (packed.has_value() && m <= kPackedMaxRows) return packed_linear(x, *packed, bias);
    return at::linear(x, weight, bias);  // oneDNN for many rows, as F.linear in Linear.forward
  }
};

// (B, Hq*D + 2*Hkv*D) fused projection -> q (B, Hq, D), k, v (B, Hkv, D): views, no copies.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> split_qkv(const at::Tensor& qkv, int64_t heads, int64_t kv_heads,
                                                                int64_t head_dim) {
  const int64_t B = qkv.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const std::vector<at::Tensor> parts = qkv.split({q_size, kv_size, kv_size}, -1);
  return {parts[0].view({B, heads, head_dim}), parts[1].view({B, kv_heads, head_dim}),
          parts[2].view({B, kv_heads, head_dim})};
}

// One layer's attention for B decode rows: k, v (B, Hkv, D) written into the paged cache at `slots` (an INT8
// cache quantizes them with its scales), then q (B, Hq, D) over each row's context through its block table;
// window 0: none, softcap 0: none. Returns (B, Hq, D).
inline at::Tensor cache_and_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                                   const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                   double scale, int64_t window, double softcap) {
  const at::Tensor kc = k.contiguous(), vc = v.contiguous();
  if (k_scale.has_value()) {
    write_kv_int8(kc, vc, k_cache, v_cache, *k_scale, *v_scale, slots);
  } else {
    write_kv(kc.to(k_cache.scalar_type()), vc.to(v_cache.scalar_type()), k_cache, v_cache, slots);
  }
  return paged_decode(q.contiguous(), k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, scale, window,
                      softcap);
}
