"""Routing policies. Each takes the request's block keys and the live replicas and returns a
Decision; the same objects run in the ingress, the simulator and the unit tests.

`affinity` minimises a predicted time to first token plus the prefill work it adds:

    cost(r) = wait(r) + 2 × uncached_tokens(r) × c_prefill + cached_tokens(r) × c_ctx
    wait(r) = pending_prefill_tokens(r) × c_prefill + inflight(r) × c_decode

subject to a bounded-load guard (inflight(r) + 1 ≤ max(⌈(1+ε)·m⌉, ⌈m⌉ + slack), with
m = (total+1)/n), so affinity can never build a hot spot. Near-ties go to the conversation's
session owner, then to the replica ranked first by rendezvous hashing of the prefix's first
block: independent router replicas and followers of a re-homed prefix agree without talking
to each other.

Uncached tokens count twice: once for this request's first token and once for the work they
add in front of everything queued behind it on that engine. Counted once, a move that saves
this request a millisecond of queue looks free even when it recomputes a conversation's
history (measured on H200s: 1.1k tokens recomputed for a 1 ms gain).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from rayattn.routing.load import LoadTracker
from rayattn.routing.prefix_index import PrefixIndex
from rayattn.routing.text_tree import TextPrefixTree


@dataclass
class RouteRequest:
    keys: list[int]
    """Block keys of the prompt (full blocks only)."""
    prompt_tokens: int
    affinity_key: int
    """Stable per-prefix key for tie-breaking (the first block's key, or a hash of the prompt
    head for prompts shorter than one block)."""
    session: str | None = None
    text: str = ""
    """Prompt text; only the `ray_prefix` comparison policy looks at it."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Full vLLM hashes behind `keys`, so prompt + output can be hashed incrementally."""
    token_ids: list[int] = field(default_factory=list)
    """The prompt's token ids (the router indexes prompt + output after the request)."""


@dataclass
class Decision:
    replica: str
    reason: str
    predicted_cached_tokens: int
    costs: dict[str, float] = field(default_factory=dict)
    dispatched_at: float = 0.0
    """time.perf_counter() when the engine call was issued (the router hop ends there)."""
    loads: dict[str, int] = field(default_factory=dict)
    """In-flight estimate of each candidate when the choice was made (for explaining it)."""


def rendezvous_rank(key: int, replicas: list[str]) -> list[str]:
    """Highest-random-weight order: removing a replica only moves the keys it owned."""
    def weight(r: str) -> bytes:
        return hashlib.blake2b(f"{key}:{r}".encode(), digest_size=8).digest()
    return sorted(replicas, key=weight, reverse=True)


