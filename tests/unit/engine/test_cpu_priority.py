"""Ray's workers at normal priority, declared once (rayattn/engine/cpu_priority.py): set where
rayattn starts Ray, asked for by its deployments, warned about where missing. (The Makefile
and the KubeRay pods: tests/unit/server/test_front_door.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rayattn.engine import cpu_priority

ROOT = Path(__file__).resolve().parents[3]


def test_apply_sets_normal_priority_and_keeps_an_operators_choice():
    env: dict[str, str] = {}
    cpu_priority.apply(env)
    assert env == {"RAY_worker_niceness": "0"}
    chosen = {"RAY_worker_niceness": "10"}
    cpu_priority.apply(chosen)
    assert chosen == {"RAY_worker_niceness": "10"}


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
