"""`rayattn bench` (real engines through the OpenAI API) and `rayattn simulate`."""

from __future__ import annotations

import argparse
import asyncio
import copy
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import yaml

from rayattn.bench.report import markdown, plot_ramp, plot_sim, write_run
from rayattn.bench.stats import percentile
from rayattn.bench.workloads import (
    agent_loop,
    doc_chat,
    long_doc_qa,
    mix,
    multi_turn,
    shared_prefix,
)
from rayattn.config.loader import ROUTER_DEPLOYMENT, rayattn_apps
from rayattn.config.plan import build_plan
from rayattn.config.schema import RouterConfig
from rayattn.models.embedded import resolve_embedded
from rayattn.routing.policies import REGISTRY

if TYPE_CHECKING:
    from rayattn.bench.sim_fleet import FleetScaling
    from rayattn.bench.simulate import SimResult

# Imported in the functions that need them: Ray and the Serve app (after cluster_env has set
# the environment Ray reads), httpx, transformers, and the driver's and simulator's modules
# (aiohttp, the routing core): every `rayattn` command builds this module's parsers.

POLICIES = list(REGISTRY)


def variant_base(policies: list[str], router: Any) -> dict:
    """The config's value of every router setting some variant changes (each run sets
    them all, so a run does not inherit the previous variant's), after checking that every
    variant is a valid router config: a typo must not surface after the start-up."""
    config = router.model_dump(mode="json")
    for pol in policies:
        name, settings = variant(pol)
        try:
            RouterConfig.model_validate({**config, **settings, "policy": name})
        except ValueError as e:  # pydantic's ValidationError too
            raise SystemExit(f"--policies: {pol!r} is not a valid router config: {e}") from None
    return {k: config[k] for pol in policies for k in variant(pol)[1]}


def variant(policy: str) -> tuple[str, dict]:
    """`affinity@load_slack=8;min_match_fraction=0.2`: a policy with router settings of its
    own for its runs (applied with the reset, on the same engines); `affinity@predicted`:
    with that index mode."""
    name, _, rest = policy.partition("@")
    settings = {}
    for kv in filter(None, rest.split(";")):
        key, eq, value = kv.partition("=")
        settings.update({key: yaml.safe_load(value)} if eq else {"index": key})
    return name, settings


def start_local(port: int, config: str = "deployments/local.yaml") -> tuple[str, float]:
    """Start the local deployment once in this process (Ray + Serve); returns URL, start-up s."""
    serve_config = yaml.safe_load(Path(config).read_text())
    serve_config.setdefault("http_options", {})["port"] = port
    return start_local_config(serve_config)


def start_local_config(serve_config: dict, num_gpus: int | None = None) -> tuple[str, float]:
    """Ray and Serve in this process, serving a Serve config's first application on its
    http_options.port once every engine is up; returns its URL and the deployment's start-up
    time (s). `num_gpus`: what Ray is told the node has (None: what it detects)."""
    from rayattn import cluster_env

    # Before Ray (and Serve's constants) are imported here.
    cluster_env.apply(rayattn_apps(serve_config)[0][1].router.session_header)
    import ray
    from ray import serve

    from rayattn.app import deploy_config, wait_running

    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(k, "1")
    port = serve_config["http_options"]["port"]
    ray.init(address="local", include_dashboard=False, num_gpus=num_gpus)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    t0 = time.time()
    deploy_config(serve_config)
    wait_running(serve_config["applications"][0]["name"])
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    return url, time.time() - t0


def wait_healthy(url: str, timeout: float = 300) -> dict:
    """Poll /health until every engine replica is up."""
    import httpx

    deadline = time.time() + timeout
    last: object = None
    while time.time() < deadline:
        try:
            r = httpx.get(f"{url}/health", timeout=10)
            last = r.json()
            if r.status_code == 200 and last["up"] == last["of"]:
                return last
        except (httpx.HTTPError, ValueError) as e:  # proxy or route not up yet
            last = repr(e)
        time.sleep(0.25)
    raise TimeoutError(f"deployment not healthy: {last}")


