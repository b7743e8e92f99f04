"""Extend-first scheduling (router.extend_first, engine.scheduling_policy): the priority the
router gives vLLM, and how the config declares it once."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rayattn.config.loader import parse_args
from rayattn.config.plan import PlanError, build_plan
from rayattn.routing.priority import extend_first

ROOT = Path(__file__).resolve().parents[2]
RATE = 1e-4  # s per prefilled token (the router's fitted rate): 2,600 tokens = 0.26 s
FACTOR = 4.0


def _order(*requests: tuple[str, float, int]) -> list[str]:
    """Names in the order vLLM's priority scheduler takes them: (priority, arrival)."""
    keyed = [(extend_first(sent, uncached, RATE, FACTOR), sent, name)
             for name, sent, uncached in requests]
    return [name for _, _, name in sorted(keyed)]


def test_an_extend_overtakes_cold_prefills_queued_shortly_before_it():
    # A later turn (560 tokens to compute over a cached history) sent 0.5 s after a new
    # conversation's 2,600-token prompt runs first: 0.5 s < 4 × (2600 - 560) × 0.1 ms.
    assert _order(("cold", 100.0, 2600), ("extend", 100.5, 560)) == ["extend", "cold"]


def test_a_long_prompt_is_overtaken_only_within_its_bound():
    # ...but not by one sent later than that bound (0.816 s here): no starvation.
    assert _order(("cold", 100.0, 2600), ("extend", 100.9, 560)) == ["cold", "extend"]
    # The bound scales with the engines' speed: on engines 10× slower, 10× the window.
    slow = extend_first(100.9, 560, 10 * RATE, FACTOR)
    assert slow < extend_first(100.0, 2600, 10 * RATE, FACTOR)
    # Equal work keeps arrival order.
    assert _order(("b", 100.2, 500), ("a", 100.1, 500)) == ["a", "b"]
    # Nothing to compute (a fully cached prompt) is no more urgent than arrival says.
    assert extend_first(100.0, -5, RATE, FACTOR) == extend_first(100.0, 0, RATE, FACTOR) \
        == 100_000_000


def _local(**router) -> dict:
    app = yaml.safe_load((ROOT / "deployments" / "local.yaml").read_text())["applications"][0]
    return {**app["args"], "router": router}


def test_the_engine_runs_the_scheduler_the_config_names_and_it_is_declared_once():
    args = _local(extend_first=FACTOR)
    args["engine"] = {**args["engine"], "scheduling_policy": "priority"}
    plan = build_plan(parse_args(args))
    assert plan.engine_kwargs["scheduling_policy"] == "priority"
    assert not any("extend_first" in n for n in plan.notes)

    # Router on, engines on vLLM's default: allowed (the router setting is live and the
    # engine's is not), but `rayattn check` says the router will send no priorities.
    args = _local(extend_first=FACTOR)
    args["engine"] = {**args["engine"], "scheduling_policy": "fcfs"}
    plan = build_plan(parse_args(args))
    assert plan.engine_kwargs["scheduling_policy"] == "fcfs"
    assert any("engine.scheduling_policy is fcfs" in n for n in plan.notes)

    args = _local()
    args["engine"] = {**args["engine"], "extra_engine_kwargs": {"scheduling_policy": "priority"}}
    with pytest.raises(PlanError, match="'scheduling_policy' is set by engine.scheduling_policy"):
        build_plan(parse_args(args))


def test_the_peers_get_the_same_scheduler_flag():
    from rayattn.bench.peer import serve_flags

    args = _local()
    args["engine"] = {**args["engine"], "scheduling_policy": "priority"}
    flags = serve_flags(build_plan(parse_args(args)).engine_kwargs)
    assert flags[flags.index("--scheduling-policy") + 1] == "priority"
