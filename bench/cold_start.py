"""Cold start, side by side: `rayattn serve <config>` (what `make serve` and users run) against
one `vllm serve` per engine with the same engine flags and environment (what rayattn's plan
gives its own engines), started in turn, alternating which goes first.

    .venv/bin/python bench/cold_start.py [--config deployments/local.yaml] [--model DIR]
        [--runs 3] [--first-run 0] [--gpus 0] [--timeout-s 400] [--out FILE]
        [--set KEY=VALUE ...] [--variant KEY=VALUE ...]

Per start: seconds to the first answer (a 1-token chat completion through the stack's front
door), to every engine answering, and when each phase first shows in the stack's log, for the
slowest engine (the stack serves fully once its last engine does): Ray up, Serve up, app
deployed and the engine replica's own start (rayattn only), vLLM's config resolved in the
engine's process, its engine core process, weights loaded, torch.compile done, engine
initialized, engine serving. Each stack is stopped as a user stops it (SIGTERM to its process
group) before the next starts, and the next waits for the GPUs to be free. vLLM's compile
cache is shared: the very first start fills it. A `--variant` is one more rayattn stack with
one setting changed (`engine.prestart_core=false`: the engine core spawned after the
replica's own vLLM import, as before the prestart).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
# After what PYTHONPATH names: bench/gpu/run.sh serves a snapshot of rayattn from there.
sys.path.append(str(ROOT))

from bench.gpu.common import set_setting  # noqa: E402
from bench.peers.vllm_router import end_group, serve_command  # noqa: E402
from rayattn.config.plan import Plan  # noqa: E402

CLUSTER_PHASES = {"ray_up": r"Started a local Ray instance",
                  "serve_up": r"Started Serve in namespace",
                  "app_deploying": r"Deploying new app"}
ENGINE_PHASES = {"replica_init": r"rayattn\.engine: engine \S+ starting",
                 "vllm_config": r"Resolved architecture",
                 "engine_core": r"Initializing a V1 LLM engine",
                 "weights_loaded": r"Loading weights took",
                 "compiled": r"torch\.compile (took|takes)",
                 "engine_init_done": r"init engine \(profile",
                 "engine_serving":
                     r"Application startup complete|rayattn\.engine: engine \S+ ready"}
"""Each phase's first log line. In rayattn's log, engine phases count only on the engine
replicas' lines (`(ServeReplica:<app>:engine pid=N)`: the router builds a vLLM config too),
cluster phases only on the others."""
RUN_MARK = "RAYATTN_COLD_START_RUN"
"""In the environment of everything a run starts: what marks its processes as its own."""
ENGINE_LINE = re.compile(r"\(ServeReplica:[^:]+:engine[^ ]* pid=(\d+)\)")


class LogWatch(threading.Thread):
    """Seconds from `t0` at which each phase's first line appeared in `path`, per source: the
    engine replica's pid in rayattn's log, the whole file in a `vllm serve` log."""

    def __init__(self, path: Path, t0: float, split_engines: bool) -> None:
        super().__init__(daemon=True)
        self.path, self.t0, self.split = path, t0, split_engines
        self.seen: dict[str, dict[str, float]] = defaultdict(dict)
        self.done = threading.Event()

    def _line(self, line: str, now: float) -> None:
        m = ENGINE_LINE.search(line) if self.split else None
        source = m.group(1) if m else ("cluster" if self.split else "engine")
        phases = CLUSTER_PHASES if source == "cluster" else ENGINE_PHASES
        for name, pat in phases.items():
            if name not in self.seen[source] and re.search(pat, line):
                self.seen[source][name] = now

    def run(self) -> None:
        with self.path.open(errors="replace") as f:
            tail = ""
            while True:
                last = self.done.is_set()
                chunk = f.read()
                now = round(time.time() - self.t0, 1)
                *lines, tail = (tail + chunk).split("\n")
                for line in lines:
                    self._line(line, now)
                if last:
                    return
                time.sleep(0.2)

    def finish(self) -> dict[str, dict[str, float]]:
        self.done.set()
        self.join(10)
        return dict(self.seen)


def slowest(engines: list[dict[str, float]], expected: int) -> dict[str, float]:
    """Per engine phase, the latest of the engines' (once all `expected` reached it)."""
    return {name: max(e[name] for e in engines) for name in ENGINE_PHASES
            if len(engines) == expected and all(name in e for e in engines)}


