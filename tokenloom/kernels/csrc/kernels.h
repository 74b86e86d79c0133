// The CPU kernels' C++ entry points, declared once: bindings.cpp exposes them to Python, the decode
// stack (decode_stack.cpp) calls them directly, and each defining file includes this header so the
// compiler checks its definitions against these declarations.
#pragma once
#include <torch/types.h>  // not torch/extension.h (pybind11, torch::nn): ~3x the compile time per file

#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include <tuple>
#include <utility>

namespace pybind11 { class module_; }  // the bind_* declarations below; only bindings.cpp and the stacks include pybind11

// The numbers Python relies on too are defined once, in tokenloom/kernels/limits.py, and reach this
// build as -DTOKENLOOM_<NAME>=<value> flags (tokenloom/kernels/__init__.py).
#if !defined(TOKENLOOM_SKINNY_MAX_ROWS) || !defined(TOKENLOOM_PACKED_MAX_ROWS) || !defined(TOKENLOOM_QUANT_CHUNK) || \
    !defined(TOKENLOOM_INT4_BLOCK)
#error "build through tokenloom.kernels.load_cpu_kernels: the shared limits come from tokenloom/kernels/limits.py"
#endif
// skinny_linear and quant_linear's few-row paths serve 1..kSkinnyMaxRows rows (limits.SKINNY_MAX_ROWS).
constexpr int64_t kSkinnyMaxRows = TOKENLOOM_SKINNY_MAX_ROWS;
// A dense layer's prepacked (oneDNN-blocked) weight serves 2..kPackedMaxRows rows (limits.PACKED_MAX_ROWS).
constexpr int64_t kPackedMaxRows = TOKENLOOM_PACKED_MAX_ROWS;
// Quantized code layout (quant/layout.py): rows padded to chunks of kQuantChunk inputs, int4 output
// channels in blocks of kInt4Block.
constexpr int64_t kQuantChunk = TOKENLOOM_QUANT_CHUNK;
constexpr int64_t kInt4Block = TOKENLOOM_INT4_BLOCK;
static_assert(kSkinnyMaxRows >= 1 && kPackedMaxRows >= 2, "row limits");
static_assert(kQuantChunk == 64, "the quantized kernels load a chunk of int8 codes as one 512-bit vector");
static_assert(kInt4Block == 16, "an int4 block of output channels is vpdpbusd's 16 int32 lanes");

// Scratch that lives as long as the calling thread (a decode step calls the quantized kernels ~120 times,
// and two tensor allocations per call cost as much as a permute of x), 64-byte aligned: the kernels read it
// in 64-byte loads, which span two cache lines wherever std::vector's 16-byte alignment put a buffer off a
// line (docs/performance-notes.md#quantized-batching).
template <typename T>
T* scratch(std::vector<T>& buf, int64_t n) {
  constexpr int64_t pad = 64 / sizeof(T);
  if (static_cast<int64_t>(buf.size()) < n + pad) buf.resize(n + pad);
  const auto at = reinterpret_cast<std::uintptr_t>(buf.data());
  return reinterpret_cast<T*>((at + 63) & ~std::uintptr_t{63});
}

// The few-row kernels are compiled once per row count: calls f.template operator()<R>() with R = rows,
// for rows in 1..kSkinnyMaxRows (the caller checks the bound; any other count runs as kSkinnyMaxRows).
template <typename F, int... R>
inline void with_rows_impl(int64_t rows, F& f, std::integer_sequence<int, R...>) {
  if (!((rows == R + 1 && (f.template operator()<R + 1>(), true)) || ...)) {
    f.template operator()<static_cast<int>(kSkinnyMaxRows)>();
  }
}
template <typename F>
inline void with_rows(int64_t rows, F&& f) {
  with_rows_impl(rows, f, std::make_integer_sequence<int, static_cast<int>(kSkinnyMaxRows) - 1>{});
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
                        int64_t sliding_window, double softcap);
