"""Whether the router serves, and what: /health (status for probes, details for operators),
/v1/models (vLLM's own model cards), and the not-ready answer both give while engines load."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from rayattn.server import front_door
from rayattn.server.errors import APIError
from rayattn.server.fleet.status import RouterSnapshot
from rayattn.server.http.access import Access
from rayattn.server.http.bases import Bases
from rayattn.server.tenancy.gates import Gates

log = logging.getLogger("rayattn.ingress")


class Health:
    def __init__(self, bases: Bases, access: Access, gates: Gates,
                 session_header: str) -> None:
        """`gates`: the router's admission and fairness, shared by all its models (their
        counts are the router's own)."""
        self.bases, self.access, self.gates = bases, access, gates
        self.front_door: dict[str, Any] = {}
        self.look_at_front_door(session_header)

    def look_at_front_door(self, session_header: str) -> None:
        """How clients reach this router, for /health, with a warning where that is not what
        rayattn sets up (Serve's proxy, or HAProxy hashing another header)."""
        self.front_door = front_door.report(session_header)
        if self.front_door["note"]:
            log.warning("%s", self.front_door["note"])

    async def models(self, request: Request) -> Response:
        try:
            self.access.caller(request)
        except APIError as e:
            return e.response()
        await self.bases.start()
        # vLLM's own cards (names, max_model_len, adapters with their parent) from each base
        # model's engines; a model none of whose engines serves yet is left out.
        cards = [await r.models() for r in self.bases]
        if all(c is None for c in cards):
            return self.not_ready().response()
        return JSONResponse({"object": "list", "data": [m for c in cards if c for m in c]})

    def not_ready(self) -> APIError:
        down = [r for r in self.bases if not r.dispatcher.live()]
        if len(self.bases) == 1 or not down:
            return self.bases.first.not_ready()
        names = ", ".join(r.name for r in down)
        return APIError(503, f"not ready: no engine replica of {names} serves yet (engines "
                             "load the model at start-up; retry shortly)", retry_after=5)

    async def report(self, request: Request) -> Response:
        await self.bases.start()
        snaps = {r.name: r.dispatcher.snapshot() for r in self.bases}
        # Ready when every model has an engine serving: a balancer must not send a model's
        # requests to a router that cannot serve them. Nor, while it starts, before its view
        # of each engine's cache is taken (Serve holds traffic back until then too, see
        # Router.reconfigure): routed now, a conversation's next turn would find no history.
        syncing = [t for s in snaps.values() for t in s.syncing]
        ready = all(s.replicas_up for s in snaps.values()) and not syncing
        reason = None
        if syncing:  # a count: replica names are for operators
            reason = (f"not ready: taking the KV cache view of {len(syncing)} engine "
                      "target(s); retry shortly")
        elif not ready:
            reason = self.not_ready().message
        body: dict[str, Any] = {
            "status": "ok" if ready else "unavailable", "reason": reason,
            "up": sum(len(s.replicas_up) for s in snaps.values()),
            "of": sum(s.replicas for s in snaps.values())}
        if self.access.is_admin(request):
            # Probes need only the status; pids, GPU ids, replica names and live load are
            # for operators.
            body |= self._details(snaps)
        return JSONResponse(body, status_code=200 if ready else 503,
                            headers=None if ready else {"Retry-After": "5"})

    def _details(self, snaps: dict[str, RouterSnapshot]) -> dict[str, Any]:
        first = next(iter(snaps.values()))
        out: dict[str, Any] = {
            "replicas_up": [r for s in snaps.values() for r in s.replicas_up],
            "syncing": [t for s in snaps.values() for t in s.syncing],
            "replicas": sum(s.replicas for s in snaps.values()),
            "joined": sum(s.joined for s in snaps.values()), "policy": first.policy,
            "router_pid": os.getpid(), "front_door": self.front_door,
            "limits": {"max_inflight": first.max_inflight},
            "index": first.index_mode,
            # The gates' counts are the router's own (one set for all models).
            "counts": {**_summed(s.counts for s in snaps.values()),
                       **self.gates.counts(),
                       **_summed(r.render_counts() for r in self.bases)},
            "regret_tokens": _summed(s.regret_tokens for s in snaps.values()),
            "session_moves": _summed(s.session_moves for s in snaps.values()),
            "engines": {n: asdict(e) for s in snaps.values() for n, e in s.engines.items()},
            # Cache-pressure admission (the first model's: one router, one front door).
            "admission": first.admission,
            # Calls to an engine deployment Serve autoscales keep to Serve's channel.
            "engines_autoscaled": any(s.autoscaled for s in snaps.values())}
        if len(snaps) > 1:
            out["models"] = {n: {"up": len(s.replicas_up), "of": s.replicas,
                                 "engines": sorted(s.engines),
                                 "engines_autoscaled": s.autoscaled}
                             for n, s in snaps.items()}
        return out


def _summed(counters: Iterable[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in counters:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out
