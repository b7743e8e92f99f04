"""The rival runs on the same engines: the `vllm serve` flags rayattn's bench builds parse
back (with vLLM's own argument parser) into exactly the deployment's engine settings."""

from __future__ import annotations

import sys

import pytest
import yaml

from rayattn.bench.cli import PEER_MODULES, peer_module
from rayattn.config.loader import parse_args
from rayattn.config.plan import build_plan
from rayattn.integrations.patches import MovedModuleFinder, restore_moved_vllm_modules
from tests.conftest import ROOT


def local_plan():
    """deployments/local.yaml's plan, its model prepared (cached after the first time)."""
    args = yaml.safe_load((ROOT / "deployments" / "local.yaml").read_text())
    return build_plan(parse_args(args["applications"][0]["args"]), prepare_model=True)


def test_serve_flags_round_trip_through_vllms_parser():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    plan = local_plan()  # vLLM's parser resolves the model: prepared (cached) there
    kw = dict(plan.engine_kwargs)
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(["--model", kw["model"], *peer_module("vllm_router").serve_flags(kw)])
    parsed = AsyncEngineArgs.from_cli_args(ns)
    for k, v in kw.items():
        got = getattr(parsed, k)
        assert got == v or (isinstance(v, list) and list(got) == v), (k, got, v)
    assert parsed.dtype == "float32" and parsed.block_size == 32


def test_ray_serve_llm_peer_gets_the_same_engine_settings_and_its_router():
    """Ray Serve LLM splits engine_kwargs between vLLM's engine and frontend arguments and
    rejects unknown ones: what its engines start with must be the deployment's settings."""
    from ray.llm._internal.serve.engines.vllm.vllm_models import VLLMEngineConfig

    RayServeLLMStack = peer_module("ray_serve_llm").RayServeLLMStack  # noqa: N806 - a class
    plan = local_plan()
    stack = RayServeLLMStack(plan, "smollm2", 8200)
    cfg = stack.llm_config("prefix_cache_affinity")
    engine = VLLMEngineConfig.from_llm_config(cfg)
    started = engine.get_initialization_kwargs()
    for k, v in plan.engine_kwargs.items():
        if k not in ("model", "disable_log_stats"):
            assert started[k] == v, (k, started[k], v)
    assert started["model"] == plan.engine_kwargs["model"]
    # Without it the peer's responses carry no cached tokens and its hit rate reads 0.
    assert engine.frontend_kwargs["enable_prompt_tokens_details"] is True
    router = cfg.deployment_config["request_router_config"]["request_router_class"]
    assert router.endswith("PrefixCacheAffinityRouter")
    # Named, not left to Ray's default: under direct streaming the default is round robin.
    p2c = stack.llm_config("power_of_two").deployment_config["request_router_config"]
    assert p2c["request_router_class"].endswith(":PowerOfTwoChoicesRequestRouter")
    assert set(plan.env.items()) <= set(engine.runtime_env["env_vars"].items())


def test_kv_aware_peer_is_set_up_as_rays_guide_has_it(monkeypatch):
    """KVAwareRouter: its router class on the engine deployment, direct streaming asked for,
    and a clear stop before anything starts where it would silently pick engines at random
    (no HAProxy in front: Serve's proxy has no token tracker) or cannot start (no Dynamo)."""
    import importlib.util

    from rayattn.server import front_door

    RayServeLLMStack = peer_module("ray_serve_llm").RayServeLLMStack  # noqa: N806 - a class

    plan = local_plan()
    find = importlib.util.find_spec
    dynamo: list[object | None] = [None]
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: dynamo[0] if name == "dynamo" else find(name, *a))
    monkeypatch.setattr(front_door, "available", lambda: True)
    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY", raising=False)
    with pytest.raises(SystemExit, match="--no-deps ai-dynamo-runtime"):
        RayServeLLMStack(plan, "smollm2", 8200, ("prefix_cache_affinity", "kv_aware"))
    assert not RayServeLLMStack(plan, "smollm2", 8200, ("prefix_cache_affinity",)).direct

    dynamo[0] = object()
    stack = RayServeLLMStack(plan, "smollm2", 8200, ("kv_aware",))
    assert stack.direct
    router = stack.llm_config("kv_aware").deployment_config["request_router_config"]
    assert router["request_router_class"].endswith(".KVAwareRouter")
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    with pytest.raises(SystemExit, match="HAProxy"):
        RayServeLLMStack(plan, "smollm2", 8200, ("kv_aware",))


