"""Gemma 3 270M Q4_K_M (or any GGUF) in tokenloom against llama.cpp on the same file, in one sitting.

What issue 20's benchmark bars need, each measured the same way for both engines:
  (a) weight memory: tokenloom's resident weight tensors (counted in-process, prepacked copies included)
      and llama-server's model buffers (from its log) against the GGUF file's size; both servers' RSS
      (weights + KV cache + runtime) as context;
  (b) single-stream decode and (c) 16-user output throughput: the same client, `tokenloom bench serve`
      (/v1/completions, prompts of exactly --input-len tokens by the file's own tokenizer, --output-len
      tokens with ignore_eos, streaming), against `tokenloom serve --model F` and
      `llama-server -m F -np USERS -c USERS*SLOT --no-kv-unified`; the servers take turns round by round
      (--rounds, medians reported, since runs of one point differ by tens of percent on shared VMs);
  (d) perplexity on one text file (the Gutenberg Shakespeare texts tokenloom's eval uses), three ways:
      `tokenloom eval perplexity` (its own method: windows of CTX tokens every CTX/2, every token scored
      once), kept-quantized and dequantized to bfloat16; `llama-perplexity -c CTX` (its method:
      non-overlapping chunks of CTX tokens, BOS at each chunk's start where the vocabulary adds one,
      only each chunk's second half scored); and llama-perplexity's method replayed through tokenloom's
      engine in-process, which is the figure to compare with llama.cpp's directly.
Plus `llama-bench` (pp/tg of llama.cpp without HTTP) as a reference for llama.cpp's raw speed.

    python benchmarks/gemma3_vs_llamacpp.py [--model F.gguf] [--rounds 3]
    python benchmarks/gemma3_vs_llamacpp.py --engines llamacpp --parts serve,perplexity   # one side only
Needs llama.cpp's tools: benchmarks/peers/install_llamacpp.sh. Writes OUT/results.json (every raw
figure), OUT/table.md (the table printed at the end), the servers' logs and the bench folders.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenloom.errors import ConfigError
from tokenloom.netutil import free_port, stop_process_group, wait_until_healthy

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("tokenloom", "llamacpp")
PARTS = ("memory", "serve", "perplexity", "llama-bench")
SERVED_NAME = "bench-model"  # both servers answer to it (--served-model-name / --alias)


@dataclass(frozen=True)
class Settings:
    model: Path
    out: Path
    engines: tuple[str, ...]
    parts: tuple[str, ...]
    rounds: int
    users: int
    input_len: int
    output_len: int
    single_prompts: int
    multi_prompts: int
    warmup: int
    slot_ctx: int
    threads: int
    kv_cache_memory: str
    ppl_ctx: int
    ppl_chunks: int
    ppl_pass: int | None
    llama_bin: Path
    startup_timeout: float


# ---------------------------------------------------------------------------------------------- model file

def find_default_gguf() -> Path:
    """The Gemma 3 270M Q4_K_M file `make setup` assembles into the venv's data folder (issue 20)."""
    try:
        from tokenloom.models.default import gemma3_270m_path
    except ImportError:  # a tree without the helper: look where `make setup` puts the file
        hits = sorted((Path(sysconfig.get_paths()["data"]) / "share").rglob("gemma-3-270m*q4_k_m*.gguf"))
        if not hits:
            raise ConfigError("no gemma-3-270m Q4_K_M GGUF in the venv's share/ (pass --model PATH)") from None
        return hits[0]
    return gemma3_270m_path()


# ---------------------------------------------------------------------------------------------- processes

