"""`import_path: rayattn.app:build_app` — the Serve application builder.

One engine deployment (`engine`: one replica per DP rank, each owning its devices through a
placement group; a fixed count or Serve autoscaling) behind one router/ingress deployment
that chooses the replica for every call (server/fleet/pinning.py, docs/routing.md).
"""

from __future__ import annotations

import time
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.schema import ServeDeploySchema

from rayattn.config.loader import ENGINE_DEPLOYMENT, engine_deployment, model_args, parse_args
from rayattn.config.plan import Plan, build_plan
from rayattn.config.router_tier import RouterBounds, config_bounds, router_bounds, routing_targets
from rayattn.config.schema import RayAttnConfig
from rayattn.engine import cpu_priority
from rayattn.engine.replica import EngineReplica
from rayattn.engine.simulated import SimulatedEngineReplica
from rayattn.integrations import serve_private
from rayattn.server.fleet.pinning import REQUEST_ROUTER
from rayattn.server.http.api import Router


@serve.deployment
class Engine(EngineReplica):
    async def __init__(self, args: dict[str, Any]) -> None:  # Serve awaits an async init
        super().__init__(args)
        # Serve lists a replica to the routers as soon as this returns: have vLLM's OpenAI
        # layer built by then, so that a router's first probe answers at once (during a
        # rolling update the next old replica is stopped the moment this one is listed).
        await self.openai.get()


@serve.deployment
class SimulatedEngine(SimulatedEngineReplica):
    """engine.simulated: benchmarks and fleet-scale tests only."""


# Serve slots per engine kept free of generation for the routers' control calls.
CONTROL_HEADROOM = 64
# Serve's own cap on one router replica: far above any admission limit, because the router
# answers 429 itself (router.max_inflight, a live setting) before Serve would queue.
ROUTER_SERVE_CAP = 100_000
# Ray Serve runs a replica's user code on a second event loop in another thread, and its
# handles' routing on a third, by default; every request and every streamed chunk then
# crosses threads. The router is all asyncio (nothing blocks its loop for long: templating
# runs in a worker thread), so it runs on the replica's main loop unless serve.router_loop
# says otherwise. Engines keep the default: vLLM's output handling must not stall Serve's
# health checks.
ROUTER_SERVE_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


ROUTER_UNIT = 0.001
"""Of serve.router_node_resource, per router replica: a node declaring 1 takes up to 1000."""


def engine_options(plan: Plan, name: str = ENGINE_DEPLOYMENT,
                   routers: int | None = None) -> dict[str, Any]:
    """The engine deployment's Serve options; `routers`: the most router replicas that call
    it (default: as many as the config alone implies)."""
    cfg = plan.config
    bundle0 = plan.bundles[0]
    actor: dict[str, Any] = {
        "num_cpus": bundle0.get("CPU", 1),
        # A replica of one bundle holds its GPUs itself (its engine's processes use them);
        # with one bundle per GPU, vLLM's Ray workers take them.
        "num_gpus": bundle0.get("GPU", 0) if len(plan.bundles) == 1 else 0,
        **cfg.serve.ray_actor_options,
    }
    runtime_env = dict(actor.pop("runtime_env", {}) or {})
    # Normal CPU priority however the cluster was started (engine/cpu_priority.py); the
    # plan's and the operator's own variables win.
    runtime_env["env_vars"] = {**cpu_priority.cluster_env(), **plan.env,
                               **runtime_env.get("env_vars", {})}
    actor["runtime_env"] = runtime_env
    if routers is None:
        routers = config_bounds(cfg).max
    scaling: dict[str, Any] = {"num_replicas": cfg.parallelism.data_parallel_size}
    if cfg.serve.engine_autoscaling is not None:
        scaling = {"autoscaling_config": cfg.serve.engine_autoscaling.serve_config()}
    return dict(
        name=name,
        **scaling,
        request_router_config=RequestRouterConfig(request_router_class=REQUEST_ROUTER),
        # A rolling update replaces max(20 %, 1) replicas at a time; with surge, the new
        # ones start before the old ones stop (each needs its own devices meanwhile).
        max_surge_percent=cfg.serve.engine_max_surge_percent,
        # Each router caps its own generation calls at serve.max_ongoing_requests per routing
        # target (rayattn/server/dispatch.py: an engine, or each DP rank of one); Serve's cap
        # sits above what all routers together can send, so probes and snapshots never
        # queue behind generation.
        max_ongoing_requests=(cfg.serve.max_ongoing_requests * routers
                              * cfg.parallelism.dp_ranks + CONTROL_HEADROOM),
        placement_group_bundles=plan.bundles,
        placement_group_strategy=plan.strategy,
        ray_actor_options=actor,
        health_check_period_s=cfg.serve.health_check_period_s,
        logging_config={"enable_access_log": cfg.serve.access_log},
        health_check_timeout_s=max(30.0, cfg.serve.health_check_period_s * 3),
        # A leaving replica (scale-down, update) gets no new calls; let its running
        # generations finish.
        graceful_shutdown_timeout_s=cfg.serve.graceful_shutdown_timeout_s,
    )