def test_the_rivals_workers_find_moved_vllm_modules_under_their_old_names():
    """Ray 2.60's KV-aware tokenizer imports vllm.entrypoints.chat_utils (vLLM 0.29's path);
    the hook makes that name import the module where this vLLM has it, and nothing else."""
    import importlib
    import sys

    old = "vllm.entrypoints.chat_utils"
    before = list(sys.meta_path)
    try:
        restore_moved_vllm_modules()
        restore_moved_vllm_modules()  # once per process, however often the hook runs
        assert sum(isinstance(f, MovedModuleFinder) for f in sys.meta_path) == 1
        chat_utils = importlib.import_module(old)
        assert callable(chat_utils.load_chat_template)
        assert importlib.util.find_spec("vllm.entrypoints.no_such_module") is None
    finally:
        sys.meta_path[:] = before
        if sys.modules.get(old) is not None and sys.modules[old].__name__ != old:
            del sys.modules[old]


def test_ratios_are_against_the_best_peer_that_answered_everything():
    """A rival that lost requests finishes early and reports no throughput: it must never
    become the baseline every other row is divided by."""
    from rayattn.bench.cli import add_ratios

    def row(wall: float, tok_s: float, ok: int) -> dict:
        return {"wall_s": wall, "ttft_p90_s": 2.0, "later_ttft_p50_s": 0.5,
                "later_ttft_p90_s": 1.0,
                "output_tok_per_s": tok_s, "ok": ok, "requests": 64}

    table = {"doc_chat": {"rayattn affinity": row(40.0, 50.0, 64),
                          "vllm-router sticky_least_loaded": row(50.0, 40.0, 64),
                          "ray-serve-llm prefix_cache_affinity": row(60.0, 30.0, 64),
                          "vllm-router consistent_hash": row(5.0, 0.0, 0)}}
    add_ratios(table, ("vllm-router", "ray-serve-llm"))
    ours = table["doc_chat"]["rayattn affinity"]
    assert ours["vs_peer"] == "vllm-router sticky_least_loaded"
    assert ours["wall_ratio"] == 0.8 and ours["throughput_ratio"] == 1.25


def test_bench_variants_carry_router_settings_checked_before_anything_starts():
    from rayattn.bench.cli import variant, variant_base
    from rayattn.config.schema import RouterConfig

    assert variant("affinity@predicted") == ("affinity", {"index": "predicted"})
    assert variant("affinity@load_slack=8;predicted") == \
        ("affinity", {"load_slack": 8, "index": "predicted"})
    router = RouterConfig(load_slack=4)
    # Each run sets every setting some variant names: the config's value where its own
    # variant does not, so a run never inherits the previous variant's.
    assert variant_base(["affinity", "affinity@load_slack=8"], router) == {"load_slack": 4}
    for bad in ("affinity@load_slack=abc", "affinity@no_such_setting=1", "no_such_policy"):
        with pytest.raises(SystemExit, match="not a valid router config"):
            variant_base([bad], router)


def test_peers_launchers_come_from_the_checkout_and_their_absence_names_it(monkeypatch,
                                                                            tmp_path):
    """The launchers live in the repository's bench/peers/, outside the installed package:
    found from a checkout, and without one `--peer` stops naming where it looked."""
    for name in PEER_MODULES.values():
        assert peer_module(name).__file__ == str(ROOT / "bench" / "peers" / f"{name}.py")
    assert not (ROOT / "rayattn" / "bench" / "peer.py").exists()
    monkeypatch.setattr("rayattn.bench.cli.peer_dirs", lambda: [tmp_path / "bench" / "peers"])
    monkeypatch.delitem(sys.modules, "rayattn_bench_peers.vllm_router")
    with pytest.raises(SystemExit, match=f"checkout.*{tmp_path}"):
        peer_module("vllm_router")
