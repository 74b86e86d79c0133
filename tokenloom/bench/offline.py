"""`tokenloom bench offline`: the engine against transformers on the same model, dtype and machine.

(a) single-stream decode tokens/s and the fraction of memory bandwidth it achieves,
(b) output throughput for 64 prompts of 128 tokens generating 128 tokens each
    (transformers: padded static batches of --hf-batch-size),
(c) prefill tokens/s for one 2,000-token prompt.
Each figure is the median of --repeats runs, measured in one process, one system after the other.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tokenloom.engine_args import add_engine_args, engine_config

if TYPE_CHECKING:  # the engine is imported when a benchmark runs, not when the CLI builds its parser
    from tokenloom.llm import LLM


def add_offline_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    # Same weights and dtype on both sides: a GGUF's quantized tensors are expanded to --dtype as
    # transformers does (`--gguf-weights keep` measures tokenloom's quantized kernels instead).
    p.set_defaults(gguf_weights="dequantize")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is reported")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--batch-prompts", type=int, default=64)
    p.add_argument("--batch-input-len", type=int, default=128)
    p.add_argument("--batch-output-len", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=2000)
    p.add_argument("--hf-batch-size", type=int, default=64, help="static batch size for transformers in (b)")
    p.add_argument("--skip-hf", action="store_true", help="measure tokenloom only")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")


def median_of(repeats: int, fn: Callable[[], float]) -> float:
    return statistics.median(fn() for _ in range(repeats))


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; the CPU needs nothing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Read+write bytes per second of a large tensor copy on `device` (the achievable memory bandwidth)."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        b.copy_(a)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / min(times) / 1e9


def exact_prompts(tokenizer: Any, n: int, length: int, vocab: int) -> list[list[int]]:
    """n distinct prompts of exactly `length` tokens, cut from real-looking text."""
    text = (
        "The history of computing is a story of people who wanted answers faster than they could work them out. "
        "Engines of brass gave way to valves, valves to transistors, and transistors to chips of silicon. "
    )
    base = tokenizer.encode(text * (length // 20 + 2), add_special_tokens=False)
    return [[(t + i) % vocab for t in base[:length]] if i else base[:length] for i in range(n)]


def decode_rate(llm: LLM, prompt: list[int], n: int) -> float:
    """Single-stream decode tok/s: (tokens - 1) / time from the first token to the last (greedy, n tokens)."""
    from tokenloom.sampling_params import SamplingParams

    llm.reset_prefix_cache()  # every run computes its prompt: repeats must not hit the cache
    first = None
    count = 0
    for d in llm.stream(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)):
        count += len(d.token_ids)
        if first is None:
            first = time.perf_counter()
    if first is None or count < 2:
        raise RuntimeError("decode benchmark produced fewer than two tokens")
    return (count - 1) / (time.perf_counter() - first)


def output_throughput(llm: LLM, prompts: list[list[int]], n: int) -> float:
    """Output tok/s of generating n tokens (greedy, ignore_eos) for every prompt at once."""
    from tokenloom.sampling_params import SamplingParams

    llm.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    el = time.perf_counter() - t
    return sum(len(o.outputs[0].token_ids) for o in outs) / el


class TokenloomRunner:
    def __init__(self, args: argparse.Namespace) -> None:
        from tokenloom.engine.engine import freeze_gc
        from tokenloom.llm import LLM
        from tokenloom.quant.weight_only import weight_bytes

        self.llm = LLM(**engine_config(args).__dict__)
        freeze_gc()  # as `tokenloom serve` does
        eng = self.llm.engine
        self.weight_bytes = weight_bytes(eng.loaded.model)
        self.vocab = eng.model_config.vocab_size

    def decode(self, prompt: list[int], n: int) -> float:
        return decode_rate(self.llm, prompt, n)

    def throughput(self, prompts: list[list[int]], n: int) -> float:
        return output_throughput(self.llm, prompts, n)

    def prefill(self, prompt: list[int]) -> float:
        from tokenloom.sampling_params import SamplingParams

        self.llm.reset_prefix_cache()
        t = time.perf_counter()
        self.llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
        return len(prompt) / (time.perf_counter() - t)


class HFRunner:
    def __init__(self, path: Path, dtype: torch.dtype, device: torch.device) -> None:
        import transformers

        if path.is_file():
            self.model = _hf_from_gguf(path, dtype)
        else:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        self.device = device
        self.model.to(device).eval()

    @torch.inference_mode()
    def _gen(self, ids: torch.Tensor, n: int, mask: torch.Tensor | None = None) -> float:
        sync(self.device)
        t = time.perf_counter()
        self.model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            pad_token_id=0)
        sync(self.device)
        return time.perf_counter() - t

    def decode(self, prompt: list[int], n: int) -> float:
        ids = torch.tensor([prompt], device=self.device)
        return (n - 1) / (self._gen(ids, n) - self._gen(ids, 1))

    def throughput(self, prompts: list[list[int]], n: int, batch: int) -> float:
        total = 0.0
        for i in range(0, len(prompts), batch):
            chunk = torch.tensor(prompts[i : i + batch], device=self.device)  # equal lengths: no padding
            total += self._gen(chunk, n, torch.ones_like(chunk))
        return len(prompts) * n / total

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> float:
        ids = torch.tensor([prompt], device=self.device)
        sync(self.device)
        t = time.perf_counter()
        self.model(ids)
        sync(self.device)
        return len(prompt) / (time.perf_counter() - t)


def _hf_from_gguf(path: Path, dtype: torch.dtype) -> Any:
    """transformers' Llama with the very weights tokenloom runs: dense, in `dtype`.

    (transformers 5 loading a GGUF itself keeps the Q4_1 blocks packed and computes in float32, which
    is a different workload from the dense bfloat16 model both should run here.)
    """
    import transformers

    from tokenloom.models.gguf import load_gguf

    cfg, state, _ = load_gguf(path, dtype)
    if cfg.architecture != "LlamaForCausalLM":
        raise ValueError(f"the transformers baseline for GGUF files covers Llama only, not {cfg.architecture}")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings,
    )
    model = transformers.LlamaForCausalLM(hf_cfg).to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise ValueError(f"weights do not fit transformers' Llama: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


def run_offline_bench(args: argparse.Namespace) -> int:
    from tokenloom.engine.builder import resolve_device

    device = resolve_device(args.device)
    bw = copy_bandwidth_gbs(device)
    res: dict[str, dict[str, float]] = {"tokenloom": {}, "transformers": {}}
    # One system at a time: the engine (and its KV cache) is freed before transformers loads.
    path, dtype, prompts = _measure_tokenloom(args, device, bw, res["tokenloom"])
    if not args.skip_hf:
        _measure_transformers(args, device, path, dtype, prompts, res["transformers"])
    _print_table(res, args)
    if args.out:
        machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else platform.processor() or platform.machine())
        meta = {"machine": machine, "device": str(device), "threads": torch.get_num_threads(),
                "copy_bandwidth_gbs": bw, "date": time.strftime("%Y-%m-%d"), "repeats": args.repeats}
        args.out.write_text(json.dumps({"meta": meta, "results": res}, indent=2))
    return 0


def _measure_tokenloom(
    args: argparse.Namespace, device: torch.device, bw: float, t: dict[str, float]
) -> tuple[Path, torch.dtype, tuple[list[int], list[list[int]], list[int]]]:
    r = args.repeats
    tl = TokenloomRunner(args)
    eng = tl.llm.engine
    tok = tl.llm.tokenizer
    short = exact_prompts(tok, 1, 16, tl.vocab)[0]
    batch = exact_prompts(tok, args.batch_prompts, args.batch_input_len, tl.vocab)
    long_prompt = exact_prompts(tok, 1, args.prefill_len, tl.vocab)[0]
    print(f"model {eng.model_name} ({eng.loaded.dtype}), weights {tl.weight_bytes / 1e6:.0f} MB, "
          f"threads {torch.get_num_threads()}, copy bandwidth {bw:.1f} GB/s, attention {eng.backend.name}")
    print(eng.capacity.describe())
    tl.decode(short, 16)  # warm-up
    t["decode_tok_s"] = median_of(r, lambda: tl.decode(short, args.decode_tokens))
    t["batch_out_tok_s"] = median_of(r, lambda: tl.throughput(batch, args.batch_output_len))
    t["prefill_tok_s"] = median_of(r, lambda: tl.prefill(long_prompt))
    t["decode_bandwidth_fraction"] = tl.weight_bytes * t["decode_tok_s"] / (bw * 1e9)
    _print_roofline(args, t, tl, device, bw, len(short))
    return eng.loaded.path, eng.loaded.dtype, (short, batch, long_prompt)


def _print_roofline(args: argparse.Namespace, t: dict[str, float], tl: TokenloomRunner, device: torch.device,
                    bw: float, short_len: int) -> None:
    """A roofline line per phase (bench/roofline.py): the measured rates against this machine's ceilings."""
    from tokenloom.bench.roofline import ModelCosts, Phase, measure_peaks

    eng = tl.llm.engine
    peaks = measure_peaks(bw, device)
    kv_token = sum(2 * c.k[0, 0].numel() * c.k.element_size() for c in eng.runner.kv_caches)
    costs = ModelCosts.of(eng.loaded.model, tl.weight_bytes, kv_token)
    quantized = any(hasattr(m, "codes") for m in eng.loaded.model.modules())
    rows = min(args.batch_prompts, eng.config.max_num_seqs)
    phases = [
        Phase("(a) decode, 1 row", t["decode_tok_s"], 1, 1, short_len + args.decode_tokens / 2),
        # (b)'s rate includes its prompts' prefill: the line slightly understates the decode steps.
        Phase(f"(b) decode, {rows} rows", t["batch_out_tok_s"], rows, 1, args.batch_input_len + args.batch_output_len / 2),
        Phase(f"(c) prefill, {args.prefill_len} tokens", t["prefill_tok_s"], 1, args.prefill_len, args.prefill_len / 2),
    ]
    print(peaks.describe())
    for ph in phases:
        print(ph.line(costs, peaks, quantized))