def cmd_bench(a: argparse.Namespace) -> int:
    import httpx
    from transformers import AutoTokenizer

    # Checked before anything starts: a typo must not cost the rayattn half of the run.
    peers = list(dict.fromkeys(x for x in (a.peer or "").split(",") if x))
    for peer in peers:
        if peer not in PEERS:
            raise SystemExit(f"--peer: unknown peer {peer!r} (one of {', '.join(PEERS)})")
        peer_module(PEER_MODULES[peer])
    ray_llm_policies = peer_module(PEER_MODULES["ray-serve-llm"]).RAY_LLM_POLICIES \
        if "ray-serve-llm" in peers else {}
    for pol in a.ray_llm_policies.split(",") if "ray-serve-llm" in peers else []:
        if pol not in ray_llm_policies:
            raise SystemExit(f"--ray-llm-policies: unknown policy {pol!r} "
                             f"(one of {', '.join(ray_llm_policies)})")

    wl_all = {"shared_prefix": shared_prefix(groups=a.groups, prompts_per_group=a.prompts,
                                             seed=a.seed),
              "multi_turn": multi_turn(conversations=a.conversations, turns=a.turns,
                                       shared_systems=a.shared_systems,
                                       system_words=a.system_words, seed=a.seed),
              "doc_chat": doc_chat(conversations=a.conversations, turns=a.turns,
                                   doc_words=a.doc_words, seed=a.seed),
              "agent_loop": agent_loop(sessions=a.conversations, turns=a.turns + 2,
                                       seed=a.seed),
              "long_doc_qa": long_doc_qa(seed=a.seed), "mix": mix(seed=a.seed)}
    workloads = {k: v for k, v in wl_all.items() if k in a.workload.split(",")}
    tok = AutoTokenizer.from_pretrained(a.tokenizer or
                                        str(resolve_embedded("rayattn://smollm2-135m")))
    table: dict = {}
    raw: dict = {}
    if a.policies:
        policies = a.policies.split(",")
        if a.index:
            policies = [f"{p}{';' if '@' in p else '@'}{i}" for p in policies
                        for i in a.index.split(",")]
        # Each run sets every setting some variant changes: back to the config's value where
        # its own variant does not name it (--config's: with --target, the same file).
        # Every variant is validated before anything starts.
        router = rayattn_apps(yaml.safe_load(Path(a.config).read_text()))[0][1].router
        base = variant_base(policies, router)

        url = a.target
        if url is None:
            url, startup = start_local(a.port, a.config)
            print(f"local deployment up in {startup:.1f}s at {url}")

        def rayattn_policy(pol: str) -> bool | None:
            # "affinity@predicted", "affinity@load_slack=8": switched live with the reset.
            policy, settings = variant(pol)
            r = httpx.post(f"{url}/admin/reset", json={"policy": policy,
                                                       "settings": {**base, **settings}},
                           timeout=60)
            r.raise_for_status()
            cold: bool | None = r.json().get("cold")  # None: a router from before it said
            return cold

        if not a.ingress:
            run_matrix("rayattn", url, a.model, workloads, policies, rayattn_policy,
                       a.concurrency, a.block_size, tok, a.runs, a.rate, table, raw, a.think_s)
            if "affinity" in policies and a.rate is None:  # not with --index (affinity@…)
                write_engine_model(a, url, raw, workloads, tok)
        for n in [int(x) for x in (a.ingress or "").split(",") if x]:
            if a.target is not None:
                raise SystemExit("--ingress redeploys the router: only with the local deployment")

            def on_n_routers(pol: str, n: int = n) -> bool | None:
                # Every router replica must switch, so the setting goes through the Serve
                # config (user_config reaches all of them); the reset then only empties the
                # engines' caches, which every router's events index sees.
                policy, settings = variant(pol)
                deploy_router(yaml.safe_load(Path(a.config).read_text()), n,
                              {"policy": policy, **base, **settings})
                return rayattn_policy(pol)

            run_matrix(f"rayattn ×{n} ingress", url, a.model, workloads, policies,
                       on_n_routers, a.concurrency, a.block_size, tok, a.runs, a.rate, table,
                       raw, a.think_s)
        if a.target is None and peers:
            stop_local()  # the peer gets the machine to itself, as rayattn had it
    failed = []
    for peer in peers:
        try:
            PEERS[peer](a, workloads, tok, table, raw)
        except Exception:  # one rival failing must not lose the others' runs
            traceback.print_exc()
            failed.append(peer)
            print(f"peer {peer} failed: its rows are missing from the table")
    if peers:
        add_ratios(table, tuple(peers))
    write_run(Path(a.out), table, raw)
    print((Path(a.out) / "policies.md").read_text())
    return 1 if failed else 0


