"""The HTTP surface: the FastAPI app, its error handlers and every route, in one place.

The routes are methods of the `Router` Serve deployment (the ingress); what each one does
lives in the rooms `rayattn.server.http.ingress.Ingress` puts together: the request path
(requests.py), the operator's routes (admin.py), health and models (health.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from rayattn.server import router_scaling
from rayattn.server.cpu_meter import CpuMeter
from rayattn.server.errors import APIError
from rayattn.server.http.ingress import Ingress

# No /docs, /redoc or /openapi.json: they would list the admin routes to anyone.
app = FastAPI(title="rayattn", version="0.1.0", docs_url=None, redoc_url=None,
              openapi_url=None)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    return APIError(exc.status_code, str(exc.detail)).response()


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    return APIError(400, str(exc.errors()[:3])).response()


@serve.deployment
@serve.ingress(app)
class Router(Ingress):
    def __init__(self, args: dict[str, Any], engines: Any) -> None:
        super().__init__(args, engines)
        self.cpu_meter = CpuMeter()

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self.request_path.handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self.request_path.handle(request, "completion")

    @app.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        return await self.request_path.handle(request, "responses")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        return await self.admin.lora(request, "load")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        return await self.admin.lora(request, "unload")

    @app.get("/v1/models")
    async def list_models(self, request: Request) -> Response:
        return await self.health.models(request)

    @app.post("/admin/reset")
    async def reset(self, request: Request) -> Response:
        return await self.admin.reset(request)

    @app.get("/health")
    async def health_check(self, request: Request) -> Response:
        # Open without a key (load balancers and Kubernetes probes call it); the details
        # need the admin key where keys are configured.
        return await self.health.report(request)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        # Serve's autoscaler asks each router for its load (rayattn/server/router_scaling.py).
        return {router_scaling.METRIC: self.cpu_meter.read()}

    def __del__(self) -> None:
        # Serve calls this when the replica stops: the last batch of spans goes out.
        if getattr(self, "tracing", None) is not None:
            self.tracing.shutdown()

    async def reconfigure(self, router: dict[str, Any]) -> None:
        # async: Serve then runs it on the replica's event loop, where the KV feeds live.
        self.apply_router_config(router)
        # Serve calls this once before the replica takes traffic: a router that starts
        # while others serve (an update) knows the engines, and what their caches hold,
        # before its first request.
        await self.start()
        await self.synced()
