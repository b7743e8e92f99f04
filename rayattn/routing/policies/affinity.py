"""`affinity` minimises a predicted time to first token plus the prefill work it adds:

    cost(r) = wait(r) + 2 × uncached_tokens(r) × c_prefill + cached_tokens(r) × c_ctx
              + reloaded_tokens(r) × c_reload
    wait(r) = pending_prefill_tokens(d) × c_prefill + inflight(d) × c_decode
              + max(0, inflight(r) + 1 - batch(r)) × output × c_decode

where cached tokens include those r's engine would reload from its host-memory KV tier
(vLLM's offloading connector), priced at c_reload, between an extend from HBM (free but for
c_ctx) and a cold prefill: a conversation whose history moved to r's host tier stays with r.

where d is r's device: engines that share a GPU share its throughput, so their queues count
together and a move between them saves no wait while it recomputes the history. But each
engine has its own batch (max_num_seqs, batch(r)): past it a request queues in its engine
until a running one ends, about `output` steps of the batch (the output requests run to,
measured; at most this request's max_tokens) for each place it waits for, even while an
engine beside it on the same GPU has free places. Without that term, conversations
sharing a prompt cached on one of two engines of one GPU all stayed on that engine
(docs/log/gpu-one-gpu-contest.md).

Past every engine's batch, a shorter queue (of places, of queued prefill work, of
co-running decodes) seats a request sooner only by seating the next one there later: the
waits add up the same wherever it goes, and a move buys nothing but the recompute. There the
work decides first (only the engines where this request's prefill, context and reload cost
least stay candidates), the queued work and decodes only among those (a new conversation
still goes where less is queued), the wait for a place not at all; the load guard bounds the
queues.

subject to a bounded-load guard per device (inflight(d) + 1 ≤ max(⌈(1+ε)·m⌉, ⌈m⌉ + slack,
batch(d)), with m = (total+1)/n over devices and batch(d) the requests its engines run in one
batch), so affinity can never build a hot spot, and never moves a conversation off its
cache while its engine still has room in its batch. Near-ties go to the conversation's
session owner, then to the replica ranked first by rendezvous hashing of the prefix's first
block: independent router replicas and followers of a re-homed prefix agree without talking
to each other.

Uncached tokens count twice: once for this request's first token and once for the work they
add in front of everything queued behind it on that engine. Counted once, a move that saves
this request a millisecond of queue looks free even when it recomputes a conversation's
whole history, which costs every request queued behind it far more.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, Field

from rayattn.routing.policies.base import (
    Decision,
    Policy,
    PolicyContext,
    RouteRequest,
    rendezvous_rank,
)
from rayattn.routing.policies.cost_model import CostModel
from rayattn.routing.policies.spec import PolicyParams, PolicySpec


class AffinityFields(BaseModel):
    """`affinity`'s parameters, as `router:` spells them (RouterConfig takes these fields)."""

    load_epsilon: float = Field(0.5, ge=0)
    """Bounded-load guard: no replica takes a request while its in-flight count exceeds the
    larger of (1 + ε) × m and m + `load_slack` (m = the mean in-flight, counting this
    request), whatever its cache holds."""
    load_slack: int = Field(4, ge=0)
    """Bounded-load guard: in-flight requests a replica may carry above the mean before the
    guard applies, however small the mean. Engines batch, so a few requests more is not a hot
    spot; without it, at low load (a run's tail, a quiet hour) ⌈(1 + ε) × mean⌉ is a handful
    and the guard moved conversations off their cache to save nothing (vllm-router's
    cache_aware waits for an absolute gap of 32)."""
    min_match_fraction: float = Field(0.1, ge=0, le=1)
    """`affinity`: a cached prefix shorter than this fraction of the prompt does not count
    (like Ray Serve LLM's match-rate threshold): new conversations that share only a short
    head (chat template, a common first line) spread by where they differ instead of piling
    onto the replica that served the first of them."""
    prefill_s_per_token: float = Field(2e-4, gt=0)
    """Initial cost of prefilling one token; refitted online from engine timings."""
    extend_s_per_context_token: float = Field(1e-6, ge=0)
    """Initial cost per cached context token an extend attends to; refitted online."""
    decode_s_per_request: float = Field(5e-3, ge=0)
    """Cost an in-flight decode adds to a new request's wait."""
    weigh_queues_past_batch: bool = False
    """`affinity`: while every candidate is past its batch, weigh the queued prefill work
    and the co-running decodes (not the wait for a place) against the recompute, as below
    the batch. Off: there the engines where the request's own work costs least are the only
    candidates; on two H200s at 512 conversations the queues moved document chats off their
    histories to skip a queue the next request then joined (docs/routing.md)."""
    reload_cost_fraction: float = Field(0.1, ge=0, le=1)
    """`affinity`: what reloading a cached token from an engine's host-memory KV tier
    (engine.kv_offload) costs, as a fraction of prefilling it. A copy over the host link is
    far cheaper than the model's compute (docs/results.md measures both); pricing it
    above zero keeps a conversation on the replica whose HBM still holds it."""