def answered(url: str, model: str) -> bool:
    import httpx

    try:
        return httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "model": model, "max_tokens": 1,
            "messages": [{"role": "user", "content": "hello"}]}).status_code == 200
    except httpx.HTTPError:
        return False


def wait_answers(urls: list[str], model: str, procs: list[subprocess.Popen],
                 deadline: float) -> list[float | None]:
    """When each URL first answered (None: not by the deadline, or its process exited)."""
    when: list[float | None] = [None] * len(urls)
    while time.time() < deadline and None in when:
        if any(p.poll() is not None for p in procs):
            break
        for i, url in enumerate(urls):
            if when[i] is None and answered(url, model):
                when[i] = time.time()
        time.sleep(0.25)
    return when


def end_strays(run: str, grace: float = 15) -> list[str]:
    """HAProxy processes of this run (they inherit RUN_MARK from `serve run`) that outlived
    its stop: ended by pid (the stop they missed is what `rayattn-haproxy` does where rayattn
    is installed; a snapshot on PYTHONPATH has no such wrapper)."""
    import psutil

    def ours(p: psutil.Process) -> bool:
        try:
            return p.info["name"] == "haproxy" and p.environ().get(RUN_MARK) == run
        except psutil.Error:
            return False

    deadline = time.time() + grace
    while True:
        strays = [p for p in psutil.process_iter(["name", "cmdline"]) if ours(p)]
        if not strays or time.time() > deadline:
            break
        time.sleep(0.5)
    for p in strays:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    return [" ".join(p.info["cmdline"] or [])[:120] for p in strays]


def gpus_free(gpus: int, timeout: float = 120) -> None:
    """Until no process holds GPU memory (a stopped stack's engines take seconds to go)."""
    if not gpus:
        return
    deadline = time.time() + timeout
    while time.time() < deadline:
        held = subprocess.run(["nvidia-smi", "--query-compute-apps=pid",
                               "--format=csv,noheader"], capture_output=True, text=True)
        if not held.stdout.strip():
            return
        time.sleep(1)
    raise TimeoutError(f"GPU memory still held {timeout} s after the stop: {held.stdout}")


