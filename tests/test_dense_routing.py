"""Where the skinny kernel hands batched rows over to the prepacked oneDNN copies (models/dense_routing.py):
the crossover rule, its bounds, the start-up measurement, and both routes keeping the C++ decode stack equal
to the Python model bit for bit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from test_decode_stack import PROMPTS
from test_gemma_stack import check_every_fused_step
from tokenloom import LLM, SamplingParams
from tokenloom.errors import ConfigError
from tokenloom.kernels import load_cpu_kernels
from tokenloom.kernels.limits import SKINNY_MAX_ROWS
from tokenloom.models import dense_routing
from tokenloom.models.layers import Linear, prepack_available

K = load_cpu_kernels()
pytestmark = pytest.mark.skipif(K is None or not K.skinny_available() or not prepack_available(),
                                reason="needs the skinny kernel (AVX512-BF16) and oneDNN's bf16 prepacking")


@pytest.fixture
def restore_routing() -> Iterator[None]:
    before = Linear.skinny_rows_packed
    yield
    dense_routing.apply(K, before)


def test_crossover_keeps_skinny_while_it_wins_at_every_count() -> None:
    assert dense_routing.crossover([(2, 1.0, 2.0), (4, 1.0, 1.5), (8, 2.0, 1.0)]) == 4
    assert dense_routing.crossover([(2, 3.0, 2.0), (4, 1.0, 1.5)]) == 1  # lost at the first: single rows only
    assert dense_routing.crossover([(2, 1.0, 1.0), (8, 1.0, 2.0)]) == 8  # a tie keeps skinny


def test_apply_sets_both_paths_and_refuses_bad_counts(restore_routing: None) -> None:
    dense_routing.apply(K, 5)
    assert Linear.skinny_rows_packed == 5 and K.skinny_packed_max_rows() == 5
    for bad in (0, SKINNY_MAX_ROWS + 1):
        with pytest.raises(ConfigError, match="1 to"):
            dense_routing.apply(K, bad)
    with pytest.raises(RuntimeError, match="set_skinny_packed_max_rows"):
        K.set_skinny_packed_max_rows(0)


def test_calibration_times_every_count_and_picks_within_bounds() -> None:
    routing = dense_routing.calibrate(K, rows=(2, 4, 8), reps=2)
    assert [m for m, _, _ in routing.timings] == [2, 4, 8]
    assert all(a > 0 and b > 0 for _, a, b in routing.timings)
    assert routing.skinny_max_rows == dense_routing.crossover(routing.timings)
    assert "skinny kernel up to" in routing.describe()


def test_engine_start_measures_and_logs_the_crossover(tiny_llama: Path, restore_routing: None,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="tokenloom.models"):
        llm = LLM(str(tiny_llama), dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=128)
    routing = dense_routing.measured(K)
    assert llm.engine.dense_routing == routing  # what `tokenloom serve` prints at start-up
    assert Linear.skinny_rows_packed == routing.skinny_max_rows == K.skinny_packed_max_rows()
    assert any("dense bf16 matmuls with a prepacked copy" in r.message for r in caplog.records)


@pytest.mark.parametrize("skinny_rows", [1, SKINNY_MAX_ROWS])
def test_decode_stack_equals_the_python_model_on_either_route(tiny_llama: Path, restore_routing: None,
                                                              skinny_rows: int) -> None:
    llm = LLM(str(tiny_llama), dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=256, block_size=4)
    dense_routing.apply(K, skinny_rows)  # after the engine's own measurement
    served = check_every_fused_step(llm)
    llm.generate(PROMPTS[:5], SamplingParams(max_tokens=12, ignore_eos=True))  # steps of 5 rows
    assert served and all(same for _, same in served)
    assert any(2 <= n <= SKINNY_MAX_ROWS for n, _ in served)  # rows the two routes split differently
