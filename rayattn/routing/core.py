"""The routing core: everything the router knows and decides, with no transport in it.

It owns the block hasher, the cache index, the load view and the policy, and walks every
request through one lifecycle:

    request()  →  choose()  →  dispatched()  →  first_token()  →  finished()  →  ended()

plus membership (`joined` / `left`, engine load reports), live settings (`reconfigure`),
a cold start (`reset`) and a typed `snapshot`. Each job is a part of its own: the
prompt's block keys (prompt_keys.py), what its decisions did to conversations
(decision_log.py), what settings build (builders.py) and the snapshot (snapshot.py); the
core walks them through the lifecycle. The ingress (rayattn/server/dispatch.py) calls
it around real engine calls; the simulator (rayattn/bench/simulate.py) calls it around
modelled ones, so what the simulator predicts is what the shipped router does. Nothing here
awaits, starts a task or talks to Ray, Serve or ZMQ: feeds of KV events write into `index`
from the server side, and membership comes from there too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rayattn.routing import policies, warm_plan
from rayattn.routing.adapters import AdapterResidency
from rayattn.routing.builders import PolicyBuilder, new_index, new_kv_budget
from rayattn.routing.decision_log import DecisionLog
from rayattn.routing.hashing import to_key
from rayattn.routing.load import LoadTracker
from rayattn.routing.policies import Decision, RouteRequest
from rayattn.routing.prefix_index import EventIndex
from rayattn.routing.prompt_keys import PromptKeys
from rayattn.routing.settings import RoutingSettings
from rayattn.routing.snapshot import CoreSnapshot, replica_views

log = logging.getLogger("rayattn.router")


@dataclass
class Finished:
    """What the engine said of a request that ran to its end."""

    prompt_tokens: int
    cached_tokens: int
    output_ids: list[int] = field(default_factory=list)
    """Generated ids (the first choice's): the engine now caches the prompt and all of them
    but the last, whose KV was never computed."""
    timings: dict[str, Any] = field(default_factory=dict)
    """The engine's timings (scheduled_ts / first_token_ts on its own clock, itl_s, …)."""
    continuation_keys: list[int] | None = None
    """Block keys of prompt + output when the caller already has them (simulated traces
    carry keys, not ids); else they are hashed from `output_ids`."""


class RoutingCore:
    def __init__(self, settings: RoutingSettings, block_size: int, *,
                 hash_algo: str = "sha256", hash_seed: str = "0", origin: str = "",
                 seed: int | None = None, clock: Callable[[], float] = time.monotonic,
                 adapters: Mapping[str, str] | None = None, adapter_slots: int = 1,
                 adapters_cached: int = 1) -> None:
        """`settings`: the routing settings (RouterConfig.routing_settings()); `origin`:
        this router's name in the engines' per-origin load reports; `seed`: for randomised
        policies (the simulator repeats runs); `adapters`: the LoRA adapters the engines
        serve (name: the path they load it from, which vLLM hashes into its blocks), with
        vLLM's max_loras (`adapter_slots`) and max_cpu_loras (`adapters_cached`)."""
        self.settings = settings
        self.keys = PromptKeys(block_size, hash_algo, hash_seed, adapters)
        self.adapter_paths = self.keys.adapter_paths
        self.adapters = AdapterResidency(adapter_slots, adapters_cached) \
            if self.adapter_paths else AdapterResidency()
        self._clock = clock
        self.load = LoadTracker(origin, clock)
        self._policies = PolicyBuilder(self.load, self.adapters, seed)
        self.routable: dict[str, int] = {}
        """The replicas this core routes to (joined and not left), with their KV capacity in
        blocks."""
        self.index = new_index(settings, clock, self.routable)
        self.policy = self._policies.build(settings.policy, settings, self.index, block_size)
        self.decisions = DecisionLog(clock=clock)
        self.regret_tokens = self.decisions.regret_tokens
        self.session_moves = self.decisions.session_moves
        self.kv = new_kv_budget(settings, clock, self.load.routers, lambda: self.block_size)
        """Cache-pressure admission's bookkeeping (the dispatcher gates on it when
        router.kv_admission is on)."""

    @property
    def block_size(self) -> int:
        return self.keys.block_size

    # --- membership ---------------------------------------------------------------------
    def joined(self, name: str, block_size: int, capacity_blocks: int,
               device: str | None = None, max_batch: int = 0,
               host_tier: bool = False) -> bool:
        """An engine replica is up. False when the router cannot route to it correctly.
        `device`: what it computes on (GPU UUIDs); replicas naming the same one share its
        throughput. `max_batch`: the requests its engine runs in one batch (routing/load.py).
        `host_tier`: it keeps blocks evicted from HBM in host memory (engine.kv_offload)."""
        if block_size != self.block_size and not self.routable:
            # The engine is the authority on its block size (vLLM may override the configured
            # one for a backend): the first engine up sets what the router hashes.
            log.warning("engine %s reports KV block size %d (configured %d): hashing with %d",
                        name, block_size, self.block_size, block_size)
            self.keys.rehash(block_size)
            self.policy = self._policies.build(self.policy.name, self.settings, self.index,
                                               block_size)
        if block_size != self.block_size:
            # Hashing with another block size would predict hits that never happen.
            log.error("engine %s uses KV block size %d but the router hashes %d-token blocks "
                      "(attention.block_size): not routing to it", name, block_size,
                      self.block_size)
            return False
        self.index.remove_replica(name)  # a rejoining replica starts as empty as its cache
        self.index.add_replica(name, capacity_blocks)
        self.adapters.joined(name, list(self.adapter_paths))
        self.routable[name] = capacity_blocks
        self.kv.joined(name, capacity_blocks * self.block_size, host_tier)
        if device:
            self.load.device[name] = device
        if max_batch:
            self.load.batch[name] = max_batch
        return True

    def left(self, name: str) -> None:
        """A replica is gone (down, drained, replaced): nothing learned of it stays."""
        self.routable.pop(name, None)
        self.index.remove_replica(name)
        self.adapters.forget(name)
        self.kv.left(name)
        self.policy.forget_replica(name)
        self.load.forget(name)

    def reported(self, name: str, by_origin: Mapping[str, int],
                 stamp: tuple[int, int] | None = None) -> None:
        """An engine's in-flight requests per sending router (probe reply or chunk)."""
        if name in self.routable:
            self.load.reported(name, by_origin, stamp)

    # --- one request --------------------------------------------------------------------
    def request(self, token_ids: list[int], session: str | None = None,
                text: str = "", salt: str | None = None,
                adapter: str | None = None) -> RouteRequest:
        """The routing view of a prompt: its block keys. A conversation's new turn extends
        its previous prompt (and answer): only the blocks after what it shares with them
        are hashed. `salt` is the request's cache namespace (vLLM's `cache_salt`) and
        `adapter` its LoRA adapter: both are in every block key, and conversations are named
        within them (one tenant's session id never meets another's)."""
        return self.keys.route(token_ids, session, text, salt, adapter)

    def choose(self, route: RouteRequest, candidates: list[str],
               retry: bool = False) -> Decision:
        """The replica for `route` among `candidates`. `retry`: an earlier attempt's replica
        failed; this choice is not the router's to account as a move or a regret."""
        if route.session:
            last = self.decisions.previous(route.session)
            route.previous = last if last in self.routable else None
        # Now: a retry sees the index anew.
        route.held, route.reloaded = self.index.match_tiers(route.keys)
        d = self.policy.choose(route, candidates)
        d.predicted_reload_tokens = self.policy.reloaded_tokens(route, d.replica) \
            if d.predicted_cached_tokens else 0
        d.loads = {r: self.load.inflight[r] for r in candidates}
        self.decisions.record(d, route, candidates, self.block_size, retry)
        return d

    def dispatched(self, d: Decision, route: RouteRequest) -> None:
        """The call to `d.replica` is being issued; `ended(d)` must follow, however it
        ends."""
        d.uncached_tokens = route.prompt_tokens - d.predicted_cached_tokens
        d.prefill_pending = d.in_flight = True
        d.session = route.session
        # Only an index that follows the engines' own events can tell a kept history from a
        # lost one (the predicted index guesses from this router's traffic, HBM only).
        learns = self.settings.kv_admission and isinstance(self.index, EventIndex)
        d.kv_held = self.kv.dispatched(d.replica, route.session, route.prompt_tokens,
                                       route.max_tokens,
                                       (route.continued_tokens, d.predicted_cached_tokens)
                                       if learns else None, d.predicted_cached_tokens,
                                       route.keys)
        self.load.acquire(d.replica, d.uncached_tokens)
        self.adapters.dispatched(d.replica, route.adapter)
        d.adapter = route.adapter
        self.policy.on_dispatch(d.replica, route)
        d.dispatched_at = time.perf_counter()

    def first_token(self, d: Decision) -> None:
        """The replica answered: this request's prefill no longer waits there."""
        if d.prefill_pending:
            self.load.prefill_done(d.replica, d.uncached_tokens)
            d.prefill_pending = False

    def finished(self, d: Decision, route: RouteRequest, done: Finished) -> None:
        """The request ran to its end on `d.replica`: learn where its blocks are and how
        fast the engine was. A replica that left meanwhile must not re-enter the index."""
        if d.replica not in self.routable:
            return
        keys = done.continuation_keys
        if keys is None:
            keys = self.keys.continuation(route, done.output_ids)
        self.policy.on_complete(d.replica, keys)
        self.kv.finished(d.replica, route.session, route.prompt_tokens + len(done.output_ids))
        self.policy.observe(d.replica, done.prompt_tokens - done.cached_tokens, done.timings,
                            self.load.inflight[d.replica], len(done.output_ids))

    def ended(self, d: Decision) -> None:
        """The attempt is over (finished, failed or cancelled): its load is released, once
        however many cleanup paths report it (and not at all if it was never held)."""
        if d.in_flight:
            self.load.release(d.replica, d.uncached_tokens if d.prefill_pending else 0)
            self.kv.ended(d.replica, d.session, d.kv_held)
            self.adapters.ended(d.replica, d.adapter)
            d.prefill_pending = d.in_flight = False

    def kv_room(self, route: RouteRequest, candidates: list[str]) -> list[str]:
        """The candidates that can take `route` now without pushing a live conversation's
        history out of their KV cache (routing/kv_budget.py). Sessions are spread over the
        router replicas, so each budgets its share of every engine's cache."""
        # A prefix other conversations left there (a system or tool prompt) adds nothing.
        # A new conversation matches again at every look: held since a burst began, it finds
        # the prefix its siblings have cached meanwhile (only the first held new
        # conversation looks at each release: server/forwarding/candidates.py). A live one
        # is measured by its own history at home: once is enough.
        cached = route.kv_cached
        if cached is None or any(r not in cached for r in candidates) or \
                not self.kv.is_live(route.session):
            held, _ = self.index.match_tiers(route.keys)
            cached = route.kv_cached = {
                r: policies.cached_tokens(route.prompt_tokens, held.get(r, 0), self.block_size)
                for r in candidates}
        return self.kv.room(candidates, route.session, route.prompt_tokens, route.max_tokens,
                            cached, route.keys)

    # --- engines that come and go (routing/warm_plan.py) --------------------------------
    @property
    def warms_engines(self) -> bool:
        """Whether the policy has engines that come and go warmed (the comparison policies
        reproduce routers that do not)."""
        return policies.spec(self.policy.name).warms_engines

    def warm_plans(self, targets: list[str]) -> dict[str, list[warm_plan.Prefill]]:
        """For each joining target, the prefixes the most recent conversations share,
        within its share of its cache (of this router's share). Conversations under a LoRA
        adapter are left out (the prefill would need the engine's adapter request)."""
        recent = [(k.ids, k.hashes, k.salt) for k in
                  self.keys.prefixes.recent(warm_plan.RECENT_CONVERSATIONS)
                  if k.adapter is None]
        shared = warm_plan.shared_prefixes(recent, self.block_size)
        share = warm_plan.WARM_SHARE / self.load.routers()
        return {t: plan for t in targets
                if (plan := warm_plan.within(shared, self.block_size, int(
                    self.routable.get(t, 0) * self.block_size * share)))}

    def move_plan(self, leaving: list[str], staying: list[str]) -> list[warm_plan.Prefill]:
        """The live conversations whose last turn ran on `leaving` (the targets of an engine
        that goes), to prefill on `staying`, within a share of their caches (of this
        router's share; adapter conversations left out, as in warm_plans). Live as the KV
        budget says (a turn running, or the last one ended within the pause the router
        learned from its clients): a conversation that has ended costs a prefill and brings
        nothing back (docs/results.md, the simulator from 8 to 64 engines)."""
        budget = int(sum(self.routable.get(t, 0) for t in staying) * self.block_size
                     * warm_plan.MOVE_SHARE / self.load.routers())
        kept = ((s, at, k.ids, k.salt)
                for s, at in self.decisions.sessions_on(set(leaving), warm_plan.LIVE_S)
                if self.kv.is_live(s)
                and (k := self.keys.prefixes.get(s)) is not None and k.adapter is None)
        return warm_plan.moves(kept, self.block_size, budget)

    def move_target(self, p: warm_plan.Prefill, candidates: list[str]) -> str | None:
        """Where moved conversation `p`'s next turn would go among `candidates` (the policy's
        choice for its history, as for a turn); None where its next turn has come (it
        found its own way). `moved` records it once its history is there."""
        assert p.session is not None
        if not candidates or self.decisions.last_turn(p.session) != p.at:
            return None
        k = self.keys.prefixes.get(p.session)
        if k is None:
            return None
        keys = [to_key(h) for h in k.hashes]
        route = RouteRequest(keys, len(k.ids), keys[0] if keys else 0, p.session,
                             block_hashes=k.hashes)
        route.held, route.reloaded = self.index.match_tiers(route.keys)
        return self.policy.choose(route, candidates).replica

    def moved(self, p: warm_plan.Prefill, target: str) -> None:
        """`p`'s history is on `target` now: its next turn's previous replica, unless that
        turn came meanwhile."""
        assert p.session is not None and p.at is not None
        self.decisions.moved(p.session, p.at, target)

    # --- settings -----------------------------------------------------------------------
    def reconfigure(self, settings: RoutingSettings) -> bool:
        """New routing settings. The policy is rebuilt (forgetting what it learned) only
        when its name, one of its parameters, or the index mode changed. Returns whether the
        index was replaced (the caller re-attaches its event feeds)."""
        old = self.settings
        self.settings = new = settings
        index_changed = old.index != new.index
        if index_changed:
            self.index = new_index(new, self._clock, self.routable)
        elif isinstance(self.index, EventIndex):
            self.index.overlay.ttl_s = new.speculative_ttl_s  # for blocks sent from now on
        self.kv.idle_s, self.kv.fill = new.conversation_idle_s, new.kv_admission_fill
        self.kv.protect = new.kv_admission_protect
        self.kv.climbs = new.kv_admission == "auto"
        if index_changed or old.policy != new.policy or \
                old.params(new.policy) != new.params(new.policy):
            self.policy = self._policies.build(new.policy, new, self.index, self.block_size)
        return index_changed

    def reset(self, policy: str | None = None) -> str:
        """Cold start, after the engines emptied their caches: every member's view empty,
        a fresh policy (optionally another one), so runs compared on the same engines start
        alike."""
        if policy:
            self.settings = self.settings.replace(policy=policy)
        for name, capacity in self.routable.items():
            self.index.remove_replica(name)
            self.index.add_replica(name, capacity)
        # The engines keep their loaded LoRA adapters through a prefix-cache reset, and so
        # does self.adapters.
        self.policy = self._policies.build(self.settings.policy, self.settings, self.index,
                                           self.block_size)
        self.decisions.clear()
        self.kv = new_kv_budget(self.settings, self._clock, self.load.routers,
                                lambda: self.block_size, members_of=self.kv)
        return self.policy.name

    def snapshot(self) -> CoreSnapshot:
        return CoreSnapshot(self.policy.name, self.settings.index, self.block_size,
                            replica_views(self.routable, self.load, self.index, self.kv),
                            dict(self.regret_tokens), dict(self.session_moves))