def run(cmd: list[str], log: Path, timeout: float | None = None) -> str:
    """Run to completion with stdout+stderr to `log`; returns the output; raises on a non-zero exit."""
    print(f"$ {shlex.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    log.write_text(proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"exit status {proc.returncode}: {shlex.join(cmd)}; see {log}\n{proc.stdout[-2000:]}")
    return proc.stdout


class Server:
    """A server process in its own session (so a stop reaches its children), output to a log file."""

    def __init__(self, cmd: list[str], log: Path, port: int, timeout: float) -> None:
        self.cmd, self.log, self.port = cmd, log, port
        print(f"$ {shlex.join(cmd)}", flush=True)
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        t = time.monotonic()
        try:
            # llama-server answers /health 503 while it loads; tokenloom not before its warm-up ends.
            wait_until_healthy(self.url, timeout, path="/health", alive=lambda: self.proc.poll() is None)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"server did not come up; see {log}:\n{log.read_text()[-2000:]}") from None
        self.startup_s = time.monotonic() - t

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def memory(self) -> dict[str, int]:
        """VmRSS and VmHWM (peak) in bytes, summed over the server's process group."""
        total = {"rss_bytes": 0, "peak_rss_bytes": 0}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) != self.proc.pid:  # field 5 of /proc/PID/stat: the process group
                    continue
                status = (stat.parent / "status").read_text()
            except (OSError, IndexError, ValueError):
                continue  # the process ended meanwhile
            for key, name in (("VmRSS", "rss_bytes"), ("VmHWM", "peak_rss_bytes")):
                m = re.search(rf"^{key}:\s+(\d+) kB", status, re.M)
                total[name] += int(m.group(1)) * 1024 if m else 0
        return total

    def stop(self) -> None:
        stop_process_group(self.proc)


def server_command(engine: str, s: Settings, port: int) -> list[str]:
    if engine == "tokenloom":
        return [sys.executable, "-m", "tokenloom.cli", "serve", "--model", str(s.model), "--host", "127.0.0.1",
                "--port", str(port), "--served-model-name", SERVED_NAME, "--max-model-len", str(s.slot_ctx),
                "--kv-cache-memory", s.kv_cache_memory, "--num-threads", str(s.threads)]
    # One slot per user, each with its own KV (--no-kv-unified), as llama.cpp's users run concurrency.
    return [str(s.llama_bin / "llama-server"), "-m", str(s.model), "--alias", SERVED_NAME, "--host", "127.0.0.1",
            "--port", str(port), "-t", str(s.threads), "-tb", str(s.threads), "-np", str(s.users),
            "-c", str(s.users * s.slot_ctx), "--no-kv-unified"]


def llama_buffers(log_text: str) -> dict[str, float]:
    """llama.cpp's 'CPU_Mapped model buffer size = 241.41 MiB'-style lines, in bytes by buffer name."""
    out: dict[str, float] = {}
    for m in re.finditer(r"(\S+)\s+(model|KV|compute) buffer size\s*=\s*([\d.]+) MiB", log_text):
        key = f"{m.group(2)}:{m.group(1)}"
        out[key] = out.get(key, 0.0) + float(m.group(3)) * 2**20
    return out


# ---------------------------------------------------------------------------------------------- (b), (c)

def bench(s: Settings, server: Server, concurrency: int, prompts: int, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "tokenloom.cli", "bench", "serve", "--base-url", server.url, "--model", SERVED_NAME,
           "--tokenizer", str(s.model), "--backend", "openai", "--dataset", "fixed", "--input-len", str(s.input_len),
           "--output-len", str(s.output_len), "--concurrency", str(concurrency), "--num-prompts", str(prompts),
           "--warmup", str(s.warmup), "--out", str(out)]
    out.mkdir(parents=True, exist_ok=True)
    run(cmd, out / "bench.log")
    point = json.loads((out / "summary.json").read_text())["points"][0]
    done = point["completed"]
    point["mean_output_tokens"] = point["total_output_tokens"] / done if done else 0.0
    point["decode_tok_s"] = 1.0 / point["tpot_s_median"] if point.get("tpot_s_median") else None
    point["command"] = shlex.join(cmd)
    return point


