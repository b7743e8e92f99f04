"""rayattn: Ray Serve + vLLM serving with named attention backends, prefix-cache-affinity
routing and per-path metrics.

The public surface (like `ray.serve.llm` over its internals)::

    from rayattn import build_app, deploy_config, RayAttnConfig
    app = build_app(args)            # a Serve application from a config's `args`

Everything else is internal and may change. Imports are lazy: engine subprocesses and the
CLI import `rayattn.*` modules without pulling in Ray Serve.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "build_app": "rayattn.app",
    "deploy_config": "rayattn.app",
    "RayAttnConfig": "rayattn.config.schema",
    "ModelConfig": "rayattn.config.schema",
    "AttentionConfig": "rayattn.config.schema",
    "ParallelismConfig": "rayattn.config.schema",
    "EngineConfig": "rayattn.config.schema",
    "PlatformConfig": "rayattn.config.schema",
    "RouterConfig": "rayattn.config.schema",
    "ServeSettings": "rayattn.config.schema",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'rayattn' has no attribute {name!r}")
