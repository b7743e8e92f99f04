"""Whether Serve autoscales the engine deployment: the router then keeps every call to
Serve's channel, which is all Serve's autoscaler counts (the direct transport would hide the
load from it).

One answer for the whole deployment, asked of Serve's controller by the router itself: the
bounds are the deployment's, and a live change reaches neither the replicas' context nor
their args. (Each engine replica once asked on its own clock; for seconds after a change
one said yes and another no, and calls to the second bypassed Serve's channel.)"""

from __future__ import annotations

import asyncio
import logging
import time

from rayattn.integrations import serve_private
from rayattn.server.background import detached

log = logging.getLogger("rayattn.router")

AUTOSCALING_TTL_S = 5.0
"""A live change of the engine deployment's bounds reaches the router within this (plus a
busy controller's answer time): one question per router per period."""

ANSWER_WAIT_S = 30.0
"""A busy controller can take seconds; a question still open after this is given up."""


class EngineAutoscaling:
    def __init__(self, app: str, deployment: str) -> None:
        self._app, self._deployment = app, deployment
        self.now = True
        """Until Serve's controller answers, and while it does not, the last answer holds,
        first True: calls keep to Serve's channel rather than hide load from the
        autoscaler."""
        self._asked_at = -AUTOSCALING_TTL_S
        self._asking: asyncio.Task | None = None

    def poll(self) -> None:
        """Ask again where the last answer is older than AUTOSCALING_TTL_S, in the
        background (the caller's loop must not wait on the controller)."""
        now = time.monotonic()
        if (self._asking is None or self._asking.done()) and \
                now - self._asked_at >= AUTOSCALING_TTL_S:
            self._asked_at = now
            self._asking = detached(self._ask())

    async def _ask(self) -> None:
        try:
            known = await asyncio.wait_for(
                serve_private.serve_autoscales(self._app, self._deployment), ANSWER_WAIT_S)
        except TimeoutError:
            known = None
        if known is not None and known != self.now:
            log.info("engine deployment %s %s by Serve: calls %s", self._deployment,
                     "autoscaled" if known else "no longer autoscaled",
                     "keep to Serve's channel" if known else "may go direct")
            self.now = known