class AffinityParams(AffinityFields, PolicyParams):
    """`affinity`'s parameters, frozen (its factory's input)."""


class Affinity(Policy):
    name = "affinity"

    def __init__(self, ctx: PolicyContext, *, cost: CostModel, epsilon: float,
                 min_match_fraction: float = 0.1, slack: int = 0,
                 weigh_queues_past_batch: bool = False) -> None:
        super().__init__(ctx)
        self.cost, self.epsilon, self.slack = cost, epsilon, slack
        self.min_match_fraction = min_match_fraction
        self.weigh_queues_past_batch = weigh_queues_past_batch

    def allowed(self, replicas: list[str]) -> list[str]:
        """The bounded-load guard, per device (engines sharing a GPU are one unit: moving
        work between them frees nothing): a device may take a request while its in-flight
        count stays within max(⌈(1+ε)·m⌉, ⌈m⌉ + slack) of the mean m over devices, or
        within what its engines batch at once (max_num_seqs): below that a request joins
        the running batch, and moving a conversation off its cache buys nothing."""
        devices: dict[str, list[str]] = {}
        for r in replicas:
            devices.setdefault(self.load.device.get(r, r), []).append(r)
        load = {d: sum(self.load.inflight[r] for r in rs) for d, rs in devices.items()}
        mean = (sum(load.values()) + 1) / len(devices)
        cap = max(math.ceil((1 + self.epsilon) * mean), math.ceil(mean) + self.slack)
        ok = {d for d, rs in devices.items()
              if load[d] + 1 <= max(cap, sum(self.load.batch.get(r, 0) for r in rs))}
        return [r for r in replicas if self.load.device.get(r, r) in ok] or replicas

    def choose(self, req: RouteRequest, replicas: list[str]) -> Decision:
        # Only the candidates' caches: a replica at its cap or already tried is not one.
        matches = {r: n for r, n in self.matches(req).items() if r in replicas}
        allowed = self.allowed(replicas)
        floor = self.min_match_fraction * req.prompt_tokens
        costs, slots = self._costs(req, allowed, matches, floor)
        near = self._near(req, costs, matches, floor)
        owner = req.previous
        best_cached = max(matches, key=lambda r: matches[r]) if matches else None
        if owner in near and len(near) > 1:
            chosen, reason = owner, "session"
        else:
            key = self._tie_key(req, matches, best_cached in allowed)
            chosen = rendezvous_rank(key, near)[0] if len(near) > 1 else near[0]
            reason = "affinity_hit" if self.cached_tokens(req, matches.get(chosen, 0)) \
                >= max(floor, 1) else "cold"
        home = owner if owner in costs else best_cached if best_cached in costs else None
        if home is not None and chosen != home and slots[home] > slots[chosen] and \
                costs[home] - slots[home] <= costs[chosen] - slots[chosen]:
            # The engine holding its history (or the longest cached prefix) was past its
            # batch: the wait for a place there outweighed the recompute elsewhere.
            reason = "batch_wait"
        if best_cached is not None and best_cached not in allowed:
            reason = "load_guard"
        return Decision(chosen, reason, self.cached_tokens(req, matches.get(chosen, 0)), costs)

    def _costs(self, req: RouteRequest, allowed: list[str], matches: dict[str, int],
               floor: float) -> tuple[dict[str, float], dict[str, float]]:
        """Each allowed replica's predicted cost (the module's formula), and of it the wait
        for a place in its batch."""
        c = self.cost
        costs: dict[str, float] = {}
        device_load = self.load.device_load()
        slots = {r: self._slot_wait(req, r) for r in allowed}
        saturated = all(slots.values())
        if saturated:
            # Every candidate is past its batch: a place that ends on one engine is taken by
            # the next request there, so the shorter queue seats this request sooner only
            # by seating the next one later. The waits add up the same wherever it goes,
            # while a move recomputes its history in front of everyone queued there; the
            # queues' lengths differ by what each router has yet to hear of the others'
            # requests. The load guard alone keeps them within bounds across devices;
            # between engines of one GPU, one with a free place still takes the next ones.
            slots = dict.fromkeys(allowed, 0.0)
        work: dict[str, float] = {}
        for r in allowed:
            cached = self.cached_tokens(req, matches.get(r, 0))
            if cached < floor:
                # A short shared head (chat template, a common first line) is not worth
                # piling new conversations onto one replica: count it as a tie, so they
                # spread by where they differ.
                cached = 0
            reload = self.reloaded_tokens(req, r) if cached else 0
            work[r] = (2 * (req.prompt_tokens - cached) * c.prefill_s_per_token
                       + cached * c.ctx_s_per_token + reload * c.reload_s_per_token
                       + self._adapter_cost(req, r))
        if saturated and not self.weigh_queues_past_batch:
            # As with the places, so with the prefill work queued there and the decodes
            # running there: one engine's queue is shorter only until the next request
            # joins it. So the work decides (the engines where this request costs least,
            # within the model's error), and the queues only among those: a new
            # conversation, holding as much everywhere, still goes where less is queued.
            allowed = self._within_error(work)
        for r in allowed:
            # Counted per device: engines sharing a GPU share its throughput, so the work
            # queued on the other one delays this request as much as its own does.
            pending, inflight = device_load.get(r, (0, 0))
            costs[r] = (pending * c.prefill_s_per_token + inflight * c.decode_s_per_request
                        + slots[r] + work[r])
        return costs, slots

    def _near(self, req: RouteRequest, costs: dict[str, float], matches: dict[str, int],
              floor: float) -> list[str]:
        """The replicas whose costs are indistinguishable from the best one's, narrowed to
        those holding the request's adapter and, when none holds a prefix worth keeping, to
        the least busy."""
        # Costs within the model's error are indistinguishable: decide those
        # deterministically so conversations and independent routers stay put.
        near = self._within_error(costs)
        if req.adapter is not None:
            # Among near-equal engines, one that has the adapter loaded: on a slow engine
            # the load is within the model's error, and its requests would still scatter
            # the adapter over every engine's LoRA slots.
            near = [r for r in near if self.adapters.holds(r, req.adapter)] or near
        if len(near) > 1 and not any(self.cached_tokens(req, matches.get(r, 0)) >= max(floor, 1)
                                     for r in near):
            near = self._least_busy(near)
        return near

    def _within_error(self, costs: dict[str, float]) -> list[str]:
        """The replicas whose cost is within the cost model's error of the least: a few
        percent, or half a decode's share of a step."""
        least = min(costs.values())
        tol = max(least * 0.05, self.cost.decode_s_per_request * 0.5)
        return [r for r, v in costs.items() if v <= least + tol]

    def _least_busy(self, near: list[str]) -> list[str]:
        """Nothing to keep: a new conversation goes to the least busy engine first. The cost
        ties engines that share a GPU (one queue of compute), but each has its own KV cache
        and batch, and a conversation placed on the fuller one is the first its LRU evicts
        (a hash alone splits them unevenly, the same way every run). Between engines of one
        GPU, this router's own requests first: they are exact, while the other routers' come
        from reports of different ages per engine, which in a burst steer every router the
        same way; each router even on its own keeps the sum even. Across GPUs the cost
        already weighs every router's load, and the total decides."""
        one_gpu = len({self.load.device.get(r) for r in near}) == 1 and \
            self.load.device.get(near[0]) is not None

        def busy(r: str) -> tuple[int, int]:
            return (self.load.local.get(r, 0) if one_gpu else 0, self.load.inflight[r])

        fewest = min(busy(r) for r in near)
        return [r for r in near if busy(r) == fewest]

    def _slot_wait(self, req: RouteRequest, replica: str) -> float:
        """Waiting for a place in `replica`'s own batch: for each place this request waits
        for past its engine's max_num_seqs, one running request must end, about `output`
        steps of a batch whose step costs c_decode per sequence (the first of B running
        requests ends in ~output / B steps). `output` is what requests ran to, measured, at
        most this request's max_tokens (a cap, 256 where the client sends none)."""
        batch = self.load.batch.get(replica, 0)
        places = self.load.inflight[replica] + 1 - batch
        if not batch or places <= 0:
            return 0.0
        return places * self.cost.request_decode_s(req.max_tokens)

    def _adapter_cost(self, req: RouteRequest, replica: str) -> float:
        """What running under a LoRA adapter adds on `replica`: loading it where the engine
        does not hold it, and waiting for a batch slot where every slot runs another
        adapter (about one running request's decode: the output requests run to, measured,
        at most this one's max_tokens, in steps of the batch)."""
        if req.adapter is None:
            return 0.0
        c, cost = self.cost, 0.0
        if not self.adapters.holds(replica, req.adapter):
            cost += c.adapter_load_s
        if self.adapters.waits_for_slot(replica, req.adapter):
            cost += c.request_decode_s(req.max_tokens) * max(self.load.inflight[replica], 1)
        return cost

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
        self.cost.forget(replica)

    def observe(self, replica: str, computed_tokens: int, timings: dict[str, Any],
                running: int, output_tokens: int) -> None:
        self.cost.observe_output(output_tokens)
        if timings:
            # Keyed by the replica's name so that a departed replica's measured speed
            # leaves with it (forget_replica).
            if timings.get("first_token_ts"):
                self.cost.observe_prefill(replica, timings["scheduled_ts"],
                                          timings["first_token_ts"], computed_tokens)
            self.cost.observe_decode(timings.get("itl_s"), running)


def _build(ctx: PolicyContext, params: AffinityParams) -> Affinity:
    cost = CostModel(params.prefill_s_per_token, params.extend_s_per_context_token,
                     params.decode_s_per_request, params.reload_cost_fraction)
    return Affinity(ctx, cost=cost, epsilon=params.load_epsilon,
                    min_match_fraction=params.min_match_fraction, slack=params.load_slack,
                    weigh_queues_past_batch=params.weigh_queues_past_batch)


SPEC = PolicySpec(
    "affinity", "predicted-TTFT cost over the engines' cached blocks, bounded load",
    AffinityParams, _build, warms_engines=True)
