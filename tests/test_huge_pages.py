"""Weights on 2 MiB pages (engine/huge_pages.py, --huge-pages): every weight moves into one mapping, ties stay
tied, the old memory is let go, and the engine's tokens and log-probabilities do not change by a bit."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from tokenloom import LLM, SamplingParams
from tokenloom.cli import build_parser, engine_config
from tokenloom.engine.huge_pages import (HUGE_PAGE, Moved, anon_huge_bytes, huge_pages_usable, move_to_huge_pages,
                                         thp_mode)
from tokenloom.quant.linear import QuantLinear

USABLE = huge_pages_usable()


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 64)
        self.head = nn.Linear(64, 1000, bias=False)
        self.head.weight = self.embed.weight  # tied, as small LMs tie their embeddings and LM head
        self.proj = nn.Linear(64, 96)
        self.register_buffer("table", torch.arange(24, dtype=torch.float32).view(4, 6))
        self.register_buffer("empty", torch.empty(0))
        self.register_buffer("absent", None)
        shared = torch.linspace(0, 1, 64)  # one tensor registered in two modules (as a shared table would be)
        self.norm_a, self.norm_b = nn.Module(), nn.Module()
        self.norm_a.register_buffer("scale", shared)
        self.norm_b.register_buffer("scale", shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(self.embed(x))[..., :64] * self.table.sum())


def test_thp_mode_reads_the_bracketed_setting(tmp_path: Path) -> None:
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert thp_mode(f) == "madvise" and huge_pages_usable(f) in (None, "not Linux")
    f.write_text("always madvise [never]\n")
    assert thp_mode(f) == "never"
    assert huge_pages_usable(f) in ("transparent huge pages are off (never)", "not Linux")
    assert thp_mode(tmp_path / "missing") is None


def test_anon_huge_bytes_reads_the_mapping_that_holds_the_address(tmp_path: Path) -> None:
    smaps = tmp_path / "smaps"
    smaps.write_text("1000-2000 rw-p 00000000 00:00 0\nAnonHugePages:         4 kB\n"
                     "200000-800000 rw-p 00000000 00:00 0\nRss: 6144 kB\nAnonHugePages:      4096 kB\n")
    assert anon_huge_bytes(0x300000, smaps) == 4096 * 1024
    assert anon_huge_bytes(0x1800, smaps) == 4 * 1024
    assert anon_huge_bytes(0x900000, smaps) == 0  # in no mapping
    assert anon_huge_bytes(0x300000, tmp_path / "missing") == 0


@pytest.mark.skipif(USABLE is not None, reason=f"huge pages not usable here: {USABLE}")
def test_move_keeps_values_and_ties_and_puts_every_weight_in_one_mapping() -> None:
    torch.manual_seed(0)
    m = Tied()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    embed_param = m.embed.weight
    x = torch.randint(0, 1000, (3, 5))
    want = m(x)
    moved = move_to_huge_pages(m)
    # embed/head (one tensor), proj weight and bias, table, the shared scale; the empty buffer and the None
    # one are left alone
    assert (moved.tensors, moved.nbytes) == (5, (1000 * 64 + 96 * 64 + 96 + 24 + 64) * 4)
    assert m.embed.weight is embed_param and m.head.weight is m.embed.weight  # the same Parameter, still tied
    assert m.norm_a.scale is m.norm_b.scale  # the shared buffer: one copy, both holders on it
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    ptrs = sorted(t.data_ptr() for t in (m.embed.weight, m.proj.weight, m.proj.bias, m.table, m.norm_a.scale))
    assert ptrs[0] % HUGE_PAGE == 0 and ptrs[-1] - ptrs[0] < HUGE_PAGE  # packed from the mapping's 2 MiB boundary
    assert all(p % 64 == 0 for p in ptrs)
    assert torch.equal(m(x), want)
    # The kernel gave the touched 2 MiB page as a huge page (THP mode always or madvise, as checked above)
    assert moved.huge_bytes >= HUGE_PAGE
    assert "5 weight tensors" in moved.describe()


def test_nothing_to_move() -> None:
    assert move_to_huge_pages(nn.ReLU()) == Moved(0, 0, 0)


@pytest.mark.skipif(USABLE is not None, reason=f"huge pages not usable here: {USABLE}")
def test_engine_tokens_and_logprobs_do_not_change(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    prompts = ["the cat sat on the mat", "a", "one two three four five six seven eight nine ten"] * 2
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)
    runs = []
    for huge in (True, False):
        with caplog.at_level(logging.INFO, logger="tokenloom.engine"):
            caplog.clear()
            llm = LLM(str(tiny_llama), dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=256,
                      quantization="int4", quant_group_size=32, huge_pages=huge)
        logged = any("on huge pages" in r.getMessage() for r in caplog.records)
        assert logged is huge
        assert (llm.engine.huge_pages is not None and llm.engine.huge_pages.tensors > 0) is huge
        quant = [m for m in llm.engine.loaded.model.modules() if isinstance(m, QuantLinear)]
        assert quant
        if huge:  # the quantized layers' codes and scales moved too
            lo = min(m.codes.data_ptr() for m in quant)
            assert all(m.codes.data_ptr() - lo < 64 << 20 and m.scales.data_ptr() - lo < 64 << 20 for m in quant)
        runs.append(llm.generate(prompts, params))
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp.logprob for lp in a.outputs[0].logprobs] == [lp.logprob for lp in b.outputs[0].logprobs]


def test_cli_flag() -> None:
    p = build_parser()
    assert engine_config(p.parse_args(["generate", "hi"])).huge_pages is True
    assert engine_config(p.parse_args(["generate", "hi", "--no-huge-pages"])).huge_pages is False