def write_engine_model(a: argparse.Namespace, url: str, raw: dict, workloads: dict,
                       tokenizer) -> None:
    """The simulator's engine coefficients fitted to this run's first affinity run of each
    workload and calibrated by replaying those runs in the simulator
    (`rayattn simulate --engine-model <out>/engine_model.json`)."""
    from rayattn.bench.fit import (
        base_model,
        calibrate,
        case_of,
        fit_engine_model,
        results_from_json,
    )
    from rayattn.bench.simulate import trace_from_run

    _, cfg = rayattn_apps(yaml.safe_load(Path(a.config).read_text()))[0]
    base = base_model(url, cfg.engine.model_dump())
    cases, rows = [], []
    for wname, wl in workloads.items():
        res = results_from_json([r for r in raw.get(f"{wname}/rayattn affinity", [])
                                 if r["run"] == 0])
        if not res:
            continue
        rows += res
        wall = max(r.start_s + r.e2e_s for r in res) - min(r.start_s for r in res)
        trace = trace_from_run(res, wl, tokenizer, base.block_size)
        cases.append(case_of(res, trace, wall, a.concurrency, len(_engines_up(url)),
                             a.think_s))
    try:
        model = calibrate(cases, fit_engine_model(rows, base))
    except ValueError as e:
        print(f"engine model not fitted: {e}")
        return
    Path(a.out).mkdir(parents=True, exist_ok=True)
    model.save(Path(a.out) / "engine_model.json")
    print(f"simulator coefficients fitted from this run: {Path(a.out) / 'engine_model.json'}")


def _engines_up(url: str) -> list[str]:
    import httpx

    return httpx.get(f"{url}/health", timeout=10).json()["replicas_up"]


def deploy_router(serve_config: dict, replicas: int | None, settings: dict) -> None:
    """Redeploy the app's router (the first application of a Serve config, deployed from
    it) with `replicas` replicas (None: as many as the tier sizes itself to) and these
    settings (a lightweight Serve update: engines keep running) and wait until every router
    replica serves them."""
    from ray import serve

    from rayattn.app import deploy_config

    cfg = copy.deepcopy(serve_config)
    app = cfg["applications"][0]
    deps = app.setdefault("deployments", [])
    router = next((d for d in deps if d["name"] == ROUTER_DEPLOYMENT), None)
    if router is None:
        router = {"name": ROUTER_DEPLOYMENT}
        deps.append(router)
    if replicas is not None:
        # A fixed count in place of the tier's autoscaling, if the app built one.
        router.update(num_replicas=replicas, autoscaling_config=None)
    router["user_config"] = {**(router.get("user_config") or {}), **settings}
    deploy_config(cfg)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        st = serve.status().applications[app["name"]]
        d = st.deployments[ROUTER_DEPLOYMENT]
        running = d.replica_states.get("RUNNING", 0)
        if str(st.status).endswith("RUNNING") and running == sum(d.replica_states.values()) \
                and running == (replicas or running) and running > 0:
            return
        time.sleep(1)
    raise TimeoutError(f"router not at {replicas or 'its'} running replicas")


def running_routers(app_name: str = "rayattn") -> int:
    """Router replicas running now (what the tier sized itself to)."""
    from ray import serve

    d = serve.status().applications[app_name].deployments[ROUTER_DEPLOYMENT]
    return d.replica_states.get("RUNNING", 0)


def stop_local() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def run_peer(a: argparse.Namespace, workloads: dict, tok, table: dict, raw: dict) -> None:
    _, cfg = rayattn_apps(yaml.safe_load(Path(a.config).read_text()))[0]
    plan = build_plan(cfg, prepare_model=True)
    stack = peer_module(PEER_MODULES["vllm-router"]).PeerStack(plan, a.peer_port,
                                                              Path(a.out) / "peer-logs")
    try:
        took = stack.start_engines()
        print(f"{plan.replicas} vllm serve engines up in {took:.1f}s")

        def prepare(policy: str) -> bool:
            stack.start_router(policy)
            return stack.reset_caches()

        run_matrix("vllm-router", stack.url, a.model, workloads, a.peer_policies.split(","),
                   prepare, a.concurrency, a.block_size, tok, a.runs, a.rate, table, raw, a.think_s)
    finally:
        stack.stop()


