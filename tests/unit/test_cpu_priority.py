"""Ray's workers at normal priority is declared once (rayattn/engine/cpu_priority.py); what
starts Ray outside Python (make serve, the KubeRay pods) carries the same setting."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from rayattn.engine import cpu_priority
from rayattn.k8s.render import render_all

ROOT = Path(__file__).resolve().parents[2]


def test_apply_sets_normal_priority_and_keeps_an_operators_choice():
    env: dict[str, str] = {}
    cpu_priority.apply(env)
    assert env == {"RAY_worker_niceness": "0"}
    chosen = {"RAY_worker_niceness": "10"}
    cpu_priority.apply(chosen)
    assert chosen == {"RAY_worker_niceness": "10"}


def test_make_serve_starts_ray_with_it():
    text = (ROOT / "Makefile").read_text()
    for k, v in cpu_priority.cluster_env().items():
        assert re.search(rf"^export {k} \??= {re.escape(v)}$", text, re.M), \
            f"Makefile lacks {k}={v}"


def test_every_kuberay_container_has_it():
    containers = 0
    for fname, text in render_all(ROOT).items():
        for doc in yaml.safe_load_all(text):
            if not doc or doc.get("kind") != "RayService":
                continue
            cluster = doc["spec"]["rayClusterConfig"]
            for g in [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]:
                for c in g["template"]["spec"]["containers"]:
                    env = {e["name"]: e.get("value") for e in c.get("env", [])}
                    for k, v in cpu_priority.cluster_env().items():
                        assert env.get(k) == v, f"{fname}: container {c['name']} lacks {k}"
                    containers += 1
    assert containers >= 6


def test_an_engine_below_normal_priority_says_how_to_fix_it():
    # Raising one's own nice value needs no privilege: a child at nice +5 sees the warning.
    out = subprocess.run(
        [sys.executable, "-c", "import os; os.nice(5); "
         "from rayattn.engine import cpu_priority; print(cpu_priority.warning())"],
        capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "RAY_worker_niceness=0" in out and "nice" in out
    if os.getpriority(os.PRIO_PROCESS, 0) <= 0:
        assert cpu_priority.warning() is None


def test_the_deployments_ask_for_it_whoever_started_ray():
    from rayattn.app import engine_options, router_options
    from rayattn.config.loader import parse_args
    from rayattn.config.plan import build_plan
    from tests.conftest import local_args

    cfg = parse_args(local_args())
    for opts in (engine_options(build_plan(cfg)), router_options(cfg)):
        env = opts["ray_actor_options"]["runtime_env"]["env_vars"]
        assert env.items() >= cpu_priority.cluster_env().items(), opts["name"]
