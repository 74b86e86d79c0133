"""The capacity planner's simulator: hand-computed latencies, the engine's own scheduler and KV cache
manager (not a copy), determinism, block-pool invariants under pressure, and the fleet search."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import sim_bench_folder
from tokenloom.engine.block_pool import BlockPool
from tokenloom.engine.kv_cache_manager import KVCacheManager
from tokenloom.engine.scheduler import Scheduler
from tokenloom.errors import ConfigError
from tokenloom.plan.cost_model import FEATURES, LinearStepCost
from tokenloom.plan.metrics import fleet_summary
from tokenloom.plan.profile_file import Profile
from tokenloom.plan.search import SLO, search
from tokenloom.plan.simulator import FleetConfig, SimulationError, SimWorker, Simulation, simulate
from tokenloom.plan.workload import SimRequest, poisson


def profile(coef: tuple[float, ...], num_blocks: int = 1000, seqs: int = 8, budget: int = 64,
            block_size: int = 16) -> Profile:
    coef = tuple(coef) + (0.0,) * (len(FEATURES) - len(coef))  # the features left out cost nothing
    return Profile("measured", "fake", LinearStepCost(coef), block_size, num_blocks, 1000.0, seqs, budget, 4096)


def req(t: float, n: int, out: int, base: int = 0) -> SimRequest:
    return SimRequest(t, tuple(range(base, base + n)), out)


def test_fixed_step_times_give_hand_computed_latencies() -> None:
    # Every step takes 10 ms. A (8-token prompt, 3 tokens) arrives at 0: prefill [0, .01] -> token 1 at .01,
    # then decodes at .02 and .03. B (8, 2) arrives at .005, mid-step: it joins step 2 [.01, .02] beside A's
    # decode (first token .02), decodes in step 3 (.03). C arrives at 1.0 on an idle worker: .01 later.
    p = profile((0.01, 0, 0, 0, 0))
    res = simulate(p, FleetConfig(), [req(0.0, 8, 3), req(0.005, 8, 2, 100), req(1.0, 8, 1, 200)])
    a, b, c = res.records
    assert a.token_times == pytest.approx([0.01, 0.02, 0.03])
    assert b.token_times == pytest.approx([0.02, 0.03])
    assert c.token_times == pytest.approx([1.01])
    s = fleet_summary(res)
    assert s["completed"] == 3
    assert s["ttft_s_mean"] == pytest.approx((0.01 + 0.015 + 0.01) / 3)
    assert s["tpot_s_median"] == pytest.approx(0.01)
    assert s["duration_s"] == pytest.approx(1.01)


def test_token_dependent_cost_and_chunked_prefill() -> None:
    # step = 1 ms + 0.1 ms per token, chunk 64: a 100-token prompt runs as 64 then 36 tokens
    # (7.4 ms, 4.6 ms: first token at 12 ms), then one decode step (1.1 ms).
    p = profile((0.001, 1e-4, 0, 0, 0), budget=64)
    (r,) = simulate(p, FleetConfig(), [req(0.0, 100, 2)]).records
    assert r.token_times == pytest.approx([0.012, 0.0131])


def test_the_workers_run_the_engines_scheduler_and_kv_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = Simulation(profile((0.01, 0, 0, 0, 0)), FleetConfig(workers=2, prefill_workers=1))
    for w in sim.decode + sim.prefill:
        assert type(w.scheduler) is Scheduler and type(w.kv) is KVCacheManager and type(w.kv.pool) is BlockPool
    # Patching the engine's classes changes what the simulation does: it cannot be running a copy.
    calls = []
    original = Scheduler.schedule

    def counting(self: Scheduler):  # type: ignore[no-untyped-def]
        calls.append(self)
        return original(self)

    monkeypatch.setattr(Scheduler, "schedule", counting)
    shared = poisson(5.0, 20, 64, 4, seed=1, shared_prefix_len=48)
    hits = fleet_summary(simulate(profile((0.01, 0, 0, 0, 0)), FleetConfig(), shared))["prefix_hit_rate"]
    assert calls and hits > 0.5
    monkeypatch.setattr(KVCacheManager, "find_cached_prefix", lambda self, seq: _no_hit(self))
    assert fleet_summary(simulate(profile((0.01, 0, 0, 0, 0)), FleetConfig(), shared))["prefix_hit_rate"] == 0


def _no_hit(kv: KVCacheManager):  # type: ignore[no-untyped-def]
    from tokenloom.engine.kv_cache_manager import PrefixHit

    return PrefixHit([[] for _ in kv.windows])


def test_same_seed_same_simulation_and_another_seed_differs() -> None:
    p = profile((0.002, 1e-5, 1e-4, 1e-7, 1e-8))
    fleet = FleetConfig(workers=3, policy="cache_aware")

    def times(seed: int) -> list[list[float]]:
        reqs = poisson(40.0, 120, 100, 16, seed=seed, range_ratio=0.5, shared_prefix_len=32)
        return [r.token_times for r in simulate(p, fleet, reqs, seed=seed).records]

    assert times(3) == times(3)
    assert times(3) != times(4)


@pytest.mark.parametrize("fleet", [FleetConfig(workers=2), FleetConfig(workers=1, prefill_workers=1)])
def test_block_pool_invariants_hold_under_pressure(fleet: FleetConfig) -> None:
    # 40 blocks of 16 tokens for up to 8 sequences of up to ~200 tokens: preemptions must happen.
    p = profile((0.002, 1e-5, 1e-4, 0, 0), num_blocks=40, seqs=8, budget=64)
    checked = []

    def check(w: SimWorker) -> None:
        pool = w.kv.pool
        pool.check_invariants()
        assert len(pool._free) + pool.num_cached + pool.num_used == pool.num_blocks  # free + cached + used
        held = [b for s in w.scheduler.running for t in s.block_tables for b in t if b >= 0]
        # Prefix sharing: a block may sit in several tables, once per reference.
        assert len(set(held)) == pool.num_used and len(held) == sum(pool.ref_counts)
        checked.append(w)

    reqs = poisson(30.0, 80, 120, 60, seed=2, range_ratio=0.5, shared_prefix_len=32)
    res = simulate(p, fleet, reqs, on_step=check)
    s = fleet_summary(res)
    assert checked and s["completed"] == 80
    assert s["preemptions"] > 0
    for w in res.workers:  # everything finished: nothing is held
        assert w.kv.pool.num_used == 0 and not w.scheduler.has_unfinished()


def test_a_prompt_larger_than_the_kv_cache_is_an_error() -> None:
    with pytest.raises(SimulationError, match="cannot admit"):
        simulate(profile((0.01, 0, 0, 0, 0), num_blocks=2), FleetConfig(), [req(0.0, 100, 2)])
    with pytest.raises(ConfigError):
        FleetConfig(workers=0)
    with pytest.raises(ConfigError):
        FleetConfig(policy="random")


def test_split_fleet_adds_the_kv_transfer() -> None:
    # 32-token prompt, 100 bytes per token, 1 KB/s: 3.2 s + 0.5 s latency between prefill and decode.
    p = Profile("measured", "fake", profile((0.01,)).cost, 16, 100, 100.0, 8, 64, 4096)
    fleet = FleetConfig(workers=1, prefill_workers=1, link_bandwidth=1000.0, link_latency_s=0.5)
    (r,) = simulate(p, fleet, [req(0.0, 32, 2)]).records
    # prefill step [0, .01]; transfer to 3.71; the decode worker computes the last token (the prompt's
    # full blocks are cached but one token always is), first token 3.72, second 3.73.
    assert r.kv_transfer_s == pytest.approx(3.7)
    assert r.token_times == pytest.approx([3.72, 3.73])
    assert r.cached_tokens == 16  # (32 - 1) // 16 full blocks found in the decode worker's cache


def test_search_finds_the_known_cheapest_fleet() -> None:
    # Each step costs 1 ms per token and nothing else, so a worker computes 1,000 tokens/s however it
    # batches. A request is 10 prompt + 10 output tokens = 19 computed tokens -> 19 ms of work; at 120 req/s
    # the fleet needs 2.28 workers' time: 2 workers fall behind (their queues grow), 3 keep up.
    p = profile((0, 1e-3, 0, 0, 0), num_blocks=2000, seqs=64, budget=256)
    reqs = poisson(120.0, 1200, 10, 10, seed=0)
    best, tried = search(p, reqs, SLO(0.5, 1.0), FleetConfig(), max_workers=8)
    assert best is not None and best.fleet.workers == 3 and best.fleet.prefill_workers == 0
    missed = {c.fleet.workers for c in tried if not c.meets}
    assert 2 in missed


def test_per_request_overheads_and_the_router_hop_are_hand_computed() -> None:
    # Steps take 10 ms. A request reaches the scheduler 50 ms after it arrives (HTTP, tokenization) and its
    # response ends 20 ms after its last token; neither holds the engine. Single server: A (8, 3) arrives at
    # 0, enqueued at .05, tokens .06 .07 .08, end .10. B arrives at .055, while A's first step runs: it is
    # enqueued at .105, after A is done: tokens .115, .125, end .145 (it never waited on A's requests' tails).
    p = replace(profile((0.01,)), request_s=0.05, response_s=0.02)
    a, b = simulate(p, FleetConfig(), [req(0.0, 8, 3), req(0.055, 8, 2, 100)]).records
    assert a.token_times == pytest.approx([0.06, 0.07, 0.08]) and a.end == pytest.approx(0.10)
    assert b.token_times == pytest.approx([0.115, 0.125]) and b.end == pytest.approx(0.145)
    # Behind a router (2 workers): + 30 ms hop before enqueue, and each streamed token adds 2 ms of router
    # CPU to the step that made it. A and B arrive together and go to different workers (least outstanding):
    # each enqueued at .08, steps of 12 ms: tokens .092 .104 .116, end .136.
    r = replace(p, router_hop_s=0.03, router_token_s=0.002)
    res = simulate(r, FleetConfig(workers=2), [req(0.0, 8, 3), req(0.0, 8, 3, 100)])
    assert {x.worker for x in res.records} == {0, 1}
    for x in res.records:
        assert x.token_times == pytest.approx([0.092, 0.104, 0.116]) and x.end == pytest.approx(0.136)
    s = fleet_summary(res)
    assert s["ttft_s_median"] == pytest.approx(0.092) and s["e2el_s_median"] == pytest.approx(0.136)
    assert s["tpot_s_median"] == pytest.approx((0.136 - 0.092) / 2)  # the bench's TPOT includes the tail
    # A per-step router cost (1 ms) lengthens every step of a colocated worker behind the router: 13 ms.
    for x in simulate(replace(r, router_step_s=0.001), FleetConfig(workers=2),
                      [req(0.0, 8, 3), req(0.0, 8, 3, 100)]).records:
        assert x.token_times == pytest.approx([0.093, 0.106, 0.119])
    # The same two workers without a router (router=False) pay none of the router's terms.
    (x, _) = simulate(r, FleetConfig(workers=2, router=False), [req(0.0, 8, 3), req(0.0, 8, 3, 100)]).records
    assert x.token_times == pytest.approx([0.06, 0.07, 0.08])


def test_split_handoff_adds_to_the_kv_transfer() -> None:
    # 1 prefill + 1 decode behind the router: enqueued on the prefill worker at .05 + .03 = .08, its step
    # .08-.09 streams nothing (no router token cost); transfer 3.2 s (3,200 bytes at 1 KB/s) + .5 latency
    # + .1 handoff -> 3.89, imported at once (no copy time); the request then passes the decode worker's
    # HTTP layer (.05): enqueued 3.94; the decode step takes 10 + 2 ms: tokens 3.952, 3.964, end 3.984.
    # The router's per-step cost is a colocated worker's (its peers step as often as it does): neither the
    # prefill nor the decode worker pays it.
    p = Profile("measured", "fake", profile((0.01,)).cost, 16, 100, 100.0, 8, 64, 4096, request_s=0.05,
                response_s=0.02, router_hop_s=0.03, router_step_s=0.005, router_token_s=0.002, handoff_s=0.1)
    fleet = FleetConfig(workers=1, prefill_workers=1, link_bandwidth=1000.0, link_latency_s=0.5)
    (r,) = simulate(p, fleet, [req(0.0, 32, 2)]).records
    assert r.kv_transfer_s == pytest.approx(3.8)
    assert r.token_times == pytest.approx([3.952, 3.964]) and r.end == pytest.approx(3.984)
    with pytest.raises(ConfigError, match="request_s"):
        replace(p, request_s=-0.1)


def test_kv_export_and_import_hold_the_engines_between_steps() -> None:
    # Steps take 10 ms; 32-token prompts = 2 full blocks; export 5 ms and import 20 ms per block; 1 KB/s
    # link (3.2 s for 3,200 bytes) + .5 latency. No router terms (router=False).
    p = Profile("measured", "fake", profile((0.01,)).cost, 16, 100, 100.0, 8, 64, 4096,
                kv_export_s_per_block=0.005, kv_import_s_per_block=0.02)
    fleet = FleetConfig(workers=1, prefill_workers=1, link_bandwidth=1000.0, link_latency_s=0.5, router=False)
    # A alone: prefill .00-.01, export of 2 blocks to .02, ships to 3.72; the idle decode worker imports at
    # once, 40 ms -> 3.76, then computes the last token: first token 3.77, second 3.78.
    (a,) = simulate(p, fleet, [req(0.0, 32, 2)]).records
    assert a.token_times == pytest.approx([3.77, 3.78])
    # B arrives at .005, during A's prefill: its prompt goes in at .02 (the prefill worker is held by A's
    # export until then), prefill .02-.03, export to .04, its blocks arrive at 3.74, while the decode
    # worker imports A's: imported after that copy ends at 3.76, 40 ms -> 3.80 (A's row waits too: no
    # step in between); then A's and B's rows step together: both first tokens at 3.81.
    a, b = simulate(p, fleet, [req(0.0, 32, 20), req(0.005, 32, 2, 100)]).records
    assert a.token_times[0] == pytest.approx(3.81) and b.token_times[0] == pytest.approx(3.81)
    # Without the per-block times the same requests pay neither (the transfer alone, as before).
    (c,) = simulate(replace(p, kv_export_s_per_block=0.0, kv_import_s_per_block=0.0), fleet, [req(0.0, 32, 2)]).records
    assert c.token_times == pytest.approx([3.72, 3.73])


def test_calibration_recovers_known_serving_terms(tmp_path: Path) -> None:
    from tokenloom.plan.calibrate import bench_points, calibrate, light

    # "Reality": steps cost 3 ms + 0.4 ms per row more than the profile says; 50 ms before a request is
    # enqueued, 10 ms after its last token; behind the router 30 ms per request and 1.5 ms per token; a
    # split handoff 40 ms more than its bytes and link latency. Single server at 0.2 req/s (the light
    # point: requests barely overlap) and at 30 req/s (labelled concurrency 8); cluster and split light only.
    bare = profile((0.002, 1e-5, 2e-4))
    real = replace(bare, overhead_step_s=0.003, overhead_row_s=0.0004, request_s=0.05, response_s=0.01,
                   router_hop_s=0.03, router_token_s=0.0015, handoff_s=0.04)
    split_fleet = FleetConfig(workers=1, prefill_workers=1)
    single = sim_bench_folder(tmp_path / "single", real, FleetConfig(), [(0.2, None), (30.0, 8)])
    cluster = sim_bench_folder(tmp_path / "cluster", real, FleetConfig(workers=2), [(0.2, None)])
    split = sim_bench_folder(tmp_path / "split", real, split_fleet, [(0.2, None)])
    got = calibrate(bare, [single], FleetConfig(), cluster=([cluster], FleetConfig(workers=2)),
                    split=([split], split_fleet))
    assert got.overhead_step_s == pytest.approx(0.003, rel=0.3)
    assert got.overhead_row_s == pytest.approx(0.0004, rel=0.3)
    assert got.request_s == pytest.approx(0.05, rel=0.05)
    assert got.response_s == pytest.approx(0.01, rel=1e-6)
    assert got.router_token_s == pytest.approx(0.0015, rel=0.2)
    assert got.router_hop_s == pytest.approx(0.03, rel=0.2)
    assert got.handoff_s == pytest.approx(0.04, rel=0.2)
    assert got.cost == bare.cost and len(got.calibration["points"]) == 2
    assert [f["term"] for f in got.calibration["residual_fits"]] == ["router_token_s", "router_hop_s", "handoff_s"]
    # The per-request terms come from the sparse point, not the loaded one; a concurrency-1 point first.
    assert [p["request_rate"] for p, _ in light(bench_points(single))] == [0.2]
    one = ({"concurrency": 1, "request_rate": None}, single / "x.csv")
    assert light([*bench_points(single), one]) == [one]
    # The calibrated profile saves and loads with every term.
    got.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").router_hop_s == got.router_hop_s


def test_interference_comes_from_a_loaded_split_point(tmp_path: Path) -> None:
    from tokenloom.plan.calibrate import calibrate

    # "Reality": the decode worker's streaming steps slow the prefill worker by 2 ms per step/s, and a
    # handoff costs 40 ms more than its bytes. At the light point nothing streams during a prefill; at
    # the loaded one (20 req/s, labelled concurrency 4) prefills overlap streams and run slower.
    bare = profile((0.002, 1e-5, 2e-4))
    real = replace(bare, request_s=0.05, response_s=0.01, handoff_s=0.04, interference_step_s=0.002)
    split_fleet = FleetConfig(workers=1, prefill_workers=1)
    single = sim_bench_folder(tmp_path / "single", replace(real, handoff_s=0.0, interference_step_s=0.0),
                           FleetConfig(), [(0.2, None), (30.0, 8)])
    split = sim_bench_folder(tmp_path / "split", real, split_fleet, [(0.2, None), (20.0, 4)])
    got = calibrate(bare, [single], FleetConfig(), split=([split], split_fleet))
    assert got.handoff_s == pytest.approx(0.04, rel=0.1)
    assert got.interference_step_s == pytest.approx(0.002, rel=0.1)
    fits = [f for f in got.calibration["residual_fits"] if f["term"] == "interference_step_s"]
    assert [f["concurrency"] for f in fits] == [4]
    # Without the term the loaded point's TTFT is simulated short: the fit had something to find.
    loaded = poisson(20.0, 60, 64, 32, seed=5)
    slow = fleet_summary(simulate(real, split_fleet, loaded))["ttft_s_median"]
    fast = fleet_summary(simulate(replace(real, interference_step_s=0.0), split_fleet, loaded))["ttft_s_median"]
    assert slow > fast + 1e-3  # deterministic: 2 ms more here (the decode worker's own request_s dilutes it)


def test_interference_slows_only_a_split_fleets_prefill_worker() -> None:
    p = replace(profile((0.005, 0.0, 0.0)), interference_step_s=0.01)
    # A split fleet: request 0 is prefilled, handed off (1 ms link latency) and decoded, one token per 5 ms
    # step, from ~6 ms to ~100 ms. Request 1's prefill starts at 15 ms on the idle prefill worker while the
    # decode worker streams (200 steps/s): 5 ms x (1 + 0.01 x 200) = 15 ms instead of 5.
    split = FleetConfig(workers=1, prefill_workers=1, router=False)
    reqs = [SimRequest(0.0, tuple(range(1, 9)), 20), SimRequest(0.015, tuple(range(100, 108)), 2)]
    slow = simulate(p, split, reqs)
    fast = simulate(replace(p, interference_step_s=0.0), split, reqs)
    assert slow.records[0].first_token == pytest.approx(fast.records[0].first_token)  # nothing streamed yet
    late = slow.records[1].first_token - fast.records[1].first_token
    # 10 ms later off the prefill worker; the decode worker then takes it at its next step boundary (5 ms grid).
    assert 0.010 - 0.005 <= late <= 0.010 + 0.005
    # A colocated cluster's prefill is not slowed by the term (it priced the 2-worker cluster's light TTFT
    # 61-65% high on the 2-core Xeon): worker 1's prefill at 6 ms, while worker 0 streams, is a plain 5 ms step.
    fleet = FleetConfig(workers=2, policy="round_robin", router=False)
    reqs = [SimRequest(0.0, tuple(range(1, 9)), 20), SimRequest(0.006, tuple(range(100, 108)), 2)]
    res = simulate(p, fleet, reqs)
    assert res.records[0].first_token == pytest.approx(0.005)
    assert res.records[1].first_token == pytest.approx(0.011)


def test_a_colocated_workers_prompt_chunks_beside_another_workers_step_cost_the_ratio() -> None:
    # Steps of 5 ms. Request 0 reaches worker 0 at 0: its prefill runs alone (worker 1 idle), a plain 5 ms;
    # then it decodes. Request 1 reaches worker 1 at 6 ms, while worker 0 has a decode step in flight: its
    # prefill costs 5 ms x 1.2 = 6 ms, first token at 12 ms (11 without the ratio). Decode steps never pay it.
    p = replace(profile((0.005,)), peer_chunk_ratio=0.2)
    fleet = FleetConfig(workers=2, policy="round_robin", router=False)
    reqs = [SimRequest(0.0, tuple(range(1, 9)), 20), SimRequest(0.006, tuple(range(100, 108)), 2)]
    a, b = simulate(p, fleet, reqs).records
    assert a.token_times[:4] == pytest.approx([0.005, 0.010, 0.015, 0.020])
    assert b.first_token == pytest.approx(0.012) and b.token_times[1] == pytest.approx(0.017)
    a0, b0 = simulate(replace(p, peer_chunk_ratio=0.0), fleet, reqs).records
    assert b0.first_token == pytest.approx(0.011) and a0.token_times == pytest.approx(a.token_times)
    # One worker has no peer, and a split fleet's prefill worker is priced by interference_step_s instead.
    (one,) = simulate(p, FleetConfig(), reqs[1:]).records
    assert one.first_token == pytest.approx(0.006 + 0.005)
    split = simulate(p, FleetConfig(workers=1, prefill_workers=1, router=False), reqs).records
    assert split[1].first_token == pytest.approx(
        simulate(replace(p, peer_chunk_ratio=0.0), FleetConfig(workers=1, prefill_workers=1, router=False),
                 reqs).records[1].first_token)


def test_a_split_fleets_steps_cost_their_roles_ratios_alone_and_beside_the_other_role() -> None:
    # Steps of 5 ms; 1 ms link latency; 8-token prompts (no full block: the decode worker computes them).
    # Prefill steps x1.2 alone, +0.4 beside decode work; decode steps x1.1 alone, +0.6 beside a prefill step.
    # A: prefill 0-6 (decode worker idle), arrives 7; decode steps 7-12.5 (its prompt), 12.5-18.
    # B arrives at 15: the decode worker has work, so its prefill costs 5 x 1.6 = 8 ms, 15-23. A's step that
    # starts at 18, beside it, costs 5 x 1.7 = 8.5 (to 26.5). B arrives at the decode worker at 24, mid-step,
    # and joins at 26.5: 26.5-32 with the prefill worker idle, x1.1.
    p = replace(profile((0.005, 0.0, 0.0)), split_prefill_ratio=0.2, split_prefill_peer_ratio=0.4,
                split_decode_ratio=0.1, split_decode_peer_ratio=0.6)
    split = FleetConfig(workers=1, prefill_workers=1, router=False)
    reqs = [SimRequest(0.0, tuple(range(1, 9)), 20), SimRequest(0.015, tuple(range(100, 108)), 2)]
    a, b = simulate(p, split, reqs).records
    assert a.token_times[:5] == pytest.approx([0.0125, 0.018, 0.0265, 0.032, 0.0375])
    assert b.token_times == pytest.approx([0.032, 0.0375])
    none = replace(p, split_prefill_ratio=0.0, split_prefill_peer_ratio=0.0, split_decode_ratio=0.0,
                   split_decode_peer_ratio=0.0)
    a0, _ = simulate(none, split, reqs).records
    assert a0.token_times[:3] == pytest.approx([0.011, 0.016, 0.021])
    # A decode worker's step that holds a prompt chunk pays split_decode_chunk_ratio more, its decode-only
    # steps not: A alone, its prompt's step on the decode worker 6-11 ms becomes 6-13.5, the 5 ms steps stay.
    c0, = simulate(replace(none, split_decode_chunk_ratio=0.5), split, reqs[:1]).records
    assert c0.token_times[:3] == pytest.approx([0.0135, 0.0185, 0.0235])
    # A colocated cluster's workers never pay them.
    cluster = FleetConfig(workers=2, policy="round_robin", router=False)
    assert [r.token_times for r in simulate(p, cluster, reqs).records] == \
        [r.token_times for r in simulate(none, cluster, reqs).records]


def _split_traces(folder: Path, bare: Profile, prefill: tuple[float, float],
                  decode: tuple[float, float], decode_chunk: float | None = None) -> tuple[Path, Path]:
    """A split fleet's worker traces (decode, prefill) whose steps cost price x (1 + alone + peer x busy).
    The decode worker's loop iterations cover 0-60 s back to back (a step at each second, 1-8 rows); a
    128-token prefill step starts 5 ms before every odd second (busy 1: inside them), so that the decode
    steps of odd seconds run beside it (busy 1) and even ones alone; ten more prefill steps at 61-70 s
    run alone. With `decode_chunk`, every third decode step also holds a 12-token prompt chunk (the tail
    of a prompt past its last whole block) and costs + decode_chunk x its price."""
    folder.mkdir(exist_ok=True)
    dsteps = []
    for k in range(60):
        chunk = decode_chunk is not None and k % 3 == 0
        rows = [(1, 100)] * (1 + k % 8) + ([(12, 96)] if chunk else [])
        e = bare.cost.step_time(rows) * (1 + decode[0] + decode[1] * (k % 2) + (decode_chunk or 0.0) * chunk)
        dsteps.append((float(k), e, rows, 1.0 - e))
    psteps = []
    for t, busy in [(k - 0.005, 1) for k in range(1, 60, 2)] + [(float(k), 0) for k in range(61, 71)]:
        psteps.append((t, bare.cost.step_time([(128, 0)]) * (1 + prefill[0] + prefill[1] * busy), [(128, 0)], 0.0))
    return _timed_trace(folder / "worker-0.csv", dsteps), _timed_trace(folder / "worker-1.csv", psteps)


def test_a_decode_workers_prompt_chunk_steps_get_their_own_ratio(tmp_path: Path) -> None:
    """Plan validation run 41's decode worker ran its decode-only steps near their price and its steps holding
    a prompt chunk ~1.3x; one ratio over both priced the light load's 1-row steps high. The fit now tells
    them apart: decode steps at their price alone, +0.1 beside a prefill, +0.3 holding a chunk."""
    from tokenloom.plan.host import attribute, fit_split_ratios, load_trace

    bare = profile((0.002, 1e-4, 2e-4))
    dw, pw = _split_traces(tmp_path, bare, (0.05, 0.2), (0.0, 0.1), decode_chunk=0.3)
    fit = fit_split_ratios(attribute(bare, load_trace([dw, pw])), {str(pw)})
    assert fit.decode == pytest.approx((0.0, 0.1), abs=2e-3) and fit.decode_chunk == pytest.approx(0.3, abs=2e-3)
    assert fit.prefill == pytest.approx((0.05, 0.2), abs=2e-3)
    assert fit.line().endswith("+0.300 holding a prompt chunk")


def test_the_split_ratios_come_from_each_roles_steps_beside_the_others(tmp_path: Path) -> None:
    from tokenloom.plan.calibrate import calibrate
    from tokenloom.plan.host import attribute, fit_split_ratios, load_trace

    bare = profile((0.002, 1e-4, 2e-4))  # 2 ms + 0.1 ms per token + 0.2 ms per row
    dw, pw = _split_traces(tmp_path, bare, (0.05, 0.2), (0.15, 0.1))
    fit = fit_split_ratios(attribute(bare, load_trace([dw, pw])), {str(pw)})
    assert fit.prefill_steps == 40 and fit.decode_steps == 60
    assert fit.prefill == pytest.approx((0.05, 0.2), abs=2e-3)  # the trace keeps microseconds
    assert fit.decode == pytest.approx((0.15, 0.1), abs=2e-3)
    assert fit.prefill_busy == pytest.approx(0.75) and fit.decode_busy == pytest.approx(0.5)
    assert fit.decode_chunk == 0.0  # no decode step held a prompt chunk
    assert fit.line().startswith("prefill steps x1.050 their price alone, +0.200 beside")
    # Decode steps faster beside a prefill step than alone: no negative cost; the alone part takes their mean.
    fd, fp = _split_traces(tmp_path / "faster", bare, (0.05, 0.2), (0.1, -0.1))
    faster = fit_split_ratios(attribute(bare, load_trace([fd, fp])), {str(fp)})
    assert faster.decode[1] == 0.0 and 0.0 < faster.decode[0] < 0.1

    # Through calibrate, with the traces in `cluster --step-trace-dir`'s order (decode first): the ratios are
    # the traces', and the loaded split point fits no interference beside them (it would price the same
    # slowing twice); without the traces it does.
    real = replace(bare, overhead_step_s=9e-4, overhead_row_s=2e-4, request_s=0.05, interference_step_s=0.002)
    split_fleet = FleetConfig(workers=1, prefill_workers=1)
    single = sim_bench_folder(tmp_path / "single", replace(real, interference_step_s=0.0), FleetConfig(),
                              [(0.2, None)])
    split = sim_bench_folder(tmp_path / "split", real, split_fleet, [(0.5, 1), (40.0, 4)])
    single_trace = _timed_trace(tmp_path / "single.csv", [
        (float(t), bare.cost.step_time([(1, 100)] * n), [(1, 100)] * n, 9e-4 + 2e-4 * n)
        for t, n in enumerate((1, 2, 4, 8) * 10)])
    got = calibrate(bare, [single], FleetConfig(), split=([split], split_fleet), step_traces=[single_trace],
                    split_step_traces=[dw, pw])
    assert (got.split_prefill_ratio, got.split_prefill_peer_ratio) == pytest.approx((0.05, 0.2), abs=2e-3)
    assert (got.split_decode_ratio, got.split_decode_peer_ratio) == pytest.approx((0.15, 0.1), abs=2e-3)
    assert got.interference_step_s == 0.0
    assert got.calibration["split_ratio_fit"].startswith("prefill steps x1.050")
    # And the split workers' spread: 40 prompt steps and 60 decode steps, each kind's quantiles around its mean.
    assert set(got.step_spread) >= {"split-chunk", "split-decode"}
    assert got.calibration["split_spread_fit"].startswith("step spread: chunk steps")
    untraced = calibrate(bare, [single], FleetConfig(), split=([split], split_fleet), step_traces=[single_trace])
    assert untraced.interference_step_s > 0 and untraced.split_decode_ratio == 0.0
    with pytest.raises(ConfigError, match="decode workers' first"):
        calibrate(bare, [single], FleetConfig(), split=([split], split_fleet), step_traces=[single_trace],
                  split_step_traces=[dw])


def test_a_profile_with_a_retired_term_loads_at_zero_and_is_refused_calibrated(tmp_path: Path) -> None:
    d = profile((0.005,)).to_json()
    d["split_decode_row_s"] = 0.0  # every profile written before 2026-12-07 has it
    assert Profile.from_json(d).split_decode_ratio == 0.0
    d["split_decode_row_s"] = 3e-4
    with pytest.raises(ConfigError, match="split_decode_row_s .* plan calibrate"):
        Profile.from_json(d)


def test_router_token_cost_comes_from_a_loaded_cluster_point(tmp_path: Path) -> None:
    from tokenloom.plan.calibrate import calibrate

    # "Reality" as above; the cluster also ran loaded (30 req/s, labelled concurrency 8), where each step
    # streams several rows through the router: the per-token term is fitted there, per running row.
    bare = profile((0.002, 1e-5, 2e-4))
    real = replace(bare, overhead_step_s=0.003, overhead_row_s=0.0004, request_s=0.05, response_s=0.01,
                   router_hop_s=0.03, router_token_s=0.0015)
    single = sim_bench_folder(tmp_path / "single", real, FleetConfig(), [(0.2, None), (30.0, 8)])
    cluster = sim_bench_folder(tmp_path / "cluster", real, FleetConfig(workers=2), [(0.2, None), (30.0, 8)])
    got = calibrate(bare, [single], FleetConfig(), cluster=([cluster], FleetConfig(workers=2)))
    assert got.router_token_s == pytest.approx(0.0015, rel=0.05)
    assert got.router_hop_s == pytest.approx(0.03, rel=0.05)
    token_fits = [f for f in got.calibration["residual_fits"] if f["term"] == "router_token_s"]
    assert [f["concurrency"] for f in token_fits] == [8] and token_fits[0]["rows"] > 1.5


def _trace(path: Path, prof: Profile, steps: list[list[tuple[int, int]]], extra: Callable[[int, int], float]) -> Path:
    """A `serve --step-trace` file of `steps` (rows as (new, computed) pairs): each engine step takes the
    profile's price, and the loop iteration `extra(rows, streamed)` seconds more."""
    from tokenloom.engine.step_trace import StepTrace

    trace, t = StepTrace(path), 0.0
    for rows in steps:
        engine = prof.cost.step_time(rows)
        streamed = len(rows)  # decode rows: each samples a token
        trace.write(t, t, t, t + engine, t + engine, t + engine + extra(len(rows), streamed), rows, streamed)
        t += 1.0
    trace.close()
    return path


