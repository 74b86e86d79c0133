"""The load generator end to end against a live tokenloom server with a tiny model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pandas as pd
import pytest

from conftest import LiveServer
from tokenloom.bench.datasets import exact_prompt
from tokenloom.bench.serve import load_tokenizer
from tokenloom.cli import main


def test_exact_prompt_lengths(tiny_llama: Path) -> None:
    tok = load_tokenizer(str(tiny_llama))
    rng = random.Random(0)
    for n in (5, 37, 120):
        text, count = exact_prompt(tok, n, rng)
        assert count == len(tok.encode(text, add_special_tokens=False))
        assert abs(count - n) <= 1


@pytest.mark.parametrize("backend", ["openai", "openai-chat", "ollama"])
def test_sweep_writes_consistent_records_and_summary(live_server: LiveServer, tiny_llama: Path, tmp_path: Path,
                                                     backend: str) -> None:
    out = tmp_path / backend
    rc = main(["bench", "serve", "--base-url", live_server.url, "--backend", backend, "--tokenizer", str(tiny_llama),
               "--num-prompts", "4", "--input-lens", "16,48", "--output-len", "6", "--concurrency", "1,2",
               "--warmup", "1", "--slo-ttft", "10", "--out", str(out)])
    assert rc == 0
    records = pd.read_csv(out / "records.csv")
    summary = json.loads((out / "summary.json").read_text())
    assert len(records) == 2 * 2 * 4 and records["success"].all()
    assert len(summary["points"]) == 4 and set(summary["knee"]) == {"16", "48"}
    for p in summary["points"]:
        rows = records[(records["input_len"] == p["input_len"]) & (records["concurrency"] == p["concurrency"])]
        assert p["completed"] == len(rows) == 4 and p["failed"] == 0
        assert p["total_output_tokens"] == rows["output_tokens"].sum()
        assert p["ttft_s_mean"] == pytest.approx(rows["ttft"].mean())
        assert p["e2el_s_p95"] == pytest.approx(rows["e2el"].quantile(0.95))
        assert p["output_throughput"] == pytest.approx(p["total_output_tokens"] / p["duration_s"])
        assert p["good_requests"] == (rows["ttft"] <= 10).sum()
        if backend == "ollama":
            assert p["server_prefill_s_mean"] == pytest.approx(rows["server_prefill_s"].mean())
    # The server's token counts were used: 6 output tokens each (ignore_eos / num_predict).
    assert (records["output_tokens"] <= 6).all() and (records["output_tokens"] > 0).all()
    for png in ("prompt_lengths.png", "load_sweep.png", "distributions.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.html").read_text()
    assert report.count("data:image/png;base64,") == 3 and "knee" in report


def test_compare_two_runs(live_server: LiveServer, tiny_llama: Path, tmp_path: Path) -> None:
    for name, conc in (("run-a", "1,2"), ("run-b", "1,4")):
        assert main(["bench", "serve", "--base-url", live_server.url, "--tokenizer", str(tiny_llama),
                     "--num-prompts", "4", "--output-len", "4", "--concurrency", conc, "--warmup", "0",
                     "--out", str(tmp_path / name)]) == 0
    out = tmp_path / "cmp"
    assert main(["bench", "compare", str(tmp_path / "run-a"), str(tmp_path / "run-b"), "--out", str(out)]) == 0
    table = (out / "compare.csv").read_text().splitlines()
    assert len(table) == 1 + 4 and (out / "compare.png").is_file() and "run-a" in (out / "compare.md").read_text()
    assert main(["bench", "compare", str(tmp_path / "nope"), "--out", str(out)]) == 2


def test_unreachable_server_counts_failures(tmp_path: Path, tiny_llama: Path) -> None:
    rc = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", str(tiny_llama),
               "--num-prompts", "2", "--warmup", "0", "--output-len", "2", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert rc == 1 and summary["points"][0]["failed"] == 2 and summary["points"][0]["completed"] == 0


def test_agentic_multi_turn(live_server: LiveServer, tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "agentic"
    assert main(["bench", "serve", "--base-url", live_server.url, "--backend", "openai-chat", "--dataset", "agentic",
                 "--tokenizer", str(tiny_llama), "--sessions", "3", "--turns", "3", "--system-len", "40",
                 "--input-len", "8", "--output-len", "4", "--concurrency", "2", "--warmup", "0", "--out", str(out)]) == 0
    records = pd.read_csv(out / "records.csv")
    summary = json.loads((out / "summary.json").read_text())
    assert len(records) == 9 and records["success"].all()
    assert sorted(records["turn"].tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # Each call resends the growing conversation: the server-counted prompt grows turn by turn.
    for _, conv in records.groupby("session"):
        sizes = conv.sort_values("turn")["input_tokens"].tolist()
        assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    p = summary["points"][0]
    assert p["ttft_cold_s_median"] == pytest.approx(records[records["turn"] == 0]["ttft"].median())
    assert p["ttft_warm_s_median"] == pytest.approx(records[records["turn"] > 0]["ttft"].median())
    assert main(["bench", "serve", "--base-url", live_server.url, "--dataset", "agentic", "--tokenizer",
                 str(tiny_llama), "--sessions", "1", "--turns", "1", "--out", str(tmp_path / "x")]) != 0


def test_server_tokenizer_gives_exact_lengths(live_server: LiveServer, tmp_path: Path) -> None:
    """--tokenizer server: prompt lengths counted by the server's own /tokenize (no local tokenizer)."""
    out = tmp_path / "server-tok"
    assert main(["bench", "serve", "--base-url", live_server.url, "--tokenizer", "server", "--num-prompts", "3",
                 "--input-len", "40", "--output-len", "3", "--warmup", "0", "--out", str(out)]) == 0
    records = pd.read_csv(out / "records.csv")
    assert records["success"].all() and set(records["input_tokens"]) <= {39, 40, 41}


