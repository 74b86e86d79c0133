// Python bindings of the CPU kernels (one extension module, tokenloom_cpu_kernels).
#include <torch/extension.h>

#include <tuple>

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        int64_t sliding_window);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots);
std::tuple<at::Tensor, at::Tensor> write_kv_int8(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                                                 at::Tensor v_cache, at::Tensor k_scale, at::Tensor v_scale,
                                                 const at::Tensor& slots);
void rotary_inplace(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
bool skinny_available();
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t bits, const c10::optional<at::Tensor>& bias);
bool quant_available();
void bind_decode_stack(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention, one query per sequence; int8 caches with float16 scales");
  m.def("write_kv", &write_kv, "new K and V (T, Hkv, D) into their cache slots");
  m.def("write_kv_int8", &write_kv_int8, "new K and V quantized into an int8 cache with per-(token, head) float16 "
        "scales; returns the dequantized K and V");
  m.def("add_rms_norm", &add_rms_norm, "optional residual add + RMSNorm; returns (normed, new residual)");
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU activation: silu(gate) * up");
  m.def("rotary_inplace", &rotary_inplace, "neox rotary embedding applied in place to q and k");
  m.def("skinny_linear", &skinny_linear, "x @ w.T (+ bias) for 1..8 bfloat16 rows, weights streamed once");
  m.def("skinny_available", &skinny_available, "whether skinny_linear has its AVX512-BF16 fast path");
  m.def("quant_linear", &quant_linear,
        "x @ dequant(W).T (+ bias): bfloat16 x (M, K), int8 (N, K) or int4 (N, K/2) codes, float16 scales (N, G) "
        "and int4 mins (N, G)");
  m.def("quant_available", &quant_available, "whether the AVX512-BF16 quantized matmuls were compiled in");
  bind_decode_stack(m);
}
