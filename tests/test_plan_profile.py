"""The capacity planner's step costs: the fit recovers known coefficients, the roofline matches hand
arithmetic, a profile of real engine steps on a tiny model is a fittable JSON, trace replay, CLI errors."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokenloom.cli import main
from tokenloom.config import EngineConfig
from tokenloom.errors import ConfigError
from tokenloom.kernels.limits import SKINNY_MAX_ROWS
from tokenloom.plan.cost_model import FEATURES, FEATURES_V1, FEATURES_V2, FEATURES_V3, LinearStepCost, features, nnls
from tokenloom.plan.hardware import SPECS, ModelShape, RooflineStepCost, load_model_shape
from tokenloom.plan.profile import ProfileGrid, profile_engine
from tokenloom.plan.profile_file import Profile
from tokenloom.plan.simulator import FleetConfig, simulate
from tokenloom.plan.workload import poisson, replay


def random_rows(rng: random.Random) -> list[tuple[int, int]]:
    rows = [(1, rng.randrange(1, 3000)) for _ in range(rng.randrange(0, 64))]
    rows += [(rng.randrange(2, 512), rng.choice((0, rng.randrange(1, 2000)))) for _ in range(rng.randrange(0, 3))]
    return rows or [(1, 5)]


def test_fit_recovers_known_coefficients() -> None:
    rng = random.Random(0)
    true = LinearStepCost((0.004, 2e-5, 1e-4, 3e-8, 1e-9, 0.01, 2e-4, 5e-10, 6e-4, 3e-4, 2e-3))
    samples = [(rows, true.step_time(rows)) for rows in (random_rows(rng) for _ in range(60))]
    got = LinearStepCost.fit(samples)
    assert got.coef == pytest.approx(true.coef, rel=1e-6)


def test_features_by_hand() -> None:
    # 2 decodes at contexts 9 and 19 (they attend to 10 and 20 keys) and a 4-token chunk after 6 computed:
    # pairs 4 * (6 + 2.5) = 34; no fresh chunk.
    assert features([(1, 9), (1, 19), (4, 6)]) == [1.0, 6.0, 3.0, 30.0, 34.0, 1.0, 1.0, 0.0, 6.0, 6.0, 0.0]
    assert features([(1, 9)]) == [1.0, 1.0, 1.0, 10.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    # A fresh 4-token prompt (nothing computed before): pairs 4 * 5 / 2 = 10, all of them fresh.
    assert features([(4, 0), (1, 9)]) == [1.0, 5.0, 2.0, 10.0, 10.0, 1.0, 1.0, 10.0, 5.0, 5.0, 0.0]
    # 40 decode rows: the tokens past 16 leave the first hinge; a 100-token chunk beside them both.
    assert features([(1, 0)] * 40)[8:] == [16.0, 40.0, 1.0]
    assert features([(1, 0)] * 40 + [(100, 0)])[8:] == [16.0, 64.0, 1.0]
    # The few-row kernels' last row count, and one more: the step past them.
    assert features([(1, 0)] * SKINNY_MAX_ROWS)[10] == 0.0
    assert features([(1, 0)] * (SKINNY_MAX_ROWS + 1))[10] == 1.0
    assert features([(SKINNY_MAX_ROWS + 1, 0)])[10] == 1.0  # a chunk's rows reach the matmuls the same way
    assert len(FEATURES) == 11


def test_matmul_cost_is_concave_in_the_rows() -> None:
    # Slopes 1.3 ms a row up to 16 tokens, 0.8 up to 64, 0.45 past it (the 2-core Xeon's served decode steps,
    # rounded): the tokens coefficient is the last slope, each hinge adds the difference below its knot.
    cost = LinearStepCost((0.004, 4.5e-4, 0, 0, 0, 0, 0, 0, 5e-4, 3.5e-4, 0))
    t = {r: cost.step_time([(1, 0)] * r) for r in (1, 16, 64, 128)}
    assert t[1] == pytest.approx(0.004 + 1.3e-3)
    assert (t[16] - t[1]) / 15 == pytest.approx(1.3e-3)
    assert (t[64] - t[16]) / 48 == pytest.approx(0.8e-3)
    assert (t[128] - t[64]) / 64 == pytest.approx(0.45e-3)
    # Fitted from steps timed by that cost, the slopes come back.
    samples = [([(1, 0)] * r, cost.step_time([(1, 0)] * r)) for r in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)]
    samples += [([(n, 0)], cost.step_time([(n, 0)])) for n in (16, 64, 256)]
    assert LinearStepCost.fit(samples).coef == pytest.approx(cost.coef, abs=1e-9)


def test_fit_prices_the_step_past_the_few_row_kernels() -> None:
    # Decode steps timed by a cost with a 3 ms jump past SKINNY_MAX_ROWS rows (the embedded Q4_1 model's
    # profiled 8 -> 9-row steps on the 2-core EPYC: 17.9 -> 22.5 ms): the fit finds the jump and prices
    # the rows on either side of it by the same slopes, where a line through them would price the few-row
    # steps high and the next ones low.
    cost = LinearStepCost((0.004, 4.5e-4, 0, 0, 0, 0, 0, 0, 5e-4, 3.5e-4, 3e-3))
    counts = (1, 2, 4, 6, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 12, 16, 24, 32, 48, 64, 96, 128)
    samples = [([(1, 0)] * r, cost.step_time([(1, 0)] * r)) for r in counts]
    samples += [([(n, 0)], cost.step_time([(n, 0)])) for n in (16, 64, 256)]
    got = LinearStepCost.fit(samples)
    assert got.coef == pytest.approx(cost.coef, abs=1e-9)
    jump = got.step_time([(1, 0)] * (SKINNY_MAX_ROWS + 1)) - got.step_time([(1, 0)] * SKINNY_MAX_ROWS)
    assert jump == pytest.approx(3e-3 + 1.3e-3)  # the step and one row's slope below 16 tokens (1.3 ms)


def test_fit_prices_lone_prefills_by_chunk_size() -> None:
    # The profile grid's lone prefills (fresh prompts of 16 .. 512 tokens, and chunks of those sizes after a
    # cached context) beside decode and mixed steps, timed by a known cost: the fit recovers every
    # coefficient, so a lone prefill's time grows with its chunk as the known cost does, faster than
    # linearly (the fresh chunk's causal pairs), and no constant stands in for it.
    rng = random.Random(2)
    true = LinearStepCost((0.005, 6e-4, 3e-4, 7e-7, 1.3e-6, 0.004, 1e-3, 6.5e-7, 0.0, 0.0, 0.0))
    lone = [[(n, c)] for n in (16, 64, 128, 256, 512) for c in (0, 128, 512, 1024)]
    mixed = [[(1, rng.randrange(100, 2000)) for _ in range(rng.randrange(1, 64))] + [(16, rng.randrange(100, 1000))]
             for _ in range(12)]
    decode = [[(1, c)] * r for r in (1, 4, 16, 64) for c in (128, 512, 1024)]
    hits = [[(1, c + 16)] + [(16, c)] * k for k in (3, 15, 32) for c in (112, 496)]  # prefix hits' last blocks
    samples = [(rows, true.step_time(rows)) for rows in lone + mixed + decode + hits]
    got = LinearStepCost.fit(samples)
    assert got.coef == pytest.approx(true.coef, rel=1e-6)
    t = {n: got.step_time([(n, 0)]) for n in (16, 128, 512)}
    # By hand: fixed + has_chunk + rows + chunk_rows = 10.3 ms; n x 0.6 ms; n (n + 1) / 2 x (1.3 + 0.65) us.
    for n in (16, 128, 512):
        assert t[n] == pytest.approx(0.0103 + n * 6e-4 + n * (n + 1) / 2 * 1.95e-6, rel=1e-6)
    assert (t[512] - t[128]) / 384 > (t[128] - t[16]) / 112  # superlinear in the chunk
    # A chunk that continues a cached context is priced on the paged path: no fresh pairs.
    assert got.step_time([(128, 128)]) == pytest.approx(0.0103 + 128 * 6e-4 + 128 * (128 + 64.5) * 1.3e-6, rel=1e-6)


def test_profiles_of_the_previous_features_load_and_others_fail(tmp_path: Path) -> None:
    old = {"kind": "linear", "features": list(FEATURES_V1), "coef": [0.004, 2e-5, 1e-4, 3e-8, 1e-9, 0.01, 2e-4]}
    cost = LinearStepCost.from_json(old)
    assert cost.coef == (0.004, 2e-5, 1e-4, 3e-8, 1e-9, 0.01, 2e-4, 0.0, 0.0, 0.0, 0.0)
    rows = [(128, 0), (1, 40)]  # a fresh chunk: the features the old profile lacks cost it nothing
    assert cost.step_time(rows) == pytest.approx(float(np.dot(old["coef"], features(rows)[:7])), rel=1e-12)
    assert LinearStepCost.from_json(cost.to_json()) == cost
    v2 = {"kind": "linear", "features": list(FEATURES_V2), "coef": [0.004, 2e-5, 1e-4, 3e-8, 1e-9, 0.01, 2e-4, 5e-7]}
    cost = LinearStepCost.from_json(v2)
    assert cost.step_time(rows) == pytest.approx(float(np.dot(v2["coef"], features(rows)[:8])), rel=1e-12)
    v3 = {"kind": "linear", "features": list(FEATURES_V3), "coef": [0.004, 2e-5, 1e-4, 3e-8, 1e-9, 0.01, 2e-4, 5e-7,
                                                                     6e-4, 3e-4]}
    cost = LinearStepCost.from_json(v3)
    assert cost.step_time(rows) == pytest.approx(float(np.dot(v3["coef"], features(rows)[:10])), rel=1e-12)
    with pytest.raises(ConfigError, match="plan profile"):
        LinearStepCost.from_json({"kind": "linear", "features": ["fixed", "tokens"], "coef": [0.1, 0.2]})
    with pytest.raises(ConfigError, match="plan profile"):  # the old names with a coefficient too many
        LinearStepCost.from_json({"kind": "linear", "features": list(FEATURES_V1), "coef": [0.0] * 8})
    with pytest.raises(ConfigError, match="plan profile"):
        LinearStepCost.from_json({"kind": "linear", "features": list(FEATURES_V2), "coef": [0.0] * 10})
    with pytest.raises(ConfigError, match="plan profile"):
        LinearStepCost.from_json({"kind": "linear", "features": list(FEATURES_V3), "coef": [0.0] * 11})


def test_robust_fit_leaves_out_steps_slowed_by_other_processes() -> None:
    rng = random.Random(1)
    true = LinearStepCost((0.004, 2e-5, 1e-4, 3e-8, 1e-9, 0.01, 2e-4, 5e-10, 6e-4, 3e-4, 2e-3))
    samples = [(rows, true.step_time(rows)) for rows in (random_rows(rng) for _ in range(60))]
    slowed = {3, 17, 40}
    noisy = [(rows, t * 10 if i in slowed else t) for i, (rows, t) in enumerate(samples)]
    got, keep = LinearStepCost.fit_robust(noisy)
    assert {i for i, k in enumerate(keep) if not k} == slowed
    assert got.coef == pytest.approx(true.coef, rel=1e-6)


def test_nnls_matches_least_squares_when_unconstrained_and_clips_otherwise() -> None:
    rng = np.random.default_rng(0)
    a = rng.random((40, 4))
    x = np.array([1.0, 2.0, 0.5, 3.0])
    assert nnls(a, a @ x) == pytest.approx(x)
    b = a @ np.array([1.0, -2.0, 0.5, 3.0])  # the unconstrained optimum has a negative coefficient
    got = nnls(a, b)
    assert (got >= 0).all()
    # Reference: brute force over which coefficients are zero, least squares on the rest.
    best = min((np.linalg.norm(a[:, m] @ np.linalg.lstsq(a[:, m], b, rcond=None)[0] - b), m)
               for m in ([i for i in range(4) if (k >> i) & 1] for k in range(1, 16))
               if (np.linalg.lstsq(a[:, m], b, rcond=None)[0] >= 0).all())
    assert np.linalg.norm(a @ got - b) == pytest.approx(best[0], rel=1e-9)


def test_roofline_of_llama_8b_on_h100_by_hand() -> None:
    cost = RooflineStepCost(SPECS["H100"], ModelShape.of(load_model_shape("llama-3.1-8b")))
    # Per layer: attention 4096 * (4096 + 2 * 1024) + 4096 * 4096 = 41,943,040; MLP 3 * 4096 * 14336 =
    # 176,160,768; x 32 layers = 6,979,321,856. LM head 4096 * 128256 = 525,336,576. bf16 weights:
    # 15,009,316,864 bytes. K/V per token: 2 * 32 layers * 8 heads * 128 * 2 bytes = 131,072.
    assert cost.shape.dense_params == 6_979_321_856
    assert cost.shape.weight_bytes == 15_009_316_864
    assert cost.shape.kv_bytes_per_token == 131_072
    # One decode row after 1,023 tokens: reads the weights and 1,024 keys' K/V, writes 1 token's.
    p = cost.step_parts([(1, 1023)])
    assert p["bytes"] == 15_009_316_864 + 131_072 * 1025
    assert p["flops"] == 2 * 6_979_321_856 + 2 * 525_336_576 + 4 * 32 * 32 * 128 * 1024
    assert p["memory_s"] == pytest.approx(15_143_665_664 / (3.35e12 * 0.7))
    assert cost.step_time([(1, 1023)]) == pytest.approx(15_143_665_664 / (3.35e12 * 0.7) + 0.002)
    # 80 GB less the weights, 90% of it for K/V: 4,008,906,240-ish... by the formula:
    assert cost.kv_capacity_tokens() == int((80e9 - 15_009_316_864) * 0.9 / 131_072)


def test_profile_of_a_tiny_model_is_a_fittable_json(tiny_llama: Path, tmp_path: Path) -> None:
    config = EngineConfig(model=str(tiny_llama), max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory="32MiB")
    grid = ProfileGrid(decode_rows=(1, 7), context_lens=(16, 48), decode_steps=2, mixed_prompt_len=24, warmup_steps=1,
                       prefill_lens=(8, 40), prefill_repeats=2)
    prof = profile_engine(config, grid)
    samples = prof.fit["samples"]
    assert len(samples) >= 10
    # Every timed step is one the engine's scheduler made: within its budget and sequence cap.
    for rows, t in samples:
        assert t > 0 and 1 <= len(rows) <= 8 and sum(n for n, _ in rows) <= 64
    assert any(len(rows) == 7 and all(n == 1 for n, _ in rows) for rows, _ in samples)  # the 7-row decodes
    assert any(n > 1 for rows, _ in samples for n, _ in rows)  # prefill chunks
    lone = [tuple(rows[0]) for rows, _ in samples if len(rows) == 1 and rows[0][0] > 1]
    assert lone.count((8, 0)) >= 2 and lone.count((40, 0)) >= 2  # fresh prompts alone, each repeated
    assert (8, 16) in lone and (40, 48) in lone  # chunks after a cached context of each length
    # The mixed prompt again beside the 7 decodes: a prefix hit but for its last 8 tokens (24 = one cached
    # block + 8), the step a split fleet's decode worker takes for each request it receives.
    assert any(len(rows) == 8 and sorted(rows)[-1] == [8, 16] and all(n == 1 for n, _ in sorted(rows)[:-1])
               for rows, _ in samples)
    # The handoff's copies, timed on the same engine, per block.
    assert prof.kv_export_s_per_block > 0 and prof.kv_import_s_per_block > 0
    path = tmp_path / "p.json"
    prof.save(path)
    back = Profile.load(path)
    assert back.cost == prof.cost and back.num_blocks == prof.num_blocks and back.source == "measured"
    assert (back.kv_export_s_per_block, back.kv_import_s_per_block) == (prof.kv_export_s_per_block,
                                                                        prof.kv_import_s_per_block)
    assert back.machine["cpu"] and "engine_config" in back.machine
    saved = json.loads(path.read_text())["fit"]
    refit = LinearStepCost.fit([(rows, t) for (rows, t), k in zip(saved["samples"], saved["kept"]) if k])
    assert refit.coef == pytest.approx(prof.cost.coef, rel=1e-6)
    assert len(saved["rel_errors"]) == len(samples)
    s = simulate(back, FleetConfig(), poisson(2.0, 5, 20, 4, seed=0))
    assert all(r.end is not None for r in s.records)


def test_profiled_decode_rows_each_read_their_own_context(tiny_llama: Path) -> None:
    # Served requests have their own prompts, so a batch of decodes reads as many K/V blocks as it has rows.
    # Rows sharing one cached prompt would share its blocks, which then stay in the CPU's cache: such steps
    # were priced ~35% low at 16-64 rows on a machine with slow memory (docs/benchmarks.md, run 10).
    from tokenloom.engine.engine import LLMEngine
    from tokenloom.plan.profile import run_grid

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_num_seqs=8, max_num_batched_tokens=64,
                                    kv_cache_memory="32MiB"))
    grid = ProfileGrid(decode_rows=(1, 7), context_lens=(48,), decode_steps=2, mixed_prompt_len=24, warmup_steps=1,
                       prefill_lens=(8,), prefill_repeats=1)
    decode_tables: list[list[list[int]]] = []
    real_step = engine.step

    def step() -> list[Any]:
        seqs = [s for r in engine.requests.values() for s in r.seqs if not s.status.finished]
        if len(seqs) == 7 and all(s.num_computed_tokens >= 48 for s in seqs):
            decode_tables.append([list(s.block_ids) for s in seqs])
        return real_step()

    engine.step = step  # type: ignore[method-assign]
    run_grid(engine, grid)
    assert decode_tables, "no 7-row decode step"
    for tables in decode_tables:
        blocks = [b for t in tables for b in t]
        assert len(blocks) == len(set(blocks)), tables  # no block read by two rows


def test_replay_of_bench_records(tmp_path: Path) -> None:
    csv = tmp_path / "records.csv"
    csv.write_text("start,input_tokens,output_tokens,session,turn\n"
                   "10.0,40,8,0,0\n10.5,40,8,1,0\n11.0,70,8,0,1\n12.0,30,5,,\n")
    reqs = replay(csv, system_len=32)
    assert [r.arrival for r in reqs] == [0.0, 0.5, 1.0, 2.0]
    a, b, a2, lone = reqs
    assert a2.prompt_token_ids[:40] == a.prompt_token_ids  # a session's next call resends the conversation
    assert a.prompt_token_ids[:32] == b.prompt_token_ids[:32] and a.prompt_token_ids != b.prompt_token_ids
    assert lone.session is None and lone.input_len == 30 and lone.output_len == 5
    with pytest.raises(ConfigError):
        replay(tmp_path / "missing.csv")


def test_cli_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "simulate", "--profile", str(tmp_path / "none.json"), "--rate", "1"]) == 2
    assert "cannot read profile" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"source": "measured"}')
    assert main(["plan", "simulate", "--profile", str(tmp_path / "bad.json"), "--rate", "1"]) == 2
    assert "unknown cost kind" in capsys.readouterr().err
    assert main(["plan", "hardware", "--hardware", "H900", "--model", "smollm2-135m", "--out", str(tmp_path / "h.json")]) == 2
    prof = tmp_path / "h100.json"
    assert main(["plan", "hardware", "--hardware", "H100", "--model", "smollm2-135m", "--out", str(prof)]) == 0
    assert main(["plan", "simulate", "--profile", str(prof)]) == 2  # neither --rate nor --trace
    misspelt = json.loads(prof.read_text()) | {"interference_token_s": 0.002}  # would simulate as 0 s
    (tmp_path / "misspelt.json").write_text(json.dumps(misspelt))
    assert main(["plan", "simulate", "--profile", str(tmp_path / "misspelt.json"), "--rate", "1"]) == 2
    assert "unknown field(s) interference_token_s" in capsys.readouterr().err
    assert main(["plan", "simulate", "--profile", str(prof), "--rate", "5", "--workers", "0"]) == 2
    assert main(["plan", "search", "--profile", str(prof), "--rate", "5", "--slo-ttft-p99", "0",
                 "--slo-tpot-p99", "1"]) == 2


def test_model_shapes_from_an_hf_folder_and_a_gguf(tiny_llama: Path, smollm2_gguf: Path) -> None:
    from tokenloom.models.config import ModelConfig

    assert load_model_shape(str(tiny_llama)) == ModelConfig.from_hf_folder(tiny_llama)
    assert load_model_shape(str(tiny_llama / "config.json")) == ModelConfig.from_hf_folder(tiny_llama)
    smol = ModelShape.of(load_model_shape(str(smollm2_gguf)))
    assert smol == ModelShape.of(load_model_shape("smollm2-135m"))  # the preset is the shipped file's shapes
    with pytest.raises(ConfigError):
        load_model_shape("no-such-model")
