"""The routing core: everything the router knows and decides, with no transport in it.

It owns the block hasher, the cache index, the load view and the policy, and walks every
request through one lifecycle:

    request()  →  choose()  →  dispatched()  →  first_token()  →  finished()  →  ended()

plus membership (`joined` / `left`, engine load reports), live settings (`reconfigure`),
a cold start (`reset`) and a typed `snapshot`. The ingress (rayattn/server/dispatch.py) calls
it around real engine calls; the simulator (rayattn/bench/simulate.py) calls it around
modelled ones, so what the simulator predicts is what the shipped router does. Nothing here
awaits, starts a task or talks to Ray, Serve or ZMQ: feeds of KV events write into `index`
from the server side, and membership comes from there too.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rayattn.routing import policies
from rayattn.routing.adapters import AdapterResidency
from rayattn.routing.hashing import BlockHasher, to_key
from rayattn.routing.kv_budget import KVBudget
from rayattn.routing.load import LoadTracker
from rayattn.routing.policies import Decision, Policy, PolicyContext, RouteRequest
from rayattn.routing.prefix_index import CacheIndex, EventIndex, PrefixIndex
from rayattn.routing.settings import RoutingSettings

log = logging.getLogger("rayattn.router")

# Token ids of recent conversations' last prompt (+ answer) the core keeps, so a next turn
# hashes only its new blocks: 4-byte ids, 16M tokens = 64 MiB at most, however many
# conversations (client-chosen session ids) and however long their contexts.
KNOWN_PREFIX_TOKENS = 16 << 20
# Conversations whose last replica the core remembers (a name each).
LAST_REPLICAS = 100_000


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


@dataclass
class ReplicaView:
    """The core's picture of one member, for /health and the simulator's reports."""

    inflight: int
    local: int
    pending_prefill_tokens: int
    blocks: int
    speculative_blocks: int | None
    offloaded_blocks: int = 0
    """Blocks of its host-memory KV tier (vLLM's offloading connector)."""
    admission_fill: float = 0.0
    """The fraction of its KV cache cache-pressure admission admits up to now."""


@dataclass
class CoreSnapshot:
    policy: str
    index_mode: str
    block_size: int
    routable: dict[str, ReplicaView]
    regret_tokens: dict[str, int]
    """By decision reason: tokens recomputed that another replica held (core.py)."""
    session_moves: dict[str, int]
    """By decision reason: conversations sent elsewhere than their previous turn."""


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
        self.adapter_paths = dict(adapters or {})
        self.adapters = AdapterResidency(adapter_slots, adapters_cached) \
            if self.adapter_paths else AdapterResidency()
        self._hash = (hash_algo, hash_seed)
        self._seed, self._clock = seed, clock
        self.load = LoadTracker(origin)
        self.hasher = BlockHasher(block_size, hash_algo, hash_seed)
        self.routable: dict[str, int] = {}
        """The replicas this core routes to (joined and not left), with their KV capacity in
        blocks."""
        self.index = self._new_index()
        self.policy = self._new_policy(self.settings.policy)
        self._prefixes: OrderedDict[str, tuple[array, list[bytes]]] = OrderedDict()
        """Per conversation: the token ids it sent last and their full blocks' hashes."""
        self._prefix_tokens = 0
        self.hashed_blocks = 0
        """Blocks hashed so far (a conversation's known prefix is not hashed again)."""
        self._last_replica: OrderedDict[str, str] = OrderedDict()
        """Where each recent conversation's previous turn went (bounded)."""
        self.regret_tokens: Counter[str] = Counter()
        self.session_moves: Counter[str] = Counter()
        self.kv = KVBudget(self.settings.conversation_idle_s,
                           self.settings.kv_admission_fill, clock,
                           self.settings.kv_admission_protect)
        """Cache-pressure admission's bookkeeping (the dispatcher gates on it when
        router.kv_admission is on)."""

    @property
    def block_size(self) -> int:
        return self.hasher.block_size

    @property
    def index_mode(self) -> str:
        return self.settings.index

    def _new_index(self) -> CacheIndex:
        index: CacheIndex = (EventIndex(self.settings.speculative_ttl_s, self._clock)
                             if self.settings.index == "events" else PrefixIndex())
        for name, capacity in self.routable.items():
            index.add_replica(name, capacity)
        return index

    def _new_policy(self, name: str) -> Policy:
        ctx = PolicyContext(self.index, self.load, self.block_size, self._seed, self.adapters)
        return policies.build(name, ctx, self.settings.params(name))

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
            self.hasher = BlockHasher(block_size, *self._hash)
            self.policy = self._new_policy(self.policy.name)
            self._prefixes.clear()  # hashed with the other block size
            self._prefix_tokens = 0
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
        session = session or None  # an empty header names no conversation
        if session and (salt or adapter):
            session = "\0".join((salt or "", adapter or "", session))
        known = self._known_hashes(token_ids, session) if session else []
        hashes = self.hasher.full_hashes(token_ids, known, salt, self._adapter(adapter))
        self.hashed_blocks += len(hashes) - len(known)
        if session:
            self._remember(session, token_ids, hashes)
        keys = [to_key(h) for h in hashes]
        head = keys[0] if keys else hash((adapter, tuple(token_ids[: self.block_size])))
        return RouteRequest(keys, len(token_ids), head, session, text, hashes, token_ids,
                            adapter=adapter, salt=salt,
                            continued_tokens=len(known) * self.block_size)

    def _adapter(self, name: str | None) -> tuple[str, str] | None:
        if name is None:
            return None
        try:
            return name, self.adapter_paths[name]
        except KeyError:
            raise ValueError(f"unknown LoRA adapter {name!r}") from None

    def _known_hashes(self, token_ids: list[int], session: str) -> list[bytes]:
        entry = self._prefixes.get(session)
        if entry is None:
            return []
        ids, hashes = entry
        bs = self.block_size
        n = min(len(ids), len(token_ids)) // bs * bs
        try:
            if array("I", token_ids[:n]) == ids[:n]:
                return hashes[: n // bs]
        except OverflowError:  # not token ids this cache can hold
            return []
        # Diverged (an edited history, a re-tokenized answer): the blocks before the first
        # differing one still hold, found by halving.
        lo, hi = 0, n // bs
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if array("I", token_ids[: mid * bs]) == ids[: mid * bs]:
                lo = mid
            else:
                hi = mid - 1
        return hashes[:lo]

    def _remember(self, session: str, token_ids: list[int], hashes: list[bytes]) -> None:
        try:
            ids = array("I", token_ids)
        except OverflowError:  # an id beyond 32 bits: nothing to keep
            return
        old = self._prefixes.pop(session, None)
        if old is not None:
            self._prefix_tokens -= len(old[0])
        if len(ids) > KNOWN_PREFIX_TOKENS // 4:
            return  # one conversation may not take the whole budget
        self._prefixes[session] = (ids, hashes)
        self._prefix_tokens += len(ids)
        while self._prefix_tokens > KNOWN_PREFIX_TOKENS:
            _, (dropped, _) = self._prefixes.popitem(last=False)
            self._prefix_tokens -= len(dropped)

    def choose(self, route: RouteRequest, candidates: list[str],
               retry: bool = False) -> Decision:
        """The replica for `route` among `candidates`. `retry`: an earlier attempt's replica
        failed; this choice is not the router's to account as a move or a regret."""
        if route.session:
            last = self._last_replica.get(route.session)
            route.previous = last if last in self.routable else None
        # Now: a retry sees the index anew.
        route.held, route.reloaded = self.index.match_tiers(route.keys)
        d = self.policy.choose(route, candidates)
        d.predicted_reload_tokens = self.policy.reloaded_tokens(route, d.replica) \
            if d.predicted_cached_tokens else 0
        d.loads = {r: self.load.inflight[r] for r in candidates}
        if not retry:
            self._account(d, route, candidates)
        if route.session:
            self._last_replica[route.session] = d.replica
            self._last_replica.move_to_end(route.session)
            if len(self._last_replica) > LAST_REPLICAS:
                self._last_replica.popitem(last=False)
        return d

    def _account(self, d: Decision, route: RouteRequest, candidates: list[str]) -> None:
        """The router's own regret, by the decision's reason: prompt tokens another
        candidate held beyond the chosen one's, and conversations moved off the replica of
        their previous turn while it was a candidate."""
        matches = route.held or {}
        held = max((matches.get(r, 0) for r in candidates), default=0)
        best = policies.cached_tokens(route.prompt_tokens, held, self.block_size)
        d.regret_tokens = max(0, best - d.predicted_cached_tokens)
        if d.regret_tokens:
            self.regret_tokens[d.reason] += d.regret_tokens
        if route.previous in candidates and route.previous != d.replica:
            d.moved_from = route.previous
            self.session_moves[d.reason] += 1

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
                                       if learns else None)
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
            cached = route.token_ids + done.output_ids[:-1]
            full = self.hasher.full_hashes(cached, route.block_hashes, route.salt,
                                           self._adapter(route.adapter))
            self.hashed_blocks += len(full) - len(route.block_hashes)
            keys = route.keys + [to_key(h) for h in full[len(route.block_hashes):]]
            if route.session:
                # The next turn starts with this prompt and, re-rendered, usually the answer.
                self._remember(route.session, cached, full)
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
        history out of their KV cache (routing/kv_budget.py)."""
        return self.kv.room(candidates, route.session, route.prompt_tokens, route.max_tokens)

    # --- settings -----------------------------------------------------------------------
    def reconfigure(self, settings: RoutingSettings) -> bool:
        """New routing settings. The policy is rebuilt (forgetting what it learned) only
        when its name, one of its parameters, or the index mode changed. Returns whether the
        index was replaced (the caller re-attaches its event feeds)."""
        old = self.settings
        self.settings = new = settings
        index_changed = old.index != new.index
        if index_changed:
            self.index = self._new_index()
        elif isinstance(self.index, EventIndex):
            self.index.ttl_s = new.speculative_ttl_s  # for blocks sent from now on
        self.kv.idle_s, self.kv.fill = new.conversation_idle_s, new.kv_admission_fill
        self.kv.protect = new.kv_admission_protect
        if index_changed or old.policy != new.policy or \
                old.params(new.policy) != new.params(new.policy):
            self.policy = self._new_policy(new.policy)
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
        self.policy = self._new_policy(self.settings.policy)
        self._last_replica.clear()
        old, self.kv = self.kv, KVBudget(self.settings.conversation_idle_s,
                                         self.settings.kv_admission_fill, self._clock,
                                         self.settings.kv_admission_protect)
        self.kv.capacity, self.kv.running = old.capacity, old.running
        self.kv.host_tier = old.host_tier
        self.regret_tokens.clear()
        self.session_moves.clear()
        return self.policy.name

    def snapshot(self) -> CoreSnapshot:
        return CoreSnapshot(self.policy.name, self.index_mode, self.block_size, {
            n: ReplicaView(self.load.inflight[n], self.load.local.get(n, 0),
                           self.load.pending_prefill.get(n, 0), self.index.size(n),
                           self.index.speculative(n), self.index.offloaded(n),
                           self.kv.fill_of(n))
            for n in self.routable}, dict(self.regret_tokens), dict(self.session_moves))
