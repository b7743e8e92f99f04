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
so that `rayattn check` and the KubeRay renderer see what Serve will run.

Several base models behind one router: `args.models` lists them, each entry a config of its
own (`model`, and any section it sets differently) on top of the shared sections beside
`models` (`platform`, `engine`, `serve`, …; the router's settings are always shared). Each
model has its own engine deployment, `engine-<served name>`, with its own `deployments:`
entry for replica counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rayattn.config.schema import RayAttnConfig

APP_IMPORT_PATH = "rayattn.app:build_app"
ROUTER_DEPLOYMENT = "router"
ENGINE_DEPLOYMENT = "engine"
# Sections one router applies to all its models: set once, beside `models`.
ROUTER_WIDE = ("router", "tracing")


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


def model_args(args: dict[str, Any]) -> list[dict[str, Any]]:
    """One application's settings per base model: `args` itself for one model, else each
    `models` entry merged over the shared sections."""
    if "models" not in args:
        return [args]
    entries = args["models"]
    if not isinstance(entries, list) or not entries:
        raise ConfigError("models: a non-empty list of model configs")
    shared = {k: v for k, v in args.items() if k != "models"}
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ConfigError(f"models.{i}: a model config (model, engine, …)")
        for key in ROUTER_WIDE:
            if key in entry:
                raise ConfigError(f"models.{i}.{key}: shared by every model of the router; "
                                  "set it beside `models`")
        out.append(_merged(shared, entry))
    cfgs = []
    for i, a in enumerate(out):
        try:
            cfgs.append(parse_args(a))
        except ConfigError as e:
            raise ConfigError("\n".join(f"models.{i}.{line}" for line in str(e).splitlines())) \
                from None
    names = [c.model.name for c in cfgs]
    if len(set(names)) != len(names):
        raise ConfigError(f"models: served names must be distinct, got {names}")
    deployments = [engine_deployment(c, True) for c in cfgs]
    if len(set(deployments)) != len(deployments):
        raise ConfigError(f"models: served names {names} give engine deployments "
                          f"{deployments}; make them differ in letters or digits")
    return out


def parse_models(args: dict[str, Any]) -> list[RayAttnConfig]:
    cfgs = [parse_args(a) for a in model_args(args)]
    served = [n for c in cfgs for n in c.model.served_names]
    if len(set(served)) != len(served):
        raise ConfigError(f"models: every base model and LoRA adapter needs its own name, "
                          f"got {served}")
    return cfgs


def engine_deployment(cfg: RayAttnConfig, several: bool) -> str:
    """The engine deployment's name: `engine`, or `engine-<served name>` beside others."""
    if not several:
        return ENGINE_DEPLOYMENT
    return f"{ENGINE_DEPLOYMENT}-" + "".join(c if c.isalnum() or c in "-_." else "-"
                                            for c in cfg.model.name)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) \
            else v
    return out


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
    deployments = {d.get("name"): d for d in app.get("deployments") or []}
    router = deployments.get(ROUTER_DEPLOYMENT) or {}
    if router.get("user_config") is not None:
        args["router"] = router["user_config"]
    if "models" not in args:
        return _with_replicas(args, deployments.get(ENGINE_DEPLOYMENT))
    entries = model_args(args)
    several = len(entries) > 1  # as rayattn.app names the deployments
    args["models"] = [_with_replicas(entry, deployments.get(
        engine_deployment(parse_args(merged), several)))
        for entry, merged in zip(args["models"], entries, strict=True)]
    return args


def _with_replicas(args: dict[str, Any], d: dict[str, Any] | None) -> dict[str, Any]:
    """`args` with the engine deployment's replica count or autoscaling from its entry."""
    args = dict(args)
    if d is None:
        return args
    if d.get("num_replicas") is not None:
        args["parallelism"] = {**(args.get("parallelism") or {}),
                               "data_parallel_size": d["num_replicas"]}
    if d.get("autoscaling_config") is not None:
        args["serve"] = {**(args.get("serve") or {}),
                         "engine_autoscaling": d["autoscaling_config"]}
    return args


def rayattn_apps(serve_config: dict[str, Any]) -> list[tuple[str, RayAttnConfig]]:
    """Every rayattn application's config, one per base model (`app/model` where an
    application serves several)."""
    apps = [a for a in serve_config["applications"] if a.get("import_path") == APP_IMPORT_PATH]
    if not apps:
        raise ConfigError(f"no application with import_path {APP_IMPORT_PATH!r}")
    out = []
    for a in apps:
        name = a.get("name", "default")
        cfgs = parse_models(app_args(a))
        out += [(name if len(cfgs) == 1 else f"{name}/{c.model.name}", c) for c in cfgs]
    return out
