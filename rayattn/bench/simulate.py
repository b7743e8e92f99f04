"""Discrete-event simulator of a rayattn fleet: N modelled engine replicas and the shipped
routing core (rayattn/routing/core.py) choosing among them, through the same request
lifecycle as the ingress (request → choose → dispatched → first token → finished → ended),
so the policy's cost model refits from simulated engine timings exactly as it does from
real ones.

Engine model (one replica), a step loop like vLLM's scheduler:
  * every step runs all running sequences' next token plus prompt chunks from the waiting
    queue (FIFO) up to `max_batched_tokens`, at most `max_seqs` sequences;
  * a step has a fixed part, itl_base_s + itl_per_seq_s × decodes (reading the weights,
    which every step pays once, and each decode's own cost), and a compute part,
    prefill_s_per_token × the prompt tokens it computes; `step_overlap` of the shorter
    runs under the longer: 0 adds them, 1 takes the longer (a roofline: a short extend
    rides on the weights' read almost free while a long prefill is bound by compute).
    Added to that: ctx_s_per_token × cached tokens the new prompts attend to +
    attn_s_per_token_pair × Σ over prompt chunks of (tokens computed × tokens before them)
    (attention of the new tokens over their context: what makes a long extend slower than
    a short one with the same number of new tokens); all of it × (1 + contention × the
    other engines of its host that have work when the step starts), for engines that
    share one host's cores or one GPU and slow each other down;
  * a prompt's cache hit is decided when it is first scheduled, by the replica's block LRU
    (bounded by its KV capacity), with vLLM's rule (whole blocks, never the last token);
    its blocks are cached once its prefill completes, prompt + output when it finishes.
The router spends `router_s` on each request before it chooses (rendering, tokenizing,
hashing), drawn per request from an exponential with that mean: requests that arrive
together leave the router's renderer threads in either order, as they do in the real
router, which is what decides where round_robin sends them. Before a request reaches the
engine's waiting queue, the engine replica takes it in, one request at a time,
`frontend_s` each; `hop_s` is added to every first token (proxy, engine calls, streaming).

Coefficients come from `rayattn bench` (fit.py writes engine_model.json from a real run) or
from the command line (docs/results.md has fitted ones, with their commands).

Two drivers: an open loop (each request's `arrival` is fixed) and a closed loop like
`rayattn bench` (`concurrency` conversations at a time, a conversation's next turn
`think_s` after its previous answer).
"""

from __future__ import annotations

import heapq
import json
import random
import time
import zlib
from array import array
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rayattn.bench.driver import replay_tokens
from rayattn.bench.sim_fleet import (
    Autoscaler,
    EngineSignals,
    FleetScaling,
    Members,
    windows_of,
)
from rayattn.bench.stats import percentile
from rayattn.config.schema import RouterConfig
from rayattn.routing.core import Finished, RoutingCore
from rayattn.routing.hashing import BlockHasher, to_key
from rayattn.routing.policies import Decision, RouteRequest, cached_tokens
from rayattn.routing.prefix_index import EventIndex, PrefixIndex

if TYPE_CHECKING:
    from rayattn.bench.driver import Result
    from rayattn.bench.workloads import Workload

TIMELINE_S = 10.0
"""The stretch of a scaling fleet's timeline (Serve's engines report latencies over 10 s)."""


@dataclass
class SimRequest:
    arrival: float
    """Open loop: when it arrives. Closed loop: ignored (the driver decides)."""
    keys: list[int]
    """Block keys of the prompt."""
    prompt_tokens: int
    output_keys: list[int]
    """Block keys of prompt + output (what the engine caches after the request)."""
    output_tokens: int
    session: str
    text: str = ""
    turn: int = 0
    ids: array | None = None
    """The conversation's token ids (at least `prompt_tokens` of them), where the trace
    keeps them: a fleet that scales routes through the routing core's own keys, which
    remember what each conversation sent for its warm and move plans."""


