"""`tokenloom plan profile | hardware | calibrate | host | simulate | search`: the capacity planner's commands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tokenloom.engine_args import add_engine_args, engine_config
from tokenloom.errors import ConfigError


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _floats(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def _workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=500, help="Poisson arrivals per simulated rate")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    g.add_argument("--output-len", type=int, default=128, help="output tokens (requests ignore EOS, as bench's)")
    g.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- r)")
    g.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of a prefix every prompt shares")
    g.add_argument("--trace", type=Path, default=None,
                   help="replay a `bench serve` records.csv (arrival times, lengths, sessions) instead of Poisson")
    g.add_argument("--system-len", type=int, default=0, help="--trace of an agentic run: its --system-len")
    g.add_argument("--seed", type=int, default=0)


def _fleet_args(p: argparse.ArgumentParser) -> None:
    from tokenloom.router.config import POLICIES

    g = p.add_argument_group("fleet")
    g.add_argument("--policy", default="least_outstanding", choices=POLICIES, help="the router's policy")
    g.add_argument("--no-prefix-caching", action="store_true", help="workers run without the prefix cache")
    g.add_argument("--link-bandwidth", type=float, default=10e9, help="prefill -> decode KV transfer, bytes/s")
    g.add_argument("--link-latency", type=float, default=1e-3, help="prefill -> decode KV transfer, s per request")


def add_plan_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    plan = sub.add_parser("plan", help="capacity planner: simulate fleets with the engine's scheduler and "
                                       "measured (or analytic) step costs")
    psub = plan.add_subparsers(dest="plan_command", required=True)

    pr = psub.add_parser("profile", help="time real engine steps on this machine and fit a step-cost model")
    pr.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    pr.add_argument("--decode-rows", type=_ints, default=[1, 4, 16, 64, 128])
    pr.add_argument("--context-lens", type=_ints, default=[128, 512, 2048])
    pr.add_argument("--decode-steps", type=int, default=4, help="timed decode steps per grid point")
    pr.add_argument("--settle-steps", type=int, default=8,
                    help="untimed decode steps before them (a step right after a prefill runs slower on CPU)")
    pr.add_argument("--mixed-prompt-len", type=int, default=256, help="prompt joining the decodes in a mixed step")
    pr.add_argument("--warmup-steps", type=int, default=8)
    pr.add_argument("--prefill-lens", type=_ints, default=[16, 64, 128, 256, 512],
                    help="lone prefills of these lengths, at zero context and after each --context-lens")
    pr.add_argument("--prefill-repeats", type=int, default=3, help="timed lone prefills per length at zero context")
    add_engine_args(pr)
    pr.set_defaults(func=_profile)

    hw = psub.add_parser("hardware", help="an analytic (roofline) profile from a hardware spec: not measured")
    hw.add_argument("--hardware", required=True, help="H100, H200, L4, epyc-zen4-2core, xeon-spr-56core or a JSON spec")
    hw.add_argument("--model", required=True, help="smollm2-135m, llama-3.1-8b, an HF folder / config.json or a .gguf")
    hw.add_argument("--out", type=Path, required=True)
    hw.add_argument("--tp", type=int, default=1, help="tensor-parallel devices per worker")
    hw.add_argument("--weight-bytes", type=float, default=2.0, help="bytes per weight (2: bf16, 1: int8/fp8)")
    hw.add_argument("--kv-bytes", type=float, default=2.0, help="bytes per K/V value")
    hw.add_argument("--block-size", type=int, default=16)
    hw.add_argument("--max-num-seqs", type=int, default=256)
    hw.add_argument("--max-num-batched-tokens", type=int, default=2048)
    hw.add_argument("--max-model-len", type=int, default=None, help="default: the model's, at most 32768")
    hw.add_argument("--mfu", type=float, default=None, help="override the spec's achievable fraction of peak FLOP/s")
    hw.add_argument("--mbu", type=float, default=None, help="override the spec's achievable fraction of bandwidth")
    hw.add_argument("--overhead", type=float, default=None, help="override the spec's host seconds per step")
    hw.set_defaults(func=_hardware)

    ca = psub.add_parser("calibrate", help="fit the serving overhead outside engine steps to real bench runs")
    ca.add_argument("--profile", type=Path, required=True)
    ca.add_argument("--bench", type=Path, nargs="+", required=True, help="`bench serve` results folders")
    ca.add_argument("--workers", type=int, default=1, help="workers of the measured server (1: `serve`)")
    ca.add_argument("--cluster-bench", type=Path, nargs="+", default=None,
                    help="`bench serve` folders of a cluster behind the router: its light point (concurrency 1) fits the "
                         "router's per-request hop, a loaded one (e.g. concurrency 8) its per-token cost")
    ca.add_argument("--cluster-workers", type=int, default=2, help="workers of that cluster")
    ca.add_argument("--split-bench", type=Path, nargs="+", default=None,
                    help="`bench serve` folders of a 1 prefill + 1 decode cluster: its light point fits the handoff, a "
                         "loaded one (e.g. concurrency 4) how the decode worker's streams slow the prefill worker")
    ca.add_argument("--step-trace", type=Path, nargs="+", default=None,
                    help="the server's `serve --step-trace` CSV over the --bench runs: fits the per-step and per-row "
                         "overhead from its steps instead of from the runs' TPOT medians")
    ca.add_argument("--cluster-step-trace", type=Path, nargs="+", default=None,
                    help="the cluster workers' step traces over the --cluster-bench runs (`cluster --step-trace-dir`): "
                         "fits the router's per-step and per-token cost from their steps instead of the per-token "
                         "cost from the loaded TPOT (leave out steps of a concurrency-1 run: one worker steps at "
                         "a time there)")
    ca.add_argument("--split-step-trace", type=Path, nargs="+", default=None,
                    help="the split cluster's workers' step traces over the --split-bench runs (`cluster "
                         "--step-trace-dir`, decode worker first, then prefill): fits what each role's steps cost "
                         "against their price, alone and beside the other role's work, instead of the "
                         "interference from the loaded TTFT (best with runs at many rows per step among them, "
                         "e.g. concurrency 16)")
    ca.add_argument("--seed", type=int, default=0)
    ca.add_argument("--out", type=Path, required=True, help="the calibrated profile")
    ca.set_defaults(func=_calibrate)

    ho = psub.add_parser("host", help="a served step trace against a profile: what serving adds to each step")
    ho.add_argument("--profile", type=Path, required=True)
    ho.add_argument("--step-trace", type=Path, nargs="+", required=True, help="`serve --step-trace` CSV file(s)")
    ho.set_defaults(func=_host)

    si = psub.add_parser("simulate", help="simulate a fleet at one or more request rates")
    si.add_argument("--profile", type=Path, required=True)
    si.add_argument("--workers", type=_ints, default=[1], help="colocated (or decode) workers; a list sweeps")
    si.add_argument("--prefill-workers", type=int, default=0, help="split fleet: this many prefill workers")
    si.add_argument("--rate", type=_floats, default=None, help="request rates, req/s (a list sweeps)")
    si.add_argument("--max-num-seqs", type=int, default=None, help="default: the profile's")
    si.add_argument("--max-num-batched-tokens", type=int, default=None, help="chunk size; default: the profile's")
    si.add_argument("--slo-ttft", type=float, default=None, help="seconds; enables goodput")
    si.add_argument("--slo-tpot", type=float, default=None, help="seconds; enables goodput")
    si.add_argument("--out", type=Path, default=None, help="folder for summary.json, sweep.png, report.html")
    _workload_args(si)
    _fleet_args(si)
    si.set_defaults(func=_simulate)

    se = psub.add_parser("search", help="the cheapest fleet that meets p99 TTFT / TPOT SLOs at a rate")
    se.add_argument("--profile", type=Path, required=True)
    se.add_argument("--rate", type=float, default=None, help="req/s (or --trace)")
    se.add_argument("--slo-ttft-p99", type=float, required=True, help="seconds")
    se.add_argument("--slo-tpot-p99", type=float, required=True, help="seconds")
    se.add_argument("--max-workers", type=int, default=64)
    se.add_argument("--prefill-shares", type=_floats, default=[0.0, 0.25, 0.5],
                    help="prefill workers' share of a fleet (0: colocated)")
    se.add_argument("--max-num-seqs", type=_ints, default=None, help="candidates (default: the profile's)")
    se.add_argument("--chunk-sizes", type=_ints, default=None, help="max-num-batched-tokens candidates")
    se.add_argument("--out", type=Path, default=None, help="JSON of every fleet tried and the answer")
    _workload_args(se)
    _fleet_args(se)
    se.set_defaults(func=_search)


def _requests(args: argparse.Namespace, rate: float | None) -> list[Any]:
    from tokenloom.plan.workload import poisson, replay

    if args.trace is not None:
        return replay(args.trace, args.system_len, args.seed)
    if rate is None:
        raise ConfigError("give --rate (Poisson arrivals) or --trace (a bench records.csv)")
    return poisson(rate, args.num_requests, args.input_len, args.output_len, args.seed, args.random_range_ratio,
                   args.shared_prefix_len)


def _fleet(args: argparse.Namespace, workers: int, prefill: int, seqs: int | None = None,
           chunk: int | None = None) -> Any:
    from tokenloom.plan.simulator import FleetConfig

    return FleetConfig(workers, prefill, args.policy, seqs, chunk, not args.no_prefix_caching, args.link_bandwidth,
                       args.link_latency)


def _profile(args: argparse.Namespace) -> int:
    from tokenloom.plan.profile import ProfileGrid, profile_engine

    grid = ProfileGrid(tuple(args.decode_rows), tuple(args.context_lens), args.decode_steps,
                       args.settle_steps, args.mixed_prompt_len, args.warmup_steps, tuple(args.prefill_lens),
                       args.prefill_repeats)
    prof = profile_engine(engine_config(args), grid, log=lambda m: print(m, file=sys.stderr, flush=True))
    prof.save(args.out)
    print(f"profile of {prof.model} ({prof.machine.get('cpu')}): {len(prof.fit['samples'])} steps, cost "
          f"{prof.cost.to_json()['coef']} (s per {', '.join(prof.cost.to_json()['features'])}); median relative "
          f"error {prof.fit['median_rel_error']:.1%}, p90 {prof.fit['p90_rel_error']:.1%} -> {args.out}")
    return 0


def _hardware(args: argparse.Namespace) -> int:
    from tokenloom.plan.hardware import ANALYTIC, ModelShape, RooflineStepCost, load_model_shape, load_spec, with_overrides
    from tokenloom.plan.profile_file import Profile

    spec = with_overrides(load_spec(args.hardware), mfu=args.mfu, mbu=args.mbu, overhead_s=args.overhead)
    cfg = load_model_shape(args.model)
    cost = RooflineStepCost(spec, ModelShape.of(cfg, args.weight_bytes, args.kv_bytes), args.tp)
    max_len = args.max_model_len or min(cfg.max_position_embeddings, 32768)
    blocks = cost.kv_capacity_tokens() // args.block_size
    prof = Profile(ANALYTIC, args.model, cost, args.block_size, blocks, cost.shape.kv_bytes_per_token,
                   args.max_num_seqs, args.max_num_batched_tokens, max_len,
                   machine={"hardware": spec.name, "note": spec.note, "tp": args.tp})
    prof.save(args.out)
    one = cost.step_parts([(1, 1024)])
    print(f"{ANALYTIC}: {args.model} on {args.tp} x {spec.name}: {blocks} KV blocks of {args.block_size}; one decode "
          f"row at 1,024 context: {cost.step_time([(1, 1024)]) * 1e3:.2f} ms (compute {one['compute_s'] * 1e3:.3f}, "
          f"memory {one['memory_s'] * 1e3:.3f}, overhead {one['overhead_s'] * 1e3:.1f}) -> {args.out}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from tokenloom.plan.calibrate import calibrate, overheads_line
    from tokenloom.plan.profile_file import Profile
    from tokenloom.plan.simulator import FleetConfig

    cluster = (args.cluster_bench, FleetConfig(workers=args.cluster_workers, router=True)) if args.cluster_bench else None
    split = (args.split_bench, FleetConfig(workers=1, prefill_workers=1)) if args.split_bench else None
    prof = calibrate(Profile.load(args.profile), args.bench, FleetConfig(workers=args.workers), args.seed,
                     cluster=cluster, split=split, step_traces=args.step_trace,
                     cluster_step_traces=args.cluster_step_trace, split_step_traces=args.split_step_trace, log=print)
    prof.save(args.out)
    print(f"serving overhead: {overheads_line(prof)}, from {len(prof.calibration['points'])} measured points "
          f"-> {args.out}")
    return 0


def _host(args: argparse.Namespace) -> int:
    from tokenloom.plan.host import attribute, bucket_table, fit_overheads, load_trace
    from tokenloom.plan.profile_file import Profile

    df = attribute(Profile.load(args.profile), load_trace(args.step_trace))
    print("per step, medians in ms: the profile's price for the rows, the engine step as served, the loop "
          "iteration, and the two differences (inside the step, around it)")
    print(bucket_table(df).to_string())
    print(f"served {df['served'].sum():.1f} s in {len(df)} steps against {df['predicted'].sum():.1f} s priced; "
          f"overhead fit: {fit_overheads(df).line()}")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from tokenloom.plan.metrics import fleet_summary, format_summary
    from tokenloom.plan.profile_file import Profile
    from tokenloom.plan.report import fleet_name, write_report
    from tokenloom.plan.simulator import simulate

    if args.trace is not None and args.rate is not None:
        raise ConfigError("--rate and --trace exclude each other (a trace brings its own arrival times)")
    prof = Profile.load(args.profile)
    points = []
    for workers in args.workers:
        for rate in (args.rate or [None]):
            fleet = _fleet(args, workers, args.prefill_workers, args.max_num_seqs, args.max_num_batched_tokens)
            s = fleet_summary(simulate(prof, fleet, _requests(args, rate), args.seed), args.slo_ttft, args.slo_tpot)
            name = fleet_name(workers, args.prefill_workers)
            print(f"== {name}, {'trace ' + str(args.trace) if rate is None else f'{rate:g} req/s'} ({prof.source})")
            print(format_summary(s))
            points.append({"fleet": name, "rate": rate if rate is not None else s["request_throughput"], **s})
    if args.out is not None:
        path = write_report(args.out, points, {"model": prof.model, "source": prof.source, "profile": str(args.profile)})
        print(f"report: {path}")
    return 0


def _search(args: argparse.Namespace) -> int:
    from tokenloom.plan.profile_file import Profile
    from tokenloom.plan.search import SLO, search

    prof = Profile.load(args.profile)
    slo = SLO(args.slo_ttft_p99, args.slo_tpot_p99)
    reqs = _requests(args, args.rate)
    best, tried = search(prof, reqs, slo, _fleet(args, 1, 0), args.prefill_shares, args.max_num_seqs or [None],
                         args.chunk_sizes or [None], args.max_workers, args.seed,
                         log=lambda m: print(m, file=sys.stderr, flush=True))
    answer: dict[str, Any] = {"profile": str(args.profile), "source": prof.source, "rate": args.rate,
                              "slo": {"ttft_p99": slo.ttft_p99, "tpot_p99": slo.tpot_p99}, "answer": None,
                              "tried": [{"workers": c.fleet.workers, "prefill_workers": c.fleet.prefill_workers,
                                         "max_num_seqs": c.fleet.max_num_seqs or prof.max_num_seqs,
                                         "chunk": c.fleet.max_num_batched_tokens or prof.max_num_batched_tokens,
                                         "meets": c.meets, "ttft_s_p99": c.summary["ttft_s_p99"],
                                         "tpot_s_p99": c.summary["tpot_s_p99"]} for c in tried]}
    if best is None:
        print(f"no fleet of up to {args.max_workers} workers meets p99 TTFT <= {slo.ttft_p99} s and p99 TPOT <= "
              f"{slo.tpot_p99} s ({prof.source})")
    else:
        f = best.fleet
        answer["answer"] = answer["tried"][tried.index(best)]
        kind = f"{f.prefill_workers} prefill + {f.workers} decode" if f.prefill_workers else f"{f.workers} colocated"
        print(f"cheapest: {best.devices} workers ({kind}), max-num-seqs {f.max_num_seqs or prof.max_num_seqs}, chunk "
              f"{f.max_num_batched_tokens or prof.max_num_batched_tokens}: p99 TTFT {best.summary['ttft_s_p99'] * 1e3:.0f} ms, "
              f"p99 TPOT {best.summary['tpot_s_p99'] * 1e3:.1f} ms, {best.summary['request_throughput']:.1f} req/s "
              f"({prof.source})")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(answer, indent=1))
    return 0 if best is not None else 1
