"""Serve's HAProxy ingress is declared once (rayattn/server/front_door.py); what starts Ray
outside Python (make serve, the GPU recipe, the KubeRay pods) carries the same setting."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from rayattn.k8s.render import render_all
from rayattn.server import front_door

ROOT = Path(__file__).resolve().parents[2]


def test_apply_sets_the_flag_and_keeps_an_operators_choice():
    env: dict[str, str] = {}
    front_door.apply(env)
    assert env == front_door.CLUSTER_ENV
    chosen = {k: "0" for k in front_door.CLUSTER_ENV}
    front_door.apply(chosen)
    assert set(chosen.values()) == {"0"}


def test_make_serve_starts_ray_with_the_flag():
    text = (ROOT / "Makefile").read_text()
    for k, v in front_door.CLUSTER_ENV.items():
        assert re.search(rf"^export {k} \??= {re.escape(v)}$", text, re.M), \
            f"Makefile lacks {k}={v}"


def test_routers_are_picked_by_the_configured_session_header():
    env = front_door.cluster_env("x-conversation")
    assert env["RAY_SERVE_HAPROXY_BALANCE_ALGORITHM"] == "hdr(x-conversation)"


def test_every_kuberay_container_has_the_flag():
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
                    for k, v in front_door.CLUSTER_ENV.items():
                        assert env.get(k) == v, f"{fname}: container {c['name']} lacks {k}"
                    containers += 1
    assert containers >= 6  # head + workers of the three models