@dataclass
class CostModel:
    prefill_s_per_token: float
    ctx_s_per_token: float
    decode_s_per_request: float
    alpha: float = 0.2
    window: int = 64
    """Finished prefills per engine that the prefill rate is measured over."""
    _spans: dict[str, deque[tuple[float, float, int]]] = field(
        default_factory=dict, init=False, repr=False)
    _rates: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def observe_prefill(self, engine: str, start: float, end: float,
                        computed_tokens: int) -> None:
        """Refit c_prefill from an engine's prefill throughput: over its last `window`
        prefills, the time during which any of them was in progress (the union of their
        scheduled → first-token spans, on the engine's own clock) per token they computed.
        One request's span alone covers every prompt batched with it: a cache hit that
        computed 50 tokens next to cold prompts took seconds, which per token is 100× the
        engine's rate and made every queued prefill look prohibitive. The fleet's rate is
        the upper median engine's (of two engines the slower one's: pricing prefill on the
        slow side keeps conversations home). Only this router's requests are measured; with
        several routers sharing an engine the others' prefills fill the same spans, so the
        rate errs slow (docs/routing.md)."""
        if end <= start or computed_tokens < 0:
            return
        spans = self._spans.setdefault(engine, deque(maxlen=self.window))
        spans.append((start, end, computed_tokens))
        tokens = sum(n for _, _, n in spans)
        if tokens < 256:  # too little to measure: keep what we have
            return
        busy, reach = 0.0, float("-inf")
        for a, b, _ in sorted(spans):
            if b > reach:
                busy += b - max(a, reach)
                reach = b
        self._rates[engine] = busy / tokens
        self._refit_fleet()

    def forget(self, engine: str) -> None:
        """A departed engine's rate must not stay in the fleet's median."""
        self._spans.pop(engine, None)
        if self._rates.pop(engine, None) is not None:
            self._refit_fleet()

    def _refit_fleet(self) -> None:
        if self._rates:
            rates = sorted(self._rates.values())
            self.prefill_s_per_token = rates[len(rates) // 2]

    def observe_decode(self, itl_s: float | None, running: int = 1) -> None:
        """Refit what one in-flight request costs a newcomer: the marginal step time of one
        more co-running sequence, i.e. the observed inter-token latency shared by the
        sequences that were running (the whole ITL would charge each of them a full step
        and make the router flee any replica holding a few decodes)."""
        if itl_s is None or itl_s <= 0:
            return
        per_seq = min(itl_s / max(running, 1), max(self.decode_s_per_request, 1e-3) * 10)
        self.decode_s_per_request += self.alpha * (per_seq - self.decode_s_per_request)


class Policy:
    name = "base"

    def __init__(self, index: PrefixIndex, load: LoadTracker, block_size: int):
        self.index, self.load, self.block_size = index, load, block_size

    def choose(self, req: RouteRequest, replicas: list[str]) -> Decision:
        raise NotImplementedError

    def cached_tokens(self, req: RouteRequest, matched_blocks: int) -> int:
        """What the engine will serve from cache given `matched_blocks` leading blocks: whole
        blocks only, and never the prompt's last token (vLLM always computes one)."""
        return min(matched_blocks, max(req.prompt_tokens - 1, 0) // self.block_size) \
            * self.block_size

    def on_dispatch(self, replica: str, req: RouteRequest) -> None:
        """Called once the request is sent; affinity inserts speculatively so followers that
        arrive before this one finishes already find the prefix."""

    def on_complete(self, replica: str, keys: list[int]) -> None:
        self.index.insert(replica, keys)

    def forget_replica(self, replica: str) -> None:
        pass

    def observe(self, replica: str, computed_tokens: int, timings: dict[str, Any],
                running: int) -> None:
        """Engine timings of a request finished on `replica` (policies with a cost model
        learn here)."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self._next = 0

    def choose(self, req: RouteRequest, replicas: list[str]) -> Decision:
        r = replicas[self._next % len(replicas)]
        self._next += 1
        return Decision(r, "round_robin", self._predicted(req, r))

    def _predicted(self, req: RouteRequest, r: str) -> int:
        return self.cached_tokens(req, self.index.match(req.keys).get(r, 0))


class PowerOfTwo(RoundRobin):
    name = "power_of_two"

    def __init__(self, *a, seed: int | None = None, **kw) -> None:
        super().__init__(*a, **kw)
        self._rng = random.Random(seed)

    def choose(self, req: RouteRequest, replicas: list[str]) -> Decision:
        pair = self._rng.sample(replicas, min(2, len(replicas)))
        r = min(pair, key=lambda x: self.load.inflight[x])
        return Decision(r, "power_of_two", self._predicted(req, r))


class Affinity(Policy):
    name = "affinity"

    def __init__(self, index: PrefixIndex, load: LoadTracker, block_size: int, *,
                 cost: CostModel, epsilon: float, min_match_fraction: float = 0.1,
                 slack: int = 0, max_sessions: int = 100_000) -> None:
        super().__init__(index, load, block_size)
        self.cost, self.epsilon, self.slack = cost, epsilon, slack
        self.min_match_fraction = min_match_fraction
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._max_sessions = max_sessions

    def capacity(self, replicas: list[str]) -> int:
        total = sum(self.load.inflight[r] for r in replicas)
        mean = (total + 1) / len(replicas)
        return max(math.ceil((1 + self.epsilon) * mean), math.ceil(mean) + self.slack)

    def choose(self, req: RouteRequest, replicas: list[str]) -> Decision:
        matches = self.index.match(req.keys)
        cap = self.capacity(replicas)
        allowed = [r for r in replicas if self.load.inflight[r] + 1 <= cap] or replicas
        c = self.cost
        costs: dict[str, float] = {}
        floor = self.min_match_fraction * req.prompt_tokens
        for r in allowed:
            cached = self.cached_tokens(req, matches.get(r, 0))
            if cached < floor:
                # A short shared head (chat template, a common first line) is not worth
                # piling new conversations onto one replica: count it as a tie, so they
                # spread by where they differ.
                cached = 0
            wait = (self.load.pending_prefill[r] * c.prefill_s_per_token
                    + self.load.inflight[r] * c.decode_s_per_request)
            costs[r] = (wait + 2 * (req.prompt_tokens - cached) * c.prefill_s_per_token
                        + cached * c.ctx_s_per_token)
        best = min(costs.values())
        # Costs within a few percent are indistinguishable given the model's error; decide
        # those deterministically so conversations and independent routers stay put.
        tol = max(best * 0.05, c.decode_s_per_request * 0.5)
        near = [r for r, v in costs.items() if v <= best + tol]
        owner = self._sessions.get(req.session) if req.session else None
        best_cached = max(matches, key=lambda r: matches[r]) if matches else None
        if owner in near and len(near) > 1:
            chosen, reason = owner, "session"
        else:
            key = self._tie_key(req, matches, best_cached in allowed)
            chosen = rendezvous_rank(key, near)[0] if len(near) > 1 else near[0]
            reason = "affinity_hit" if self.cached_tokens(req, matches.get(chosen, 0)) \
                >= max(floor, 1) else "cold"
        if best_cached is not None and best_cached not in allowed:
            reason = "load_guard"
        if req.session:
            self._sessions[req.session] = chosen
            self._sessions.move_to_end(req.session)
            if len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        return Decision(chosen, reason, self.cached_tokens(req, matches.get(chosen, 0)), costs)

    @staticmethod
    def _tie_key(req: RouteRequest, matches: dict[str, int], owner_allowed: bool) -> int:
        """Key for rendezvous among near-equal candidates. Normally the prompt's first block
        that no replica holds: prompts sharing only a short head (chat template, a common
        system line) spread by where they differ. When the load guard keeps a prefix off
        its holder, the last shared block instead, so the prefix's overflow goes to one
        stable second home (the same from every router) rather than everywhere."""
        depth = max(matches.values(), default=0)
        if not req.keys:
            return req.affinity_key
        if depth and not owner_allowed:
            return req.keys[depth - 1]
        return req.keys[min(depth, len(req.keys) - 1)]

    def on_dispatch(self, replica: str, req: RouteRequest) -> None:
        self.index.insert(replica, req.keys)

    def forget_replica(self, replica: str) -> None:
        for s in [s for s, r in self._sessions.items() if r == replica]:
            del self._sessions[s]
        self.cost.forget(replica)

    def observe(self, replica: str, computed_tokens: int, timings: dict[str, Any],
                running: int) -> None:
        if timings:
            # Keyed by the replica's name so that a departed replica's measured speed
            # leaves with it (forget_replica).
            if timings.get("first_token_ts"):
                self.cost.observe_prefill(replica, timings["scheduled_ts"],
                                          timings["first_token_ts"], computed_tokens)
            self.cost.observe_decode(timings.get("itl_s"), running)


class RayPrefix(PowerOfTwo):
    """Ray Serve LLM's PrefixCacheAffinityRouter, reproduced for comparison on the same
    engines: a character prefix tree over the prompt text (no chat template), affinity only
    when the match rate passes a threshold and the fleet is balanced within an absolute
    gap, else power-of-two; prompt text inserted at routing, responses never."""

    name = "ray_prefix"

    def __init__(self, *a, match_rate_threshold: float = 0.1,
                 imbalanced_threshold: int = 10, **kw) -> None:
        super().__init__(*a, **kw)
        self.tree = TextPrefixTree()
        self.match_rate_threshold = match_rate_threshold
        self.imbalanced_threshold = imbalanced_threshold

    def choose(self, req: RouteRequest, replicas: list[str]) -> Decision:
        loads = [self.load.inflight[r] for r in replicas]
        if max(loads) - min(loads) <= self.imbalanced_threshold and req.text:
            matched, owners = self.tree.longest_match(req.text, set(replicas))
            if owners and matched / len(req.text) >= self.match_rate_threshold:
                r = min(owners, key=lambda x: self.load.inflight[x])
                return Decision(r, "affinity_hit", self._predicted(req, r))
        d = super().choose(req, replicas)
        d.reason = "power_of_two"
        return d

    def on_dispatch(self, replica: str, req: RouteRequest) -> None:
        if req.text:
            self.tree.insert(req.text, replica)

    def forget_replica(self, replica: str) -> None:
        self.tree.remove_tenant(replica)


POLICIES = {p.name: p for p in (Affinity, RoundRobin, PowerOfTwo, RayPrefix)}


def make_policy(name: str, index: PrefixIndex, load: LoadTracker, block_size: int,
                router_cfg=None, seed: int | None = None) -> Policy:
    from rayattn.config.schema import RouterConfig

    rc = router_cfg or RouterConfig()
    if name == "affinity":
        cost = CostModel(rc.prefill_s_per_token, rc.extend_s_per_context_token,
                         rc.decode_s_per_request)
        return Affinity(index, load, block_size, cost=cost, epsilon=rc.load_epsilon,
                        min_match_fraction=rc.min_match_fraction, slack=rc.load_slack)
    if name == "round_robin":
        return RoundRobin(index, load, block_size)
    if name == "power_of_two":
        return PowerOfTwo(index, load, block_size, seed=seed)
    if name == "ray_prefix":
        return RayPrefix(index, load, block_size, seed=seed,
                         match_rate_threshold=rc.ray_prefix_match_rate_threshold,
                         imbalanced_threshold=rc.ray_prefix_imbalanced_threshold)
    raise ValueError(f"router.policy: unknown policy {name!r}; allowed: {', '.join(POLICIES)}")