def run_ray_llm_peer(a: argparse.Namespace, workloads: dict, tok, table: dict,
                     raw: dict) -> None:
    _, cfg = rayattn_apps(yaml.safe_load(Path(a.config).read_text()))[0]
    policies = a.ray_llm_policies.split(",")
    stack = peer_module(PEER_MODULES["ray-serve-llm"]).RayServeLLMStack(
        build_plan(cfg, prepare_model=True), a.model, a.peer_port, tuple(policies))
    try:
        stack.start()

        def prepare(policy: str) -> bool | None:
            took = stack.deploy(policy)
            if took:
                print(f"Ray Serve LLM ({policy}) up in {took:.1f}s")
            stack.reset_caches()
            return None  # its broadcast says nothing of whether each engine emptied

        run_matrix("ray-serve-llm", stack.url, a.model, workloads, policies, prepare,
                   a.concurrency, a.block_size, tok, a.runs, a.rate, table, raw, a.think_s)
    finally:
        stack.stop()


def peer_dirs() -> list[Path]:
    """Where the peers' launchers may be: bench/peers/ of the repository checkout this
    package is imported from (an editable install or the checkout's own directory), then
    of the current directory. They start rival stacks for benchmarks only, so they are
    kept out of the installed package."""
    dirs = [Path(__file__).resolve().parents[2] / "bench" / "peers",
            Path.cwd().resolve() / "bench" / "peers"]
    return list(dict.fromkeys(dirs))