@dataclass
class EngineModel:
    prefill_s_per_token: float = 2.4e-4
    ctx_s_per_token: float = 5e-6
    itl_base_s: float = 0.02
    itl_per_seq_s: float = 0.002
    capacity_blocks: int = 360
    block_size: int = 32
    max_batched_tokens: int = 2048
    max_seqs: int = 64
    hop_s: float = 0.0
    attn_s_per_token_pair: float = 0.0
    frontend_s: float = 0.0
    router_s: float = 0.0
    """Mean of the router's own time per request before it chooses (0: none, and a
    deterministic run). Measured at the fitted run's load: the real router's time grows
    with concurrent arrivals, which this mean does not."""
    step_overlap: float = 0.0
    """Share (0..1) of the shorter of a step's fixed and compute parts that runs under the
    longer. Calibrated from a real run; 0, the default, is the additive model the GPU
    coefficients of docs/results.md were fitted with."""
    contention: float = 0.0
    """How much longer a step takes for each other engine of its host that has work when
    the step starts (the CPU engines of docs/log/simulator.md share two cores: each runs at its
    own speed only while the other is idle). 0, the default: engines of their own."""
    engines_per_host: int = 0
    """Engines that share a host, consecutive in the fleet (0: the whole fleet), for
    `contention`: a model fitted on two engines of one host slows a 64-replica fleet only
    pair by pair."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.step_overlap <= 1.0:
            raise ValueError(f"step_overlap must be within 0..1, not {self.step_overlap}")
        for name in ("contention", "router_s", "hop_s", "frontend_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.engines_per_host < 0:
            raise ValueError("engines_per_host must not be negative")

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> EngineModel:
        return cls(**json.loads(Path(path).read_text()))


@dataclass
class SimResult:
    policy: str
    replicas: int
    routers: int
    requests: int
    hit_rate: float
    oracle_hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    later_ttft_p50_s: float
    later_ttft_p90_s: float
    """TTFT of turns after a conversation's first."""
    max_replica_share: float
    load_imbalance: float
    """Time-averaged max/mean in-flight across replicas."""
    sim_wall_s: float
    """Simulated time from the first arrival to the last answer."""
    wall_s: float
    """Real time the simulation took."""
    per_replica: dict[str, int] = field(default_factory=dict)
    regret_tokens: int = 0
    """Tokens recomputed that another replica held when the router chose (all routers)."""
    session_moves: int = 0
    """Conversations routed elsewhere than their previous turn."""
    engine_prefill_p50_s: float = 0.0
    """Scheduled → first token on the engine (vLLM's prefill time)."""
    engine_itl_p50_s: float = 0.0
    learned: dict[str, float] = field(default_factory=dict)
    """The first router's cost model at the end (affinity refits it from simulated engine
    timings, as it does from real ones)."""
    engine_ttft_p50_s: float = 0.0
    """Sent to the engine replica → first token: its intake, vLLM's queue and prefill (the
    real engine replica's own measure starts when vLLM's rendering does, so a wait for the
    replica's event loop before that is in this one and not in the real one)."""
    engine_ttft_p90_s: float = 0.0
    engine_seconds: float = 0.0
    """Engines holding resources (starting ones included) × simulated seconds."""
    max_engines: int = 0
    timeline: list[dict] = field(default_factory=list)
    """A fleet that scales: per stretch of TIMELINE_S, engines serving, requests and their
    TTFT p90 (sim_fleet.Window.row)."""
    scale_decisions: list = field(default_factory=list)
    """(when, engines, the policy's pressures) of each change Serve applied."""
    warm_prefills: int = 0
    moved_conversations: int = 0

    @property
    def hit_vs_oracle(self) -> float:
        return self.hit_rate / self.oracle_hit_rate if self.oracle_hit_rate else 0.0


