"""Shared fixtures: tiny random-weight models in real Hugging Face layout, and the embedded SmolLM2 GGUF."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:
    from tokenloom.plan.profile_file import Profile
    from tokenloom.plan.simulator import FleetConfig

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "What is the capital of France? The capital of France is Paris.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time there was a small engine that served many users at once.",
    "1 2 3 4 5 6 7 8 9 10 100 1000",
]

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog and keeps running far away",
    "What is the capital of France?",
    "def add(a, b): return a + b; print(add(1, 2)) " * 4,
    "1 2 3",
]


def sim_bench_folder(folder: Path, prof: "Profile", fleet: "FleetConfig", loads: list[tuple[float, int | None]],
                     num_prompts: int = 60, output_len: int = 32, seed: int = 5) -> Path:
    """Simulated "reality" written as `bench serve` writes a results folder: one point per (Poisson rate,
    concurrency label) of `num_prompts` 64-token prompts; a point labelled with a concurrency is recorded as a
    closed-loop one."""
    import pandas as pd

    from tokenloom.plan.metrics import fleet_summary, to_bench_record
    from tokenloom.plan.simulator import simulate
    from tokenloom.plan.workload import poisson

    folder.mkdir()
    rows, points = [], []
    for rate, conc in loads:
        res = simulate(prof, fleet, poisson(rate, num_prompts, 64, output_len, seed=seed))
        label = {"concurrency": conc, "request_rate": None if conc else rate}
        points.append({"input_len": 64, **label, **fleet_summary(res)})
        rows += [{**to_bench_record(r).to_row(), "input_len": 64, **label} for r in res.records]
    (folder / "summary.json").write_text(json.dumps({"points": points}))
    pd.DataFrame(rows).to_csv(folder / "records.csv", index=False)
    return folder


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device-under-test", default="cuda",
                     help="device of tests/test_cuda.py (default cuda, skipped without one; cpu dry-runs them here)")


def build_tokenizer(folder: Path) -> int:
    """A small byte-level BPE tokenizer trained on CORPUS; returns its vocab size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    return tok.get_vocab_size()


def make_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, **overrides: object) -> Path:
    """Random-weight Llama/Qwen2/Qwen3/Mistral/Phi3 saved with transformers' own save_pretrained (float32)."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(folder)
    common: dict[str, object] = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "mistral": transformers.MistralConfig,
               "qwen3": transformers.Qwen3Config, "phi3": transformers.Phi3Config}[arch]
    model_cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "phi3": transformers.Phi3ForCausalLM,
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**common)).to(torch.float32)
    # Larger-than-default init makes logits peaked, so greedy choices are far from ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def hf_greedy_ids(model: "torch.nn.Module", ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' forward with its KV cache, argmax each step, EOS not special (like ignore_eos).

    Returns the n generated ids and the float32 log-probabilities at the first generated position.
    """
    out = model(torch.tensor([ids]), use_cache=True)
    first = torch.log_softmax(out.logits[0, -1].float(), -1)
    new: list[int] = []
    for _ in range(n):
        tok = int(out.logits[0, -1].argmax())
        new.append(tok)
        out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return new, first


def assert_matches_reference(outs: list, ref_ids: list[list[int]], ref_logprobs: list[torch.Tensor], atol: float) -> None:
    """Engine outputs (greedy, logprobs=N) against transformers': identical ids, and each of the first token's
    top logprobs within `atol` of the reference's log-softmax."""
    assert [o.outputs[0].token_ids for o in outs] == ref_ids
    for out, lp in zip(outs, ref_logprobs):
        first = out.outputs[0].logprobs[0]
        for tok, value in first.top.items():
            assert abs(value - float(lp[tok])) < atol
        assert abs(first.logprob - float(lp[first.token_id])) < atol


@pytest.fixture
def vnni_tiles() -> Iterator[None]:
    """The quantized tiles dotted by vpdpbusd (int8 x) for the test: an engine started earlier in the session
    may have chosen an AMX dot process-wide (quant/routing.py), and tests of the int8 arithmetic need this one."""
    from tokenloom.kernels import load_quant_kernels

    kernels = load_quant_kernels()
    if kernels is None or not hasattr(kernels, "set_quant_tile_dot"):
        yield
        return
    before = kernels.quant_tile_dot()
    kernels.set_quant_tile_dot(0)
    yield
    kernels.set_quant_tile_dot(before)


@pytest.fixture(scope="module")
def one_gguf_parse() -> Iterator[None]:
    """For a module whose transformers references load real GGUF files: transformers parses a file with
    gguf-py's reader once for the config, once for the weights and once for the tokenizer, and a parse of
    a large vocabulary is slow (Gemma 3's 262k entries, read element by element through a memmap: ~15 s
    on these CPUs). The reader is read-only after construction, so one parse per path serves all three.
    Module-scoped: a later module may write another file at a path seen here."""
    import gguf

    real = gguf.GGUFReader
    parsed: dict[tuple[str, str], object] = {}

    def reader(path: "str | Path", mode: str = "r") -> object:
        key = (str(path), mode)
        if key not in parsed:
            parsed[key] = real(path, mode)
        return parsed[key]

    patch = pytest.MonkeyPatch()
    patch.setattr(gguf, "GGUFReader", reader)  # transformers imports it from `gguf` at call time
    yield
    patch.undo()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from tokenloom.models.default import default_model_path

    return default_model_path()


class LiveServer:
    """A tokenloom server on 127.0.0.1 (free port) in a background thread."""

    def __init__(self, model_dir: Path, name: str = "tiny", api_key: str | None = None, role: str = "both",
                 max_request_bytes: int | None = None, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, **engine: object) -> None:
        import threading

        import uvicorn

        from tokenloom.netutil import free_port, wait_until_healthy
        from tokenloom.config import EngineConfig
        from tokenloom.engine.async_engine import AsyncLLMEngine
        from tokenloom.serve.app import build_app
        from tokenloom.serve.metrics import ServingMetrics

        cfg = dict(model=str(model_dir), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
        cfg.update(engine)
        max_waiting = cfg.pop("max_waiting", None)
        max_n = cfg.pop("max_n", None)
        self.metrics = ServingMetrics(name)
        self.engine = AsyncLLMEngine.from_config(EngineConfig(**cfg), max_waiting, self.metrics.on_step,  # type: ignore[arg-type]
                                                 max_n)  # type: ignore[arg-type]
        self.name = name
        self.receiver = None
        if role == "decode":
            from tokenloom.disagg.transfer import KVReceiver

            self.receiver = KVReceiver(self.engine, "127.0.0.1", 0).start()
        limit = {} if max_request_bytes is None else {"max_request_bytes": max_request_bytes}
        app = build_app(self.engine, name, api_key, self.metrics, role,
                        self.receiver.address if self.receiver else None, **limit,
                        tool_parser=tool_parser, reasoning_parser=reasoning_parser)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                    loop="asyncio", http="h11"))  # as serve/server.py
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        wait_until_healthy(self.url, timeout=30)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        if self.receiver is not None:
            self.receiver.close()
        self.engine.shutdown()


@pytest.fixture(scope="session")
def live_server(tiny_llama: Path) -> "Iterator[LiveServer]":
    srv = LiveServer(tiny_llama)
    yield srv
    srv.close()
