"""Helpers shared by the GPU scripts of bench/gpu: HTTP waits, nvidia-smi, starting
rayattn in-process (ray.init + serve.run(build_app(args))), Ray's Prometheus scrape."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]


def log(*a: Any) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def wait_http(url: str, timeout: float, ok=lambda r: r.status_code == 200) -> float:
    """Poll `url` until `ok(response)`; returns the seconds waited."""
    import httpx

    t0 = time.time()
    last: Any = None
    while time.time() - t0 < timeout:
        try:
            r = httpx.get(url, timeout=10)
            if ok(r):
                return time.time() - t0
            last = f"{r.status_code} {r.text[:200]}"
        except Exception as e:  # not up yet
            last = repr(e)
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout} s: {last}")


def gpus() -> list[dict[str, str]]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,name,memory.used,memory.total",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True)
    rows = [r.split(", ") for r in out.stdout.strip().splitlines()]
    return [dict(zip(["index", "uuid", "name", "mem_used_mib", "mem_total_mib"], r,
                     strict=False)) for r in rows]


def gpu_processes() -> list[dict[str, str]]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,gpu_uuid,"
                          "used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True)
    rows = [r.split(", ") for r in out.stdout.strip().splitlines() if r.strip()]
    return [dict(zip(["pid", "name", "gpu_uuid", "mem_mib"], r, strict=False)) for r in rows]


def rayattn_args(config: str, model: str | None = None, **over: Any) -> dict:
    """The `args:` of the first application of a Serve config, with dotted overrides
    (`parallelism.tensor_parallel_size=2`)."""
    from rayattn.config.loader import app_args

    args = copy.deepcopy(app_args(yaml.safe_load((ROOT / config).read_text())["applications"][0]))
    if model:
        args["model"]["source"] = model
    for key, value in over.items():
        set_dotted(args, key, value)
    return args


def parse_setting(setting: str) -> tuple[str, Any]:
    """A command line's `parallelism.data_parallel_size=1`: the dotted key, the value read as
    YAML."""
    key, eq, value = setting.partition("=")
    if not eq:
        raise SystemExit(f"--set: {setting!r} is not KEY=VALUE")
    return key, yaml.safe_load(value)


def set_setting(args: dict, setting: str) -> None:
    """A command line's `--set KEY=VALUE` into an app's args."""
    set_dotted(args, *parse_setting(setting))


def set_dotted(args: dict, key: str, value: Any) -> None:
    """`parallelism.tensor_parallel_size` = 2 into an app's args."""
    *parents, leaf = key.split(".")
    for p in parents:
        args = args.setdefault(p, {})
    args[leaf] = value


class RayattnApp:
    """ray.init + serve.run(build_app(args)) in this process; `url`, `metrics_port`."""

    def __init__(self, args: dict, num_gpus: int, port: int = 8000) -> None:
        from rayattn import cluster_env
        from rayattn.config.loader import parse_args
        from rayattn.ports import pick_port

        # Before Ray is imported: the cluster's HAProxy ingress, its workers' priority.
        cluster_env.apply(parse_args(args).router.session_header)
        import ray
        from ray import serve

        from rayattn.app import deploy_config
        from rayattn.config.loader import parse_args as parse
        from rayattn.config.router_tier import config_bounds

        self.metrics_port = pick_port()
        t0 = time.time()
        ray.init(num_gpus=num_gpus, include_dashboard=False,
                 _metrics_export_port=self.metrics_port,
                 _system_config={"metrics_report_interval_ms": 1000})
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        self.url = f"http://127.0.0.1:{port}"
        # Declaratively, as `serve run <file>` does: only that path lets a router setting
        # change reconfigure the running routers without restarting the engines.
        self.serve_config = {"applications": [{
            "name": "rayattn", "route_prefix": "/", "import_path": "rayattn.app:build_app",
            "args": args}]}
        deploy_config(self.serve_config)
        self.replicas = args.get("parallelism", {}).get("data_parallel_size", 1)
        cfg = parse(args)
        # A fixed router count, or None where the tier sizes itself; `many_routers`: whether
        # a setting must reach more than one router (then through user_config).
        self.routers, self._router = cfg.serve.ingress_replicas, cfg.router.model_dump(mode="json")
        self.many_routers = config_bounds(cfg).max > 1
        self.t0 = t0

    def wait(self, timeout: float) -> float:
        import httpx

        def ok(r: httpx.Response) -> bool:
            if r.status_code != 200:
                return False
            body = r.json()
            return len(body.get("replicas_up", [])) == self.replicas
        wait_http(f"{self.url}/health", timeout, ok)
        return time.time() - self.t0

    def set_router(self, settings: dict) -> None:
        """Router settings on every router replica (their Serve user_config: /admin/reset
        reaches one router of several, and refuses to change settings there)."""
        from rayattn.bench.cli import deploy_router

        # The whole user_config: Serve's replaces the one the app was built with.
        deploy_router(self.serve_config, self.routers, {**self._router, **settings})

    def running_routers(self) -> int:
        from rayattn.bench.cli import running_routers

        return running_routers()

    def engine_infos(self) -> list[dict]:
        """EngineReplica.info() of every replica up, each called through the engine
        deployment's handle pinned to it, in rank order."""
        import httpx
        from ray import serve

        from rayattn.config.loader import ENGINE_DEPLOYMENT

        h = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name="rayattn")
        names = httpx.get(f"{self.url}/health", timeout=30).json()["replicas_up"]
        from dataclasses import asdict

        # EngineInfo dataclasses, as the JSON-ready dicts the reports keep.
        infos = [asdict(h.info.remote(n).result(timeout_s=120)) for n in names]
        for info in infos:  # the direct endpoint's bearer token stays out of reports
            if info.get("direct"):
                info["direct"].pop("token", None)
        return sorted(infos, key=lambda i: i["rank"])

    def scrape(self) -> str:
        import httpx

        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30).text

    def shutdown(self) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def series(text: str, prefix: str) -> dict[str, float]:
    """Prometheus text lines starting with `prefix` as {line-without-value: value}."""
    out = {}
    for ln in text.splitlines():
        if ln.startswith(prefix):
            key, _, val = ln.rpartition(" ")
            try:
                out[key] = float(val)
            except ValueError:
                continue
    return out


def total(values: dict[str, float], *must: str) -> float:
    return sum(v for k, v in values.items() if all(m in k for m in must))


def dump(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str))
    log(f"wrote {path}")


def fail(msg: str) -> None:
    log("FAILED:", msg)
    sys.stdout.flush()