@dataclass
class _Seq:
    i: int
    req: SimRequest
    router: int
    """-1: a router's prefill of an engine that joins or of a moved conversation."""
    decision: Decision | None
    route: RouteRequest | None
    arrived: float
    """At the router."""
    dispatched: float = 0.0
    """Sent to the engine replica (after the router's own time)."""
    left: int = 0
    """Prompt tokens still to compute (set when first scheduled)."""
    cached: int = -1
    """Tokens served from cache (-1: not scheduled yet)."""
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    outputs: int = 0
    target: str = ""
    """The engine it runs on."""
    on_done: Callable[[], None] | None = None
    """A prefill's: what follows it."""


class _Engine:
    def __init__(self, name: str, model: EngineModel, truth: PrefixIndex) -> None:
        self.name, self.m, self.truth = name, model, truth
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.busy = False
        self.pairs = 0.0
        """This step's Σ tokens computed × tokens before them."""
        self.frontend_free = 0.0
        """When the replica's intake is free for the next request."""
        self.host: list[_Engine] = [self]
        """The engines that share this one's host (for contention)."""

    def step(self, now: float) -> tuple[float, list[_Seq], list[_Seq]]:
        """Run one step from `now`: (its end, sequences that got their first token,
        sequences that finished)."""
        m = self.m
        decodes = [s for s in self.running if s.left == 0]
        budget = m.max_batched_tokens - len(decodes)
        prefill_tokens = ctx_tokens = 0
        self.pairs = 0.0
        chunked: list[_Seq] = []
        for s in [s for s in self.running if s.left > 0]:  # partly computed prompts first
            prefill_tokens += self._schedule(s, budget)
            budget = m.max_batched_tokens - len(decodes) - prefill_tokens
            chunked.append(s)
        while self.waiting and budget > 0 and len(self.running) < m.max_seqs:
            s = self.waiting.popleft()
            # The hit is decided when the prompt is first scheduled, on what is cached then
            # (including blocks of prompts scheduled earlier in this same step: vLLM
            # registers a block when it allocates it for computing).
            matched = self.truth.match(s.req.keys).get(self.name, 0)
            s.cached = cached_tokens(s.req.prompt_tokens, matched, m.block_size)
            s.scheduled_ts = now
            s.left = s.req.prompt_tokens - s.cached
            ctx_tokens += s.cached
            prefill_tokens += self._schedule(s, budget)
            budget = m.max_batched_tokens - len(decodes) - prefill_tokens
            self.running.append(s)
            chunked.append(s)
        fixed = m.itl_base_s + m.itl_per_seq_s * len(decodes)
        compute = m.prefill_s_per_token * prefill_tokens
        dt = (fixed + compute - m.step_overlap * min(fixed, compute)
              + m.ctx_s_per_token * ctx_tokens + m.attn_s_per_token_pair * self.pairs)
        if m.contention:
            dt *= 1 + m.contention * sum(e.busy for e in self.host if e is not self)
        end = now + dt
        first = [s for s in chunked if s.left == 0]
        for s in first:
            s.first_token_ts = end
            s.outputs = 1
        for s in decodes:
            s.outputs += 1
        done = [s for s in first + decodes if s.outputs >= s.req.output_tokens]
        for s in done:
            self.running.remove(s)
            self.truth.insert(self.name, s.req.output_keys)
        return end, first, done

    def _schedule(self, s: _Seq, budget: int) -> int:
        """Compute up to `budget` more of `s`'s prompt this step; its full blocks so far are
        cached from now on. Returns the tokens taken."""
        take = min(s.left, max(budget, 0))
        before = s.req.prompt_tokens - s.left
        s.left -= take
        self.pairs += take * (before + take / 2)
        self.truth.insert(self.name, s.req.keys[:(before + take) // self.m.block_size])
        return take


def simulate(trace: list[SimRequest], replicas: int, policy: str, model: EngineModel,
             routers: int = 1, router_cfg: RouterConfig | None = None,
             seed: int = 0, index: str = "predicted", concurrency: int | None = None,
             think_s: float = 0.0, scaling: FleetScaling | None = None) -> SimResult:
    """`index`: `predicted` (each router's own LRU guess and its own dispatch counts) or
    `events` (each router follows the engines' real caches and load counts, as with vLLM's
    KV events, delivered instantly here). `concurrency`: closed loop over the trace's
    conversations (in order of first appearance), a conversation's next turn a uniform
    0..`think_s` after its answer; None: open loop on `arrival`. `scaling`: the engines
    autoscale from `replicas` within its bounds (sim_fleet.py); None: `replicas`, fixed."""
    t_wall = time.perf_counter()
    auto = scaling.autoscaling if scaling is not None else None
    pool_size = max(replicas, auto.max_replicas) if auto is not None else replicas
    names = [f"engine-{i}" for i in range(pool_size)]
    router_cfg = router_cfg or RouterConfig()
    settings = router_cfg.routing_settings().replace(policy=policy,
                                                                         index=index)
    now = 0.0  # the simulated clock, which the cores' TTLs and budgets run on

    def clock() -> float:
        return now

    cores = [RoutingCore(settings, model.block_size, origin=str(r), seed=seed + r,
                         clock=clock) for r in range(routers)]
    views = [c.index for c in cores if isinstance(c.index, EventIndex)]

    def evicted(rep: str, key: int) -> None:
        for v in views:
            v.removed(rep, [key])

    def stored(rep: str, keys: Sequence[int]) -> None:
        for v in views:
            v.stored(rep, keys)

    # What each engine really holds; its stores and evictions reach every events-mode
    # router at once, as vLLM's KV events would.
    truth = PrefixIndex(on_evict=evicted, on_store=stored if views else None)

    engines = {n: _Engine(n, model, truth) for n in names}
    per_host = model.engines_per_host or pool_size
    fleet = list(engines.values())
    for k, e in enumerate(fleet):
        e.host = fleet[k - k % per_host:k - k % per_host + per_host]

    # (time, seq, kind, payload): kind 0 arrival at the router (payload: request index),
    # 1 an engine's step ends (its name), 2 arrival in an engine's queue (the _Seq),
    # 3 the router has rendered a request and chooses (request index, arrival time),
    # 4 Serve's autoscaler ticks, 5 an engine started (its name), 6 a joining engine's
    # warm hold times out (its name)
    events: list[tuple[float, int, int, object]] = []
    counter = 0

    def push(t: float, kind: int, payload: object) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, counter, kind, payload))

    def to_engine(seq_: _Seq, t: float) -> None:
        # The engine replica takes requests in one at a time (one Python event loop).
        eng = engines[seq_.target]
        eng.frontend_free = max(t, eng.frontend_free) + model.frontend_s
        push(eng.frontend_free, 2, seq_)

    hasher = BlockHasher(model.block_size)

    routers_prefills = dict.fromkeys(names, 0)
    """Routers' prefills sent to each engine and not yet run (they keep a leaving one)."""

    def send_prefill(target: str, token_ids: list[int], on_done: Callable[[], None]) -> None:
        keys = _keys(hasher.full_hashes(token_ids))
        req = SimRequest(now, keys, len(token_ids), keys, 1, "")
        routers_prefills[target] += 1
        to_engine(_Seq(-1, req, -1, None, None, now, now, target=target, on_done=on_done),
                  now)

    members = Members(names, replicas, cores, truth, model.capacity_blocks, model.max_seqs,
                      router_cfg, send_prefill)
    signals = {n: EngineSignals() for n in names}
    autoscaler = Autoscaler(scaling, replicas) if scaling is not None else None
    if auto is not None:
        # Serve decides as often as the replicas push their metrics.
        push(auto.metrics_interval_s, 4, None)

    # Streams of their own, so that seed k's router times are not seed k+1's think times.
    think = random.Random(f"think/{seed}")
    router_time = random.Random(f"router/{seed}")
    convs: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(trace):
        convs[r.session].append(i)
    order = list(convs)
    started = 0
    if concurrency is None:
        for i, r in enumerate(trace):
            push(r.arrival, 0, i)
    else:
        for _ in range(min(concurrency, len(order))):
            push(0.0, 0, convs[order[started]][0])
            started += 1
    next_turn = {idxs[k]: idxs[k + 1] for idxs in convs.values() for k in range(len(idxs) - 1)}

    ttfts: dict[int, float] = {}
    arrivals: dict[int, float] = {}
    unanswered = len(trace)
    engine_ttfts: list[float] = []
    prefills: list[float] = []
    itls: list[float] = []
    hits = prompt_total = oracle_hits = 0
    seen_blocks: set[int] = set()
    per_replica: dict[str, int] = defaultdict(int)
    inflight = dict.fromkeys(names, 0)
    inflight_area = dict.fromkeys(names, 0.0)
    last_t = 0.0
    end_t = 0.0

    def advance(t: float) -> None:
        nonlocal last_t
        for n in names:
            inflight_area[n] += inflight[n] * (t - last_t)
        last_t = t

    # Engines count in-flight requests per sending router and report them with every
    # chunk; events-mode routers take the others' share from there (routing/load.py).
    running_by: dict[str, dict[str, int]] = {n: defaultdict(int) for n in names}

    def report_load() -> None:
        if views and routers > 1:
            for c in cores:
                for n in members.active:
                    c.reported(n, running_by[n])

    def drained(name: str) -> bool:
        e = engines[name]
        return not (e.running or e.waiting or inflight[name] or routers_prefills[name])

    def autoscale(t: float) -> None:
        assert scaling is not None and autoscaler is not None
        serving = members.serving()
        target = autoscaler.tick(t, {n: signals[n] for n in serving},
                                 sum(inflight[n] for n in serving))
        while len(serving) + len(members.starting) < target:
            name, start = members.start(t)
            if name is None:
                break
            push(t + scaling.start_s, 5, (name, start))
        while len(members.serving()) + len(members.starting) > target:
            if members.cancel_start(t):
                continue
            name = members.leave(t)
            if name is None:
                break
            if drained(name):
                members.depart(name, t)

    while events:
        t, _, kind, payload = heapq.heappop(events)
        now = t
        advance(t)
        if kind == 0 and model.router_s > 0:
            push(t + router_time.expovariate(1 / model.router_s), 3, (payload, t))
            continue
        if kind in (0, 3):
            i, arrived = (payload, t) if kind == 0 else payload  # type: ignore[misc]
            req = trace[i]
            # The front door hashes the session header (HAProxy's hdr balance, as the
            # deployments run it): every turn of a conversation reaches the same router.
            rt = zlib.crc32(req.session.encode()) % routers
            core = cores[rt]
            report_load()
            if scaling is not None and req.ids is not None:
                # The router's own keys: they remember the conversation for its plans.
                route = core.request(req.ids[:req.prompt_tokens].tolist(), req.session,
                                     req.text)
                route.max_tokens = req.output_tokens
            else:
                route = RouteRequest(req.keys, req.prompt_tokens,
                                     req.keys[0] if req.keys else i, req.session, req.text,
                                     max_tokens=req.output_tokens)
            # As the router's front door: the arrival teaches the KV budget the pause.
            core.kv.arrived(route.session)
            d = core.choose(route, members.routable())
            core.dispatched(d, route)
            ob = 0
            for k in req.keys:
                if k not in seen_blocks:
                    break
                ob += 1
            oracle_hits += cached_tokens(req.prompt_tokens, ob, model.block_size)
            seen_blocks.update(req.output_keys)
            per_replica[d.replica] += 1
            inflight[d.replica] += 1
            running_by[d.replica][str(rt)] += 1
            to_engine(_Seq(i, req, rt, d, route, arrived, t, target=d.replica), t)
            continue
        if kind == 4:
            autoscale(t)
            push(t + auto.metrics_interval_s, 4, None)  # type: ignore[union-attr]
            continue
        if kind == 5:
            name, start = payload  # type: ignore[misc]
            if members.started(name, start):  # not stopped while it started
                members.join(name, t, start)
                if name in members.held:
                    push(t + router_cfg.warm_timeout_s, 6, payload)
            continue
        if kind == 6:
            members.hold_expired(*payload)  # type: ignore[misc]
            continue
        if kind == 7:  # a router's prefill answered: what follows it
            routers_prefills[payload.target] -= 1  # type: ignore[attr-defined]
            payload.on_done()  # type: ignore[attr-defined]
            continue
        if kind == 2:  # the request reaches its engine's waiting queue
            seq_ = payload
            eng = engines[seq_.target]
            eng.waiting.append(seq_)
            if not eng.busy:
                eng.busy = True
                push(t, 1, eng.name)
            continue
        eng = engines[payload]  # type: ignore[index]
        if not eng.running and not eng.waiting:
            eng.busy = False
            if eng.name in members.leaving and drained(eng.name):
                members.depart(eng.name, t)
            continue
        step_end, first, done = eng.step(t)
        if scaling is not None:
            sig = signals[eng.name]
            if auto.kv_usage is not None:  # a sum over the batch: only where it counts
                bs = model.block_size
                sig.step(sum(-(-(s.req.prompt_tokens - s.left + s.outputs) // bs)
                             for s in eng.running) / model.capacity_blocks)
            for s in first:
                sig.first_token(step_end, s.first_token_ts - s.dispatched)
        for s in done:
            if s.on_done is not None:
                push(step_end, 7, s)
        first = [s for s in first if s.decision is not None]
        done = [s for s in done if s.decision is not None]
        for s in first:
            ttfts[s.i] = s.first_token_ts - s.arrived + model.hop_s
            arrivals[s.i] = s.arrived
            engine_ttfts.append(s.first_token_ts - s.dispatched)
            prefills.append(s.first_token_ts - s.scheduled_ts)
            cores[s.router].first_token(s.decision)
            hits += s.cached
            prompt_total += s.req.prompt_tokens
        for s in done:
            core = cores[s.router]
            itl = ((step_end - s.first_token_ts) / (s.req.output_tokens - 1)
                   if s.req.output_tokens > 1 else None)
            timings = {"scheduled_ts": s.scheduled_ts, "first_token_ts": s.first_token_ts,
                       "itl_s": itl}
            if itl is not None:
                itls.append(itl)
            # The trace carries block keys, not ids: placeholders of the output's length,
            # which the KV budget and the cost model count.
            core.finished(s.decision, s.route, Finished(
                s.req.prompt_tokens, s.cached, [0] * s.req.output_tokens, timings=timings,
                continuation_keys=s.req.output_keys))
            core.ended(s.decision)
            inflight[eng.name] -= 1
            unanswered -= 1
            running_by[eng.name][str(s.router)] -= 1
            end_t = max(end_t, step_end + model.hop_s)
            if concurrency is not None:
                nxt = next_turn.get(s.i)
                if nxt is not None:
                    push(step_end + model.hop_s + think.uniform(0, think_s), 0, nxt)
                elif started < len(order):
                    push(step_end + model.hop_s, 0, convs[order[started]][0])
                    started += 1
        push(step_end, 1, eng.name)
        if scaling is not None and not unanswered:
            break  # every request answered: what Serve does next is past the run

    def _p(xs: list[float], p: float) -> float:
        return percentile(xs, p, empty=0.0)

    all_t = sorted(ttfts.values())
    engine_ttfts.sort()
    later = sorted(v for i, v in ttfts.items() if trace[i].turn > 0)
    n = len(ttfts)  # requests that got their first token (all of them, as it runs to the end)
    areas = [inflight_area[e] for e in names if e in members.ever]
    mean_area = sum(areas) / len(areas)
    result = SimResult(policy, replicas, routers, n, hits / prompt_total if prompt_total else 0,
                     oracle_hits / prompt_total if prompt_total else 0, _p(all_t, 0.5),
                     _p(all_t, 0.9), _p(all_t, 0.99), _p(later, 0.5), _p(later, 0.9),
                     max(per_replica.values()) / n if n else 0,
                     max(areas) / mean_area if mean_area else 0, end_t,
                     time.perf_counter() - t_wall, dict(per_replica),
                     sum(sum(c.regret_tokens.values()) for c in cores),
                     sum(sum(c.session_moves.values()) for c in cores),
                     _p(sorted(prefills), 0.5), _p(sorted(itls), 0.5), _learned(cores[0]),
                     _p(engine_ttfts, 0.5), _p(engine_ttfts, 0.9))
    if scaling is not None:
        changes = members.changes
        result.engine_seconds = sum(
            held * max(0.0, min(end_t, changes[k + 1][0] if k + 1 < len(changes) else end_t)
                       - t) for k, (t, _, held) in enumerate(changes) if t < end_t)
        result.max_engines = max(serving for t, serving, _ in changes if t <= end_t)
        result.timeline = [w.row(auto.ttft_p90_s) for w in windows_of(
            [(arrivals[i], v) for i, v in ttfts.items()],
            [(t, serving) for t, serving, _ in changes], end_t, TIMELINE_S)]
        result.scale_decisions = autoscaler.decisions  # type: ignore[union-attr]
        result.warm_prefills, result.moved_conversations = members.warm_prefills, members.moved
    return result


def _learned(core: RoutingCore) -> dict[str, float]:
    cost = getattr(core.policy, "cost", None)
    if cost is None:
        return {}
    return {"prefill_s_per_token": cost.prefill_s_per_token,
            "decode_s_per_request": cost.decode_s_per_request}


# --- synthetic traces (token-level, no tokenizer needed) ---------------------------------------
def shared_prefix_trace(groups: int, prompts_per_group: int, system_tokens: int,
                        question_tokens: int, output_tokens: int, rate: float,
                        block_size: int = 32, seed: int = 0) -> list[SimRequest]:
    """SGLang generated-shared-prefix shape with Poisson arrivals at `rate` req/s."""
    rng = random.Random(seed)
    h = BlockHasher(block_size)
    systems = [[rng.randrange(1, 50_000) for _ in range(system_tokens)] for _ in range(groups)]
    sys_hashes = [h.full_hashes(s) for s in systems]
    order = [(g, p) for p in range(prompts_per_group) for g in range(groups)]
    rng.shuffle(order)
    t, out = 0.0, []
    for g, p in order:
        t += rng.expovariate(rate)
        prompt = systems[g] + [rng.randrange(1, 50_000) for _ in range(question_tokens)]
        ph = h.full_hashes(prompt, sys_hashes[g])
        full = prompt + [rng.randrange(1, 50_000) for _ in range(output_tokens)]
        out.append(SimRequest(t, _keys(ph), len(prompt), _keys(h.full_hashes(full, ph)),
                              output_tokens, f"g{g}-p{p}", _text(prompt)))
    return out


def _keys(hashes: list[bytes]) -> list[int]:
    return [to_key(x) for x in hashes]


def _text(tokens: list[int]) -> str:
    """One character per token, for the text-tree policy."""
    return "".join(chr(0x4E00 + x % 20000) for x in tokens)


def multi_turn_trace(conversations: int, turns: int, shared_systems: int, system_tokens: int,
                     user_tokens: int, output_tokens: int, rate: float, think_s: float = 5.0,
                     block_size: int = 32, seed: int = 0,
                     document_tokens: int = 0, keep_ids: bool = False,
                     systems_seed: int | None = None, start_s: float = 0.0,
                     prefix: str = "conv") -> list[SimRequest]:
    """Sessions start as a Poisson process; each next turn follows after a think time and
    carries the whole history (prompt + previous outputs). `document_tokens`: each
    conversation also carries a document of its own after the shared system prompt.
    `keep_ids`: each request keeps its conversation's token ids (a fleet that scales needs
    them). `systems_seed`: the shared system prompts' own seed (default `seed`), so traces
    of several seeds can share them; the first conversation starts after `start_s`, each
    named `prefix`-k."""
    rng = random.Random(seed)
    h = BlockHasher(block_size)
    srng = rng if systems_seed is None else random.Random(systems_seed)
    systems = [[srng.randrange(1, 50_000) for _ in range(system_tokens)]
               for _ in range(shared_systems)]
    reqs: list[SimRequest] = []
    t = start_s
    sys_hashes = [h.full_hashes(s) for s in systems]
    for c in range(conversations):
        t += rng.expovariate(rate / turns)
        hist = list(systems[c % shared_systems])
        hashes = sys_hashes[c % shared_systems]
        hist += [rng.randrange(1, 50_000) for _ in range(document_tokens)]
        tc = t
        first = len(reqs)
        for turn in range(turns):
            hist += [rng.randrange(1, 50_000) for _ in range(user_tokens)]
            hashes = h.full_hashes(hist, hashes)
            o = [rng.randrange(1, 50_000) for _ in range(output_tokens)]
            after = h.full_hashes(hist + o, hashes)
            reqs.append(SimRequest(tc, _keys(hashes), len(hist), _keys(after), output_tokens,
                                   f"{prefix}-{c}", _text(hist), turn))
            hist += o
            hashes = after
            tc += think_s + rng.expovariate(1.0)
        if keep_ids:
            ids = array("I", hist)
            for r in reqs[first:]:
                r.ids = ids
    reqs.sort(key=lambda r: r.arrival)
    return reqs


def ramp_trace(phases: Sequence[tuple[float, float]], turns: int, shared_systems: int,
               system_tokens: int, user_tokens: int, output_tokens: int,
               think_s: float = 5.0, block_size: int = 32, seed: int = 0,
               document_tokens: int = 0) -> list[SimRequest]:
    """multi_turn_trace's conversations under a load that changes: `phases` of (seconds,
    requests per second), one after the other (quiet → peak → quiet), all behind the same
    shared system prompts; token ids kept (for a fleet that scales)."""
    out: list[SimRequest] = []
    start = 0.0
    for k, (seconds, rate) in enumerate(phases):
        conversations = max(1, round(seconds * rate / turns))
        out += multi_turn_trace(conversations, turns, shared_systems, system_tokens,
                                user_tokens, output_tokens, rate, think_s, block_size,
                                seed=seed * 1000 + k, document_tokens=document_tokens,
                                keep_ids=True, systems_seed=seed, start_s=start,
                                prefix=f"p{k}")
        start += seconds
    out.sort(key=lambda r: r.arrival)
    return out


def trace_from_run(results: list[Result], workload: Workload, tokenizer: Any,
                   block_size: int) -> list[SimRequest]:
    """The exact requests of a real-engine run (templated prompts, outputs, turn order), in
    the order the run started them: for the closed-loop driver, conversations keep the
    workload's order, as the bench's driver takes them."""
    h = BlockHasher(block_size)
    order = {c.session: k for k, c in enumerate(workload.conversations)}
    out = []
    for r, ids, outs in replay_tokens(results, workload, tokenizer):
        ph = h.full_hashes(ids)
        out.append(SimRequest(r.start_s, _keys(ph), len(ids),
                              _keys(h.full_hashes(ids + outs, ph)),
                              max(r.completion_tokens, 1), r.session, _text(ids), r.turn))
    out.sort(key=lambda s: (order.get(s.session, 0), s.turn))
    return out
