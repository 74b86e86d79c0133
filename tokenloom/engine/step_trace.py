"""A served engine's step trace: one CSV line per engine-loop iteration that ran a step (`serve --step-trace`).

What a profile cannot see is what serving adds around the same steps: the HTTP layer, tokenization and
every streamed token's SSE work share the process (the GIL) and the machine's cores with the engine. The
trace records, per step, on the monotonic clock of the engine thread:
- loop_start: the loop iteration begins (it then applies queued adds / aborts);
- step_start: `LLMEngine.step()` is called (schedule begins);
- compute_start / compute_end: the runner's forward and the sampler (what a profile times as the step's
  core, the `record_step` window);
- step_end: `step()` returns (update, outputs collected);
- posted: every output was handed to its caller's event loop and the metrics hook ran;
- rows: the scheduled batch as "n:c" pairs (new tokens : tokens computed before), space separated;
- streamed: rows whose step reached the end of their known tokens (each sampled a token).
`tokenloom plan host` reads it beside a profile: served step time less the profile's prediction for the
same rows, against the load, is the serving overhead the planner must charge (tokenloom/plan/host.py).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path

from tokenloom.errors import ConfigError

COLUMNS = ("loop_start", "step_start", "compute_start", "compute_end", "step_end", "posted", "num_rows",
           "num_tokens", "streamed", "rows")
Row = tuple[int, int]  # (num_new_tokens, num_computed_tokens before the step), as plan/cost_model.py


class StepTrace:
    """Appends one line per step to a CSV file; buffered (flushed every `flush_every` lines and at close)."""

    def __init__(self, path: Path, flush_every: int = 256) -> None:
        try:
            self._file: io.TextIOWrapper = open(path, "w", newline="")  # noqa: SIM115 - closed by close()
        except OSError as e:
            raise ConfigError(f"--step-trace {path}: cannot write it ({e.strerror})") from None
        self._writer = csv.writer(self._file)
        self._writer.writerow(COLUMNS)
        self._flush_every = flush_every
        self._pending = 0  # lines written since the last flush

    def write(self, loop_start: float, step_start: float, compute_start: float, compute_end: float,
              step_end: float, posted: float, rows: Sequence[Row], streamed: int) -> None:
        self._writer.writerow((f"{loop_start:.6f}", f"{step_start:.6f}", f"{compute_start:.6f}",
                               f"{compute_end:.6f}", f"{step_end:.6f}", f"{posted:.6f}", len(rows),
                               sum(n for n, _ in rows), streamed, " ".join(f"{n}:{c}" for n, c in rows)))
        self._pending += 1
        if self._pending >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        """Write out what is buffered (the engine loop calls this when it goes idle, so that a reader sees
        every step of a finished run)."""
        if self._pending and not self._file.closed:
            self._file.flush()
            self._pending = 0

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def parse_rows(text: str) -> list[Row]:
    """The `rows` column back into (n, c) pairs."""
    out = []
    for pair in text.split():
        n, _, c = pair.partition(":")
        out.append((int(n), int(c)))
    return out
