"""Serve the same model with tokenloom and its peers, one at a time, and load-test each with the same
`tokenloom bench serve` workload; then put them side by side with `tokenloom bench compare`.

The model is the embedded SmolLM2-135M-Instruct, as the same bf16 weights for every server: tokenloom
and vLLM read an HF folder exported from the GGUF (gguf_to_hf.py), llama.cpp a bf16 GGUF rewritten
from it (gguf_to_bf16.py). The `-q4_1` peers serve the embedded Q4_1 GGUF itself (tokenloom keeps it
quantized; vLLM has no CPU path for it). Peers are installed by install_llamacpp.sh / install_vllm.sh.

llama.cpp is its C++ `llama-server` (what its users run), with one slot per concurrent user and per-slot
KV: `-t THREADS -np N -c N*SLOT --no-kv-unified`, N the sweep's largest --concurrency and SLOT the
longest prompt plus --output-len (rounded up to 256), or --slot-ctx.

    python benchmarks/peers/run_peers.py --out results/peers \\
        [--peers tokenloom,llamacpp,vllm,tokenloom-q4_1,llamacpp-q4_1] \\
        -- --concurrency 1,4,16 --num-prompts 16 --input-len 128 --output-len 128
Everything after `--` goes to `tokenloom bench serve`. Writes OUT/<peer>/ (a results folder each),
OUT/compare/ and OUT/commands.md (date, machine, versions, the exact commands).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tokenloom.models.default import default_model_path
from tokenloom.netutil import free_port, stop_process_group, wait_until_healthy

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


PEERS = ("tokenloom", "llamacpp", "vllm", "tokenloom-q4_1", "llamacpp-q4_1")


def llama_server_command(binary: Path, gguf: Path, port: int, threads: int, slots: int, slot_ctx: int,
                         alias: str, extra: Sequence[str] = ()) -> list[str]:
    """llama.cpp's C++ server with `slots` parallel slots of `slot_ctx` tokens each. Per-slot KV
    (--no-kv-unified): with one unified cache and a big -c its many-user throughput halves on this CPU.
    `extra`: more flags (--llamacpp-args)."""
    return [str(binary), "-m", str(gguf), "--alias", alias, "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * slot_ctx),
            "--no-kv-unified", *extra]


def server_command(peer: str, port: int, hf_dir: Path, bf16_gguf: Path, peers_dir: Path, threads: int,
                   max_model_len: int, slots: int, slot_ctx: int,
                   llamacpp_args: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    q4_1 = default_model_path()  # the embedded Q4_1 GGUF
    if peer in ("tokenloom", "tokenloom-q4_1"):
        model = hf_dir if peer == "tokenloom" else q4_1
        return [sys.executable, "-m", "tokenloom.cli", "serve", "--port", str(port), "--model", str(model),
                "--served-model-name", "smollm2", "--max-model-len", str(max_model_len)], env
    if peer in ("llamacpp", "llamacpp-q4_1"):
        gguf = bf16_gguf if peer == "llamacpp" else q4_1
        return llama_server_command(peers_dir / "llamacpp/bin/llama-server", gguf, port, threads, slots, slot_ctx,
                                    "smollm2", llamacpp_args), env
    if peer == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = env.get("VLLM_CPU_KVCACHE_SPACE", "4")
        return [str(peers_dir / "vllm/bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
                str(hf_dir), "--served-model-name", "smollm2", "--dtype", "bfloat16", "--port", str(port),
                "--max-model-len", str(max_model_len)], env
    raise SystemExit(f"unknown peer {peer!r} ({', '.join(PEERS)})")


def version(peer: str, peers_dir: Path) -> str:
    if peer.startswith("llamacpp"):
        binary = peers_dir / "llamacpp/bin/llama-server"
        if not binary.exists():
            return "unknown"
        # "version: 1 (abc123)" and "built with ..." go to stderr
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
        return " ".join((out.stdout + out.stderr).split()) or "unknown"
    peer = peer.removesuffix("-q4_1")
    py = {"tokenloom": sys.executable, "vllm": str(peers_dir / "vllm/bin/python")}[peer]
    code = f"import importlib.metadata as m, {peer} as x; print(getattr(x, '__version__', None) or m.version('{peer}'))"
    proc = subprocess.run([py, "-c", code], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def bench_option(bench_args: list[str], name: str) -> str | None:
    """The value of `name` among the `tokenloom bench serve` arguments (`--name V` or `--name=V`)."""
    for i, a in enumerate(bench_args):
        if a == name and i + 1 < len(bench_args):
            return bench_args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def slot_plan(bench_args: list[str], slot_ctx: int | None) -> tuple[int, int]:
    """(slots, tokens per slot) for llama-server: one slot per user of the sweep's largest concurrency,
    each long enough for the longest prompt plus the output (and a chat template's few tokens)."""
    conc = bench_option(bench_args, "--concurrency") or "1"
    slots = max(int(c) for c in conc.split(",") if c.strip())
    if slot_ctx is None:
        lens = bench_option(bench_args, "--input-lens") or bench_option(bench_args, "--input-len") or "128"
        longest = max(int(n) for n in lens.split(",") if n.strip())
        ratio = float(bench_option(bench_args, "--random-range-ratio") or 0.0)
        need = int(longest * (1 + ratio)) + int(bench_option(bench_args, "--output-len") or 128) + 64
        slot_ctx = -(-need // 256) * 256
    return slots, slot_ctx


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def main() -> None:
    argv = sys.argv[1:]
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "peers")
    p.add_argument("--peers", default="tokenloom,llamacpp,vllm", help=f"comma-separated, of {', '.join(PEERS)}")
    p.add_argument("--peers-dir", type=Path, default=ROOT / ".peers",
                   help="the peers' installs (llamacpp/bin/llama-server, vllm/) and the models")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--slot-ctx", type=int, default=None,
                   help="llama-server tokens per slot (default: longest prompt + --output-len, rounded up to 256)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--startup-timeout", type=float, default=900.0, help="vLLM CPU takes minutes to warm up")
    p.add_argument("--llamacpp-args", default="",
                   help="more llama-server flags, one string (e.g. '--no-repack': on a Xeon with AMX, llama.cpp "
                        "0.3.36's AMX path for Q4_1 died with an invalid opcode at the first request)")
    args = p.parse_args(argv)

    models = args.peers_dir / "models"
    hf_dir, bf16 = models / "smollm2-135m-instruct-hf", models / "smollm2-135m-instruct-bf16.gguf"
    if not (hf_dir / "model.safetensors").is_file():
        subprocess.run([sys.executable, str(HERE / "gguf_to_hf.py"), str(hf_dir)], check=True)
    if not bf16.is_file():
        subprocess.run([sys.executable, str(HERE / "gguf_to_bf16.py"), str(bf16)], check=True)

    args.out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Peer run {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}", "", f"Machine: {machine()}", "",
             f"Runner: `{shlex.join([sys.executable, *sys.argv])}`", ""]
    done = []
    slots, slot_ctx = slot_plan(bench_args, args.slot_ctx)
    for peer in args.peers.split(","):
        port = free_port()
        cmd, env = server_command(peer, port, hf_dir, bf16, args.peers_dir, args.threads, args.max_model_len,
                                  slots, slot_ctx, shlex.split(args.llamacpp_args))
        log_path = args.out / f"{peer}.server.log"
        print(f"== {peer}: starting {shlex.join(cmd)}", flush=True)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            t0 = time.monotonic()
            # llama-server answers /health with 503 until its model is loaded
            wait_until_healthy(f"http://127.0.0.1:{port}", args.startup_timeout,
                               path="/health" if peer.startswith("llamacpp") else "/v1/models",
                               alive=lambda: proc.poll() is None)
            startup = time.monotonic() - t0
            bench = [sys.executable, "-m", "tokenloom.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                     "--model", "smollm2", "--tokenizer", str(hf_dir), "--out", str(args.out / peer), *bench_args]
            print(f"== {peer}: up in {startup:.0f} s; {shlex.join(bench)}", flush=True)
            rc = subprocess.run(bench).returncode
        except TimeoutError as e:
            print(f"== {peer}: {e}; see {log_path}", flush=True)
            rc, startup, bench = -1, float("nan"), []
        finally:
            stop_process_group(proc)
        lines += [f"## {peer} {version(peer, args.peers_dir)}", "", f"- server: `{shlex.join(cmd)}`",
                  f"- up in {startup:.0f} s; bench exit status {rc}", f"- bench: `{shlex.join(bench)}`", ""]
        if rc == 0:
            done.append(args.out / peer)
    if done:
        subprocess.run([sys.executable, "-m", "tokenloom.cli", "bench", "compare", *map(str, done), "--out",
                        str(args.out / "compare")], check=True)
    (args.out / "commands.md").write_text("\n".join(lines))
    print(f"commands and versions: {args.out / 'commands.md'}")


if __name__ == "__main__":
    main()
