// A whole decode step of a Llama-family decoder stack in one call from Python.
//
// A decode step on a small model is dominated by fixed costs, not by arithmetic: SmolLM2-135M runs
// 30 layers x ~12 kernels, and each kernel called from Python through nn.Module pays interpreter and
// binding work before it starts (docs/performance-notes.md#decode-stack). Here the
// same kernels, in the same order, with the same arguments, are called from C++: the result is bit
// for bit the one of the Python path (models/llama.py with the CPU kernels), which is its test oracle
// (tests/test_decode_stack.py), and the Python path still serves every step that is not pure decode.
//
// Per layer, for B decode rows (one new token each, or the 1 + k rows of a speculative check):
//   h, res = add_rms_norm(x, res)            qkv = linear(h)               (B, Hq*D + 2*Hkv*D)
//   rotary(q, k) in place on qkv's views    write k, v into the paged cache (int8: quantized)
//   a = paged_decode(q, cache, tables)      h, res = add_rms_norm(o_proj(a), res)
//   x = down(silu_and_mul(gate_up(h)))
// and after the last layer the final norm: the hidden states the Python model returns.
#include <torch/extension.h>  // pybind11 classes (the stack objects Python holds)

#include <tuple>
#include <vector>

#include "stack_common.h"

struct FusedLayer {
  at::Tensor input_norm, post_norm;  // (hidden,) bfloat16
  FusedLinear qkv, o, gate_up, down;
  at::Tensor k_cache, v_cache;       // (num_blocks, block_size, Hkv, D)
  c10::optional<at::Tensor> k_scale, v_scale;  // INT8 cache: (num_blocks, block_size, Hkv) float16
};

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
              int64_t sliding_window, at::Tensor final_norm)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        sliding_window_(sliding_window), final_norm_(std::move(final_norm)) {
    TORCH_CHECK(skinny_available(), "DecodeStack: needs the AVX512-BF16 kernels");
    TORCH_CHECK(final_norm_.scalar_type() == at::kBFloat16, "DecodeStack: bfloat16 models only");
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, const FusedLinear& qkv, const FusedLinear& o,
                 const FusedLinear& gate_up, const FusedLinear& down, at::Tensor k_cache, at::Tensor v_cache,
                 c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale) {
    TORCH_CHECK(k_scale.has_value() == v_scale.has_value(), "DecodeStack: K and V scales go together");
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == num_kv_heads_ && k_cache.size(3) == head_dim_,
                "DecodeStack: cache must be (num_blocks, block_size, Hkv, D)");
    layers_.push_back(FusedLayer{std::move(input_norm), std::move(post_norm), qkv, o, gate_up, down,
                                 std::move(k_cache), std::move(v_cache), std::move(k_scale), std::move(v_scale)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x: (B, hidden) embeddings; cos, sin: (B, D) of each row's position; slots: (B,) cache slots;
  // block_tables: (B, max_blocks) and seq_lens: (B,) of each row's context. Returns (B, hidden).
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens) const {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "DecodeStack.forward: x must be (B, hidden) bfloat16");
    const int64_t B = x.size(0), q_size = num_heads_ * head_dim_;
    c10::optional<at::Tensor> residual;
    for (const FusedLayer& L : layers_) {
      at::Tensor h, res;
      std::tie(h, res) = add_rms_norm(x.contiguous(), residual, L.input_norm, eps_);
      auto [q, k, v] = split_qkv(L.qkv(h), num_heads_, num_kv_heads_, head_dim_);
      rotary_inplace(q, k, cos, sin);
      const at::Tensor a = cache_and_attend(q, k, v, L.k_cache, L.v_cache, L.k_scale, L.v_scale, slots, block_tables,
                                            seq_lens, scale_, sliding_window_, /*softcap=*/0.0);  // Llama: no cap
      std::tie(h, res) = add_rms_norm(L.o(a.reshape({B, q_size})).contiguous(), res, L.post_norm, eps_);
      x = L.down(silu_and_mul(L.gate_up(h)));
      residual = res;
    }
    return std::get<0>(add_rms_norm(x.contiguous(), residual, final_norm_, eps_));
  }

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  int64_t sliding_window_;  // 0: none
  at::Tensor final_norm_;
  std::vector<FusedLayer> layers_;
};

void bind_decode_stack(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<FusedLinear>(m, "FusedLinear", "a linear layer as the decode stack calls it")
      .def(py::init<at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                    int64_t, c10::optional<at::Tensor>, int64_t>(),
           py::arg("weight"), py::arg("scales"), py::arg("mins"), py::arg("bias"), py::arg("bits"),
           py::arg("packed") = py::none(), py::arg("route") = 0)
      .def_static("kquant", &FusedLinear::kquant, "a KQuantLinear's GGUF blocks", py::arg("blocks"), py::arg("qtype"),
                  py::arg("route"), py::arg("bias"))
      .def_static("concat", &FusedLinear::concat, "a PartsLinear: the parts' outputs concatenated", py::arg("parts"));
  py::class_<DecodeStack>(m, "DecodeStack", "a Llama-family decoder stack's decode step in one call")
      .def(py::init<int64_t, int64_t, int64_t, double, double, int64_t, at::Tensor>(), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"),
           py::arg("sliding_window"), py::arg("final_norm"))
      .def("add_layer", &DecodeStack::add_layer)
      .def("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>());
}
