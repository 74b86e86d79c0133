"""The requests a simulation serves: Poisson arrivals of synthetic prompts, or a replay of a `bench serve`
records.csv (its arrival times, prompt and output lengths, and agentic sessions).

Prompts are token ids because the engine's prefix cache works on them: independent requests get distinct
random ids (no accidental cache hits), and the calls of one agentic session share the conversation so
far (system prompt + the session's own growing stream), as the real workload resends it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from tokenloom.errors import ConfigError

VOCAB = 32000  # synthetic token ids are drawn below this; any value works, only equality matters


@dataclass(frozen=True)
class SimRequest:
    arrival: float  # seconds since the start of the run
    prompt_token_ids: tuple[int, ...]
    output_len: int
    session: int | None = None
    turn: int | None = None

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


def _lengths(rng: random.Random, mean: int, ratio: float) -> int:
    if ratio <= 0:
        return mean
    return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))


def poisson(rate: float, num_requests: int, input_len: int, output_len: int, seed: int = 0,
            range_ratio: float = 0.0, shared_prefix_len: int = 0) -> list[SimRequest]:
    """`num_requests` arrivals with exponential gaps of mean 1/rate (the first at 0, as `bench serve`
    sends it); lengths fixed or uniform in len*(1 +- range_ratio); an optional common prefix."""
    if rate <= 0 or num_requests < 1 or input_len < 1 or output_len < 1:
        raise ConfigError(f"a Poisson workload needs rate > 0 and positive counts (rate {rate}, "
                          f"{num_requests} requests, input {input_len}, output {output_len})")
    if not 0 <= range_ratio < 1:
        raise ConfigError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    prefix = tuple(rng.randrange(VOCAB) for _ in range(shared_prefix_len))
    out, t = [], 0.0
    for _ in range(num_requests):
        n = _lengths(rng, input_len, range_ratio)
        own = tuple(rng.randrange(VOCAB) for _ in range(max(1, n - len(prefix))))
        out.append(SimRequest(t, (prefix + own)[: max(n, 1)], _lengths(rng, output_len, range_ratio)))
        t += rng.expovariate(rate)
    return out


def replay(records_csv: Path, system_len: int = 0, seed: int = 0) -> list[SimRequest]:
    """A `bench serve` run's records (its successful and failed requests alike, since both loaded the
    server): arrival = send time since the first send; per-session prompts share a system prompt of
    `system_len` tokens and grow turn by turn."""
    import pandas as pd

    try:
        df = pd.read_csv(records_csv)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read trace {records_csv}: {e}") from None
    need = {"start", "input_tokens", "output_tokens"}
    if not need <= set(df.columns):
        raise ConfigError(f"{records_csv}: a bench records file needs columns {sorted(need)}")
    if df.empty:
        raise ConfigError(f"{records_csv}: no records")
    df = df.sort_values("start")
    t0 = float(df["start"].iloc[0])
    rng = random.Random(seed)
    system = tuple(rng.randrange(VOCAB) for _ in range(system_len))
    streams: dict[int, list[int]] = {}
    out = []
    for row in df.itertuples(index=False):
        n = int(row.input_tokens)
        # The bench's requested output length, not the produced one: a failed request still asked for it.
        out_len = max(1, int(row.output_tokens)) if "output_len" not in df.columns else int(row.output_len)
        session = getattr(row, "session", None)
        if session is not None and session == session:  # NaN: not a multi-turn record
            s = int(session)
            stream = streams.setdefault(s, list(system))
            while len(stream) < n:
                stream.append(rng.randrange(VOCAB))
            prompt = tuple(stream[:n])
            turn = int(row.turn) if getattr(row, "turn", None) == getattr(row, "turn", None) else None
            out.append(SimRequest(float(row.start) - t0, prompt, out_len, s, turn))
        else:
            out.append(SimRequest(float(row.start) - t0, tuple(rng.randrange(VOCAB) for _ in range(max(1, n))), out_len))
    return out
