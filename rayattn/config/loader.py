"""Read rayattn configs out of Ray Serve config files (the `args:` of each application whose
import_path is rayattn's app builder)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rayattn.config.schema import RayAttnConfig

APP_IMPORT_PATH = "rayattn.app:build_app"


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


def rayattn_apps(serve_config: dict[str, Any]) -> list[tuple[str, RayAttnConfig]]:
    apps = [a for a in serve_config["applications"] if a.get("import_path") == APP_IMPORT_PATH]
    if not apps:
        raise ConfigError(f"no application with import_path {APP_IMPORT_PATH!r}")
    return [(a.get("name", "default"), parse_args(a.get("args") or {})) for a in apps]
