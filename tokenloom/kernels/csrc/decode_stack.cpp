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
//
// A step of a few rows through dense bfloat16 layers and a bfloat16 cache (a bf16 model's decode at low load)
// runs on threads the stack holds for the whole step (forward_threaded): ~8 kernels a layer each forked
// and joined its own threads, and the small ones ran on one thread while the other waited, ~1.4 ms of a
// one-row step of SmolLM2-135M against ~4 ms for its matmuls (docs/performance-notes.md#decode-stack).
// There each thread computes its share of a matmul's output rows and of the attention's pieces, and the
// small row kernels (norm, SiLU) whole, for itself, rather than wait for another thread to do them; the
// threads meet at a barrier only where a result is read by every thread. The kernels' row functions are the
// ones the per-kernel path calls (rows.h, skinny_rows, DecodeAttention), so the values are the same.
#include <torch/extension.h>  // pybind11 classes (the stack objects Python holds)
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

#include "rows.h"
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
    if (threaded_ && threaded(x.size(0))) return forward_threaded(x, cos, sin, slots, block_tables, seq_lens);
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

  // Whether a step of B rows runs on the stack's own threads (forward_threaded): every linear dense bfloat16
  // and served by skinny_linear at B rows, a bfloat16 cache, a head size with a bfloat16 attention kernel.
  bool threaded(int64_t B) const {
    if (layers_.empty() || B < 1 || B > kSkinnyMaxRows || !DecodeAttention::supports(head_dim_)) return false;
    for (const FusedLayer& L : layers_) {
      if (L.k_scale.has_value() || L.k_cache.scalar_type() != at::kBFloat16) return false;
      for (const FusedLinear* f : {&L.qkv, &L.o, &L.gate_up, &L.down})
        if (!f->skinny(B)) return false;
    }
    return true;
  }

  // Off: every step through the per-kernel path (the threaded step's oracle in tests).
  void set_threaded(bool on) { threaded_ = on; }

 private:
  // forward for a step that threaded(B) accepts, on one team of threads for the whole step (see the top).
  at::Tensor forward_threaded(const at::Tensor& x0, const at::Tensor& cos_t, const at::Tensor& sin_t,
                              const at::Tensor& slots_t, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens) const {
    using bf16 = c10::BFloat16;
    const int64_t B = x0.size(0), H = x0.size(1), D = head_dim_, Hq = num_heads_, Hkv = num_kv_heads_;
    const int64_t q_size = Hq * D, kv_size = Hkv * D, n_qkv = q_size + 2 * kv_size;
    const int64_t I = layers_[0].gate_up.weight.size(0) / 2;
    TORCH_CHECK(cos_t.is_contiguous() && sin_t.is_contiguous() && cos_t.size(0) == B && cos_t.size(1) == D &&
                    cos_t.scalar_type() == at::kBFloat16 && sin_t.sizes() == cos_t.sizes(),
                "DecodeStack.forward: cos/sin must be contiguous (B, head_dim) bfloat16");
    TORCH_CHECK(slots_t.scalar_type() == at::kLong && slots_t.numel() == B, "DecodeStack.forward: (B,) int64 slots");
    for (const FusedLayer& L : layers_) {
      for (const FusedLinear* f : {&L.qkv, &L.o, &L.gate_up, &L.down})
        TORCH_CHECK(!f->bias.has_value() || (f->bias->scalar_type() == at::kBFloat16 && f->bias->is_contiguous() &&
                                             f->bias->numel() == f->weight.size(0)),
                    "DecodeStack.forward: a bias must be a contiguous (N,) bfloat16 vector");
      TORCH_CHECK(L.qkv.weight.size(0) == n_qkv && L.qkv.weight.size(1) == H && L.o.weight.size(0) == H &&
                      L.o.weight.size(1) == q_size &&
                      L.gate_up.weight.size(0) == 2 * I && L.gate_up.weight.size(1) == H &&
                      L.down.weight.size(0) == H && L.down.weight.size(1) == I && L.k_cache.is_contiguous() &&
                      L.v_cache.is_contiguous() && L.input_norm.scalar_type() == at::kBFloat16 &&
                      L.post_norm.scalar_type() == at::kBFloat16 && L.input_norm.is_contiguous() &&
                      L.post_norm.is_contiguous(),
                  "DecodeStack.forward: a layer's shapes differ from the first's");
    }
    const at::Tensor xc = x0.contiguous(), slots_c = slots_t.contiguous();
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    DecodeAttention attn(block_tables, seq_lens, Hq, Hkv, D, layers_[0].k_cache.size(1), sliding_window_);
    const auto opts = xc.options();
    // Shared: the residual stream (two buffers, read and written in turn), the matmuls' outputs, the
    // attention's; per thread: its own copy of each normed input and of the SiLU product.
    at::Tensor res = at::empty({2, B, H}, opts), xs = at::empty({B, H}, opts), qkv = at::empty({B, n_qkv}, opts);
    at::Tensor a = at::empty({B, q_size}, opts), o = at::empty({B, H}, opts), gu = at::empty({B, 2 * I}, opts);
    at::Tensor hs = at::empty({threads, B, H}, opts), acts = at::empty({threads, B, I}, opts);
    const bf16 *cos = cos_t.data_ptr<bf16>(), *sin = sin_t.data_ptr<bf16>();
    const int64_t* slots = slots_c.data_ptr<int64_t>();
    bf16 *rp = res.data_ptr<bf16>(), *xp = xs.data_ptr<bf16>(), *qkvp = qkv.data_ptr<bf16>(), *ap = a.data_ptr<bf16>();
    bf16 *op = o.data_ptr<bf16>(), *gup = gu.data_ptr<bf16>(), *hsp = hs.data_ptr<bf16>(), *actp = acts.data_ptr<bf16>();
    std::memcpy(xp, xc.data_ptr<bf16>(), B * H * sizeof(bf16));
    const float eps = static_cast<float>(eps_);
    const bf16* const no_bias = nullptr;
    auto bias = [&](const FusedLinear& f) { return f.bias.has_value() ? f.bias->data_ptr<bf16>() : no_bias; };
    int cur = 0;  // res[cur]: the residual stream as the next norm reads it

#pragma omp parallel num_threads(threads)
    {
      const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
      std::vector<float> scratch(std::max<int64_t>({H, I, 3 * D}));  // a norm's H, SiLU's I, RoPE's 3 D
      bf16* h = hsp + t * B * H;
      bf16* act = actp + t * B * I;
      // Output rows [n0, n1) of an N-row matmul for this thread: equal shares in whole cache lines of y.
      auto share = [&](int64_t N) {
        const int64_t lines = (N + 31) / 32;
        return std::make_pair(std::min(N, lines * t / T * 32), std::min(N, lines * (t + 1) / T * 32));
      };
      auto matmul = [&](const FusedLinear& f, const bf16* in, bf16* out) {
        const int64_t N = f.weight.size(0), K = f.weight.size(1);
        const auto [n0, n1] = share(N);
        if (n0 < n1) skinny_rows(in, f.weight.data_ptr<bf16>(), bias(f), out, B, N, K, n0, n1);
      };
      // h = norm(x + res[c]) for every row (this thread's copy); thread 0 writes the sum to res[1 - c].
      // The first layer's norm has no residual: the stream starts as x.
      auto norm = [&](const bf16* x, const bf16* w, int c, bool first) {
        for (int64_t b = 0; b < B; ++b) {
          bf16* nr = t == 0 ? rp + ((1 - c) * B + b) * H : nullptr;
          add_rms_norm_row<bf16>(x + b * H, first ? nullptr : rp + (c * B + b) * H, w, h + b * H, nr, H, eps,
                                 scratch.data());
          if (first && nr != nullptr) std::memcpy(nr, x + b * H, H * sizeof(bf16));
        }
      };
      int c = cur;
      bool first = true;
      for (const FusedLayer& L : layers_) {
        norm(xp, L.input_norm.data_ptr<bf16>(), c, first);
        c = 1 - c;
        first = false;
        matmul(L.qkv, h, qkvp);
#pragma omp barrier
        if (t == 0) {  // RoPE on q and k, k and v into the cache: a few hundred values
          bf16* kc = L.k_cache.data_ptr<bf16>();
          bf16* vc = L.v_cache.data_ptr<bf16>();
          for (int64_t b = 0; b < B; ++b) {
            bf16* row = qkvp + b * n_qkv;
            float* f = scratch.data();
            rope_token<bf16>(row, cos + b * D, sin + b * D, Hq, D, f, f + D, f + 2 * D, f + 2 * D + D / 2);
            rope_token<bf16>(row + q_size, cos + b * D, sin + b * D, Hkv, D, f, f + D, f + 2 * D, f + 2 * D + D / 2);
            std::memcpy(kc + slots[b] * kv_size, row + q_size, kv_size * sizeof(bf16));
            std::memcpy(vc + slots[b] * kv_size, row + q_size + kv_size, kv_size * sizeof(bf16));
          }
        }
#pragma omp barrier
        for (int64_t r = t; r < attn.runs(); r += T)
          attn.run(r, qkvp, n_qkv, L.k_cache.data_ptr<bf16>(), L.v_cache.data_ptr<bf16>(), ap, scale_, 0.0);
#pragma omp barrier
        if (t == 0) attn.combine(ap);
#pragma omp barrier
        matmul(L.o, ap, op);
#pragma omp barrier
        norm(op, L.post_norm.data_ptr<bf16>(), c, false);
        c = 1 - c;
        matmul(L.gate_up, h, gup);
#pragma omp barrier
        for (int64_t b = 0; b < B; ++b)
          gated_and_mul_row<bf16>(gup + b * 2 * I, act + b * I, I, [](float g) { return silu(g); }, scratch.data());
        matmul(L.down, act, xp);
#pragma omp barrier
      }
      if (t == 0) cur = c;
    }
    return std::get<0>(add_rms_norm(xs, res[cur], final_norm_, eps_));
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  int64_t sliding_window_;  // 0: none
  at::Tensor final_norm_;
  std::vector<FusedLayer> layers_;
  bool threaded_ = true;
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
      .def("threaded", &DecodeStack::threaded, "whether a step of this many rows runs on the stack's own threads")
      .def("set_threaded", &DecodeStack::set_threaded, "off: every step through the per-kernel path")
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>());
}
