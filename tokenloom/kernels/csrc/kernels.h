// The CPU kernels' C++ entry points, declared once: bindings.cpp exposes them to Python, the decode
// stack (decode_stack.cpp) calls them directly, and each defining file includes this header so the
// compiler checks its definitions against these declarations.
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <tuple>

// skinny_linear and quant_linear's few-row paths serve 1..kSkinnyMaxRows rows (models/layers.py
// SKINNY_MAX_ROWS).
constexpr int64_t kSkinnyMaxRows = 8;
// A dense layer's prepacked (oneDNN-blocked) weight serves 2..kPackedMaxRows rows (models/layers.py
// PACKED_MAX_ROWS).
constexpr int64_t kPackedMaxRows = 256;

// The few-row kernels are compiled once per row count: calls f.template operator()<R>() with R = rows,
// for rows in 1..kSkinnyMaxRows (the caller checks the bound).
template <typename F>
inline void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 3: f.template operator()<3>(); break;
    case 4: f.template operator()<4>(); break;
    case 5: f.template operator()<5>(); break;
    case 6: f.template operator()<6>(); break;
    case 7: f.template operator()<7>(); break;
    default: f.template operator()<8>(); break;
  }
}

// An INT8 cache's (num_blocks, block_size, Hkv) scales are per token and head (contiguous) or one per
// head: an (Hkv,) vector expanded over blocks and tokens (zero strides), see attention/paged_kv.py.
inline bool scales_per_head(const at::Tensor& s) {
  return s.dim() == 3 && s.stride(0) == 0 && s.stride(1) == 0 && s.stride(2) == 1;
}

// paged_decode.cpp
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        int64_t sliding_window);
// elementwise.cpp
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
void rotary_inplace(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);
// kv_write.cpp
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots);
std::tuple<at::Tensor, at::Tensor> write_kv_int8(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                                                 at::Tensor v_cache, at::Tensor k_scale, at::Tensor v_scale,
                                                 const at::Tensor& slots);
// skinny_gemm.cpp
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
bool skinny_available();
// quant_gemm.cpp
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t bits, const c10::optional<at::Tensor>& bias);
bool quant_available();
// decode_stack.cpp
void bind_decode_stack(pybind11::module_& m);
