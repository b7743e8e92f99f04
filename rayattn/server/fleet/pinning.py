"""Calls to one chosen replica of the engine deployment, and who those replicas are.

All engine replicas are one Serve deployment, so Serve autoscales it and rolls an update
through it one replica at a time, and drains a leaving replica. The rayattn router still
decides which replica serves a request (prefix cache, load): every engine method takes the
chosen replica's id as its first argument, and `PinnedRequestRouter` — the engine
deployment's Serve request router, living in each process that holds an engine handle —
delivers the call there. The same request router hears first from Serve which replicas
run (new, replaced, leaving) and publishes that to the rayattn router (`Membership`).

A call without a target (e.g. `/v1/models`) goes to any replica, least loaded first. A call
whose target has just left reaches another replica, which refuses it (`Misrouted`) without
running it (engine/protocol.py), and the rayattn router re-routes it like a failed
replica's request.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

log = logging.getLogger("rayattn.router")

REQUEST_ROUTER = f"{__name__}:PinnedRequestRouter"


def target_of(pending: PendingRequest | None) -> str | None:
    args = pending.args if pending is not None else None
    return args[0] if args and isinstance(args[0], str) else None


class PinnedRequestRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Without it Serve retries a full (or slow-to-answer) target at once, in a loop
            # on the router's event loop.
            pending_request.routing_context.should_backoff = True
        target = target_of(pending_request)
        if target is not None:
            for r in candidate_replicas:
                if r.replica_id.unique_id == target:
                    return [[r]]
        # No target, or it has left: any replica (least loaded of those Serve probes). A
        # pinned call arriving there is refused, so it fails fast instead of waiting here
        # for a replica that will not come back.
        return [candidate_replicas]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        # Serve ships this class to the handle's process by value (cloudpickle), with its
        # own copies of this module's globals: publish through the imported module, where
        # the listeners are.
        from rayattn.server.fleet import pinning

        pinning.Membership.publish(self._deployment_id.app_name, self._deployment_id.name,
                                   [r.replica_id.unique_id for r in replicas])


class Membership:
    """Process-wide: the latest replica list per engine deployment, and who wants it.

    Serve calls `update_replicas` on its routing loop; listeners get the list on their own
    loop. The last list is kept, so a listener that subscribes late still hears it."""

    _latest: dict[tuple[str, str], list[str]] = {}
    _listeners: dict[tuple[str, str], list[tuple[asyncio.AbstractEventLoop,
                                                 Callable[[list[str]], None]]]] = {}

    @classmethod
    def publish(cls, app: str, deployment: str, replicas: list[str]) -> None:
        key = (app, deployment)
        cls._latest[key] = replicas
        listeners = cls._listeners.get(key, [])
        for loop, callback in list(listeners):
            if loop.is_closed():  # its router is gone
                listeners.remove((loop, callback))
                continue
            loop.call_soon_threadsafe(callback, list(replicas))

    @classmethod
    def subscribe(cls, app: str, deployment: str,
                  callback: Callable[[list[str]], None]) -> None:
        key = (app, deployment)
        loop = asyncio.get_running_loop()
        cls._listeners.setdefault(key, []).append((loop, callback))
        if key in cls._latest:
            loop.call_soon(callback, list(cls._latest[key]))


class PinnedHandle:
    """The engine deployment's handle aimed at one replica: `h.info.remote()` calls
    `info(<replica id>)`, which PinnedRequestRouter delivers to that replica."""

    def __init__(self, handle: Any, replica: str) -> None:
        self._handle, self.replica = handle, replica

    def options(self, **kwargs: Any) -> PinnedHandle:
        return PinnedHandle(self._handle.options(**kwargs), self.replica)

    def __getattr__(self, method: str) -> _PinnedMethod:
        return _PinnedMethod(getattr(self._handle, method), self.replica)


class _PinnedMethod:
    def __init__(self, method: Any, replica: str) -> None:
        self._method, self._replica = method, replica

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        # Serve hands a routed replica to the pending call with the same internal request
        # id, which a call takes from the request context it is made in: concurrent calls
        # made inside one request (or one background task) would share it, and only one of
        # them would ever be delivered. A fresh context gives each call its own id.
        return contextvars.Context().run(self._method.remote, self._replica, *args, **kwargs)
