"""The package's layers import downwards only, and the routing core has no transport in it
(the simulator and the unit tests run the very code that ships)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "rayattn"

# Lowest first: a module may import its own layer's packages and lower layers' only.
LAYERS = [
    {"ports", "cache_dir"},
    {"compat"},  # the version differences, which everything touching vLLM or Ray asks
    {"integrations"},  # vLLM's and Ray's internals, one surface a module
    {"logs", "models", "metrics", "routing"},
    {"backends"},
    {"config"},
    {"engine"},
    {"server"},
    {"app", "cluster_env", "serve_run"},
    {"bench", "k8s"},
    {"cli"},
]
LEVEL = {pkg: n for n, layer in enumerate(LAYERS) for pkg in layer}

# Transport, processes and tasks live with the server or engine code that owns them.
NOT_IN_ROUTING = ("ray", "zmq", "fastapi", "starlette", "grpc", "asyncio", "threading",
                  "multiprocessing", "rayattn.server", "rayattn.engine", "rayattn.config")


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
    return out


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "rayattn" and len(parts) > 1 else None


def _modules() -> list[tuple[str, Path]]:
    return [(p.relative_to(PACKAGE).parts[0].removesuffix(".py"), p)
            for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE]


def test_every_package_has_a_layer():
    assert {pkg for pkg, _ in _modules()} <= set(LEVEL)


def test_no_import_runs_up_the_layers():
    upward = []
    for pkg, path in _modules():
        for module in _imports(path):
            target = _package(module)
            if target in LEVEL and LEVEL[target] > LEVEL[pkg]:
                upward.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert upward == []


def test_routing_has_no_transport():
    found = [f"{p.relative_to(PACKAGE)} imports {m}" for pkg, p in _modules()
             if pkg == "routing" for m in _imports(p)
             if any(m == banned or m.startswith(banned + ".") for banned in NOT_IN_ROUTING)]
    assert found == []


# The router's rooms (rayattn/server/), lowest first: the HTTP surface composes the model
# routes, which compose forwarding over the fleet; tenancy and prompts stand alone.
SERVER_ROOMS = [
    {"errors", "background", "loop_watch", "cpu_meter", "router_scaling", "front_door",
     "haproxy_exec", "haproxy_admin"},
    {"tenancy", "prompts"},
    {"fleet"},
    {"forwarding"},
    {"dispatch", "model_route"},
    {"http"},
]
ROOM = {room: n for n, rooms in enumerate(SERVER_ROOMS) for room in rooms}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2].removesuffix(".py") if parts[:2] == ["rayattn", "server"] \
        and len(parts) > 2 else None


def test_the_routers_rooms_import_downwards_only():
    server = PACKAGE / "server"
    rooms = {p: p.relative_to(server).parts[0].removesuffix(".py")
             for p in server.rglob("*.py") if p.parent != server or p.name != "__init__.py"}
    assert set(rooms.values()) <= set(ROOM), set(rooms.values()) - set(ROOM)
    upward = [f"{p.relative_to(PACKAGE)} imports {m}" for p, room in rooms.items()
              for m in _imports(p) if (target := _room(m)) in ROOM
              and ROOM[target] > ROOM[room]]
    assert upward == []


# Serve pickles these by value into its controller, which may not have rayattn.
PICKLED_BY_VALUE = ["server/router_scaling.py", "engine/scaling_policy.py"]


@pytest.mark.parametrize("module", PICKLED_BY_VALUE)
def test_a_policy_serve_pickles_imports_nothing_of_rayattn(module):
    assert not [m for m in _imports(PACKAGE / module) if m.startswith("rayattn")]
