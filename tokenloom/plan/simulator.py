"""Discrete-event simulation of a fleet: a router in front of N workers, each running the engine's own
Scheduler and KVCacheManager / BlockPool on simulated time.

Each worker is the engine's step loop without a model: `Scheduler.schedule()` picks the batch, the step
takes `profile.step_time(rows)` simulated seconds (the step cost, plus the serving overhead `plan calibrate`
fitted, if any), then `Scheduler.update()` settles it with a token for
every row whose step reached the end of its known tokens (the runner's rule: a prefill chunk that stops
mid-prompt samples nothing). Prefix-cache hits, preemption (recomputation) and chunked prefill therefore
happen exactly as in the engine: it is the engine's code. What the simulation leaves out: stop strings
and EOS (a request ends at its output length, as `bench serve` asks with ignore_eos), speculative
decoding, and any serving time beyond the calibrated terms below.

Routing: colocated fleets choose a worker with tokenloom.router.policies (the router's own classes, over
the router's Worker records). Split fleets do what router/disagg.py does: choose the decode worker, then
a prefill worker (its own policy instance); the prefill worker computes the prompt (max_tokens 1), ships
its full blocks (bytes = blocks * block_size * kv_bytes_per_token, time = bytes / link bandwidth + latency),
the decode worker enters them in its prefix cache (the pool calls of disagg/blocks.py's import_prefix)
and then serves the request, finding the prompt cached. The copies hold the engines as they do in
serving, on the engine thread between steps: the prefill worker exports a finished prompt's blocks
before its next step, and the decode worker imports received blocks after its step in flight and before
the next (the profile's measured seconds per block; on the 2-core Xeon the import took 4.3 ms of the
decode worker's engine per 128-token prompt before disagg/blocks.py copied all blocks at once, 1.4 ms after).

Per-request serving time (the profile's calibrated terms, 0 in a bare profile) delays a request without
holding an engine: it reaches its worker's scheduler `request_s` after it arrives (plus `router_hop_s`
behind a router), and its response ends `response_s` after its last token. A split fleet's handoff takes
bytes / link bandwidth + link latency + the profile's `handoff_s`. Behind a router, every streamed
token costs `router_token_s` and every step of a colocated worker `router_step_s`: the CPU that the router
and the other workers take from the cores they all share on the measured machine, so it lengthens the
step that produced the token. A colocated worker's step with prompt tokens costs `peer_chunk_ratio` more of
its price while another worker has a step in flight (the profile timed it with the other cores idle). And
each step per second that the other workers stream tokens in slows a step that computes prompt tokens by
the profile's `interference_step_s` seconds per second (the fleet's workers share the host the profile was
calibrated on): a split fleet's prefill runs slower while its decode worker streams (the TTFT-gap fit, where
no step traces of the split workers were given). Only a prefill worker's steps: applied to a colocated
cluster's prefills too, the term fitted on the split fleet priced the 2-worker cluster's light-load TTFT
61-65% high (docs/benchmarks.md, plan validation run 11; run 12 without it: -9 to -14%). From the split
workers' traces instead, each role's step costs (1 + split_{prefill,decode}_ratio) x its engine price, plus
split_{prefill,decode}_peer_ratio x the price when it starts while the other role has work: for a prefill
step a decode worker with a step in flight or sequences to run (it steps on for the prefill's whole ~150
ms), for a decode step a prefill worker's step in flight.
Where the profile has a step spread (`step_spread`, fitted from served step traces), each step multiplies
its engine cost by a factor drawn from it (chunk or decode steps; of one worker, of colocated workers
sharing the host, or of a split fleet's workers), from a generator of its own so that the draws leave the
sampled tokens as they are: a p99 is made of the slow steps a constant price never has. (A split fleet
drew none while its prefill slowing was the TTFT-gap term: with a spread the calibration lowered that
term, and its loaded TTFT came out further short; docs/benchmarks.md, "Step-time spread".)
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenloom.engine.block_pool import NO_PARENT
from tokenloom.engine.kv_cache_manager import KVCacheManager
from tokenloom.engine.output_processor import OutputProcessor
from tokenloom.engine.sampler import SamplerOutput
from tokenloom.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from tokenloom.engine.sequence import Sequence, SequenceStatus
from tokenloom.errors import ConfigError, TokenloomError
from tokenloom.plan.profile_file import Profile
from tokenloom.plan.workload import VOCAB, SimRequest
from tokenloom.router.config import POLICIES, RouterConfig
from tokenloom.router.policies import Policy, make_policy
from tokenloom.router.prefix import routing_key
from tokenloom.router.workers import Worker
from tokenloom.sampling_params import SamplingParams


class SimulationError(TokenloomError):
    """The simulated fleet cannot serve the workload at all (e.g. a prompt larger than a worker's KV cache)."""


@dataclass(frozen=True)
class FleetConfig:
    workers: int = 1  # colocated workers; the decode workers when prefill_workers > 0
    prefill_workers: int = 0
    policy: str = "least_outstanding"  # the router's --policy
    max_num_seqs: int | None = None  # None: the profile's
    max_num_batched_tokens: int | None = None  # the prefill chunk: None: the profile's
    enable_prefix_caching: bool = True
    link_bandwidth: float = 10e9  # bytes/s of a prefill -> decode KV transfer
    link_latency_s: float = 1e-3  # per transfer (connection, signing); the profile's handoff_s adds to it
    router: bool | None = None  # behind a router (`tokenloom cluster`); None: when workers > 1 or split

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {self.workers}")
        if self.prefill_workers < 0:
            raise ConfigError(f"--prefill-workers must be >= 0, got {self.prefill_workers}")
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy {self.policy!r}: expected one of {', '.join(POLICIES)}")
        if self.link_bandwidth <= 0 or self.link_latency_s < 0:
            raise ConfigError("--link-bandwidth must be > 0 and --link-latency >= 0")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")

    @property
    def num_devices(self) -> int:
        return self.workers + self.prefill_workers

    @property
    def behind_router(self) -> bool:
        return self.router if self.router is not None else (self.workers > 1 or self.prefill_workers > 0)


class LengthOutput(OutputProcessor):
    """The output processor's part the scheduler needs, without a tokenizer: append the token and end the
    sequence at max_tokens (the simulated requests ignore EOS, as the bench's do)."""

    def __init__(self) -> None:  # noqa: D107 - no tokenizer: nothing is detokenized
        pass

    def append(self, seq: Sequence, token: int, logprob: object) -> SequenceStatus | None:
        seq.token_ids.append(token)
        if seq.num_output_tokens >= seq.max_tokens:
            seq.output.finish_reason = "length"
            return SequenceStatus.FINISHED_LENGTH
        return None


@dataclass
class SimRecord:
    """One request's simulated timeline (seconds of simulated time)."""

    request: SimRequest
    worker: int = -1  # the (decode) worker that served it
    prefill_worker: int | None = None
    first_token: float | None = None
    end: float | None = None
    token_times: list[float] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens found in the serving worker's prefix cache
    preemptions: int = 0
    kv_transfer_s: float = 0.0


def spread_factor(quantiles: tuple[float, ...], u: float) -> float:
    """The step-spread factor at probability u in [0, 1): linear between the quantiles, which sit at (i + 0.5)
    / n (profile_file.SPREAD_KEYS), and held at the first and last beyond them."""
    n = len(quantiles)
    x = min(max(u * n - 0.5, 0.0), n - 1.0)
    i = min(int(x), n - 2)
    return quantiles[i] + (quantiles[i + 1] - quantiles[i]) * (x - i)


class SimWorker:
    """One engine: the engine's Scheduler and KV cache manager, and a step that takes the profile's time."""

    def __init__(self, index: int, role: str, profile: Profile, fleet: FleetConfig, rng: random.Random,
                 spread_rng: random.Random | None = None) -> None:
        self.index, self.role = index, role
        self.kv = KVCacheManager(profile.num_blocks, profile.block_size, fleet.enable_prefix_caching,
                                 windows=profile.windows)
        seqs = fleet.max_num_seqs or profile.max_num_seqs
        budget = max(fleet.max_num_batched_tokens or profile.max_num_batched_tokens, seqs)
        self.scheduler = Scheduler(SchedulerConfig(seqs, budget, profile.max_model_len), self.kv)
        self.output = LengthOutput()
        self.profile = profile
        self.route = Worker(f"http://{role}-{index}.sim", index, healthy=True)  # what the router's policy sees
        self.batch: ScheduledBatch | None = None
        self.rng = rng
        # The step spread's quantiles for (chunk, decode) steps, or None (module doc).
        kind = "split" if role != "worker" else "single" if fleet.workers == 1 else "fleet"
        self.spread = (profile.step_spread.get(f"{kind}-chunk"), profile.step_spread.get(f"{kind}-decode"))
        self.spread_rng = spread_rng or random.Random(0)
        self.steps = 0
        self.busy_s = 0.0
        self.samples: list[tuple[int, int, float]] = []  # per step: (waiting, running, KV usage)
        # Behind the router, the shared cores' cost per token this worker streams through it (a prefill
        # worker streams none), and per step of a colocated worker, whose peers step as often as it does (a
        # split fleet's decode worker shares its cores with a prefill worker that is mostly idle: charged
        # per step, its light-load TPOT came out 46% high in a re-judged plan validation run 20).
        routed = fleet.behind_router and role != "prefill"
        self.router_step_s = profile.router_step_s if routed and role == "worker" else 0.0
        self.token_s = profile.router_token_s if routed else 0.0
        # A colocated worker's prompt chunks beside another worker's step: the profile timed them alone.
        self.chunk_ratio = profile.peer_chunk_ratio if role == "worker" and fleet.workers > 1 else 0.0
        # A split fleet's worker: its step's price x (alone, beside the other role's work) more.
        # (alone, beside the other role's work, holding a prompt chunk): only a decode worker has the last.
        ratios = {"prefill": (profile.split_prefill_ratio, profile.split_prefill_peer_ratio, 0.0),
                  "decode": (profile.split_decode_ratio, profile.split_decode_peer_ratio,
                             profile.split_decode_chunk_ratio)}
        self.split_ratio = ratios.get(role, (0.0, 0.0, 0.0))
        self.stream_rate = 0.0  # 1 / its step's duration while a step that streams tokens is in flight, else 0
        # A split fleet's KV handoff copies on the engine thread between steps (the profile's per-block
        # export / import times): held until then, no step starts; imports that arrive during a step wait.
        self.held = False
        self.imports: list[tuple[SimRecord, Sequence]] = []

    def start_step(self, others_rate: float = 0.0, peer_stepping: bool = False,
                   other_role_busy: bool = False) -> float | None:
        """Schedule a step; its duration, or None when there is nothing to run. `others_rate`: the streaming
        steps per second of the fleet's other workers at this moment (their steps in flight);
        `peer_stepping`: whether another worker has a step in flight now; `other_role_busy`: in a split
        fleet, whether a worker of the other role has work now (Simulation._kick)."""
        if not self.scheduler.has_unfinished():
            return None
        batch = self.scheduler.schedule()
        if not batch:
            waiting = self.scheduler.waiting()
            need = waiting[0].num_tokens if waiting else 0
            raise SimulationError(f"worker {self.role}/{self.index} cannot admit a {need}-token request: its KV "
                                  f"cache ({self.kv.pool.num_blocks} blocks of {self.kv.block_size}) or token "
                                  f"budget is too small")
        self.batch = batch
        rows = [(n, s.num_computed_tokens) for s, n in zip(batch.seqs, batch.num_new_tokens)]
        self.samples.append((self.scheduler.num_waiting, self.scheduler.num_running, self.kv.usage))
        # Rows whose step reaches the end of their known tokens sample one token each (see finish_step).
        streamed = sum(1 for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_computed_tokens + n == s.num_tokens)
        chunk = any(n > 1 for n in batch.num_new_tokens)
        table = self.spread[0 if chunk else 1]
        spread = spread_factor(table, self.spread_rng.random()) if table else 1.0
        dt = self.profile.step_time(rows, spread) + self.router_step_s + self.token_s * streamed
        # Fractions of the engine's price (no spread, no overheads), as plan/host.py fits them: a split
        # fleet's role ratios, a colocated worker's prompt chunk beside another worker's step (fit_peer_chunks).
        alone, peer, holding_chunk = self.split_ratio
        extra = (alone + (peer if other_role_busy else 0.0) + (holding_chunk if chunk else 0.0)
                 + (self.chunk_ratio if chunk and peer_stepping else 0.0))
        if extra:
            dt += extra * self.profile.cost.step_time(rows)
        if chunk:
            # Interference slows prompt computation (measured: a split fleet's TTFT grows with the decode
            # worker's streams); decode-only steps showed none (a 2-worker cluster's TPOT at concurrency 8).
            dt *= 1.0 + self.profile.interference_step_s * others_rate
        # A prefill worker's one token goes back to the router, not to a client stream.
        self.stream_rate = 1.0 / dt if streamed and self.role != "prefill" and dt > 0 else 0.0
        self.steps += 1
        self.busy_s += dt
        return dt

    def finish_step(self) -> tuple[list[Sequence], list[Sequence]]:
        """Settle the step with the engine's `update`; returns (sequences that got a token, finished ones)."""
        batch = self.batch
        if batch is None:
            raise SimulationError("finish_step without a step in flight")
        self.batch = None
        self.stream_rate = 0.0
        # The runner's rule: a row samples when its step reaches the end of the tokens it knows.
        tokens: list[int | None] = [self.rng.randrange(VOCAB) if s.num_computed_tokens + n == s.num_tokens else None
                                    for s, n in zip(batch.seqs, batch.num_new_tokens)]
        update = self.scheduler.update(batch, SamplerOutput(tokens, [None] * len(tokens)), self.output)
        return update.sampled, update.finished

    def import_prefix(self, token_ids: tuple[int, ...], num_blocks: int) -> None:
        """Enter a received prompt's first `num_blocks` full blocks in the prefix cache, with the same pool
        calls as disagg/blocks.py's import_prefix (allocate, index, release as cached)."""
        kv, pool = self.kv, self.kv.pool
        if not kv.enable_prefix_caching:
            return
        bs, held, parent, parent_hash = kv.block_size, [], NO_PARENT, None
        try:
            for i in range(num_blocks):
                tokens = tuple(token_ids[i * bs:(i + 1) * bs])
                h = kv.hash_fn(parent_hash, tokens)
                b = pool.lookup(h, tokens, parent)
                if b is not None:
                    pool.incref([b])
                else:
                    if pool.num_free == 0:
                        break
                    b = pool.allocate(1)[0]
                    if pool.cache(b, h, tokens, parent) != b:
                        held.append(b)
                        break
                held.append(b)
                parent, parent_hash = b, h
        finally:
            pool.free(list(reversed(held)))


@dataclass
class SimResult:
    records: list[SimRecord]
    duration: float  # simulated seconds from the first arrival to the last response's end
    workers: list[SimWorker]
    fleet: FleetConfig


_ARRIVE, _STEP_DONE, _KV_ARRIVED, _ENQUEUE, _RESUME = 0, 1, 2, 3, 4


class Simulation:
    def __init__(self, profile: Profile, fleet: FleetConfig, seed: int = 0,
                 on_step: Callable[[SimWorker], None] | None = None) -> None:
        self.profile, self.fleet = profile, fleet
        self.rng = random.Random(seed)
        spread_rng = random.Random(f"step-spread-{seed}")  # apart from self.rng: same tokens with or without
        self.decode = [SimWorker(i, "decode" if fleet.prefill_workers else "worker", profile, fleet, self.rng,
                                 spread_rng) for i in range(fleet.workers)]
        self.prefill = [SimWorker(i, "prefill", profile, fleet, self.rng, spread_rng)
                        for i in range(fleet.prefill_workers)]
        self.workers = self.decode + self.prefill
        router = RouterConfig(workers=tuple(w.route.url for w in self.decode), policy=fleet.policy)  # type: ignore[arg-type]
        self.policy: Policy = make_policy(router)
        self.prefill_policy: Policy = make_policy(router)  # the router's disagg has its own instance too
        self.key_chunk, self.key_chunks = router.prefix_chunk_chars, router.prefix_max_chunks
        self.on_step = on_step  # called after every settled step (tests check invariants there)
        self._events: list[tuple[float, int, int, object]] = []
        self._order = itertools.count()
        self._arrivals = itertools.count()
        # Arrival -> enqueue: the worker's HTTP layer, and the router's hop in front of it.
        self.admit_s = profile.request_s + (profile.router_hop_s if fleet.behind_router else 0.0)

    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self._events, (t, next(self._order), kind, payload))

    def _key(self, req: SimRequest) -> tuple[bytes, ...]:
        # The router hashes prompt text; 4 hex characters per token id makes its 64-character chunk one
        # 16-token block, as on real text (about 4 characters per token).
        if not self.policy.uses_key:
            return ()
        return routing_key("".join(f"{t:04x}" for t in req.prompt_token_ids), self.key_chunk, self.key_chunks)

    def _sequence(self, rec: SimRecord, max_tokens: int, tag: str) -> Sequence:
        n = next(self._arrivals)
        req = rec.request
        if req.input_len >= self.profile.max_model_len:
            raise SimulationError(f"a {req.input_len}-token prompt does not fit max_model_len {self.profile.max_model_len}")
        max_tokens = min(max_tokens, self.profile.max_model_len - req.input_len)
        seq = Sequence(seq_id=f"{tag}{n}", request_id=f"{tag}{n}", index=0, prompt_token_ids=list(req.prompt_token_ids),
                       params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens=max_tokens,
                       stop_token_ids=frozenset(), arrival_order=n)
        return seq

    def _submit(self, worker: SimWorker, seq: Sequence, now: float) -> None:
        worker.scheduler.add(seq)
        if worker.batch is None and not worker.held:
            self._kick(worker, now)

    def _admit(self, worker: SimWorker, seq: Sequence, now: float) -> None:
        """Enqueue after the per-request serving time; at once without one (so that a request arriving with
        a step's end joins the next step, as it did before the term existed)."""
        if self.admit_s > 0:
            self._push(now + self.admit_s, _ENQUEUE, (worker, seq))
        else:
            self._submit(worker, seq, now)

    def _kick(self, worker: SimWorker, now: float) -> None:
        # Only a split fleet's prefill workers: see the module docstring.
        slowed = self.profile.interference_step_s and worker.role == "prefill"
        others = sum(w.stream_rate for w in self.workers if w is not worker) if slowed else 0.0
        stepping = worker.chunk_ratio > 0 and any(w.batch is not None for w in self.workers if w is not worker)
        beside = worker.split_ratio[1] > 0 and self._other_role_busy(worker)
        dt = worker.start_step(others, stepping, beside)
        if dt is not None:
            self._push(now + dt, _STEP_DONE, worker)

    def _other_role_busy(self, worker: SimWorker) -> bool:
        """Whether a split fleet's worker of the other role has work as `worker` (a prefill or decode worker)
        starts a step: a decode worker with a step in flight, copies, or sequences to run (a prefill step
        lasts many decode steps, and the decode worker steps on while it has sequences); a prefill worker
        with a step in flight."""
        if worker.role == "prefill":
            return any(w.batch is not None or w.held or w.scheduler.has_unfinished() for w in self.decode)
        return any(w.batch is not None for w in self.prefill)

    def run(self, requests: list[SimRequest]) -> SimResult:
        if not requests:
            raise ConfigError("the workload has no requests")
        records = [SimRecord(r) for r in requests]
        for rec in records:
            self._push(rec.request.arrival, _ARRIVE, rec)
        owner: dict[int, tuple[SimRecord, bool]] = {}  # id(seq) -> (record, whether it is a prefill-only pass)
        decode_of: dict[int, SimWorker] = {}  # id(record) -> its decode worker (split fleets)
        now = 0.0
        while self._events:
            now, _, kind, payload = heapq.heappop(self._events)
            if kind == _ARRIVE:
                # The router (or the server's HTTP layer) decides at arrival; the request reaches the
                # scheduler after its per-request serving time, which holds no engine.
                rec = payload  # type: ignore[assignment]
                key = self._key(rec.request)
                dw = self._choose(self.policy, self.decode, key)
                dw.route.outstanding += 1
                rec.worker = dw.index
                if self.prefill:
                    pw = self._choose(self.prefill_policy, self.prefill, key)
                    pw.route.outstanding += 1
                    rec.prefill_worker = pw.index
                    decode_of[id(rec)] = dw
                    seq = self._sequence(rec, 1, "p")
                    owner[id(seq)] = (rec, True)
                    self._admit(pw, seq, now)
                else:
                    seq = self._sequence(rec, rec.request.output_len, "r")
                    owner[id(seq)] = (rec, False)
                    self._admit(dw, seq, now)
            elif kind == _ENQUEUE:
                target, seq = payload  # type: ignore[misc]
                self._submit(target, seq, now)
            elif kind == _STEP_DONE:
                worker: SimWorker = payload  # type: ignore[assignment]
                sampled, finished = worker.finish_step()
                if self.on_step is not None:
                    self.on_step(worker)
                for seq in sampled:
                    rec, prefill_only = owner[id(seq)]
                    if not prefill_only:
                        rec.token_times.append(now)
                        if rec.first_token is None:
                            rec.first_token = now
                hold = 0.0  # the engine thread's handoff copies after this step (export, then imports)
                for seq in finished:
                    rec, prefill_only = owner.pop(id(seq))
                    worker.route.outstanding -= 1
                    if prefill_only:
                        hold += self._blocks(rec) * self.profile.kv_export_s_per_block
                        self._ship(rec, seq, decode_of.pop(id(rec)), now + hold)
                    else:
                        rec.end = now + self.profile.response_s
                        rec.cached_tokens = seq.num_cached_tokens or 0
                        rec.preemptions = seq.num_preemptions
                self._hold_or_kick(worker, hold, now)
            elif kind == _KV_ARRIVED:
                rec, dw = payload  # type: ignore[misc]
                seq = self._sequence(rec, rec.request.output_len, "d")
                owner[id(seq)] = (rec, False)
                dw.imports.append((rec, seq))
                if dw.batch is None and not dw.held:  # else after its step in flight (or copies) ends
                    self._hold_or_kick(dw, 0.0, now)
            else:  # _RESUME: the handoff copies are done
                worker, copied = payload  # type: ignore[misc]
                worker.held = False
                self._enter(worker, copied, now)
                self._hold_or_kick(worker, 0.0, now)
        start = min(r.request.arrival for r in records)
        last = max([now] + [r.end for r in records if r.end is not None])
        return SimResult(records, max(last - start, 1e-9), self.workers, self.fleet)

    def _blocks(self, rec: SimRecord) -> int:
        """Full blocks of a request's prompt: what a split fleet's handoff exports, ships and imports."""
        return rec.request.input_len // self.profile.block_size

    def _hold_or_kick(self, worker: SimWorker, hold: float, now: float) -> None:
        """Between steps: copy the received blocks that wait (holding the engine for their import time,
        and `hold` seconds of other copies), then enter them (their requests reach the scheduler) and
        start the next step. Blocks that arrive during the copies wait for the next round."""
        pending = worker.imports
        hold += sum(self._blocks(rec) for rec, _ in pending) * self.profile.kv_import_s_per_block
        if hold > 0:
            worker.held = True
            worker.busy_s += hold
            worker.imports = []
            self._push(now + hold, _RESUME, (worker, pending))
            return
        self._enter(worker, pending, now)
        worker.imports = []
        if worker.batch is None:
            self._kick(worker, now)

    def _enter(self, worker: SimWorker, imported: list[tuple[SimRecord, Sequence]], now: float) -> None:
        """The imported blocks enter the prefix cache; each request follows through the decode worker's
        HTTP layer (request_s after the import's reply, as any request reaches a worker's scheduler): on
        a busy worker it then waits for the step that started meanwhile, a second wait beside the
        import's. Served, a split fleet's decode worker on the 2-core Xeon took the request 22 ms after
        the prompt's export when idle, 140-205 ms (3-4 decode steps) at 6-12 req/s (docs/benchmarks.md,
        plan validation run 15)."""
        for rec, seq in imported:
            worker.import_prefix(rec.request.prompt_token_ids, self._blocks(rec))
            if self.profile.request_s > 0:
                self._push(now + self.profile.request_s, _ENQUEUE, (worker, seq))
            else:
                worker.scheduler.add(seq)

    def _ship(self, rec: SimRecord, seq: Sequence, dw: SimWorker, now: float) -> None:
        """A prefill finished: its full blocks travel to the decode worker (whose request was counted as
        outstanding there since it arrived, as the router does)."""
        nbytes = self._blocks(rec) * self.profile.block_size * self.profile.kv_bytes_per_token
        rec.kv_transfer_s = nbytes / self.fleet.link_bandwidth + self.fleet.link_latency_s + self.profile.handoff_s
        self._push(now + rec.kv_transfer_s, _KV_ARRIVED, (rec, dw))

    @staticmethod
    def _choose(policy: Policy, workers: list[SimWorker], key: tuple[bytes, ...]) -> SimWorker:
        chosen = policy.choose([w.route for w in workers], key)
        return workers[chosen.index]


def simulate(profile: Profile, fleet: FleetConfig, requests: list[SimRequest], seed: int = 0,
             on_step: Callable[[SimWorker], None] | None = None) -> SimResult:
    return Simulation(profile, fleet, seed, on_step).run(requests)
