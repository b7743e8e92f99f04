"""What a routing core's settings decide, built afresh: at its start, and again when a live
settings change or a cold start replaces it."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from rayattn.routing import policies
from rayattn.routing.adapters import AdapterResidency
from rayattn.routing.kv_budget import KVBudget
from rayattn.routing.load import LoadTracker
from rayattn.routing.policies import Policy, PolicyContext
from rayattn.routing.prefix_index import CacheIndex, EventIndex, PrefixIndex
from rayattn.routing.settings import RoutingSettings


def new_index(settings: RoutingSettings, clock: Callable[[], float],
              members: Mapping[str, int]) -> CacheIndex:
    """An empty index of the settings' kind with `members` (name: KV capacity in blocks)."""
    index: CacheIndex = (EventIndex(settings.speculative_ttl_s, clock)
                         if settings.index == "events" else PrefixIndex())
    for name, capacity in members.items():
        index.add_replica(name, capacity)
    return index


class PolicyBuilder:
    """Builds a core's policies, each knowing nothing yet, on what every one of them shares
    (the load view, adapter residency, the seed) and what the core has now (the index, the
    block size, the policy's parameters)."""

    def __init__(self, load: LoadTracker, adapters: AdapterResidency,
                 seed: int | None) -> None:
        self._load, self._adapters, self._seed = load, adapters, seed

    def build(self, name: str, settings: RoutingSettings, index: CacheIndex,
              block_size: int) -> Policy:
        ctx = PolicyContext(index, self._load, block_size, self._seed, self._adapters)
        return policies.build(name, ctx, settings.params(name))


def new_kv_budget(settings: RoutingSettings, clock: Callable[[], float],
                  routers: Callable[[], int], block_size: Callable[[], int],
                  members_of: KVBudget | None = None) -> KVBudget:
    """Cache-pressure admission's bookkeeping, empty but for the members (capacities,
    running requests, host tiers) and the learned pauses of `members_of`: a cold start
    empties the engines' caches, not their membership, the requests they run or the
    clients' think time."""
    kv = KVBudget(settings.conversation_idle_s, settings.kv_admission_fill, clock,
                  settings.kv_admission_protect, climbs=settings.kv_admission == "auto",
                  routers=routers, block_size=block_size)
    if members_of is not None:
        kv.capacity, kv.running = members_of.capacity, members_of.running
        kv.host_tier = members_of.host_tier
        kv.keep_pauses(members_of)  # they describe the clients, not the caches
    return kv