def peer_module(name: str) -> ModuleType:
    """bench/peers/<name>.py of a rayattn repository checkout, imported by its path."""
    key = f"rayattn_bench_peers.{name}"
    if key in sys.modules:
        return sys.modules[key]
    path = next((d / f"{name}.py" for d in peer_dirs() if (d / f"{name}.py").is_file()), None)
    if path is None:
        raise SystemExit(
            f"--peer: the peers' launchers come from a rayattn repository checkout, not the "
            f"installed package; no bench/peers/{name}.py in "
            f"{' or '.join(str(d.parents[1]) for d in peer_dirs())}. Run from a checkout "
            f"(its root as the current directory) or install rayattn from one (`pip install "
            f"-e .`).")
    spec = importlib.util.spec_from_file_location(key, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[key]
        raise
    return module


# The rivals `--peer` can start, each on the deployment's engine settings.
PEERS = {"vllm-router": run_peer, "ray-serve-llm": run_ray_llm_peer}
# Their launchers: bench/peers/<module>.py of the repository checkout.
PEER_MODULES = {"vllm-router": "vllm_router", "ray-serve-llm": "ray_serve_llm"}


def score(res: list, wall: float, wl, tokenizer, block_size: int) -> dict:
    """A run's summary, its hit rate against the trace's oracle, later turns' TTFT."""
    from rayattn.bench.driver import oracle, summarize

    s = summarize(res, wall)
    s.update(oracle(res, wl, tokenizer, block_size))
    s["hit_vs_block_oracle"] = s["hit_rate"] / max(s["oracle_block_hit_rate"], 1e-9)
    s["hit_vs_token_oracle"] = s["hit_rate"] / max(s["oracle_token_hit_rate"], 1e-9)
    later = [r for r in res if r.status == 200 and r.turn > 0]
    s["later_ttft_p50_s"] = percentile(sorted(r.ttft_s for r in later), 0.5)
    s["later_ttft_p90_s"] = percentile(sorted(r.ttft_s for r in later), 0.9)
    return s


def run_matrix(label: str, url: str, model: str, workloads: dict, policies: list[str],
               prepare, concurrency: int, block_size: int, tokenizer, runs: int,
               rate: float | None, table: dict, raw: dict, think_s: float = 0.0) -> None:
    """Every policy on every workload, `runs` times (interleaved, so drift hits all alike);
    `prepare(policy)` puts the stack in that policy with cold caches and says whether every
    cache (host tiers included) emptied: True, False, or None where the stack cannot tell.
    Each run records it (`cold`) and prints it; the table counts the cold runs."""
    from rayattn.bench.driver import results_json, run_workload

    for wname, wl in workloads.items():
        per: dict[str, list[dict]] = {p: [] for p in policies}
        for run in range(runs):
            for pol in policies:
                cold = prepare(pol)
                # One router's count: only where one router answers /health.
                held = _kv_held(url) if label == "rayattn" else None
                res, wall = asyncio.run(run_workload(url, model, wl, concurrency=concurrency,
                                                     rate=rate, progress=True,
                                                     think_s=think_s))
                s = score(res, wall, wl, tokenizer, block_size)
                s["cold"] = cold
                after = _kv_held(url) if held is not None else None
                if held is not None and after is not None:
                    s["kv_held"] = after - held
                per[pol].append(s)
                raw.setdefault(f"{wname}/{label} {pol}", []).extend(
                    {**r, "run": run} for r in results_json(res))
                print(f"{wname:14s} {label:11s} {pol:19s} run {run}: "
                      f"hit/oracle={s['hit_vs_block_oracle']:.3f} wall={wall:.1f}s "
                      f"ttft p50={s['ttft_p50_s']:.3f} p90={s['ttft_p90_s']:.3f} "
                      f"later p50={s['later_ttft_p50_s']:.3f} p90={s['later_ttft_p90_s']:.3f} "
                      f"ok={s['ok']}/{s['requests']} "
                      f"moves={s['moves']} regret={s['regret_tokens']}"  # None: a peer
                      + (f" held={s['kv_held']}" if "kv_held" in s else "")
                      + {True: " cold", False: " NOT COLD", None: ""}[cold], flush=True)
        for pol, ss in per.items():
            row = dict(ss[len(ss) // 2])  # one run's details; the figures below are medians
            row.pop("cold", None)  # counted over the runs below
            for k in ("hit_rate", "hit_vs_block_oracle", "wall_s", "ttft_p50_s", "ttft_p90_s",
                      "later_ttft_p50_s", "later_ttft_p90_s", "output_tok_per_s"):
                vals = [x[k] for x in ss]
                row[k] = statistics.median(vals)
                row[f"{k}_range"] = [min(vals), max(vals)]
            row["runs"] = len(ss)
            row["cold_runs"] = sum(1 for x in ss if x["cold"]) \
                if all(x["cold"] is not None for x in ss) else None
            table.setdefault(wname, {})[f"{label} {pol}"] = row


def _kv_held(url: str) -> int | None:
    """Requests the router has held for KV room so far (cache-pressure admission; one
    router's count), None where the stack is not rayattn."""
    import httpx

    try:
        return int(httpx.get(f"{url}/health", timeout=10).json()["counts"]["kv_held"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def add_ratios(table: dict, peer_labels: tuple[str, ...] = ("vllm-router",)) -> None:
    """Each row's wall time, TTFT p90 and throughput as ratios to the best peer policy
    (lowest median wall time, over every peer whose runs all answered) on the same workload
    in the same run. A peer that lost requests finishes early: it is never the baseline."""
    def ratio(x: float, y: float) -> float:
        return x / y if y else float("nan")

    for rows in table.values():
        peers = {k: v for k, v in rows.items() if k.startswith(peer_labels)
                 and v.get("ok") == v.get("requests")}
        if not peers:
            continue
        best_name, best = min(peers.items(), key=lambda kv: kv[1]["wall_s"])
        for r in rows.values():
            r["vs_peer"] = best_name
            r["wall_ratio"] = ratio(r["wall_s"], best["wall_s"])
            r["ttft_p90_ratio"] = ratio(r["ttft_p90_s"], best["ttft_p90_s"])
            r["later_ttft_p50_ratio"] = ratio(r["later_ttft_p50_s"], best["later_ttft_p50_s"])
            r["later_ttft_p90_ratio"] = ratio(r["later_ttft_p90_s"], best["later_ttft_p90_s"])
            r["throughput_ratio"] = ratio(r["output_tok_per_s"], best["output_tok_per_s"])


# `rayattn simulate`'s engine coefficients: EngineModel fields, with MI300X-class defaults
# (per replica of TP8, docs/log/simulator.md) where the model's own are CPU ones.
_ENGINE_FLAGS: dict[str, tuple[float | int, str | None]] = {
    "prefill_s_per_token": (2e-5, None),
    "ctx_s_per_token": (2e-7, None),
    "itl_base_s": (0.02, None),
    "itl_per_seq_s": (2e-4, None),
    "step_overlap": (0.0, "share of the shorter of a step's fixed and compute parts that "
                          "runs under the longer (0..1)"),
    "contention": (0.0, "how much longer a step takes per other busy engine of its host"),
    "engines_per_host": (0, "engines that share a host, for --contention (0: all of them)"),
    "router_s": (0.0, "mean of the router's own time per request before it chooses"),
}


def _scaling(a: argparse.Namespace) -> FleetScaling | None:
    """`--scale MIN,MAX`'s FleetScaling (None without it): serve.engine_autoscaling as the
    flags set it."""
    from pydantic import ValidationError

    from rayattn.bench.sim_fleet import FleetScaling
    from rayattn.config.schema import EngineAutoscaling

    if not a.scale:
        return None
    try:
        lo, hi = (int(x) for x in a.scale.split(","))
        auto = EngineAutoscaling(
            min_replicas=lo, max_replicas=hi, ttft_p90_s=a.ttft_target_s, kv_usage=a.kv_target,
            # No target of requests in flight unless asked: this high, never the pressed one.
            target_ongoing_requests=a.ongoing_target or 1e9,
            upscale_delay_s=a.upscale_delay_s, downscale_delay_s=a.downscale_delay_s,
            metrics_interval_s=a.metrics_interval_s, look_back_period_s=a.look_back_s)
        return FleetScaling(auto, start_s=a.start_s)
    except (ValueError, ValidationError) as e:
        raise SystemExit(f"rayattn simulate: --scale: {e}") from None


def _phases(text: str) -> list[tuple[float, float]]:
    try:
        phases = [(float(s), float(r)) for s, r in (p.split(":") for p in text.split(","))]
    except ValueError:
        phases = []
    if not phases or any(s <= 0 or r <= 0 for s, r in phases):
        raise SystemExit(f"rayattn simulate: --phases {text!r}: want seconds:rate,... "
                         "(both > 0)")
    return phases


def cmd_simulate(a: argparse.Namespace) -> int:
    from rayattn.bench.simulate import (
        EngineModel,
        multi_turn_trace,
        ramp_trace,
        shared_prefix_trace,
        simulate,
    )

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.engine_model:
        # Coefficients fitted from a real run (`rayattn bench` writes engine_model.json).
        model = EngineModel.load(a.engine_model)
        a.block_size = model.block_size
    else:
        try:
            model = EngineModel(capacity_blocks=a.capacity_blocks, block_size=a.block_size,
                                **{name: getattr(a, name) for name in _ENGINE_FLAGS})
        except ValueError as e:
            raise SystemExit(f"rayattn simulate: {e}") from None
    if a.workload == "shared_prefix":
        per_group = max(1, a.requests // a.groups)
        trace = shared_prefix_trace(a.groups, per_group, a.system_tokens, a.question_tokens,
                                    a.output_tokens, a.rate, a.block_size, a.seed)
    elif a.workload == "ramp":
        if not a.scale:
            raise SystemExit("rayattn simulate: --workload ramp needs --scale MIN,MAX")
        trace = ramp_trace(_phases(a.phases), a.turns, a.groups, a.system_tokens,
                           a.question_tokens, a.output_tokens,
                           think_s=5.0 if a.think_s is None else a.think_s,
                           block_size=a.block_size, seed=a.seed,
                           document_tokens=a.document_tokens)
    else:
        trace = multi_turn_trace(a.requests // a.turns, a.turns, a.groups, a.system_tokens,
                                 a.question_tokens, a.output_tokens, a.rate,
                                 think_s=5.0 if a.think_s is None else a.think_s,
                                 block_size=a.block_size, seed=a.seed,
                                 document_tokens=a.document_tokens
                                 if a.workload == "doc_chat" else 0,
                                 keep_ids=bool(a.scale))  # a scaling fleet's plans need ids
    warms = a.warm.split(",")
    if not set(warms) <= {"on", "off"}:
        raise SystemExit(f"rayattn simulate: --warm {a.warm!r}: on, off or on,off")
    if a.scale and a.workload == "shared_prefix":
        raise SystemExit("rayattn simulate: --scale needs conversations (multi_turn, doc_chat, "
                         "ramp)")
    rows = []
    for pol in a.policies.split(","):
        for index in a.index.split(","):
            for routers in [int(x) for x in a.routers.split(",")]:
                for warm in [w == "on" for w in warms] if a.scale else [True]:
                    scaling = _scaling(a)
                    r = simulate(trace, a.replicas, pol, model, routers=routers, seed=a.seed,
                                 index=index, concurrency=a.concurrency,
                                 think_s=a.think_s or 0.0, scaling=scaling,
                                 router_cfg=RouterConfig(warm_engines=warm))
                    d = asdict(r)
                    d.pop("per_replica")
                    d["index"] = index
                    d["warm"] = warm if scaling is not None else None
                    rows.append(d)
                    print(f"{pol:13s} index={index:9s} routers={routers} hit={r.hit_rate:.3f} "
                          f"oracle={r.oracle_hit_rate:.3f} ttft p50={r.ttft_p50_s:.3f} "
                          f"p90={r.ttft_p90_s:.3f} p99={r.ttft_p99_s:.3f} "
                          f"imbalance={r.load_imbalance:.2f} moves={r.session_moves} "
                          f"regret={r.regret_tokens} ({r.wall_s:.1f}s)", flush=True)
                    if scaling is not None:
                        print(scaling_summary(r, scaling, warm), flush=True)
    name = f"sim_{a.workload}_{a.replicas}r"
    (out / f"{name}.json").write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2,
                                                 default=str))
    table = {a.workload: {f"{r['policy']} {r['index']} ×{r['routers']}": r for r in rows}}
    md = markdown(table, ["hit_rate", "oracle_hit_rate", "ttft_p50_s", "ttft_p90_s",
                          "ttft_p99_s", "load_imbalance", "max_replica_share"])
    (out / f"{name}.md").write_text(md)
    plot_sim(out, rows, name)
    if a.scale:
        plot_ramp(out, rows, name, a.ttft_target_s)
    print(md)
    return 0


def scaling_summary(r: SimResult, scaling: FleetScaling, warm: bool) -> str:
    """One line of a scaling fleet's run: its windows within the TTFT target, engines, what
    warming did, later turns."""
    rows = [w for w in r.timeline if w["within"] is not None]
    within = sum(w["within"] for w in rows)
    return (f"  warm={'on' if warm else 'off'}: windows within "
            f"{scaling.autoscaling.ttft_p90_s} s "
            f"{within}/{len(rows)}, engines max {r.max_engines}, engine-s "
            f"{r.engine_seconds:.0f}, scale decisions {[d[1] for d in r.scale_decisions]}, "
            f"warm prefills {r.warm_prefills}, moved conversations "
            f"{r.moved_conversations}, later-turn TTFT p50/p90 {r.later_ttft_p50_s:.3f}/"
            f"{r.later_ttft_p90_s:.3f} s, hit/oracle {r.hit_vs_oracle:.3f}")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="compare routing policies on real engines")
    b.add_argument("--target", help="URL of a running rayattn (admin_api on); "
                                    "default: start deployments/local.yaml here")
    b.add_argument("--port", type=int, default=8123)
    b.add_argument("--model", default="smollm2")
    b.add_argument("--tokenizer", help="tokenizer path for the oracle (default: SmolLM2)")
    b.add_argument("--workload", default="shared_prefix,multi_turn",
                   help="comma list of shared_prefix, multi_turn, doc_chat, agent_loop, "
                        "long_doc_qa, mix")
    b.add_argument("--think-s", type=float, default=0.0,
                   help="closed loop: a uniform 0..think_s pause before a conversation's "
                        "next turn")
    b.add_argument("--doc-words", type=int, default=500,
                   help="doc_chat: words of each conversation's own document")
    b.add_argument("--rate", type=float, default=None,
                   help="open loop: Poisson conversation arrivals per second "
                        "(default: closed loop at --concurrency)")
    b.add_argument("--config", default="deployments/local.yaml",
                   help="Serve config whose engines both stacks use")
    b.add_argument("--policies", default=",".join(POLICIES),
                   help="rayattn policies, each optionally with router settings of its own "
                        "(affinity@load_slack=8;min_match_fraction=0.2); empty: peer only")
    b.add_argument("--index", help="router index modes to compare, e.g. events,predicted "
                                   "(default: leave the router's index as it is)")
    b.add_argument("--ingress", help="router replica counts to compare, e.g. 1,4 (local "
                                     "deployment only; policies switch through user_config)")
    b.add_argument("--peer", help="rivals to run after rayattn in the same run, on the same "
                                  "engine settings: vllm-router (in front of `vllm serve` "
                                  "engines), ray-serve-llm (Ray Serve LLM's OpenAI app); "
                                  "comma-separated; their launchers come from a repository "
                                  "checkout's bench/peers/")
    b.add_argument("--peer-policies", default="cache_aware,sticky_least_loaded",
                   help="vllm-router policies (also: consistent_hash, power_of_two, ...)")
    b.add_argument("--ray-llm-policies", default="prefix_cache_affinity",
                   help="Ray Serve LLM routers: prefix_cache_affinity, power_of_two")
    b.add_argument("--peer-port", type=int, default=8200)
    b.add_argument("--runs", type=int, default=1, help="repetitions of every policy")
    b.add_argument("--shared-systems", type=int, default=2)
    b.add_argument("--system-words", type=int, default=200)
    b.add_argument("--concurrency", type=int, default=8)
    b.add_argument("--groups", type=int, default=6)
    b.add_argument("--prompts", type=int, default=8)
    b.add_argument("--conversations", type=int, default=12)
    b.add_argument("--turns", type=int, default=4)
    b.add_argument("--block-size", type=int, default=32)
    b.add_argument("--seed", type=int, default=11)
    b.add_argument("--out", default="bench/results/bench")
    b.set_defaults(fn=cmd_bench)

    s = sub.add_parser("simulate", help="discrete-event fleet simulation with the real router")
    s.add_argument("--replicas", type=int, default=64)
    s.add_argument("--requests", type=int, default=100_000)
    s.add_argument("--workload", choices=["shared_prefix", "multi_turn", "doc_chat", "ramp"],
                   default="shared_prefix",
                   help="ramp: doc_chat's conversations at the rates of --phases, with the "
                        "engines autoscaling within --scale")
    s.add_argument("--engine-model", help="engine_model.json fitted by `rayattn bench` "
                                          "(replaces the coefficient flags)")
    s.add_argument("--concurrency", type=int, default=None,
                   help="closed loop: conversations at a time (default: open loop at --rate)")
    s.add_argument("--think-s", type=float, default=None,
                   help="pause between a conversation's answer and its next turn (closed "
                        "loop: uniform 0..think_s, default 0; open loop: think_s + Exp(1), "
                        "default 5)")
    s.add_argument("--document-tokens", type=int, default=2048,
                   help="doc_chat: each conversation's own document")
    s.add_argument("--policies", default=",".join(POLICIES))
    s.add_argument("--routers", default="1", help="ingress replicas, e.g. 1,4")
    s.add_argument("--index", default="events,predicted",
                   help="router index modes to compare: events, predicted")
    s.add_argument("--groups", type=int, default=512)
    s.add_argument("--turns", type=int, default=4)
    s.add_argument("--system-tokens", type=int, default=1024)
    s.add_argument("--question-tokens", type=int, default=128)
    s.add_argument("--output-tokens", type=int, default=128)
    s.add_argument("--rate", type=float, default=200.0, help="arrivals per second")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--capacity-blocks", type=int, default=8192)
    for name, (default, text) in _ENGINE_FLAGS.items():
        s.add_argument("--" + name.replace("_", "-"), type=type(default), default=default,
                       help=text)
    s.add_argument("--scale", help="MIN,MAX: the engines autoscale from --replicas within "
                                   "these bounds on Serve's loop with rayattn's policy")
    s.add_argument("--phases", default="120:50,240:200,180:50",
                   help="ramp: seconds:requests-per-second of each phase")
    s.add_argument("--ttft-target-s", type=float, default=1.0,
                   help="--scale: the engines' TTFT p90 target")
    s.add_argument("--kv-target", type=float, default=None,
                   help="--scale: a KV usage target beside it")
    s.add_argument("--ongoing-target", type=float, default=None,
                   help="--scale: Serve's target_ongoing_requests per engine beside them "
                        "(default: none)")
    s.add_argument("--start-s", type=float, default=60.0,
                   help="--scale: from Serve's decision to the engine's first request")
    s.add_argument("--upscale-delay-s", type=float, default=1.0)
    s.add_argument("--downscale-delay-s", type=float, default=30.0)
    s.add_argument("--metrics-interval-s", type=float, default=1.0,
                   help="--scale: how often the engines report (and Serve decides)")
    s.add_argument("--look-back-s", type=float, default=3.0,
                   help="--scale: Serve's look-back over the engines' reports")
    s.add_argument("--warm", default="on,off",
                   help="--scale: router.warm_engines on, off, or both (compared)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", default="bench/results/sim")
    s.set_defaults(fn=cmd_simulate)
