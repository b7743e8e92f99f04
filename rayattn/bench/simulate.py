"""Discrete-event simulator of a rayattn fleet: N engine replicas with block-level LRU prefix
caches, a per-path service-time model, and the *real* routing policy objects choosing
replicas (rayattn.routing.policies — the same code the ingress runs).

Engine model (one replica):
  * prefill/extend are serialised on the replica (one context stream at a time), taking
    uncached_tokens × prefill_s_per_token + cached_tokens × ctx_s_per_token;
  * decode overlaps: each output token takes itl_base + itl_per_seq × (running sequences);
  * the replica's prefix cache is an LRU of block keys bounded by its KV capacity, updated
    with prompt + output blocks when a request finishes (as vLLM caches them).
Coefficients default to values fitted from the CPU runs (bench/results) and can be refitted
from the per-path metrics of a real deployment.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field

from rayattn.config.schema import RouterConfig
from rayattn.routing.load import LoadTracker
from rayattn.routing.policies import RouteRequest, make_policy
from rayattn.routing.prefix_index import EventIndex, PrefixIndex


@dataclass
class SimRequest:
    arrival: float
    keys: list[int]
    """Block keys of the prompt."""
    prompt_tokens: int
    output_keys: list[int]
    """Block keys of prompt + output (what the engine caches after the request)."""
    output_tokens: int
    session: str
    text: str = ""


@dataclass
class EngineModel:
    prefill_s_per_token: float = 2.4e-4
    ctx_s_per_token: float = 5e-6
    itl_base_s: float = 0.02
    itl_per_seq_s: float = 0.002
    capacity_blocks: int = 360
    block_size: int = 32


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
    max_replica_share: float
    load_imbalance: float
    """Time-averaged max/mean in-flight across replicas."""
    wall_s: float
    per_replica: dict[str, int] = field(default_factory=dict)


def simulate(trace: list[SimRequest], replicas: int, policy: str, model: EngineModel,
             routers: int = 1, router_cfg: RouterConfig | None = None,
             seed: int = 0, index: str = "predicted") -> SimResult:
    """`index`: `predicted` (each router's own LRU guess and its own dispatch counts) or
    `events` (each router follows the engines' real caches and load counts, as with vLLM's KV
    events; events are delivered instantly here)."""
    t_wall = time.perf_counter()
    names = [f"engine-{i}" for i in range(replicas)]
    views: list[EventIndex] = []

    def evicted(rep: str, key: int) -> None:
        for v in views:
            v.removed(rep, [key])

    cache = PrefixIndex(on_evict=evicted)  # ground truth: what each engine really holds
    for n in names:
        cache.add_replica(n, model.capacity_blocks)
    # Independent ingress replicas: own index, own view of the load they dispatched.
    fleet = []
    for r in range(routers):
        load = LoadTracker(origin=str(r))
        idx: PrefixIndex = EventIndex() if index == "events" else PrefixIndex()
        if isinstance(idx, EventIndex):
            views.append(idx)
        for n in names:
            idx.add_replica(n, model.capacity_blocks)
        fleet.append((make_policy(policy, idx, load, model.block_size, router_cfg,
                                  seed=seed + r), load))

    def store(rep: str, keys: list[int]) -> None:
        cache.insert(rep, keys)
        for v in views:
            v.stored(rep, keys)
    ctx_free_at = dict.fromkeys(names, 0.0)
    running = dict.fromkeys(names, 0)
    # Per replica, per router: what engines report as their in-flight count by origin.
    running_by: dict[str, dict[str, int]] = {n: defaultdict(int) for n in names}
    # (time, seq, kind, replica, request index, uncached tokens, router); kind 0 = first
    # token (the router's pending prefill drains), 1 = request finished.
    events: list[tuple[float, int, int, str, int, int, int]] = []
    ttfts: list[float] = []
    hits = prompt_total = oracle_hits = 0
    seen_blocks: set[int] = set()
    per_replica: dict[str, int] = defaultdict(int)
    inflight_area = dict.fromkeys(names, 0.0)
    last_t = 0.0
    seq = 0

    def advance(t: float) -> None:
        nonlocal last_t
        for n in names:
            inflight_area[n] += running[n] * (t - last_t)
        last_t = t

    def finish_until(t: float) -> None:
        while events and events[0][0] <= t:
            te, _, kind, rep, ri, uncached, rt = heapq.heappop(events)
            advance(te)
            pol, load = fleet[rt]
            if kind == 0:
                load.prefill_done(rep, uncached)
                continue
            running[rep] -= 1
            running_by[rep][str(rt)] -= 1
            req = trace[ri]
            store(rep, req.output_keys)
            load.release(rep, 0)
            pol.on_complete(rep, req.output_keys)

    for i, req in enumerate(trace):
        finish_until(req.arrival)
        advance(req.arrival)
        rt = i % routers
        pol, load = fleet[rt]
        if views:  # engine-reported load, shared by every router
            for n in names:
                load.reported(n, running_by[n])
        route = RouteRequest(req.keys, req.prompt_tokens, req.keys[0] if req.keys else i,
                             req.session, req.text)
        d = pol.choose(route, names)
        rep = d.replica
        # the engine's real cache decides the hit, not the router's belief
        matched = cache.match(req.keys).get(rep, 0)
        cached = min(matched * model.block_size, max(req.prompt_tokens - 1, 0))
        uncached = req.prompt_tokens - cached
        # oracle: an infinite block cache shared by everyone
        ob = 0
        for k in req.keys:
            if k not in seen_blocks:
                break
            ob += 1
        oracle_hits += min(ob * model.block_size, max(req.prompt_tokens - 1, 0))
        seen_blocks.update(req.output_keys)
        hits += cached
        prompt_total += req.prompt_tokens
        per_replica[rep] += 1
        predicted_uncached = req.prompt_tokens - d.predicted_cached_tokens
        load.acquire(rep, predicted_uncached)
        pol.on_dispatch(rep, route)
        store(rep, req.keys)  # prompt blocks are cached once prefilled
        start = max(req.arrival, ctx_free_at[rep])
        ctx_time = uncached * model.prefill_s_per_token + cached * model.ctx_s_per_token
        first_token = start + ctx_time
        ctx_free_at[rep] = first_token
        seq += 1
        heapq.heappush(events, (first_token, seq, 0, rep, i, predicted_uncached, rt))
        running[rep] += 1
        running_by[rep][str(rt)] += 1
        itl = model.itl_base_s + model.itl_per_seq_s * running[rep]
        done = first_token + max(req.output_tokens - 1, 0) * itl
        ttfts.append(first_token - req.arrival)
        seq += 1
        heapq.heappush(events, (done, seq, 1, rep, i, 0, rt))
    finish_until(float("inf"))
    ttfts.sort()

    def pct(p: float) -> float:
        return ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] if ttfts else 0.0

    n = len(trace)
    areas = list(inflight_area.values())
    mean_area = sum(areas) / len(areas)
    return SimResult(policy, replicas, routers, n, hits / prompt_total if prompt_total else 0,
                     oracle_hits / prompt_total if prompt_total else 0, pct(0.5), pct(0.9),
                     pct(0.99), max(per_replica.values()) / n if n else 0,
                     max(areas) / mean_area if mean_area else 0,
                     time.perf_counter() - t_wall, dict(per_replica))


# --- synthetic traces (token-level, no tokenizer needed) ---------------------------------------
def shared_prefix_trace(groups: int, prompts_per_group: int, system_tokens: int,
                        question_tokens: int, output_tokens: int, rate: float,
                        block_size: int = 32, seed: int = 0) -> list[SimRequest]:
    """SGLang generated-shared-prefix shape with Poisson arrivals at `rate` req/s."""
    from rayattn.routing.hashing import BlockHasher

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
    from rayattn.routing.hashing import to_key

    return [to_key(x) for x in hashes]


def _text(tokens: list[int]) -> str:
    """One character per token, for the text-tree policy."""
    return "".join(chr(0x4E00 + x % 20000) for x in tokens)


def multi_turn_trace(conversations: int, turns: int, shared_systems: int, system_tokens: int,
                     user_tokens: int, output_tokens: int, rate: float, think_s: float = 5.0,
                     block_size: int = 32, seed: int = 0) -> list[SimRequest]:
    """Sessions start as a Poisson process; each next turn follows after a think time and
    carries the whole history (prompt + previous outputs)."""
    from rayattn.routing.hashing import BlockHasher

    rng = random.Random(seed)
    h = BlockHasher(block_size)
    systems = [[rng.randrange(1, 50_000) for _ in range(system_tokens)]
               for _ in range(shared_systems)]
    reqs: list[SimRequest] = []
    t = 0.0
    sys_hashes = [h.full_hashes(s) for s in systems]
    for c in range(conversations):
        t += rng.expovariate(rate / turns)
        hist = list(systems[c % shared_systems])
        hashes = sys_hashes[c % shared_systems]
        tc = t
        for _ in range(turns):
            hist += [rng.randrange(1, 50_000) for _ in range(user_tokens)]
            hashes = h.full_hashes(hist, hashes)
            o = [rng.randrange(1, 50_000) for _ in range(output_tokens)]
            after = h.full_hashes(hist + o, hashes)
            reqs.append(SimRequest(tc, _keys(hashes), len(hist), _keys(after), output_tokens,
                                   f"conv-{c}", _text(hist)))
            hist += o
            hashes = after
            tc += think_s + rng.expovariate(1.0)
    reqs.sort(key=lambda r: r.arrival)
    return reqs


def trace_from_run(results, workload, tokenizer, block_size: int) -> list[SimRequest]:
    """The exact trace of a real-engine run (arrival times, templated prompts, outputs), to
    validate the simulator against it."""
    from rayattn.bench.driver import replay_tokens
    from rayattn.routing.hashing import BlockHasher

    h = BlockHasher(block_size)
    out = []
    for r, ids, outs in replay_tokens(results, workload, tokenizer):
        ph = h.full_hashes(ids)
        out.append(SimRequest(r.start_s, _keys(ph), len(ids), _keys(h.full_hashes(ids + outs, ph)),
                              max(r.completion_tokens, 1), r.session, _text(ids)))
    return out
