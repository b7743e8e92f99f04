"""What /health and /admin show of a model's engines and routing: read from the rooms that
own it, never reached into by the HTTP side."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rayattn.routing.snapshot import CoreSnapshot
from rayattn.routing.targets import split
from rayattn.server.fleet.replica_set import Replica
from rayattn.server.fleet.view import FleetView, capacity, devices


@dataclass
class EngineStatus:
    """One routing target as /health shows it: an engine replica, or one DP rank of its
    engine (the replica's own facts repeated on each of its ranks)."""

    up: bool
    pid: int | None
    rank: int | None
    inflight: int
    local: int
    unfinished: int | None
    downs: int
    slow_probes: int
    kv_blocks: int | None
    backend: str | None
    block_size: int | None
    engine_pids: list[int]
    devices: list[str | None]
    cache_view: dict[str, Any]
    adapters: list[str] = field(default_factory=list)
    """The LoRA adapters its engine answers to."""
    engine_rank: int | None = None
    """The DP rank inside the engine this target is (None: the replica as a whole)."""
    warming: bool = False
    """Held out of routing while the conversations' shared prefixes are prefilled on it
    (server/fleet/warming.py)."""


@dataclass
class RouterSnapshot:
    """The router's state for /health and /admin, for one model."""

    replicas_up: list[str]
    replicas: int
    joined: int
    policy: str
    index_mode: str
    max_inflight: int
    counts: dict[str, float]
    engines: dict[str, EngineStatus] = field(default_factory=dict)
    regret_tokens: dict[str, int] = field(default_factory=dict)
    """By decision reason, since start or the last reset (routing/core.py)."""
    session_moves: dict[str, int] = field(default_factory=dict)
    syncing: list[str] = field(default_factory=list)
    """Targets up whose KV event view is still being taken (kv_feeds.SYNC_GRACE_S)."""
    admission: dict[str, Any] | None = None
    """Cache-pressure admission as this router runs it (None: off): its share of every
    engine's cache (1 / the routers sending to them) and the live window in seconds."""
    autoscaled: bool = False
    """Whether Serve autoscales the engine deployment, as the router last heard from Serve's
    controller: calls then keep to Serve's channel (server/fleet/autoscaling.py)."""


def engines(fleet: FleetView, core: CoreSnapshot, kv_admission: bool
            ) -> dict[str, EngineStatus]:
    """Every target of every replica Serve lists, up or not."""
    # Held for warming and not routed to (the last ones up are routed to all the same).
    warming = set(fleet.warming.holding) - set(fleet.live_targets()) \
        if fleet.warming is not None else set()
    return {n: _status(fleet, r, n, core, kv_admission, n in warming)
            for r in fleet.members.values() for n in fleet.targets(r)}


def _status(fleet: FleetView, r: Replica, n: str, core: CoreSnapshot,
            kv_admission: bool, warming: bool) -> EngineStatus:
    info, view = r.info, core.routable.get(n)
    names = fleet.targets(r)
    i, rank = names.index(n), split(n)[1]
    cache_view: dict[str, Any] = {"blocks": view.blocks if view else 0,
                                  **fleet.feeds.stats(n)}
    if view is not None and view.speculative_blocks is not None:
        cache_view["speculative"] = view.speculative_blocks
    if view is not None and view.offloaded_blocks:
        cache_view["offloaded"] = view.offloaded_blocks
    if view is not None and kv_admission:
        cache_view["admission_fill"] = round(view.admission_fill, 3)
    return EngineStatus(
        r.up, info.pid if info else None, info.rank if info else None,
        view.inflight if view else 0, view.local if view else 0,
        info.unfinished if info else None, r.downs, r.slow_probes,
        capacity(info, len(names), i) if info else None,
        info.backend if info else None, info.block_size if info else None,
        info.engine_pids if info else [],
        devices(info, len(names), i) if info else [], cache_view,
        sorted(info.adapters) if info else [], rank, warming)
