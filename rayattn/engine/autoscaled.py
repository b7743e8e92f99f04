"""Whether Serve autoscales this engine's deployment: routers keep such a replica's calls to
Serve's channel, which is all Serve's autoscaler counts."""

from __future__ import annotations

import asyncio
import time

from ray import serve

from rayattn.integrations import serve_private

AUTOSCALED_TTL_S = 5.0
"""A live change of the engine deployment's autoscaling bounds reaches routers within this
(plus a probe period), while the controller is asked for this deployment's config once per
replica per period (integrations/serve_private.py: serve_autoscales)."""


class AutoscaledFlag:
    def __init__(self) -> None:
        # Until an answer comes, and while one does not, the last one holds, first True:
        # routers keep to Serve's channel rather than hide load from the autoscaler.
        self._now, self._at = True, -AUTOSCALED_TTL_S

    async def get(self) -> bool:
        """Asked of Serve's controller at most once per AUTOSCALED_TTL_S (every router's
        probe asks twice a second)."""
        now = time.monotonic()
        if now - self._at > AUTOSCALED_TTL_S:
            self._at = now
            try:
                ctx = serve.get_replica_context()
                known = await asyncio.wait_for(
                    serve_private.serve_autoscales(ctx.app_name, ctx.deployment), 2.0)
            except Exception:  # outside Serve, or the controller slow to answer
                known = None
            if known is not None:
                self._now = known
        return self._now