def _timed_trace(path: Path, steps: list[tuple[float, float, list[tuple[int, int]], float]]) -> Path:
    """A step trace of (start, engine seconds, rows, loop seconds after the step) per step."""
    from tokenloom.engine.step_trace import StepTrace

    trace = StepTrace(path)
    for t, engine, rows, after in steps:
        streamed = sum(1 for n, _ in rows if n == 1) + sum(1 for n, c in rows if n > 1 and c == 0)
        trace.write(t, t, t, t + engine, t + engine, t + engine + after, rows, streamed)
    trace.close()
    return path


def test_prompt_chunk_slowdown_comes_from_steps_beside_another_worker(tmp_path: Path) -> None:
    from tokenloom.plan.calibrate import calibrate
    from tokenloom.plan.host import attribute, fit_peer_chunks, load_trace, peer_busy

    # "Reality": a prompt chunk costs 1.15x its price while the other worker steps, its price alone; every
    # step pays the single server's 0.9 ms + 0.2 ms per row after it. Worker 1 steps from 0 to 50 s (one
    # long decode step) and from 80.5 to 81.5; worker 0 runs chunks at 1..20 s (beside it), 60..79 (alone)
    # and one at 80 s whose second half is beside worker 1's second step, and a decode step at 90 (alone).
    bare = profile((0.002, 1e-5, 2e-4))
    chunk = [(64, 0), (1, 100)]
    price = bare.cost.step_time(chunk)
    after = 9e-4 + 2e-4 * 2
    w0 = [(float(t), price * 1.15, chunk, after) for t in range(1, 21)]
    w0 += [(float(t), price, chunk, after) for t in range(60, 80)]
    w0 += [(80.0, 1.0, chunk, after), (90.0, bare.cost.step_time([(1, 100)]), [(1, 100)], 9e-4 + 2e-4)]
    a = _timed_trace(tmp_path / "w0.csv", w0)
    b = _timed_trace(tmp_path / "w1.csv", [(0.0, 50.0, [(1, 100)] * 8, 0.0), (80.5, 1.0, [(1, 100)], 0.0)])
    df = attribute(bare, load_trace([a, b]))
    busy = peer_busy(df)
    assert busy[:20] == pytest.approx([1.0] * 20) and busy[20:40] == pytest.approx([0.0] * 20)
    assert busy[40] == pytest.approx(0.5) and busy[41] == 0.0  # the 80 s step half beside; the decode step alone
    # Worker 1's long step: beside worker 0's 20 iterations (each chunk and the loop's work after it).
    assert busy[42] == pytest.approx(20 * (price * 1.15 + after) / 50.0, rel=1e-3)  # times kept in microseconds
    assert busy[43] == pytest.approx(0.5 + after)  # worker 1 at 80.5 s: beside the 80 s iteration to 81 s + after
    # The 80 s step (1 s, half beside) is left out of the fit for a clean answer: 15% (the trace keeps
    # microseconds, a few thousandths of a 3 ms step).
    clean = attribute(bare, load_trace([_timed_trace(tmp_path / "w0b.csv", w0[:40]), b]))
    fit = fit_peer_chunks(clean, 9e-4, 2e-4, 0.0, 0.0)
    assert fit.ratio == pytest.approx(0.15, abs=1e-3) and fit.steps == 40 and fit.busy == pytest.approx(0.5)
    assert fit.line().startswith("prompt-chunk steps 1.150x their price")
    # The router's charges come off first: a chunk step that streams its first token pays router_token_s.
    assert fit_peer_chunks(clean, 9e-4, 2e-4, 0.0, 1e-4).ratio < 0.15
    # Chunks that ran faster than their price beside the other worker: no ratio, not a negative one.
    fast = _timed_trace(tmp_path / "w0c.csv", [(float(t), price * 0.9, chunk, after) for t in range(1, 21)])
    assert fit_peer_chunks(attribute(bare, load_trace([fast, b])), 9e-4, 2e-4, 0.0, 0.0).ratio == 0.0
    # One worker's trace alone: no chunk step beside another's, nothing charged (and calibrate goes on).
    lone = fit_peer_chunks(attribute(bare, load_trace([a])), 9e-4, 2e-4, 0.0, 0.0)
    assert lone.ratio == 0.0 and lone.steps == 0 and "none charged" in lone.line()

    # Through calibrate: worker 1 now decodes back to back from 0 to 50 s (1-8 rows, each iteration its
    # price + the single server's overhead, so that the router terms fit 0) and worker 0's chunks run as above.
    real = replace(bare, overhead_step_s=9e-4, overhead_row_s=2e-4, request_s=0.05, router_hop_s=0.03)
    single = sim_bench_folder(tmp_path / "single", real, FleetConfig(), [(0.2, None)])
    cluster = sim_bench_folder(tmp_path / "cluster", real, FleetConfig(workers=2), [(0.2, None)])
    decodes, t = [], 0.0
    while t < 50.0:
        rows = [(1, 100)] * (1, 2, 4, 8)[len(decodes) % 4]
        decodes.append((t, bare.cost.step_time(rows), rows, 9e-4 + 2e-4 * len(rows)))
        t += decodes[-1][1] + decodes[-1][3]
    single_trace = _timed_trace(tmp_path / "single.csv", decodes[:40])
    got = calibrate(bare, [single], FleetConfig(), cluster=([cluster], FleetConfig(workers=2)),
                    step_traces=[single_trace],
                    cluster_step_traces=[_timed_trace(tmp_path / "w0d.csv", w0[:40]),
                                         _timed_trace(tmp_path / "w1d.csv", decodes)])
    assert got.router_step_s == pytest.approx(0.0, abs=1e-6) and got.router_token_s == pytest.approx(0.0, abs=1e-6)
    assert got.peer_chunk_ratio == pytest.approx(0.15, abs=2e-3)
    assert got.calibration["cluster_chunk_fit"].startswith("prompt-chunk steps 1.1")