class Starts:
    """One start of either stack at a time; `running` is what a stop must end."""

    def __init__(self, config: Path, plan: Plan, model: str, port: int, engines: int,
                 gpus: int, logdir: Path, timeout: float) -> None:
        from rayattn.ports import pick_port

        self.config, self.plan, self.model, self.port = config, plan, model, port
        self.engines, self.gpus, self.logdir, self.timeout = engines, gpus, logdir, timeout
        self.vllm_ports = [pick_port() for _ in range(engines)]
        self.running: list[subprocess.Popen] = []
        self.run = uuid.uuid4().hex

    def _spawn(self, cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
        with log.open("w") as out:
            p = subprocess.Popen(cmd, env={**env, "PYTHONUNBUFFERED": "1", RUN_MARK: self.run},
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.running.append(p)
        return p

    def stop(self) -> list[str]:
        """As a user stops a server: SIGTERM to its process group; then this run's strays."""
        while self.running:
            end_group(self.running[-1], grace=60)  # popped once ended (a SIGTERM may land)
            self.running.pop()
        return end_strays(self.run)

    def rayattn(self, config: Path | None = None, stack: str = "rayattn") -> dict[str, Any]:
        t0 = time.time()
        log = self.logdir / f"rayattn-{t0:.0f}.log"
        # Every engine's lines (Ray folds lines repeated across processes into one).
        proc = self._spawn([sys.executable, "-m", "rayattn.cli", "serve",
                            str(config or self.config)],
                           log, {**os.environ, "RAY_DEDUP_LOGS": "0"})
        watch = LogWatch(log, t0, split_engines=True)
        watch.start()
        url = f"http://127.0.0.1:{self.port}"
        (first,) = wait_answers([url], self.model, [proc], t0 + self.timeout)
        every = None
        while first is not None and every is None and time.time() < t0 + self.timeout:
            every = time.time() if self._engines_up(url) else None
            time.sleep(0.25)
        strays = self.stop()  # lines already written keep the time they were first read
        seen = watch.finish()
        engines = [v for k, v in seen.items() if k != "cluster"]
        return {"stack": stack, "first_answer_s": first and round(first - t0, 1),
                "all_engines_s": every and round(every - t0, 1),
                "phases": {**seen.get("cluster", {}), **slowest(engines, self.engines)},
                # More than the engines: a replica restarted (its phases are then left out).
                "engine_processes_seen": len(engines),
                "exit": proc.returncode, "strays_ended": strays, "log": str(log)}

    def _engines_up(self, url: str) -> bool:
        import httpx

        try:
            return len(httpx.get(f"{url}/health", timeout=10).json().get("replicas_up", [])) \
                >= self.engines
        except (httpx.HTTPError, ValueError):
            return False

    def vllm(self) -> dict[str, Any]:
        t0 = time.time()
        devices = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        procs, watches = [], []
        for k, port in enumerate(self.vllm_ports):
            # The engine processes' environment rayattn gives its own (plan.env).
            env = {**os.environ, **self.plan.env}
            if self.gpus:
                env["CUDA_VISIBLE_DEVICES"] = devices[k % len(devices)] if devices[0] \
                    else str(k % self.gpus)
            log = self.logdir / f"vllm{k}-{t0:.0f}.log"
            procs.append(self._spawn(serve_command(self.plan, port), log, env))
            watches.append(LogWatch(log, t0, split_engines=False))
            watches[-1].start()
        urls = [f"http://127.0.0.1:{p}" for p in self.vllm_ports]
        when = wait_answers(urls, self.model, procs, t0 + self.timeout)
        self.stop()
        seen = [w.finish().get("engine", {}) for w in watches]
        ok = [w for w in when if w is not None]
        return {"stack": "vllm serve", "first_answer_s": round(min(ok) - t0, 1) if ok else None,
                "all_engines_s": round(max(ok) - t0, 1) if len(ok) == len(when) else None,
                "phases": slowest(seen, self.engines), "exit": [p.returncode for p in procs]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="deployments/local.yaml")
    ap.add_argument("--model", help="the model's directory in place of the config's source")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--first-run", type=int, default=0,
                    help="the first run's number (it picks which stack goes first, so runs "
                         "split over several calls keep rotating)")
    ap.add_argument("--gpus", type=int, default=0, help="one vllm serve per GPU, in turn")
    ap.add_argument("--timeout-s", type=float, default=400)
    ap.add_argument("--out", default="/tmp/cold_start.json")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a dotted setting of the app's args for every stack "
                         "(parallelism.data_parallel_size=1)")
    ap.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE",
                    help="one more rayattn stack, with this setting changed "
                         "(engine.prestart_core=false)")
    a = ap.parse_args()

    from rayattn.config.loader import app_args, parse_args
    from rayattn.config.plan import build_plan

    cfg = yaml.safe_load((ROOT / a.config).read_text())
    app = cfg["applications"][0]
    if a.model:
        app["args"]["model"]["source"] = a.model
    for setting in a.set:
        set_setting(app["args"], setting)
    parsed = parse_args(app_args(app))
    plan = build_plan(parsed, prepare_model=True)
    logdir = Path(tempfile.mkdtemp(prefix="cold-start-"))
    config = logdir / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    variants: dict[str, Path] = {}
    for k, setting in enumerate(a.variant):
        changed = copy.deepcopy(cfg)
        set_setting(changed["applications"][0]["args"], setting)
        parse_args(app_args(changed["applications"][0]))  # refused before anything starts
        variants[f"rayattn@{setting}"] = logdir / f"variant{k}.yaml"
        variants[f"rayattn@{setting}"].write_text(yaml.safe_dump(changed))
    starts = Starts(config, plan, parsed.model.name, cfg.get("http_options", {}).get("port", 8000),
                    plan.replicas, a.gpus, logdir, a.timeout_s)
    out = Path(a.out)
    report: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"runs": []}
    report.update(config=a.config, model=a.model, engines=plan.replicas,
                  vllm_command=" ".join(serve_command(plan, starts.vllm_ports[0])))
    print(f"{plan.replicas} engines; logs in {logdir}", flush=True)
    # `timeout` sends SIGTERM: stop what runs, keep what was measured.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        stacks = ["rayattn", *variants, "vllm"]
        for run in range(a.first_run, a.first_run + a.runs):
            # Each run starts the stacks in a rotated order: none is always first.
            k = run % len(stacks)
            for stack in stacks[k:] + stacks[:k]:
                gpus_free(a.gpus)
                r = {"run": run, **(starts.vllm() if stack == "vllm" else
                                    starts.rayattn(variants.get(stack), stack))}
                report["runs"].append(r)
                print(json.dumps(r), flush=True)
                out.write_text(json.dumps(report, indent=1))
    finally:
        starts.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