def serve_round(s: Settings, engine: str, rnd: int) -> dict[str, Any]:
    folder = s.out / f"round{rnd}" / engine
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = Server(server_command(engine, s, port), folder / "server.log", port, s.startup_timeout)
    try:
        rec: dict[str, Any] = {"server": shlex.join(server.cmd), "startup_s": server.startup_s,
                               "memory_after_start": server.memory()}
        rec["single"] = bench(s, server, 1, s.single_prompts, folder / "c1")
        rec["multi"] = bench(s, server, s.users, s.multi_prompts, folder / f"c{s.users}")
        rec["memory_after_bench"] = server.memory()
    finally:
        server.stop()
    for key in ("single", "multi"):
        p = rec[key]
        print(f"round {rnd} {engine} c={p['concurrency']}: {p['output_throughput']:.1f} out tok/s, decode "
              f"{p['decode_tok_s'] or 0:.1f} tok/s (1/TPOT p50), {p['mean_output_tokens']:.1f} tokens/request, "
              f"{p['failed']} failed", flush=True)
    return rec


# ---------------------------------------------------------------------------------- (a), (d): in-process probe

def probe(model: Path, gguf_weights: str, dtype: str, text: Path, ctx: int, chunks: int,
          threads: int) -> dict[str, Any]:
    """Load F in tokenloom as `tokenloom serve` would; count its weight bytes; score the text with
    llama-perplexity's method. Runs in a child process (see --probe) so each load starts clean."""
    import torch

    from tokenloom.bench.perplexity import perplexity
    from tokenloom.llm import LLM
    from tokenloom.quant.weight_only import weight_bytes

    t = time.perf_counter()
    llm = LLM(model=str(model), gguf_weights=gguf_weights, dtype=dtype, kv_cache_memory="256MB",
              max_model_len=max(ctx, 256), num_threads=threads)
    eng = llm.engine
    load_s = time.perf_counter() - t
    # Every tensor the model holds: parameters, persistent buffers (the non-persistent ones are caches such
    # as RoPE's cos/sin tables, not weights) and tensors kept as plain attributes (the oneDNN-prepacked
    # copies, opaque mkldnn tensors).
    seen: set[int] = set()
    by_kind = {"parameters_and_buffers": 0, "prepacked_copies": 0}
    for module in eng.loaded.model.modules():
        tensors = [(n, v, "parameters_and_buffers") for n, v in {**module._parameters, **module._buffers}.items()
                   if n not in module._non_persistent_buffers_set]
        tensors += [(n, v, "prepacked_copies") for n, v in vars(module).items() if isinstance(v, torch.Tensor)]
        for _, v, kind in tensors:
            if v is None:
                continue
            key = id(v) if v.is_mkldnn else v.untyped_storage().data_ptr()
            if key in seen:
                continue  # tied embeddings / LM head counted once
            seen.add(key)
            by_kind[kind] += v.numel() * v.element_size()

    # llama-perplexity's method (tools/perplexity): tokenize the whole text (BOS first where the vocabulary
    # adds one), cut it into chunks of ctx tokens, put BOS in each chunk's first position, and score only
    # the second half: logits at positions ctx/2 .. ctx-2 predicting tokens ctx/2+1 .. ctx-1. Through
    # tokenloom's own scorer (bench/perplexity.py, one window per call): the negative log-likelihood of
    # the chunk's tokens 1..ctx-1 minus that of tokens 1..ctx/2 (the same causal prefix) leaves the
    # second half's.
    tok = eng.tokenizer
    ids = tok.encode(text.read_text(encoding="utf-8"), add_special_tokens=True)
    bos = tok.bos_token_id if tok.add_bos_token else None
    half = ctx // 2
    nll, count = 0.0, 0
    n_chunks = min(chunks, len(ids) // ctx)
    t = time.perf_counter()
    for c in range(n_chunks):
        chunk = ids[c * ctx:(c + 1) * ctx]
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        ppl_all, n_all = perplexity(eng, chunk, ctx, ctx)  # scores tokens 1..ctx-1
        ppl_first, n_first = perplexity(eng, chunk[:half + 1], half + 1, half + 1)  # tokens 1..ctx/2
        nll += math.log(ppl_all) * n_all - math.log(ppl_first) * n_first
        count += n_all - n_first
    return {"load_s": load_s, "weight_bytes": sum(by_kind.values()), **by_kind,
            "state_dict_weight_bytes": weight_bytes(eng.loaded.model),
            "dtype": str(eng.loaded.dtype).removeprefix("torch."), "gguf_weights": gguf_weights,
            "llama_method_ppl": math.exp(nll / count) if count else None, "llama_method_tokens": count,
            "llama_method_chunks": n_chunks, "llama_method_s": time.perf_counter() - t}


def run_probe(s: Settings, gguf_weights: str, dtype: str, text: Path, name: str) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--probe", "--model", str(s.model), "--probe-weights",
           gguf_weights, "--probe-dtype", dtype, "--probe-text", str(text), "--ppl-ctx", str(s.ppl_ctx),
           "--ppl-chunks", str(s.ppl_chunks), "--threads", str(s.threads)]
    out = run(cmd, s.out / f"probe-{name}.log")
    return {**json.loads(out.strip().splitlines()[-1]), "command": shlex.join(cmd)}


