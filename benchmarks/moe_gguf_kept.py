"""A MoE GGUF with its expert stacks kept quantized (models/gguf_kept.py -> QuantExperts) against the same file
dequantized to bfloat16 at load: weight memory and single-stream decode.

The file is synthetic, written to a temporary folder: a Qwen3-MoE-shaped model (default: 2 layers, hidden 2048,
32 experts of width 768, top 8; Qwen3-30B-A3B has 128 such experts in each of 48 layers) with Q4_K_M's types for
the experts (gate/up Q4_K, down Q6_K, random blocks with tame scales), Q8_0 attention and token table. Random
weights: the tokens are meaningless; the work per step is the real one.

Prints the file's tensor bytes, each load's weight bytes, and the median milliseconds per decoded token over
`--repeats` greedy generations of `--tokens` tokens (after one warm-up).

    python benchmarks/moe_gguf_kept.py [--layers 2 --hidden 2048 --inter 768 --experts 32 --top-k 8]
                                       [--tokens 32] [--repeats 5] [--threads N]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tokenloom import LLM, SamplingParams
from tokenloom.quant.weight_only import weight_bytes

Q = GGMLQuantizationType
VOCAB = 256


def blocks(qtype: Q, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, row bytes) random blocks whose float16 scales keep the weights around 0.01-0.1."""
    qk, size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(rows * k // qk, size), dtype=np.uint8)
    if qtype == Q.Q8_0:
        b[:, :2] = np.array([0.0005], np.float16).view(np.uint8)
    elif qtype == Q.Q4_K:  # d, dmin first
        b[:, :4] = np.array([0.002, 0.001], np.float16).view(np.uint8)
    elif qtype == Q.Q6_K:  # d last
        b[:, 208:] = np.array([0.0005], np.float16).view(np.uint8)
    return b.reshape(rows, -1)


def write(path: Path, layers: int, h: int, inter: int, experts: int, k: int) -> Path:
    rng = np.random.default_rng(0)
    heads, kv_heads, d = h // 128, max(1, h // 512), 128
    w = gguf.GGUFWriter(path, "qwen3moe")
    hp = {"block_count": layers, "context_length": 4096, "embedding_length": h, "feed_forward_length": inter,
          "expert_feed_forward_length": inter, "attention.head_count": heads, "attention.head_count_kv": kv_heads,
          "attention.key_length": d, "attention.value_length": d, "attention.layer_norm_rms_epsilon": 1e-6,
          "rope.freq_base": 1e6, "expert_count": experts, "expert_used_count": k}
    for key, v in hp.items():
        (w.add_float32 if isinstance(v, float) else w.add_uint32)(f"qwen3moe.{key}", v)
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen2")
    w.add_array("tokenizer.ggml.tokens", [bytes_to_unicode()[b] for b in range(VOCAB)])
    w.add_array("tokenizer.ggml.token_type", [int(gguf.TokenType.NORMAL)] * VOCAB)
    w.add_uint32("tokenizer.ggml.eos_token_id", 1)
    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", blocks(Q.Q8_0, VOCAB, h, rng), raw_dtype=Q.Q8_0)
    w.add_tensor("output_norm.weight", ones(h))
    for i in range(layers):
        for name, rows, cols in (("attn_q", heads * d, h), ("attn_k", kv_heads * d, h), ("attn_v", kv_heads * d, h),
                                 ("attn_output", h, heads * d)):
            w.add_tensor(f"blk.{i}.{name}.weight", blocks(Q.Q8_0, rows, cols, rng), raw_dtype=Q.Q8_0)
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", ones(h))
        for name in ("attn_q_norm", "attn_k_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", ones(d))
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", rng.normal(0, 0.5, (experts, h)).astype(np.float32))
        for name, qtype, rows, cols in (("gate", Q.Q4_K, inter, h), ("up", Q.Q4_K, inter, h),
                                        ("down", Q.Q6_K, h, inter)):
            stack = blocks(qtype, experts * rows, cols, rng).reshape(experts, rows, -1)
            w.add_tensor(f"blk.{i}.ffn_{name}_exps.weight", stack, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def ms_per_token(llm: LLM, tokens: int, repeats: int) -> float:
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(["the quick brown fox"], sp)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = llm.generate(["the quick brown fox"], sp)
        times.append((time.perf_counter() - start) * 1000 / len(out[0].outputs[0].token_ids))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        path = write(Path(tmp) / "moe.gguf", args.layers, args.hidden, args.inter, args.experts, args.top_k)
        f = gguf.GGUFReader(path)
        file_bytes = sum(int(t.n_bytes) for t in f.tensors)
        print(f"file tensors: {file_bytes / 2**20:.1f} MiB")
        for mode in ("keep", "dequantize"):
            llm = LLM(str(path), dtype="bfloat16", gguf_weights=mode, kv_cache_memory="64MiB", max_model_len=512)
            wb = weight_bytes(llm.engine.loaded.model)
            ms = ms_per_token(llm, args.tokens, args.repeats)
            print(f"{mode:>10}: weights {wb / 2**20:.1f} MiB ({wb / file_bytes:.2f}x file), "
                  f"decode {ms:.2f} ms/token (median of {args.repeats})")
            del llm


if __name__ == "__main__":
    main()