def _measure_transformers(
    args: argparse.Namespace, device: torch.device, path: Path, dtype: torch.dtype,
    prompts: tuple[list[int], list[list[int]], list[int]], h: dict[str, float],
) -> None:
    r = args.repeats
    short, batch, long_prompt = prompts
    hf = HFRunner(path, dtype, device)
    hf.decode(short, 8)  # warm-up
    h["decode_tok_s"] = median_of(r, lambda: hf.decode(short, args.decode_tokens))
    h["batch_out_tok_s"] = median_of(r, lambda: hf.throughput(batch, args.batch_output_len, args.hf_batch_size))
    h["prefill_tok_s"] = median_of(r, lambda: hf.prefill(long_prompt))


def _print_table(res: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    t, h = res["tokenloom"], res["transformers"]
    rows = [
        ("(a) single-stream decode, tok/s", "decode_tok_s"),
        (f"(b) {args.batch_prompts}x{args.batch_input_len}->{args.batch_output_len} output tok/s", "batch_out_tok_s"),
        (f"(c) prefill {args.prefill_len} tokens, tok/s", "prefill_tok_s"),
    ]
    print(f"\n| figure (median of {args.repeats}) | tokenloom | transformers | ratio |")
    print("|---|---:|---:|---:|")
    for label, key in rows:
        hv = h.get(key)
        ratio = f"{t[key] / hv:.2f}x" if hv else "-"
        print(f"| {label} | {t[key]:.1f} | {hv:.1f} | {ratio} |" if hv else f"| {label} | {t[key]:.1f} | - | - |")
    print(f"\n(a) reads {t['decode_bandwidth_fraction'] * 100:.0f}% of the measured copy bandwidth "
          f"(weight bytes per step / step time, against the copy's bytes read + written per second)")
    print(f"(b) / (a) = {t['batch_out_tok_s'] / t['decode_tok_s']:.1f}x the single-stream rate")
    # vLLM's throughput benchmark also reports total tokens/s: prompt tokens processed plus tokens
    # generated, over the same elapsed time.
    total = t["batch_out_tok_s"] * (args.batch_input_len + args.batch_output_len) / args.batch_output_len
    print(f"(b) counting prompt tokens too (total tok/s, as vLLM's throughput benchmark also reports): "
          f"{total:.1f} = {total / t['decode_tok_s']:.1f}x the single-stream rate")