def test_router_costs_come_from_the_cluster_workers_step_traces(tmp_path: Path) -> None:
    from tokenloom.plan.calibrate import calibrate
    from tokenloom.plan.host import attribute, fit_router_excess, load_trace

    # "Reality": a served single-server step costs 0.9 ms + 0.2 ms per row more than the profile says; a
    # cluster worker's step 0.5 ms per step and 0.35 ms per streamed token more again (the router proxying
    # each token and the other worker on the same cores). Decode steps of 1 to 8 rows at context 100.
    bare = profile((0.002, 1e-5, 2e-4))
    steps = [[(1, 100)] * n for n in (1, 2, 3, 4, 5, 6, 7, 8) * 4]
    single_trace = _trace(tmp_path / "single.csv", bare, steps, lambda rows, _: 9e-4 + 2e-4 * rows)
    cluster_trace = _trace(tmp_path / "w0.csv", bare, steps,
                           lambda rows, streamed: 1.4e-3 + 2e-4 * rows + 3.5e-4 * streamed)
    fit = fit_router_excess(attribute(bare, load_trace([cluster_trace])), 9e-4, 2e-4)
    assert fit.step_s == pytest.approx(5e-4) and fit.token_s == pytest.approx(3.5e-4)
    assert fit.median_abs_error_s == pytest.approx(0.0, abs=1e-9)
    assert fit.steps == len(steps) and fit.tokens == sum(map(len, steps))
    # Steps that cost less the more they stream: a per-step cost and no per-token one (not a negative one).
    cheaper = _trace(tmp_path / "w1.csv", bare, steps,
                     lambda rows, streamed: 9e-4 + 2e-3 + 2e-4 * rows - 1e-4 * streamed)
    got = fit_router_excess(attribute(bare, load_trace([cheaper])), 9e-4, 2e-4)
    assert got.token_s == 0.0 and 0.0 < got.step_s < 2e-3
    # Workers faster than the single server (the machine's drift): no cost, not a negative one.
    faster = _trace(tmp_path / "w3.csv", bare, steps, lambda rows, _: 2e-4 * rows)
    got = fit_router_excess(attribute(bare, load_trace([faster])), 9e-4, 2e-4)
    assert got.step_s == 0.0 and got.token_s == 0.0
    # One row count throughout (a light run alone) cannot separate a per-token cost from a per-step one.
    ones = _trace(tmp_path / "w2.csv", bare, [[(1, 100)]] * 8, lambda rows, _: 1e-3)
    with pytest.raises(ConfigError, match="different numbers of tokens"):
        fit_router_excess(attribute(bare, load_trace([ones])), 9e-4, 2e-4)

    real = replace(bare, overhead_step_s=9e-4, overhead_row_s=2e-4, request_s=0.05, router_hop_s=0.03)
    single = sim_bench_folder(tmp_path / "single", real, FleetConfig(), [(0.2, None)])
    cluster = sim_bench_folder(tmp_path / "cluster", real, FleetConfig(workers=2), [(0.2, None)])
    got = calibrate(bare, [single], FleetConfig(), cluster=([cluster], FleetConfig(workers=2)),
                    step_traces=[single_trace], cluster_step_traces=[cluster_trace])
    assert got.overhead_step_s == pytest.approx(9e-4) and got.overhead_row_s == pytest.approx(2e-4)
    assert got.router_step_s == pytest.approx(5e-4) and got.router_token_s == pytest.approx(3.5e-4)
    assert got.calibration["cluster_step_trace_fit"].startswith("0.50 ms/step + 0.350 ms/token")
    assert got.peer_chunk_ratio == 0.0  # one worker's decode steps: no prompt chunk beside another's
    assert [f["term"] for f in got.calibration["residual_fits"]] == ["router_hop_s"]  # no TPOT-gap search
    with pytest.raises(ConfigError, match="cluster"):
        calibrate(bare, [single], FleetConfig(), step_traces=[single_trace], cluster_step_traces=[cluster_trace])


