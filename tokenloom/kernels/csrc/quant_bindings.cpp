// Python bindings of the weight-only quantized matmuls (their own extension module,
// tokenloom_quant_kernels, so that it builds and loads independently of tokenloom_cpu_kernels).
#include <torch/extension.h>

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t bits, const c10::optional<at::Tensor>& bias);
bool quant_available();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear,
        "x @ dequant(W).T (+ bias): bfloat16 x (M, K), int8 (N, K) or int4 (N, K/2) codes, float16 scales (N, G) "
        "and int4 mins (N, G)");
  m.def("quant_available", &quant_available, "whether the AVX512-BF16 kernels were compiled in");
}
