"""A request's output does not depend on the batch, block size, chunk size, arrival order or preemption."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import PROMPTS
from tokenloom import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def greedy_ids(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def baseline(tiny_llama: Path) -> list[list[int]]:
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB")
    return [greedy_ids(llm, [p])[0] for p in PROMPTS]  # each prompt alone


@pytest.mark.parametrize(
    "engine",
    [
        {},  # the whole batch at once
        {"block_size": 1},
        {"block_size": 5},
        {"block_size": 64},
        {"max_num_batched_tokens": 7, "max_num_seqs": 2},  # tiny prefill chunks
        {"max_num_batched_tokens": 32, "max_num_seqs": 32},
        {"max_num_seqs": 1},  # strictly one at a time
        {"attention_backend": "reference"},
    ],
)
def test_greedy_is_batch_invariant(tiny_llama: Path, baseline: list[list[int]], engine: dict[str, object]) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", **engine)
    assert greedy_ids(llm, PROMPTS) == baseline


def test_arrival_order_does_not_matter(tiny_llama: Path, baseline: list[list[int]]) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=16, max_num_seqs=4)
    assert greedy_ids(llm, PROMPTS[::-1]) == baseline[::-1]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_tiny_cache_forces_preemption_and_output_is_unchanged(tiny_llama: Path, baseline: list[list[int]],
                                                              prefix_caching: bool) -> None:
    # 2 KiB per block (K,V x 2 layers x 2 heads x 16 dims x 4 bytes x 4 tokens): 80 blocks = 320 tokens,
    # a little more than one sequence of max_model_len 256, far less than ten prompts with their outputs.
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, max_model_len=256, kv_cache_memory=str(80 * 2048),
              enable_prefix_caching=prefix_caching)
    assert llm.engine.capacity.num_blocks == 80
    prompts = PROMPTS * 2
    assert greedy_ids(llm, prompts) == baseline * 2
    # Without caching the duplicated prompts cannot all fit; with it they share their prompt blocks.
    assert llm.engine.scheduler.num_preemptions > 0 or prefix_caching
    llm.engine.kv.pool.check_invariants()
    assert llm.engine.kv.pool.num_free == 80


def test_seeded_sampling_alone_and_in_a_crowd(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=24, max_num_seqs=8)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPTS[2]], seeded)[0].outputs[0].token_ids
    crowd_params = [SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)] * 4
    crowd = llm.generate(PROMPTS[:2] + [PROMPTS[2]] + PROMPTS[3:], crowd_params[:2] + [seeded] + crowd_params[2:])
    assert crowd[2].outputs[0].token_ids == alone
    # And a different seed gives a different stream (the seed is really used).
    other = llm.generate([PROMPTS[2]], SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=24, ignore_eos=True))
    assert other[0].outputs[0].token_ids != alone