def test_spread_factor_interpolates_the_quantiles() -> None:
    from tokenloom.plan.simulator import spread_factor

    q = (1.0, 2.0, 4.0)  # at probabilities 1/6, 1/2, 5/6
    assert spread_factor(q, 0.0) == 1.0 and spread_factor(q, 1 / 6) == pytest.approx(1.0)
    assert spread_factor(q, 1 / 3) == pytest.approx(1.5) and spread_factor(q, 0.5) == pytest.approx(2.0)
    assert spread_factor(q, 2 / 3) == pytest.approx(3.0) and spread_factor(q, 0.999) == 4.0


def test_a_step_spread_multiplies_the_engine_cost_of_its_kind_of_worker() -> None:
    # Steps of 10 ms and 1 ms of serving overhead; a constant spread of 2 (chunks) and 3 (decode) doubles
    # the prompt step's engine part and triples the decode steps': 21 ms, then 31 ms each.
    base = replace(profile((0.01, 0, 0, 0, 0)), overhead_step_s=0.001)
    p = replace(base, step_spread={"single-chunk": (2.0, 2.0), "single-decode": (3.0, 3.0)})
    (a,) = simulate(p, FleetConfig(), [req(0.0, 8, 3)]).records
    assert a.token_times == pytest.approx([0.021, 0.052, 0.083])
    # The "fleet" kind is for several workers sharing the host; one worker draws from "single" only.
    (b,) = simulate(replace(base, step_spread={"fleet-chunk": (2.0, 2.0)}), FleetConfig(), [req(0.0, 8, 3)]).records
    assert b.token_times == pytest.approx([0.011, 0.022, 0.033])
    two = FleetConfig(workers=2, policy="round_robin", router=False)
    fleet = replace(base, step_spread={"fleet-chunk": (2.0, 2.0), "single-decode": (3.0, 3.0)})
    c, d = simulate(fleet, two, [req(0.0, 8, 2), req(1.0, 8, 1, 100)]).records
    assert c.token_times == pytest.approx([0.021, 0.032]) and d.token_times == pytest.approx([1.021])
    # A split fleet's workers draw from the "split" kind only: the prompt step on the prefill worker 21 ms,
    # 1 ms of link latency, the decode worker's step over the (blockless) prompt 21 ms, then decode steps 31.
    split = FleetConfig(workers=1, prefill_workers=1, router=False)
    colocated = {k: (5.0, 5.0) for k in ("single-chunk", "single-decode", "fleet-chunk", "fleet-decode")}
    got = simulate(replace(base, step_spread=colocated), split, [req(0.0, 8, 3)]).records[0].token_times
    assert got == pytest.approx(simulate(base, split, [req(0.0, 8, 3)]).records[0].token_times)
    own = {**colocated, "split-chunk": (2.0, 2.0), "split-decode": (3.0, 3.0)}
    (e,) = simulate(replace(base, step_spread=own), split, [req(0.0, 8, 3)]).records
    assert e.token_times == pytest.approx([0.043, 0.074, 0.105])