def router_options(cfg: RayAttnConfig, bounds: RouterBounds | None = None) -> dict[str, Any]:
    """The router deployment's Serve options; `bounds`: the tier's, as build_app resolved
    them on the cluster (default: as the config alone implies)."""
    if bounds is None:
        bounds = config_bounds(cfg)
    opts: dict[str, Any] = dict(
        name="router",
        ray_actor_options={"num_cpus": 0,
                           **({"resources": {cfg.serve.router_node_resource: ROUTER_UNIT}}
                              if cfg.serve.router_node_resource else {}),
                           "runtime_env": {"env_vars": {
                               **cpu_priority.cluster_env(),
                               "PYTHONHASHSEED": cfg.engine.hash_seed,
                               **(ROUTER_SERVE_ENV if cfg.serve.router_loop == "main"
                                  else {})}}},
        max_ongoing_requests=ROUTER_SERVE_CAP,
        graceful_shutdown_timeout_s=cfg.serve.graceful_shutdown_timeout_s,
        # Routers are cheap (no devices): on an update the new one starts before the old
        # one drains, so the HTTP front door never has zero replicas.
        max_surge_percent=100,
        logging_config={"enable_access_log": cfg.serve.access_log},
        user_config=cfg.router.model_dump(mode="json"),
    )
    if bounds.fixed:
        opts["num_replicas"] = bounds.min
        return opts
    tier = cfg.serve.router_tier
    opts["autoscaling_config"] = {
        # No initial_replicas: Serve would go back to it on every config change, a router
        # setting changed through user_config included, and drain a grown tier under load.
        "min_replicas": bounds.min, "max_replicas": bounds.max,
        "upscale_delay_s": tier.upscale_delay_s, "downscale_delay_s": tier.downscale_delay_s,
        "look_back_period_s": tier.look_back_period_s,
        "metrics_interval_s": tier.metrics_interval_s,
        "policy": {"policy_function": "rayattn.server.router_scaling:RoutersForCpu",
                   "policy_kwargs": {"target_cpu": tier.target_cpu}},
    }
    return opts


def spare_cores(plans: list[Plan]) -> float | None:
    """The CPUs the routers may use where Ray runs: those of the nodes declaring
    serve.router_node_resource (the manifests' head, where no engine runs), else the
    cluster's less what every engine replica reserves. None outside a Ray cluster."""
    import ray

    if not ray.is_initialized():
        return None
    resource = plans[0].config.serve.router_node_resource
    if resource:
        return sum(n["Resources"].get("CPU", 0.0) for n in ray.nodes()
                   if n.get("Alive") and resource in n["Resources"])
    cpus = ray.cluster_resources().get("CPU", 0.0)
    for plan in plans:
        cpus -= plan.replica_range[1] * sum(b.get("CPU", 0.0) for b in plan.bundles)
    return max(cpus, 0.0)


def build_app(args: dict[str, Any]) -> Application:
    """The router in front of one engine deployment per base model (`args.models`, else the
    one model of `args`)."""
    per_model = model_args(args)
    several = len(per_model) > 1
    cfgs = [parse_args(margs) for margs in per_model]
    plans = [build_plan(cfg, prepare_model=True) for cfg in cfgs]
    bounds = router_bounds(cfgs[0], routing_targets(cfgs), spare_cores(plans))
    engines = {}
    for margs, cfg, plan in zip(per_model, cfgs, plans, strict=True):
        # Router settings travel as the router's Serve user_config (applied live through
        # reconfigure) and are not part of anyone's init args: changing them restarts
        # nothing, and engines never see them.
        own = {k: v for k, v in margs.items() if k != "router"}
        deployment = SimulatedEngine if cfg.engine.simulated is not None else Engine
        engine = deployment.options(**engine_options(plan, engine_deployment(cfg, several),
                                                   bounds.max))
        # Up to as many replaced at once as the surge sets devices aside for (at least
        # Serve's 20 %).
        surge = cfg.serve.engine_max_surge_percent / 100
        if surge > serve_private.default_rolling_share():
            engine = serve_private.replacing_at_once(engine, surge)
        engines[cfg.model.name] = engine.bind(own)
    shared = {k: v for k, v in args.items() if k != "router"}
    # The routers are told the bounds resolved here (their admin API refuses what would
    # reach one router of several).
    serve_args = shared.get("serve") or {}
    shared["serve"] = {**serve_args, "router_tier": {
        **(serve_args.get("router_tier") or {}),
        "min_replicas": bounds.min, "max_replicas": bounds.max}}
    return Router.options(**router_options(cfgs[0], bounds)).bind(shared, engines)


def deploy_config(serve_config: dict[str, Any]) -> None:
    """Deploy a Serve config file's applications declaratively, as `serve run <file>` and
    `serve deploy` do (its `applications`; the cluster-level keys such as http_options
    belong to whoever started Serve), on the Serve instance this process is connected to.
    Only this path
    gives Serve's lightweight updates: a changed router `user_config` reconfigures the
    running routers (imperative `serve.run` gives every deployment a new version)."""
    schema = ServeDeploySchema.model_validate({"applications": serve_config["applications"]})
    serve_private.deploy_apps(schema)


def wait_running(app_name: str, timeout_s: float = 600) -> None:
    """Block until Serve reports the application RUNNING; raise with Serve's message if its
    build or deployment failed (a config error would otherwise look like a slow start)."""
    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(app_name)
        status = str(app.status) if app else "NOT_STARTED"
        if status.endswith("RUNNING"):
            return
        if status.endswith("DEPLOY_FAILED"):
            raise RuntimeError(f"Serve application {app_name!r} failed: {app.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve application {app_name!r} still {status}")
        time.sleep(0.25)
