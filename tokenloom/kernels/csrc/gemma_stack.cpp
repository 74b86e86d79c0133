// A whole decode step of a Gemma 3 / Gemma 2 decoder stack in one call from Python (decode_stack.cpp's
// idea for the Gemma family, models/gemma.py).
//
// Gemma 3 270M decodes 18 layers of ~20 kernels each, and on 2 cores the Python side of those calls
// (nn.Module dispatch, views, the per-layer plan lookups) cost about as much as the layers' weights take
// to stream (docs/benchmarks.md, "Gemma 3 270M"). Here the same kernels run in the same order with the
// same arguments as models/gemma.py with the CPU kernels, so the hidden states are the Python model's bit
// for bit (tests/test_gemma_stack.py), and the Python model still serves every step that is not pure decode.
//
// Per layer, for B decode rows (the residual stream is `res`; `x` what the previous block adds to it):
//   h, res = norm_in(x + res)                      qkv = linear(h)            (B, Hq*D + 2*Hkv*D)
//   q, k = q_norm(q), k_norm(k) per head (Gemma 3)  rotary(q, k) with the layer kind's table (local / global)
//   write k, v into the paged cache of the layer's KV group
//   a = paged_decode(q, the group's block tables, the layer's window, softcap (Gemma 2))
//   h = norm_post_attn(o(a));   h, res = norm_pre_ff(h + res);   x = norm_post_ff(down(gelu_tanh(gate) * up))
// and after the last layer the final norm of x + res. Every norm scales by (1 + w) in float32
// (scaled_rms_norm). The embeddings (times sqrt(hidden)) and the RoPE tables are looked up in Python.
#include <torch/extension.h>  // pybind11 classes (the stack objects Python holds)

#include <tuple>
#include <vector>

#include "stack_common.h"

struct GemmaLayer {
  // (hidden,) float32 (1 + w) of the four norms around attention and the MLP
  at::Tensor norm_in, norm_post_attn, norm_pre_ff, norm_post_ff;
  c10::optional<at::Tensor> q_norm, k_norm;  // (D,) float32 (1 + w); Gemma 3 only
  FusedLinear qkv, o, gate_up, down;
  at::Tensor k_cache, v_cache;               // (num_blocks, block_size, Hkv, D)
  c10::optional<at::Tensor> k_scale, v_scale;  // INT8 cache: (num_blocks, block_size, Hkv) float16
  int64_t window;                            // 0: global attention
  bool local;                                // RoPE: the local table (rope_local_theta) or the global one
  int64_t group;                             // KV group: whose slots and block tables index this layer's cache
};

