"""Read rayattn configs out of Ray Serve config files: the `args:` of each application whose
import_path is rayattn's app builder, plus the router's live settings.

Router settings belong in the `user_config` of the application's `router` deployment
(`deployments: [{name: router, user_config: {...}}]`): Serve applies a change there to the
running routers through `reconfigure`. Anything under `args:` is part of the application's
code version in Serve (a hash of import path, runtime env and args), so changing it
restarts every replica, engines included. `args.router` is still accepted (it is the
default the router starts with) but a `user_config` given for the router replaces it, as
Serve does at run time.

Engine replica counts likewise belong to the `engine` deployment's entry (`num_replicas`, or
`autoscaling_config`): Serve scales the running deployment without restarting its
replicas. They are read into `parallelism.data_parallel_size` / `serve.engine_autoscaling`
so that `rayattn check` and the KubeRay renderer see what Serve will run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rayattn.config.schema import RayAttnConfig

APP_IMPORT_PATH = "rayattn.app:build_app"
ROUTER_DEPLOYMENT = "router"
ENGINE_DEPLOYMENT = "engine"


def format_validation_error(err: ValidationError) -> str:
    """One line per problem, each naming the dotted field path."""
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"{where}: {msg}")
    return "\n".join(lines)


class ConfigError(ValueError):
    pass


def parse_args(args: dict[str, Any]) -> RayAttnConfig:
    try:
        return RayAttnConfig.model_validate(args)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


def load_serve_config(path: str | Path) -> dict[str, Any]:
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("applications"), list):
        raise ConfigError(f"{path}: not a Ray Serve config (needs an 'applications' list)")
    return data


def app_args(app: dict[str, Any]) -> dict[str, Any]:
    """One Serve application's rayattn settings as the running app sees them: its `args`
    with `router` taken from the router deployment's `user_config` where one is given."""
    args = dict(app.get("args") or {})
    # Always present, so checks between the router and the engines run (the router applies
    # its defaults whether or not settings are given).
    args["router"] = args.get("router") or {}
    for d in app.get("deployments") or []:
        if d.get("name") == ROUTER_DEPLOYMENT and d.get("user_config") is not None:
            args["router"] = d["user_config"]
        if d.get("name") == ENGINE_DEPLOYMENT:
            if d.get("num_replicas") is not None:
                args["parallelism"] = {**(args.get("parallelism") or {}),
                                       "data_parallel_size": d["num_replicas"]}
            if d.get("autoscaling_config") is not None:
                args["serve"] = {**(args.get("serve") or {}),
                                 "engine_autoscaling": d["autoscaling_config"]}
    return args


def rayattn_apps(serve_config: dict[str, Any]) -> list[tuple[str, RayAttnConfig]]:
    apps = [a for a in serve_config["applications"] if a.get("import_path") == APP_IMPORT_PATH]
    if not apps:
        raise ConfigError(f"no application with import_path {APP_IMPORT_PATH!r}")
    return [(a.get("name", "default"), parse_args(app_args(a))) for a in apps]