struct PiecePlan;  // paged_decode.cpp: how a step's (sequence, KV head) items are cut between threads
// paged_decode's bfloat16 route (AVX512-BF16, head size 64, 128 or 256) for a caller that owns its threads:
// the pieces are planned once from the step's block tables and lengths, which every layer shares, and each
// layer runs them on its own cache: every thread run(r) for its runs r (distinct runs write disjoint outputs
// and partials), then, once all have finished, one thread combine()s the pieces of the items split between
// threads. paged_decode runs its bfloat16 route through this class: the same values.
class DecodeAttention {
 public:
  static bool supports(int64_t head_dim);
  // block_tables (B, max_blocks) and seq_lens (B,) int64, held for the object's life.
  DecodeAttention(const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t Hq, int64_t Hkv, int64_t D,
                  int64_t block_size, int64_t sliding_window);
  int64_t runs() const;
  // q: row b (Hq heads of D, dense) at q + b * q_stride; caches (num_blocks, block_size, Hkv, D); out (B, Hq, D).
  void run(int64_t r, const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* k_cache,
           const c10::BFloat16* v_cache, c10::BFloat16* out, double scale, double softcap);
  void combine(c10::BFloat16* out) const;

 private:
  at::Tensor bt_, lens_;
  int64_t Hq_, Hkv_, D_, block_size_, window_;
  std::shared_ptr<const PiecePlan> plan_;
  std::vector<float> partials_;  // (parts, G * (D + 2)): split items' pieces (combine_partials)
};
// paged_prefill.cpp
void paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                   const at::Tensor& block_tables, const at::Tensor& q_starts, const at::Tensor& q_lens,
                   const at::Tensor& seq_lens, double scale, int64_t sliding_window, at::Tensor out,
                   double softcap);
// elementwise.cpp
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
std::tuple<at::Tensor, at::Tensor> scaled_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                   const at::Tensor& scale, double eps);
at::Tensor gelu_tanh_and_mul(const at::Tensor& x);
at::Tensor first_argmax(const at::Tensor& logits);
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows);
void rotary_inplace(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);
// kv_write.cpp
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots);
std::tuple<at::Tensor, at::Tensor> write_kv_int8(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                                                 at::Tensor v_cache, at::Tensor k_scale, at::Tensor v_scale,
                                                 const at::Tensor& slots);
// skinny_gemm.cpp
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
bool skinny_available();
// Weight rows [n0, n1) of skinny_linear's y (M, N) = x (M, K) @ w (N, K).T (+ bias), on the calling thread: for a
// caller that splits the rows between threads it runs itself (every output is computed alike for any split).
void skinny_rows(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y, int64_t M,
                 int64_t N, int64_t K, int64_t n0, int64_t n1);
// Rows up to which skinny_linear serves a dense layer that has a prepacked copy too (1..kSkinnyMaxRows).
int64_t skinny_packed_max_rows();
void set_skinny_packed_max_rows(int64_t rows);
// quant_gemm.cpp
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t bits, const c10::optional<at::Tensor>& bias,
                        int64_t route);
bool quant_available();
// The auto routes of quant_linear and kquant_linear: VNNI (few rows, then qtile.h's tiles) up to this many
// rows of x, W expanded to bf16 for oneDNN beyond.
int64_t quant_tile_max_rows();
void set_quant_tile_max_rows(int64_t rows);
// quant_linear's int4 few-row kernel serves up to this many rows, in panels of kSkinnyMaxRows past them
// (then the tiles): measured at start-up (quant/routing.py); kSkinnyMaxRows (no panels) until set.
int64_t quant_panel_max_rows();
void set_quant_panel_max_rows(int64_t rows);
// The first row count quant_linear's vnni route serves by the tiles for a layer of these bits and groups.
int64_t quant_tile_min_rows(int64_t bits, int64_t groups, int64_t group_size);
// How qtile.h's tiles (quant_linear, kquant_linear) are dotted with x: 0 vpdpbusd (int8 x), 1 AMX-INT8 (int8
// x, the same outputs bit for bit), 2 AMX-BF16 (the tile decoded to bf16, x as it is). AMX only where the
// build has it and Linux granted the process its tile state (quant_tile_dots lists those usable); chosen
// at start-up (quant/routing.py).
std::vector<std::string> quant_tile_dots();
int64_t quant_tile_dot();
void set_quant_tile_dot(int64_t dot);
// Rows of x from which the tiles take quant_tile_dot (vpdpbusd below): AMX-BF16's decode costs the same
// per call at any row count, and pays for itself only from some count on.
int64_t quant_tile_dot_from();
void set_quant_tile_dot_from(int64_t rows);
// kquant.cpp
at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t route,
                         const c10::optional<at::Tensor>& bias);
std::vector<std::string> kquant_routes();
// decode_stack.cpp
void bind_decode_stack(pybind11::module_& m);
// gemma_stack.cpp
void bind_gemma_stack(pybind11::module_& m);
