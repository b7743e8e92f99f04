"""The operator's routes: /admin/reset (cold caches, another policy or other router settings
for a benchmark's next run) and vLLM's run-time LoRA load and unload, for admin callers."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from rayattn.config.router_tier import config_bounds
from rayattn.config.schema import RayAttnConfig, RouterConfig
from rayattn.server.errors import APIError, from_validation
from rayattn.server.http.access import Access
from rayattn.server.http.bases import Bases
from rayattn.server.http.body import read_object
from rayattn.server.model_route import ModelRoute


class AdminAPI:
    def __init__(self, cfg: RayAttnConfig, bases: Bases, access: Access,
                 apply_router_config: Callable[[dict[str, Any]], None]) -> None:
        """`cfg`: the first model's config (its `router` section is replaced in place by new
        settings); `apply_router_config`: how new router settings reach a running router,
        the same path as Serve's reconfigure."""
        self.cfg, self.bases, self.access = cfg, bases, access
        self.apply_router_config = apply_router_config

    async def reset(self, request: Request) -> Response:
        if not self.cfg.router.admin_api:
            return APIError(404, "admin API disabled (router.admin_api)").response()
        try:
            self.access.caller(request, admin=True)
        except APIError as e:
            return e.response()
        await self.bases.start()
        try:
            want, changed = self._wanted(await read_object(request, self.cfg.router,
                                                           empty_ok=True))
            if any(k != "policy" for k in changed):
                # Same path as a live router setting: a new index resyncs from the engines.
                self.apply_router_config(want.model_dump())
            outcomes = [await d.reset(want.policy) for d in self.bases.dispatchers]
        except APIError as e:
            return e.response()
        except ValidationError as e:
            return from_validation(e).response()
        except ValueError as e:  # e.g. a key variable the new settings name holds no key
            return APIError(400, str(e)).response()
        after = [d.snapshot() for d in self.bases.dispatchers]
        # `cold`: every engine emptied its cache and host tier (a benchmark run after a
        # reset that was not cold says so instead of passing for one).
        missed = [n for _, left in outcomes for n in left]
        return JSONResponse({"policy": outcomes[-1][0], "index": after[0].index_mode,
                             "replicas_up": [r for a in after for r in a.replicas_up],
                             "cold": not missed, "not_emptied": missed})

    def _wanted(self, data: dict[str, Any]) -> tuple[RouterConfig, list[str]]:
        """The router settings a reset asks for, all validated before anything changes, and
        the names of those that differ from the current ones (unnamed settings stay as they
        are). `settings`: other router settings for the runs after this reset (a
        benchmark's variants on the same engines), as the router's user_config would set
        them."""
        settings = data.get("settings") or {}
        if not isinstance(settings, dict):
            raise APIError(400, "settings must be an object of router settings",
                           param="settings")
        now = self.bases.dispatchers[0].snapshot()  # every model's routing runs the same
        current = {**self.cfg.router.model_dump(), "policy": now.policy,
                   "index": now.index_mode}
        want = RouterConfig.model_validate(
            {**current, **settings, **{k: data[k] for k in ("policy", "index") if data.get(k)}})
        wanted = want.model_dump()
        changed = [k for k in wanted if wanted[k] != current.get(k)]
        routers = config_bounds(self.cfg).max
        if changed and routers > 1:
            # One request reaches one router replica: the others would keep routing with
            # the old settings, and a comparison of policies would mix them.
            raise APIError(409, f"this deployment runs up to {routers} "
                           "router replicas and /admin/reset reaches one: change router "
                           "settings through the Serve config's user_config (every replica "
                           "applies it), then reset without them", param=changed[0])
        return want, changed

    async def lora(self, request: Request, action: str) -> Response:
        """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, on every engine of the
        base model (`base_model_name`, else the first): for admin callers, since the path
        is read on the engines' nodes."""
        try:
            self.access.caller(request, admin=True)
            await self.bases.start()
            data = await read_object(request, self.cfg.router, empty_ok=True)
            model = self._updatable(data.get("base_model_name"))
            name = data.get("lora_name")
            if not isinstance(name, str) or not 0 < len(name) <= 128:
                raise APIError(400, "lora_name: 1 to 128 characters", param="lora_name")
            if action == "unload":
                reply = await model.unload_adapter(name)
            else:
                reply = await model.load_adapter(name, self._new_path(data, name, model))
        except APIError as e:
            return e.response()
        if reply.status != 200:
            return Response(reply.data, status_code=reply.status,
                            media_type="application/json")
        return Response(json.loads(reply.data)["message"], media_type="text/plain")

    def _updatable(self, base: Any) -> ModelRoute:
        """The base model an adapter update is for, where run-time updates are on."""
        model = self.bases.routes.get(base) if base else self.bases.first
        if model is None:
            raise APIError(404, f"The model `{base}` does not exist.", param="base_model_name")
        if not model.cfg.model.lora.runtime_updates:
            raise APIError(404, f"run-time LoRA updates are off for {model.name} "
                                "(model.lora.runtime_updates)")
        return model

    def _new_path(self, data: dict[str, Any], name: str, model: ModelRoute) -> str:
        """The directory of an adapter to load as `name`, a name no other model has."""
        path = data.get("lora_path")
        if not isinstance(path, str) or not path:
            raise APIError(400, "lora_path: the adapter's directory on the engines' nodes",
                           param="lora_path")
        owner = self.bases.named(name)
        if name in self.bases.routes or (owner is not None and owner is not model):
            raise APIError(400, f"lora_name: `{name}` already names a model",
                           param="lora_name")
        return path
