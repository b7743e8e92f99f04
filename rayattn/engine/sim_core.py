"""The simulated engine's scheduler and prefix cache (engine.simulated): vLLM's shape of an
engine step without a model, as pure logic the simulated replica (simulated.py) drives and
the unit tests step by hand.

One step runs every sequence that is decoding (a token each) and, within the step's token
budget (engine.max_num_batched_tokens), chunks of the prompts still to prefill, in arrival
order; new requests join while the batch has room (engine.max_num_seqs) and the cache has
blocks for them. A request's prompt blocks already cached cost nothing; its step time is the
fixed step cost plus a price per prefilled token and per decoding sequence. Blocks are
vLLM's: keyed by the chained block hash (the router's index key), shared while in use,
kept after their request ends in an LRU that new requests evict from, and every change is
an event (stored, removed) for the KV event stream.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from rayattn.config.schema import SimulatedEngineConfig


@dataclass(eq=False)
class SimRequest:
    keys: list[int]
    """Index keys of every full block the request can fill: its prompt's, then those its
    output completes (the output's tokens are known in advance)."""
    prompt_tokens: int
    max_tokens: int
    arrived: float
    cached_tokens: int = 0
    to_prefill: int = 0
    generated: int = 0
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    done: bool = False
    held: list[int] = field(default_factory=list)
    """Keys of the cached blocks it uses (counted in PrefixCache.refs)."""
    anonymous: int = 0
    """Blocks it holds that have no key (yet)."""
    waker: Any = None
    """The replica's handle to wake whoever awaits this request."""


@dataclass
class Step:
    decoding: list[SimRequest]
    prefills: list[tuple[SimRequest, int]]
    duration_s: float

    @property
    def empty(self) -> bool:
        return not self.decoding and not self.prefills


class PrefixCache:
    def __init__(self, num_blocks: int) -> None:
        self.capacity = num_blocks
        self.free: OrderedDict[int, None] = OrderedDict()
        """Cached blocks no request uses, least recently used first."""
        self.refs: Counter[int] = Counter()
        """Cached blocks in use, by the requests using them."""
        self.anonymous = 0
        self.events: list[tuple[str, list[int]]] = []
        """("stored" | "removed", keys) since the replica last took them."""

    @property
    def used(self) -> int:
        return len(self.free) + len(self.refs) + self.anonymous

    @property
    def usage(self) -> float:
        """The share running requests hold, as vLLM's kv_cache_usage counts it (a cached
        block no request uses is free)."""
        return (len(self.refs) + self.anonymous) / self.capacity if self.capacity else 0.0

    def cached(self, key: int) -> bool:
        return key in self.refs or key in self.free

    def hit_blocks(self, keys: list[int], limit: int) -> int:
        n = 0
        while n < min(len(keys), limit) and self.cached(keys[n]):
            n += 1
        return n

    def admit(self, r: SimRequest, block_size: int) -> bool:
        """Blocks for `r` (its cached prefix shared, the rest new, evicting the least
        recently used free blocks); False, changing nothing, where they do not fit."""
        # At least the prompt's last token is computed, as in vLLM: a fully cached prompt
        # recomputes its last block.
        hit = self.hit_blocks(r.keys, (r.prompt_tokens - 1) // block_size)
        total = -(-(r.prompt_tokens + r.max_tokens) // block_size)
        new = total - hit
        # Free blocks may all be evicted, except the cached prefix this request will use.
        in_use = len(self.refs) + sum(1 for k in r.keys[:hit] if k not in self.refs)
        if in_use + self.anonymous + new > self.capacity:
            return False
        for k in r.keys[:hit]:
            self.free.pop(k, None)
            self.refs[k] += 1
        removed = []
        while self.used + new > self.capacity:
            removed.append(self.free.popitem(last=False)[0])
        if removed:
            self.events.append(("removed", removed))
        r.held, r.anonymous = list(r.keys[:hit]), new
        self.anonymous += new
        r.cached_tokens = hit * block_size
        r.to_prefill = r.prompt_tokens - r.cached_tokens
        return True

    def store(self, r: SimRequest, upto_tokens: int, block_size: int) -> None:
        """The request's blocks up to `upto_tokens` are computed: its full ones are cached
        (keyed) from now on."""
        full = min(upto_tokens // block_size, len(r.keys))
        stored = []
        for k in r.keys[len(r.held):full]:
            r.held.append(k)
            if self.cached(k):
                # Another request computed the same block meanwhile: its copy stays this
                # request's (anonymous) block, the key points at the first one.
                self.free.pop(k, None)
                self.refs[k] += 1
                continue
            r.anonymous -= 1
            self.anonymous -= 1
            self.refs[k] += 1
            stored.append(k)
        if stored:
            self.events.append(("stored", stored))

    def release(self, r: SimRequest) -> None:
        """The request is over: its keyed blocks stay cached, most recently used last, its
        tail before its head (vLLM frees a request's blocks in reverse: what a longer prompt
        shares with it, its head, is evicted last)."""
        for k in reversed(r.held):
            self.refs[k] -= 1
            if self.refs[k] <= 0:
                del self.refs[k]
                self.free[k] = None
                self.free.move_to_end(k)
        self.anonymous -= r.anonymous
        r.held, r.anonymous = [], 0

    def clear(self) -> bool:
        """Every cached block dropped (a prefix-cache reset); False, changing nothing, while
        requests hold blocks (vLLM refuses the reset then)."""
        if self.refs or self.anonymous:
            return False
        self.free.clear()
        return True

    def take_events(self) -> list[tuple[str, list[int]]]:
        out, self.events = self.events, []
        return out


class SimCore:
    def __init__(self, sim: SimulatedEngineConfig, block_size: int, max_num_seqs: int,
                 max_batched_tokens: int) -> None:
        self.sim, self.block_size = sim, block_size
        self.max_num_seqs, self.max_batched_tokens = max_num_seqs, max_batched_tokens
        self.cache = PrefixCache(sim.num_blocks)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []

    @property
    def unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, r: SimRequest) -> None:
        self.waiting.append(r)

    def abort(self, r: SimRequest) -> None:
        if r in self.waiting:
            self.waiting.remove(r)
        elif r in self.running:
            self.running.remove(r)
            self.cache.release(r)
        r.done = True

    def schedule(self, now: float) -> Step:
        decoding = [r for r in self.running if r.to_prefill == 0]
        budget = self.max_batched_tokens - len(decoding)
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if not self.cache.admit(r, self.block_size):
                break  # in arrival order: the next one waits for blocks too
            self.waiting.popleft()
            r.scheduled_at = now
            self.running.append(r)
        prefills = []
        for r in self.running:
            if budget <= 0:
                break
            if r.to_prefill > 0:
                n = min(r.to_prefill, budget)
                prefills.append((r, n))
                budget -= n
        s = self.sim
        duration = (s.step_ms / 1e3 + s.prefill_us_per_token / 1e6 * sum(n for _, n in prefills)
                    + s.decode_us_per_seq / 1e6 * len(decoding))
        return Step(decoding, prefills, duration)

    def finish(self, step: Step, now: float) -> list[SimRequest]:
        """The step ran: who got a token (a first one where its prefill ended)."""
        out = []
        for r in step.decoding:
            if not r.done:
                r.generated += 1
                out.append(r)
        for r, n in step.prefills:
            if r.done:
                continue
            r.to_prefill -= n
            self.cache.store(r, r.prompt_tokens - r.to_prefill, self.block_size)
            if r.to_prefill == 0:
                r.first_token_at, r.generated = now, 1
                out.append(r)
        for r in out:
            r.last_token_at = now
            if r.generated >= r.max_tokens:
                # The last token's KV is never computed (as in vLLM).
                self.cache.store(r, r.prompt_tokens + r.generated - 1, self.block_size)
                r.done = True
                self.running.remove(r)
                self.cache.release(r)
        return out
