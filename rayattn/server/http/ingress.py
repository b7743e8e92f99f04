"""The router's HTTP side put together: its base models, its keys, and the rooms its routes
(api.py) call: the request path (requests.py), the operator's routes (admin.py), health and
models (health.py). New router settings reach all of them from here."""

from __future__ import annotations

import logging
from typing import Any

from rayattn import logs
from rayattn.config.loader import parse_models
from rayattn.config.schema import RayAttnConfig, RouterConfig
from rayattn.metrics import tracing
from rayattn.server.http.access import Access
from rayattn.server.http.admin import AdminAPI
from rayattn.server.http.bases import Bases
from rayattn.server.http.health import Health
from rayattn.server.http.requests import RequestPath
from rayattn.server.http.spans import Spans
from rayattn.server.model_route import ModelRoute
from rayattn.server.tenancy.gates import Gates
from rayattn.server.tenancy.keys import Keys

log = logging.getLogger("rayattn.ingress")


class Ingress:
    def __init__(self, args: dict[str, Any], engines: Any) -> None:
        """`engines`: each base model's engine deployment handle, by served name (or, for
        one model, its handle alone)."""
        logs.setup()
        cfgs = parse_models(args)
        if not isinstance(engines, dict):
            engines = {cfgs[0].model.name: engines}
        self.gates = Gates.of(cfgs[0].router)
        self.bases = Bases([ModelRoute(c, engines[c.model.name], self.gates) for c in cfgs])
        # Router settings and the router's own serve settings are shared by every model:
        # the rooms read them from the first model's config, whose `router` is replaced
        # in place when they change.
        self.cfg = cfgs[0]
        self.access = Access(Keys.from_env(self.cfg.router))
        self.tracing = tracing.make(self.cfg.tracing, "router")
        spans = Spans(self.tracing) if self.tracing is not None else None
        self.request_path = RequestPath(self.cfg, self.bases, self.access, spans)
        self.admin = AdminAPI(self.cfg, self.bases, self.access, self.apply_router_config)
        self.health = Health(self.bases, self.access, self.gates,
                             self.cfg.router.session_header)

    def apply_router_config(self, router: dict[str, Any]) -> None:
        """New router settings on a running router (Serve's reconfigure): limits and
        thresholds apply to the next request; a new policy or index mode keeps the engines
        and their caches (a new index resyncs from the engines)."""
        new = RouterConfig.model_validate(router)
        keys = Keys.from_env(new)  # fails the update (not the requests) when a key is missing
        for route in self.bases:
            # Checked against every model's engine part before any model takes it.
            RayAttnConfig.model_validate({**route.cfg.model_dump(), "router": new.model_dump()})
        for route in self.bases:
            route.cfg.router = new
        self.access.keys = keys
        self.health.look_at_front_door(new.session_header)  # the header may have changed
        for d in self.bases.dispatchers:
            d.apply_router_config(new)
        log.info("router settings applied: %s", new.model_dump())

    async def start(self) -> None:
        await self.bases.start()

    async def synced(self) -> None:
        await self.bases.synced()
