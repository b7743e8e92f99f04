"""What every policy sees and returns: the request's block keys, the live candidates, and a
Decision. Policies are pure: the ingress, the simulator and the unit tests run the same
objects through the same lifecycle (rayattn/routing/core.py)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from rayattn.routing.adapters import AdapterResidency
from rayattn.routing.load import LoadTracker
from rayattn.routing.prefix_index import CacheIndex


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
    previous: str | None = None
    """The routable replica this conversation's previous turn went to (set by the core)."""
    held: dict[str, int] | None = None
    """Leading blocks of `keys` each replica holds, matched once per choice by the core
    (policies and the core's accounting read it instead of matching again)."""
    max_tokens: int = 256
    """Output tokens the request may add (its max_tokens; cache-pressure admission)."""
    reloaded: dict[str, int] = field(default_factory=dict)
    """Of `held`, the blocks each replica would reload from its host-memory KV tier (the
    tail of its match, past what its own cache holds)."""
    adapter: str | None = None
    """The LoRA adapter the request runs under (None: the base model)."""
    salt: str | None = None
    """Its cache namespace (vLLM's `cache_salt`), hashed into its first block."""
    pinned: str | None = None
    """The only replica that can serve it (it continues state kept in that engine)."""
    continued_tokens: int = 0
    """Tokens (whole blocks) it shares with its conversation's previous prompt and answer
    as the engine cached them: what its engine should still hold (set by the core)."""
    kv_cached: dict[str, int] | None = None
    """Cache-pressure admission: tokens of the prompt each candidate had cached when it
    last looked (RoutingCore.kv_room)."""
    queued: bool = False
    """It waits in the router behind load (engine slots, its key's turn, KV room), not for
    an engine to come up (set by the server while it waits)."""


@dataclass
class Decision:
    replica: str
    reason: str
    predicted_cached_tokens: int
    costs: dict[str, float] = field(default_factory=dict)
    predicted_reload_tokens: int = 0
    """Of predicted_cached_tokens, those the replica reloads from its host tier."""
    loads: dict[str, int] = field(default_factory=dict)
    """In-flight estimate of each candidate when the choice was made (for explaining it)."""
    dispatched_at: float = 0.0
    """time.perf_counter() when the engine call was issued (the router hop ends there)."""
    uncached_tokens: int = 0
    """Tokens this attempt adds to the replica's pending prefill until its first token."""
    prefill_pending: bool = False
    in_flight: bool = False
    """Between the core's `dispatched` and `ended`: load is held for it."""
    session: str | None = None
    adapter: str | None = None
    """The request's LoRA adapter (held in a batch slot of the replica until `ended`)."""
    kv_held: int = 0
    """KV tokens this attempt holds in the core's admission budget until `ended`."""
    regret_tokens: int = 0
    """Tokens of this prompt another candidate held beyond what the chosen one holds:
    recomputed here although they were cached elsewhere when the choice was made."""
    moved_from: str | None = None
    """The replica this conversation's previous turn went to, when it was a candidate and
    another one was chosen."""


def cached_tokens(prompt_tokens: int, matched_blocks: int, block_size: int) -> int:
    """What vLLM serves from its prefix cache when `matched_blocks` leading blocks are
    cached: whole blocks only, and never the prompt's last token (vLLM always computes one,
    so a 32-token prompt with 16-token blocks and both blocks cached gets 16)."""
    return min(matched_blocks, max(prompt_tokens - 1, 0) // block_size) * block_size


def rendezvous_rank(key: int, replicas: list[str]) -> list[str]:
    """Highest-random-weight order: removing a replica only moves the keys it owned."""
    def weight(r: str) -> bytes:
        return hashlib.blake2b(f"{key}:{r}".encode(), digest_size=8).digest()
    return sorted(replicas, key=weight, reverse=True)


@dataclass
class PolicyContext:
    """What a policy is built on: the cache index, the load view, the block size (and a seed
    for the randomised ones, so simulations repeat)."""

    index: CacheIndex
    load: LoadTracker
    block_size: int
    seed: int | None = None
    adapters: AdapterResidency = field(default_factory=AdapterResidency)


class Policy:
    name = "base"

    def __init__(self, ctx: PolicyContext) -> None:
        self.index, self.load, self.block_size = ctx.index, ctx.load, ctx.block_size
        self.adapters = ctx.adapters

    def choose(self, req: RouteRequest, replicas: list[str]) -> Decision:
        raise NotImplementedError

    def cached_tokens(self, req: RouteRequest, matched_blocks: int) -> int:
        return cached_tokens(req.prompt_tokens, matched_blocks, self.block_size)

    def matches(self, req: RouteRequest) -> dict[str, int]:
        return req.held if req.held is not None else self.index.match(req.keys)

    def reloaded_tokens(self, req: RouteRequest, replica: str) -> int:
        """Of the tokens `replica` would serve from cache for `req`, those it reloads from
        its host tier: the cached span past the blocks its own cache holds."""
        blocks = req.reloaded.get(replica, 0)
        if not blocks:
            return 0
        held = self.matches(req).get(replica, 0)
        return max(0, self.cached_tokens(req, held) - (held - blocks) * self.block_size)

    def predicted(self, req: RouteRequest, replica: str) -> int:
        """Tokens `replica` would serve from cache for `req`, by the index."""
        return self.cached_tokens(req, self.matches(req).get(replica, 0))

    def on_dispatch(self, replica: str, req: RouteRequest) -> None:
        """The request was sent to `replica` (affinity counts its prefix as cached there at
        once, so followers that arrive before it finishes already find it)."""

    def on_complete(self, replica: str, keys: list[int]) -> None:
        """`replica` now caches these blocks (the prompt and the generated continuation)."""
        self.index.insert(replica, keys)

    def forget_replica(self, replica: str) -> None:
        """`replica` left: nothing learned about it may outlive it."""

    def observe(self, replica: str, computed_tokens: int, timings: dict[str, Any],
                running: int, output_tokens: int) -> None:
        """Engine timings of a request finished on `replica` after generating
        `output_tokens` (policies with a cost model learn here)."""