# ---------------------------------------------------------------------------------------------- (d)

def write_text(s: Settings) -> Path:
    """The Shakespeare texts `tokenloom eval perplexity` scores by default, cut to about what is scored."""
    from tokenloom.bench.perplexity import default_text

    path = s.out / "text.txt"
    # ~3.5-4 characters a token in these texts; 8 per token leaves room for any tokenizer.
    path.write_text(default_text()[: (s.ppl_chunks + 1) * s.ppl_ctx * 8], encoding="utf-8")
    return path


def perplexities(s: Settings, text: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"ctx": s.ppl_ctx, "chunks": s.ppl_chunks, "text": str(text)}
    n_tokens = s.ppl_ctx * s.ppl_chunks  # the same span of text for both methods
    if "tokenloom" in s.engines:
        dequantized = ["--gguf-weights", "dequantize", "--dtype", "bfloat16"]
        for name, extra in (("kept", []), ("bf16_dequantized", dequantized)):
            cmd = [sys.executable, "-m", "tokenloom.cli", "eval", "perplexity", "--model", str(s.model),
                   "--text", str(text), "--max-tokens", str(n_tokens), "--window", str(s.ppl_ctx),
                   "--stride", str(s.ppl_ctx // 2), "--kv-cache-memory", "256MB", "--num-threads", str(s.threads),
                   *extra, *([] if s.ppl_pass is None else ["--chunk", str(s.ppl_pass)])]
            t = time.perf_counter()
            out = run(cmd, s.out / f"ppl-tokenloom-{name}.log")
            m = re.search(r"perplexity: ([\d.]+)", out)
            res[f"tokenloom_{name}"] = {"ppl": float(m.group(1)) if m else None, "s": time.perf_counter() - t,
                                        "command": shlex.join(cmd)}
            probe_res = run_probe(s, "keep" if name == "kept" else "dequantize",
                                  "auto" if name == "kept" else "bfloat16", text, name)
            res[f"tokenloom_{name}_llama_method"] = probe_res
    if "llamacpp" in s.engines:
        cmd = [str(s.llama_bin / "llama-perplexity"), "-m", str(s.model), "-f", str(text), "-c", str(s.ppl_ctx),
               "--chunks", str(s.ppl_chunks), "-t", str(s.threads), "-tb", str(s.threads)]
        t = time.perf_counter()
        out = run(cmd, s.out / "ppl-llamacpp.log")
        m = re.search(r"Final estimate: PPL = ([\d.]+)(?: \+/- ([\d.]+))?", out)
        res["llamacpp"] = {"ppl": float(m.group(1)) if m else None,
                           "stderr": float(m.group(2)) if m and m.group(2) else None,
                           "s": time.perf_counter() - t, "command": shlex.join(cmd)}
    return res


def llama_bench(s: Settings) -> dict[str, Any]:
    cmd = [str(s.llama_bin / "llama-bench"), "-m", str(s.model), "-t", str(s.threads), "-p", str(s.input_len),
           "-n", str(s.output_len), "-r", str(max(s.rounds, 2)), "-o", "json"]
    out = run(cmd, s.out / "llama-bench.log")
    rows = json.loads(out[out.index("["):out.rindex("]") + 1])
    return {"command": shlex.join(cmd),
            "tests": [{"n_prompt": r["n_prompt"], "n_gen": r["n_gen"], "avg_ts": r["avg_ts"],
                       "stddev_ts": r["stddev_ts"],
                       "build": f"{r.get('build_commit')} ({r.get('build_number')})", "cpu": r.get("cpu_info")}
                      for r in rows]}


# ---------------------------------------------------------------------------------------------- report

def med(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def table(s: Settings, res: dict[str, Any]) -> str:
    rounds = res.get("rounds", [])

    def per(engine: str, key: str, field: str) -> list[float | None]:
        return [r[engine][key][field] for r in rounds if engine in r]

    rows = ["| measure | tokenloom | llama.cpp | tokenloom / llama.cpp | bar (issue 20) |", "|---|---|---|---|---|"]
    if rounds:
        for label, key, field, bar in (
                ("single-stream decode tok/s (1 / TPOT p50)", "single", "decode_tok_s", "≥ 1.0x"),
                ("single-stream output tok/s (incl. TTFT)", "single", "output_throughput", ""),
                (f"{s.users}-user output tok/s", "multi", "output_throughput", "≥ 1.5x"),
                (f"{s.users}-user TTFT p50 s", "multi", "ttft_s_median", "")):
            t, l = med(per("tokenloom", key, field)), med(per("llamacpp", key, field))
            vals = "; ".join(f"{e}: {', '.join(fmt(v) for v in per(e, key, field))}" for e in ENGINES if e in rounds[0])
            rows.append(f"| {label} | {fmt(t, '.2f')} | {fmt(l, '.2f')} | {fmt(ratio(t, l), '.2f')}x | {bar} "
                        f"(rounds: {vals}) |")
        for key in ("single", "multi"):
            rows.append(f"| mean output tokens/request, c={1 if key == 'single' else s.users} | "
                        f"{fmt(med(per('tokenloom', key, 'mean_output_tokens')))} | "
                        f"{fmt(med(per('llamacpp', key, 'mean_output_tokens')))} | | = {s.output_len} (ignore_eos) |")
        for e_key, label in (("memory_after_bench", "server peak RSS MB (weights + KV + runtime)"),):
            t = med([r["tokenloom"][e_key]["peak_rss_bytes"] / 1e6 for r in rounds if "tokenloom" in r])
            l = med([r["llamacpp"][e_key]["peak_rss_bytes"] / 1e6 for r in rounds if "llamacpp" in r])
            rows.append(f"| {label} | {fmt(t, '.0f')} | {fmt(l, '.0f')} | {fmt(ratio(t, l), '.2f')}x | |")
    size = s.model.stat().st_size
    mem = res.get("memory", {})
    tl_w = mem.get("tokenloom", {}).get("weight_bytes")
    ll_w = mem.get("llamacpp_model_buffers_bytes")
    if tl_w is not None or ll_w is not None:
        rows.append(f"| weight memory MB (file {size / 1e6:.1f} MB) | {fmt(tl_w and tl_w / 1e6)} "
                    f"({fmt(ratio(tl_w, size), '.3f')}x file) | {fmt(ll_w and ll_w / 1e6)} "
                    f"({fmt(ratio(ll_w, size), '.3f')}x file) | {fmt(ratio(tl_w, ll_w), '.2f')}x | "
                    f"tokenloom ≤ 1.15x file |")
    ppl = res.get("perplexity", {})
    if ppl:
        kept, bf16 = ppl.get("tokenloom_kept", {}).get("ppl"), ppl.get("tokenloom_bf16_dequantized", {}).get("ppl")
        kept_l = ppl.get("tokenloom_kept_llama_method", {}).get("llama_method_ppl")
        bf16_l = ppl.get("tokenloom_bf16_dequantized_llama_method", {}).get("llama_method_ppl")
        lc = ppl.get("llamacpp", {}).get("ppl")
        ctx = s.ppl_ctx
        rows.append(f"| perplexity, tokenloom's method (window {ctx}, stride {ctx // 2}): kept / bf16-dequantized | "
                    f"{fmt(kept, '.4f')} / {fmt(bf16, '.4f')} | | kept/bf16 {fmt(ratio(kept, bf16), '.4f')} | "
                    f"within 1% of bf16 |")
        rows.append(f"| perplexity, llama-perplexity's method (chunks of {ctx}, second halves): tokenloom kept / "
                    f"bf16-dequantized vs llama.cpp | {fmt(kept_l, '.4f')} / {fmt(bf16_l, '.4f')} | {fmt(lc, '.4f')} | "
                    f"kept/llama.cpp {fmt(ratio(kept_l, lc), '.4f')}; "
                    f"kept/bf16 {fmt(ratio(kept_l, bf16_l), '.4f')} | |")
    if res.get("llama_bench"):
        for t in res["llama_bench"]["tests"]:
            kind = f"pp{t['n_prompt']}" if t["n_prompt"] else f"tg{t['n_gen']}"
            rows.append(f"| llama-bench {kind} tok/s (no HTTP) | | {t['avg_ts']:.2f} ± {t['stddev_ts']:.2f} | | |")
    return "\n".join(rows)


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    flags = Path("/proc/cpuinfo").read_text()
    amx = "with AMX" if "amx_tile" in flags else "without AMX"
    load = os.getloadavg()
    return (f"{cpu} ({amx}), {os.cpu_count()} cores, load average at start {load[0]:.2f}, "
            f"{platform.system()} {platform.release()}")


# ---------------------------------------------------------------------------------------------- main

def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, Settings | None]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="the GGUF (default: Gemma 3 270M Q4_K_M from the venv)")
    p.add_argument("--out", type=Path, default=None, help="default results/gemma3_vs_llamacpp/<model>-<time>")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"of {', '.join(ENGINES)}")
    p.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    p.add_argument("--rounds", type=int, default=3, help="serving rounds, the servers taking turns")
    p.add_argument("--users", type=int, default=16, help="the many-user point (and llama-server's slots)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--single-prompts", type=int, default=16, help="measured requests at 1 user")
    p.add_argument("--multi-prompts", type=int, default=48, help="measured requests at --users users")
    p.add_argument("--warmup", type=int, default=2, help="unrecorded requests before each point")
    p.add_argument("--slot-ctx", type=int, default=512,
                   help="llama-server tokens per slot, tokenloom --max-model-len (prompt + output fit)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--kv-cache-memory", default="512MB", help="tokenloom serve --kv-cache-memory")
    p.add_argument("--ppl-ctx", type=int, default=1024, help="llama-perplexity -c; tokenloom --window (stride half)")
    p.add_argument("--ppl-chunks", type=int, default=8, help="chunks scored (ppl-ctx x chunks tokens of text)")
    p.add_argument("--ppl-pass", type=int, default=None,
                   help="tokenloom eval perplexity --chunk: tokens per forward pass (default: a window at once, the "
                        "prefill path; 1: every token through the decode path and its few-row kernels)")
    p.add_argument("--llama-bin", type=Path, default=ROOT / ".peers/llamacpp/bin",
                   help="folder of llama-server, llama-perplexity, llama-bench (install_llamacpp.sh)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    # the in-process probe (a child process of this script)
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--probe-weights", default="keep", help=argparse.SUPPRESS)
    p.add_argument("--probe-dtype", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--probe-text", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe:
        return args, None
    model = (args.model or find_default_gguf()).resolve()
    if not model.is_file():
        raise ConfigError(f"--model {model}: no such file")
    engines = tuple(e for e in args.engines.split(",") if e)
    parts = tuple(x for x in args.parts.split(",") if x)
    if set(engines) - set(ENGINES) or set(parts) - set(PARTS):
        raise ConfigError(f"--engines of {ENGINES}, --parts of {PARTS}")
    if args.ppl_ctx % 2 or args.ppl_ctx < 4:
        raise ConfigError("--ppl-ctx must be even and at least 4")
    if args.input_len + args.output_len + 16 > args.slot_ctx:
        raise ConfigError(f"--slot-ctx {args.slot_ctx} is too small for {args.input_len} + {args.output_len} tokens")
    out = args.out or ROOT / "results/gemma3_vs_llamacpp" / f"{model.stem}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    llama_bin = args.llama_bin.resolve()
    if "llamacpp" in engines:
        need = {"serve": "llama-server", "perplexity": "llama-perplexity", "llama-bench": "llama-bench",
                "memory": "llama-server"}
        for part in parts:
            if not (llama_bin / need[part]).exists():
                raise ConfigError(f"{llama_bin / need[part]} is missing: run benchmarks/peers/install_llamacpp.sh")
    return args, Settings(model, out.resolve(), engines, parts, args.rounds, args.users, args.input_len,
                          args.output_len, args.single_prompts, args.multi_prompts, args.warmup, args.slot_ctx,
                          args.threads, args.kv_cache_memory, args.ppl_ctx, args.ppl_chunks, args.ppl_pass, llama_bin,
                          args.startup_timeout)


def main(argv: list[str] | None = None) -> int:
    args, s = parse(argv)
    if s is None:  # --probe
        print(json.dumps(probe(args.model, args.probe_weights, args.probe_dtype, args.probe_text, args.ppl_ctx,
                               args.ppl_chunks, args.threads)))
        return 0
    s.out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                           "machine": machine(), "model": str(s.model), "model_bytes": s.model.stat().st_size,
                           "runner": shlex.join([sys.executable, *sys.argv]),
                           "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(s).items()}}
    if "llamacpp" in s.engines:
        v = subprocess.run([str(s.llama_bin / "llama-server"), "--version"], capture_output=True, text=True)
        res["llamacpp_version"] = " ".join((v.stdout + v.stderr).split())
    print(f"{res['machine']}\nmodel {s.model} ({res['model_bytes'] / 1e6:.1f} MB); results in {s.out}", flush=True)

    if "serve" in s.parts:
        res["rounds"] = []
        for rnd in range(1, s.rounds + 1):
            # Take turns, and swap who goes first each round: drift in the machine's load hits both alike.
            order = list(s.engines) if rnd % 2 else list(reversed(s.engines))
            res["rounds"].append({e: serve_round(s, e, rnd) for e in order})
            (s.out / "results.json").write_text(json.dumps(res, indent=2))
    if "memory" in s.parts:
        mem: dict[str, Any] = {}
        if "tokenloom" in s.engines:
            text = s.out / "probe-text.txt"  # the probe scores a little text; the weights are what count here
            text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
            mem["tokenloom"] = run_probe(s, "keep", "auto", text, "memory")
        if "llamacpp" in s.engines:
            # llama-server prints its buffer sizes only at verbosity 4 (trace), which the measured rounds
            # do not use: start it once more, as in the rounds plus -lv 4, to read them.
            port = free_port()
            log = s.out / "llamacpp-memory.log"
            server = Server([*server_command("llamacpp", s, port), "-lv", "4"], log, port, s.startup_timeout)
            mem["llamacpp_rss_after_start"] = server.memory()
            server.stop()
            buffers = llama_buffers(log.read_text(errors="replace"))
            mem["llamacpp_buffers"] = buffers
            mem["llamacpp_model_buffers_bytes"] = sum(v for k, v in buffers.items() if k.startswith("model:"))
        res["memory"] = mem
    if "perplexity" in s.parts:
        res["perplexity"] = perplexities(s, write_text(s))
    if "llama-bench" in s.parts and "llamacpp" in s.engines:
        res["llama_bench"] = llama_bench(s)

    res["table"] = table(s, res)
    (s.out / "results.json").write_text(json.dumps(res, indent=2))
    (s.out / "table.md").write_text(f"{res['machine']}\n\nmodel {s.model}\n\n{res['table']}\n")
    print("\n" + res["table"])
    print(f"\nraw results: {s.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