def test_a_step_spread_is_deterministic_for_a_seed_and_leaves_the_tokens_alone() -> None:
    p = profile((0.002, 1e-5, 2e-4))
    spread = {"single-chunk": (0.5, 1.0, 1.5), "single-decode": (0.8, 1.0, 1.2)}
    reqs = poisson(rate=50.0, num_requests=30, input_len=24, output_len=6, seed=5)
    a = simulate(replace(p, step_spread=spread), FleetConfig(), reqs, seed=3)
    b = simulate(replace(p, step_spread=spread), FleetConfig(), reqs, seed=3)
    c = simulate(replace(p, step_spread=spread), FleetConfig(), reqs, seed=4)
    assert [r.token_times for r in a.records] == [r.token_times for r in b.records]
    assert [r.token_times for r in a.records] != [r.token_times for r in c.records]
    # Quantiles all 1: the draws change nothing, the same timeline as without a spread.
    ones = simulate(replace(p, step_spread={"single-chunk": (1.0, 1.0), "single-decode": (1.0, 1.0)}),
                    FleetConfig(), reqs, seed=3)
    plain = simulate(p, FleetConfig(), reqs, seed=3)
    assert [r.token_times for r in ones.records] == [r.token_times for r in plain.records]


def test_a_profiles_step_spread_is_checked_and_saved(tmp_path: Path) -> None:
    p = replace(profile((0.01,)), step_spread={"fleet-chunk": (0.9, 1.0, 1.6)})
    p.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").step_spread == {"fleet-chunk": (0.9, 1.0, 1.6)}
    with pytest.raises(ConfigError, match="unknown kind 'cluster-chunk'"):
        replace(p, step_spread={"cluster-chunk": (1.0, 1.0)})
    for bad in ((1.0,), (1.2, 1.0), (0.0, 1.0), (1.0, float("inf"))):
        with pytest.raises(ConfigError, match="non-decreasing positive"):
            replace(p, step_spread={"fleet-chunk": bad})