def test_tokenize_and_detokenize_endpoints(live_server: LiveServer, tiny_llama: Path) -> None:
    import httpx

    tok = load_tokenizer(str(tiny_llama))
    r = httpx.post(live_server.url + "/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert r["tokens"] == tok.encode("Hello world", add_special_tokens=False) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    chat = httpx.post(live_server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert httpx.post(live_server.url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    bad = httpx.post(live_server.url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(live_server.url + "/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    assert both.status_code == 400
    assert httpx.post(live_server.url + "/tokenize", json={"model": "nope", "prompt": "a"}).status_code == 404


def test_wait_until_healthy_gives_up_when_the_server_is_gone() -> None:
    import time

    from tokenloom.netutil import free_port, wait_until_healthy

    t = time.monotonic()
    with pytest.raises(TimeoutError, match="exited"):
        wait_until_healthy(f"http://127.0.0.1:{free_port()}", timeout=60, alive=lambda: False)
    assert time.monotonic() - t < 5  # at once, not after the timeout


def test_agentic_calls_with_tools_and_a_json_schema(live_server: LiveServer, tiny_llama: Path,
                                                     tmp_path: Path) -> None:
    """--extra-body puts tools and a response_format into every call of the agentic workload."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    extra = {"tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
             "tool_choice": "none", "ignore_eos": False, "min_tokens": 0,
             "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    out = tmp_path / "agentic-structured"
    assert main(["bench", "serve", "--base-url", live_server.url, "--backend", "openai-chat", "--dataset", "agentic",
                 "--tokenizer", str(tiny_llama), "--sessions", "2", "--turns", "2", "--system-len", "40",
                 "--input-len", "8", "--output-len", "40", "--concurrency", "2", "--warmup", "0",
                 "--extra-body", json.dumps(extra), "--out", str(out)]) == 0
    records = pd.read_csv(out / "records.csv")
    assert len(records) == 4 and records["success"].all()
    # The fields do reach the server: a response_format it must refuse fails every call.
    bad = {**extra, "response_format": {"type": "json_schema"}}
    assert main(["bench", "serve", "--base-url", live_server.url, "--backend", "openai-chat", "--dataset", "agentic",
                 "--tokenizer", str(tiny_llama), "--sessions", "1", "--turns", "1", "--system-len", "40",
                 "--input-len", "8", "--output-len", "8", "--warmup", "0", "--extra-body", json.dumps(bad),
                 "--out", str(tmp_path / "bad")]) != 0


def test_extra_body_must_be_a_json_object(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--extra-body", "[1, 2]",
              "--out", str(tmp_path)])
