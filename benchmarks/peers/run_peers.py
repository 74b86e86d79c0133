"""Serve the same model with tokenloom and its peers, one at a time, and load-test each with the same
`tokenloom bench serve` workload; then put them side by side with `tokenloom bench compare`.

The model is the embedded SmolLM2-135M-Instruct, as the same bf16 weights for every server: tokenloom
and vLLM read an HF folder exported from the GGUF (gguf_to_hf.py), llama.cpp a bf16 GGUF rewritten
from it (gguf_to_bf16.py). Peers are installed by install_llamacpp.sh / install_vllm.sh.

    python benchmarks/peers/run_peers.py --out results/peers [--peers tokenloom,llamacpp,vllm] \\
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
import signal
import subprocess
import sys
import time
from pathlib import Path

from tokenloom.netutil import free_port, wait_until_healthy

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def server_command(peer: str, port: int, hf_dir: Path, bf16_gguf: Path, peers_dir: Path, threads: int,
                   max_model_len: int) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if peer == "tokenloom":
        return [sys.executable, "-m", "tokenloom.cli", "serve", "--port", str(port), "--model", str(hf_dir),
                "--served-model-name", "smollm2", "--max-model-len", str(max_model_len)], env
    if peer == "llamacpp":
        # The llama-cpp-python server runs one request at a time, and by default a new request
        # interrupts the running one (which then ends after a token or two): queue them instead.
        return [str(peers_dir / "llamacpp/bin/python"), "-m", "llama_cpp.server", "--model", str(bf16_gguf),
                "--model_alias", "smollm2", "--port", str(port), "--n_ctx", str(max_model_len),
                "--n_threads", str(threads), "--n_threads_batch", str(threads), "--interrupt_requests", "False"], env
    if peer == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = env.get("VLLM_CPU_KVCACHE_SPACE", "4")
        return [str(peers_dir / "vllm/bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
                str(hf_dir), "--served-model-name", "smollm2", "--dtype", "bfloat16", "--port", str(port),
                "--max-model-len", str(max_model_len)], env
    raise SystemExit(f"unknown peer {peer!r} (tokenloom, llamacpp, vllm)")


def version(peer: str, peers_dir: Path) -> str:
    py = {"tokenloom": sys.executable, "llamacpp": str(peers_dir / "llamacpp/bin/python"),
          "vllm": str(peers_dir / "vllm/bin/python")}[peer]
    mod = {"tokenloom": "tokenloom", "llamacpp": "llama_cpp", "vllm": "vllm"}[peer]
    code = f"import importlib.metadata as m, {mod} as x; print(getattr(x, '__version__', None) or m.version('{mod}'))"
    proc = subprocess.run([py, "-c", code], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


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
    p.add_argument("--peers", default="tokenloom,llamacpp,vllm")
    p.add_argument("--peers-dir", type=Path, default=ROOT / ".peers", help="the peers' venvs and the models")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--startup-timeout", type=float, default=900.0, help="vLLM CPU takes minutes to warm up")
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
    for peer in args.peers.split(","):
        port = free_port()
        cmd, env = server_command(peer, port, hf_dir, bf16, args.peers_dir, args.threads, args.max_model_len)
        log_path = args.out / f"{peer}.server.log"
        print(f"== {peer}: starting {shlex.join(cmd)}", flush=True)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            t0 = time.monotonic()
            wait_until_healthy(f"http://127.0.0.1:{port}", args.startup_timeout, path="/v1/models",
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
            stop(proc)
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