class GemmaDecodeStack {
 public:
  GemmaDecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                   double softcap, at::Tensor final_norm)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        softcap_(softcap), final_norm_(std::move(final_norm)) {
    TORCH_CHECK(final_norm_.scalar_type() == at::kFloat && final_norm_.dim() == 1,
                "GemmaDecodeStack: the final norm's (1 + w) must be (hidden,) float32");
  }

  void add_layer(at::Tensor norm_in, at::Tensor norm_post_attn, at::Tensor norm_pre_ff, at::Tensor norm_post_ff,
                 c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm, const FusedLinear& qkv,
                 const FusedLinear& o, const FusedLinear& gate_up, const FusedLinear& down, at::Tensor k_cache,
                 at::Tensor v_cache, c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale,
                 int64_t window, bool local, int64_t group) {
    TORCH_CHECK(k_scale.has_value() == v_scale.has_value(), "GemmaDecodeStack: K and V scales go together");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "GemmaDecodeStack: q and k norms go together");
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == num_kv_heads_ && k_cache.size(3) == head_dim_,
                "GemmaDecodeStack: cache must be (num_blocks, block_size, Hkv, D)");
    TORCH_CHECK(window >= 0 && group >= 0, "GemmaDecodeStack: window and group must be >= 0");
    for (const at::Tensor* t : {&norm_in, &norm_post_attn, &norm_pre_ff, &norm_post_ff})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->size(0) == final_norm_.size(0),
                  "GemmaDecodeStack: a layer norm's (1 + w) must be (hidden,) float32");
    layers_.push_back(GemmaLayer{std::move(norm_in), std::move(norm_post_attn), std::move(norm_pre_ff),
                                 std::move(norm_post_ff), std::move(q_norm), std::move(k_norm), qkv, o, gate_up,
                                 down, std::move(k_cache), std::move(v_cache), std::move(k_scale),
                                 std::move(v_scale), window, local, group});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x: (B, hidden) scaled embeddings; cos/sin_global, cos/sin_local: (B, D) of each row's position;
  // per KV group g: slots[g] (B,), block_tables[g] (B, max_blocks), seq_lens[g] (B,). Returns (B, hidden).
  at::Tensor forward(at::Tensor x, const at::Tensor& cos_global, const at::Tensor& sin_global,
                     const at::Tensor& cos_local, const at::Tensor& sin_local, const std::vector<at::Tensor>& slots,
                     const std::vector<at::Tensor>& block_tables, const std::vector<at::Tensor>& seq_lens) const {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "GemmaDecodeStack.forward: x must be (B, hidden) bfloat16");
    TORCH_CHECK(slots.size() == block_tables.size() && slots.size() == seq_lens.size(),
                "GemmaDecodeStack.forward: one slot mapping, block table and length vector per KV group");
    const int64_t B = x.size(0), q_size = num_heads_ * head_dim_;
    c10::optional<at::Tensor> residual;
    for (const GemmaLayer& L : layers_) {
      TORCH_CHECK(L.group < static_cast<int64_t>(slots.size()), "GemmaDecodeStack.forward: a layer's KV group "
                  "has no block tables in this step");
      at::Tensor h, res;
      std::tie(h, res) = scaled_rms_norm(x.contiguous(), residual, L.norm_in, eps_);
      auto [q, k, v] = split_qkv(L.qkv(h), num_heads_, num_kv_heads_, head_dim_);
      if (L.q_norm.has_value()) {
        q = std::get<0>(scaled_rms_norm(q, c10::nullopt, *L.q_norm, eps_));
        k = std::get<0>(scaled_rms_norm(k, c10::nullopt, *L.k_norm, eps_));
      }
      rotary_inplace(q, k, L.local ? cos_local : cos_global, L.local ? sin_local : sin_global);
      const at::Tensor a = cache_and_attend(q, k, v, L.k_cache, L.v_cache, L.k_scale, L.v_scale, slots[L.group],
                                            block_tables[L.group], seq_lens[L.group], scale_, L.window, softcap_);
      h = std::get<0>(scaled_rms_norm(L.o(a.reshape({B, q_size})).contiguous(), c10::nullopt, L.norm_post_attn, eps_));
      std::tie(h, res) = scaled_rms_norm(h, res, L.norm_pre_ff, eps_);
      x = std::get<0>(scaled_rms_norm(L.down(gelu_tanh_and_mul(L.gate_up(h).contiguous())).contiguous(),
                                      c10::nullopt, L.norm_post_ff, eps_));
      residual = res;
    }
    return std::get<0>(scaled_rms_norm(x.contiguous(), residual, final_norm_, eps_));
  }

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_, softcap_;  // softcap 0: none (Gemma 3)
  at::Tensor final_norm_;         // (hidden,) float32 (1 + w)
  std::vector<GemmaLayer> layers_;
};

void bind_gemma_stack(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<GemmaDecodeStack>(m, "GemmaDecodeStack", "a Gemma 3 / Gemma 2 decoder stack's decode step in one call")
      .def(py::init<int64_t, int64_t, int64_t, double, double, double, at::Tensor>(), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"), py::arg("softcap"),
           py::arg("final_norm"))
      .def("add_layer", &GemmaDecodeStack::add_layer, py::arg("norm_in"), py::arg("norm_post_attn"),
           py::arg("norm_pre_ff"), py::arg("norm_post_ff"), py::arg("q_norm"), py::arg("k_norm"), py::arg("qkv"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("k_cache"), py::arg("v_cache"),
           py::arg("k_scale"), py::arg("v_scale"), py::arg("window"), py::arg("local"), py::arg("group"))
      .def("num_layers", &GemmaDecodeStack::num_layers)
      .def("forward", &GemmaDecodeStack::forward, py::call_guard<py::gil_scoped_release>());
}
