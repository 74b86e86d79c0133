// Python bindings of the CPU kernels (one extension module, tokenloom_cpu_kernels).
#include <torch/extension.h>  // pybind11: only this file needs it

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("paged_decode", &paged_decode, "paged decode attention, one query per sequence; int8 caches with float16 "
        "scales; softcap > 0 caps the scaled scores at softcap * tanh(s / softcap) (Gemma 2)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"), py::arg("sliding_window"),
        py::arg("softcap") = 0.0);
  m.def("paged_prefill", &paged_prefill, "paged causal prefill attention for chunks of several sequences over their "
        "cached K/V, read in place; writes the chunks' rows of out; int8 caches with float16 scales; softcap as "
        "paged_decode", py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"),
        py::arg("block_tables"), py::arg("q_starts"), py::arg("q_lens"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("sliding_window"), py::arg("out"), py::arg("softcap") = 0.0);
  m.def("write_kv", &write_kv, "new K and V (T, Hkv, D) into their cache slots");
  m.def("write_kv_int8", &write_kv_int8, "new K and V quantized into an int8 cache with per-(token, head) float16 "
        "scales; returns the dequantized K and V");
  m.def("add_rms_norm", &add_rms_norm, "optional residual add + RMSNorm; returns (normed, new residual)");
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU activation: silu(gate) * up");
  m.def("scaled_rms_norm", &scaled_rms_norm, "optional residual add + RMSNorm scaled by a float32 (H,) vector in "
        "float32 (Gemma's (1 + w)); x (T, H) or (T, heads, H) with a contiguous last dim; returns (normed, new residual)",
        py::arg("x"), py::arg("residual"), py::arg("scale"), py::arg("eps"));
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "GeGLU activation: gelu_tanh(gate) * up");
  m.def("first_argmax", &first_argmax, "(R, V) float32 -> (R,) int64 index of each row's largest value (first on "
        "ties; a NaN wins, as torch's max)");
  m.def("apply_token_bitmask", &apply_token_bitmask, "structured outputs: logits[r, j] = -inf where bit j of "
        "bitmask[r] is 0, for the listed rows (float32 logits, int32 bitmask)");
  m.def("rotary_inplace", &rotary_inplace, "neox rotary embedding applied in place to q and k");
  m.def("skinny_linear", &skinny_linear, "x @ w.T (+ bias) for 1..SKINNY_MAX_ROWS bfloat16 rows, weights streamed once");
  m.def("skinny_available", &skinny_available, "whether skinny_linear has its AVX512-BF16 fast path");
  m.def("skinny_packed_max_rows", &skinny_packed_max_rows, "rows up to which skinny_linear serves a dense layer "
        "that has a prepacked oneDNN copy too (models/dense_routing.py)");
  m.def("set_skinny_packed_max_rows", &set_skinny_packed_max_rows, "set skinny_packed_max_rows (1..SKINNY_MAX_ROWS)");
  m.def("quant_linear", &quant_linear,
        "x @ dequant(W).T (+ bias): bfloat16 x (M, K), int8 (N, Kp) or int4 (N, Kp/2) codes, float16 scales (N, G) "
        "and int4 mins (N, G), in the layout of tokenloom/quant/layout.py; route 0 auto, 1 vnni, 2 expand (bf16 + oneDNN)");
  m.def("quant_tile_max_rows", &quant_tile_max_rows, "rows of x up to which the auto routes of quant_linear and "
        "kquant_linear take the VNNI kernels (W expanded to bf16 for oneDNN beyond)");
  m.def("set_quant_tile_max_rows", &set_quant_tile_max_rows, "set quant_tile_max_rows (at least SKINNY_MAX_ROWS)");
  m.def("quant_panel_max_rows", &quant_panel_max_rows, "rows of x up to which quant_linear's int4 vnni route "
        "runs the few-row kernel (in panels of SKINNY_MAX_ROWS past them) rather than the tiles");
  m.def("set_quant_panel_max_rows", &set_quant_panel_max_rows, "set quant_panel_max_rows (at least SKINNY_MAX_ROWS)");
  m.def("quant_tile_min_rows", &quant_tile_min_rows, "the first row count quant_linear's vnni route serves by the "
        "tiles for a layer of these bits, groups per row and group size");
  m.def("quant_tile_dots", &quant_tile_dots, "the dots of quant_linear's and kquant_linear's tiles usable here, "
        "by index: vnni (0), amx-int8 (1), amx-bf16 (2)");
  m.def("quant_tile_dot", &quant_tile_dot, "how the tiles are dotted: 0 vnni, 1 amx-int8, 2 amx-bf16");
  m.def("set_quant_tile_dot", &set_quant_tile_dot, "set quant_tile_dot (AMX only where usable)");
  m.def("quant_tile_dot_from", &quant_tile_dot_from, "rows of x from which the tiles take quant_tile_dot "
        "(vpdpbusd below)");
  m.def("set_quant_tile_dot_from", &set_quant_tile_dot_from, "set quant_tile_dot_from");
  m.def("quant_available", &quant_available, "whether the AVX512-BF16 + VNNI quantized matmuls were compiled in");
  m.def("kquant_linear", &kquant_linear,
        "x @ dequant(W).T (+ bias): bfloat16 x (M, K), W as its GGUF blocks (N, K / QK * type_size) uint8 of type "
        "Q5_0 (6), Q4_K (12), Q5_K (13) or Q6_K (14); route 0 auto, 1 vnni, 2 avx512, 3 portable");
  m.def("kquant_routes", &kquant_routes, "the kquant_linear routes compiled in, by name");
  m.def("limits", [] {
    pybind11::dict d;  // as tokenloom/kernels/limits.py SHARED, the values this build was compiled with
    d["SKINNY_MAX_ROWS"] = kSkinnyMaxRows;
    d["PACKED_MAX_ROWS"] = kPackedMaxRows;
    d["QUANT_CHUNK"] = kQuantChunk;
    d["INT4_BLOCK"] = kInt4Block;
    return d;
  }, "the limits shared with Python (tokenloom/kernels/limits.py) this build was compiled with");
  bind_decode_stack(m);
  bind_gemma_stack(m);
}