def test_the_step_spread_comes_from_the_traced_steps_around_their_mean(tmp_path: Path) -> None:
    from tokenloom.plan.calibrate import calibrate
    from tokenloom.plan.host import attribute, fit_spread, load_trace

    bare = profile((0.002, 1e-5, 2e-4))
    dec = [(1, 100)] * 4
    # 100 decode steps, 90 at their price and 10 at 3x: the ratio's mean is 1.2, so the quantiles are 1/1.2
    # up to the 90th, 3/1.2 = 2.5 from the 92nd (the 91st, at probability 0.905, lies between the two
    # samples); 10 chunk steps are too few for a table of their own.
    steps = [(float(i), bare.cost.step_time(dec) * (3.0 if i % 10 == 9 else 1.0), dec, 1e-3) for i in range(100)]
    steps += [(200.0 + i, bare.cost.step_time([(64, 0)]), [(64, 0)], 1e-3) for i in range(10)]
    trace = _timed_trace(tmp_path / "single.csv", steps)
    fit = fit_spread(attribute(bare, load_trace([trace])))
    assert set(fit.tables) == {"decode"} and fit.steps == {"chunk": 10, "decode": 100}
    t = fit.tables["decode"]
    assert len(t) == 100 and t[0] == pytest.approx(1 / 1.2, rel=1e-4) and t[89] == pytest.approx(1 / 1.2, rel=1e-4)
    assert 1 / 1.2 < t[90] < 2.5 and t[91] == pytest.approx(2.5, rel=1e-4) and t[-1] == pytest.approx(2.5, rel=1e-4)
    assert fit.line().startswith("step spread: chunk steps: 10 traced, too few (no spread); decode steps x0.83 / ")
    assert fit.line().endswith(" / x2.50 their mean at q10 / q90 / q99 (100 traced)")
    # Through calibrate: the single server's table under "single-decode", refitted afresh each time.
    real = replace(bare, overhead_step_s=1e-3, request_s=0.05)
    single = sim_bench_folder(tmp_path / "single-runs", real, FleetConfig(), [(0.2, None)])
    stale = replace(bare, step_spread={"fleet-chunk": (1.0, 9.0)})
    got = calibrate(stale, [single], FleetConfig(), step_traces=[trace])
    assert set(got.step_spread) == {"single-decode"}
    assert got.step_spread["single-decode"][-1] == pytest.approx(2.5, rel=0.05)
    assert got.calibration["single_spread_fit"].startswith("step spread: chunk steps: 10 traced")
