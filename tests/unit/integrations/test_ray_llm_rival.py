"""Pins: the private and experimental parts of Ray Serve LLM that the benchmark's rival stack
uses (bench/peers/ray_serve_llm.py)."""

from __future__ import annotations

import importlib

import pytest

from rayattn.bench.cli import peer_module
from tests.unit.integrations import pins

RAY_LLM_POLICIES = peer_module("ray_serve_llm").RAY_LLM_POLICIES
USER = "bench/peers/ray_serve_llm.py"


def test_every_rival_policy_names_an_importable_router():
    for policy, path in RAY_LLM_POLICIES.items():
        module, _, name = path.replace(":", ".").rpartition(".")
        try:
            imported = importlib.import_module(module)
        except ImportError as e:
            if "vLLM is installed but failed to import" not in str(e):
                raise
            # Ray Serve LLM of this Ray needs another vLLM than the one installed (Ray 2.60
            # beside vLLM 0.25 on the GPU image): the rival cannot run here at all.
            pytest.skip(f"ray.llm {pins.version('ray')} does not run on vLLM "
                        f"{pins.version('vllm')}: {str(e).splitlines()[-1][:200]}")
        assert hasattr(imported, name), (
            f"{pins.version('ray')}: no {path} any more; {USER} policy {policy} names it")


def test_direct_streaming_and_broadcast_are_where_the_rival_finds_them():
    from ray.llm._internal.serve import constants
    from ray.llm._internal.serve.utils.broadcast import broadcast

    pins.attrs(constants, "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING",
               user=f"{USER} RayServeLLMStack.start")
    pins.params(broadcast, "handle", "method_name", leading=True,
                user=f"{USER} RayServeLLMStack.reset_caches")
    from ray.serve._private import constants as serve_constants

    pins.attrs(serve_constants, "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY",
               user=f"{USER} DIRECT_STREAMING_ENV")


def test_the_prefix_tree_actor_is_named_and_empties_as_the_rival_expects():
    from ray.llm._internal.serve.routing_policies.prefix_aware import (
        prefix_aware_router,
        prefix_tree,
    )

    user = f"{USER} RayServeLLMStack.reset_caches"
    pins.source_says(prefix_aware_router, r'actor_name = "LlmPrefixTreeActor"',
                     r"PrefixTreeActor\.options\(", user=user)
    pins.attrs(prefix_tree.PrefixTree, "remove_tenants", "add_tenants", user=user)
    pins.source_says(prefix_tree.PrefixTree.__init__, r"self\.tenant_to_char_count\b",
                     user=user)
    pins.source_says(prefix_tree, r"class PrefixTreeActor\(PrefixTree\): .*def getattr\(self, ",
                     user=user)
