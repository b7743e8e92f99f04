"""The rival on the same engines: `vllm serve` engines with the deployment's exact engine
settings, vllm-router (PyPI `vllm-router`) in front, driven by the same workloads.

Everything started here runs in its own process group and is ended by PID when the run is
over; nothing else is touched.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from rayattn.config.plan import Plan

PEER_POLICIES = ["cache_aware", "sticky_least_loaded"]


def serve_flags(engine_kwargs: dict[str, Any]) -> list[str]:
    """AsyncEngineArgs keyword arguments → `vllm serve` flags (the same settings)."""
    flags: list[str] = []
    for k, v in engine_kwargs.items():
        if v is None or k in ("model",):
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            flags.append(flag if v else "--no-" + k.replace("_", "-"))
        elif isinstance(v, (list, tuple)):
            flags += [flag, *map(str, v)]
        else:
            flags += [flag, str(v)]
    return flags


def serve_command(plan: Plan, port: int) -> list[str]:
    """`vllm serve` on 127.0.0.1:`port` with the engine arguments rayattn's plan gives its own
    engines."""
    kw = {k: v for k, v in plan.engine_kwargs.items() if k != "disable_log_stats"}
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", kw["model"],
            "--host", "127.0.0.1", "--port", str(port), *serve_flags(kw)]


class PeerStack:
    """N `vllm serve` engines + one vllm-router at a time."""

    def __init__(self, plan: Plan, base_port: int, log_dir: Path) -> None:
        self.plan, self.base_port, self.log_dir = plan, base_port, log_dir
        self.engines: list[subprocess.Popen] = []
        self.router: subprocess.Popen | None = None
        self.urls = [f"http://127.0.0.1:{base_port + 1 + i}" for i in range(plan.replicas)]
        self.url = f"http://127.0.0.1:{base_port}"

    def _spawn(self, cmd: list[str], name: str, env: dict[str, str]) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - lives with the process
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)

    def start_engines(self, timeout: float = 600) -> float:
        env = {**os.environ, **self.plan.env, "VLLM_SERVER_DEV_MODE": "1"}
        t0 = time.time()
        for i, url in enumerate(self.urls):
            cmd = [*serve_command(self.plan, int(url.rsplit(":", 1)[1])),
                   "--enable-prompt-tokens-details"]
            self.engines.append(self._spawn(cmd, f"vllm-serve-{i}", env))
        for url in self.urls:
            _wait(f"{url}/health", timeout, self.engines)
        return time.time() - t0

    def start_router(self, policy: str, timeout: float = 120) -> None:
        self.stop_router()
        exe = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
        cmd = [exe, "--host", "127.0.0.1", "--port", str(self.base_port), "--policy", policy,
               "--worker-urls", *self.urls, "--log-level", "warning"]
        self.router = self._spawn(cmd, f"vllm-router-{policy}", dict(os.environ))
        _wait(f"{self.url}/v1/models", timeout, [self.router])

    def reset_caches(self) -> bool:
        """Empty every engine's prefix cache and host tier; whether all of them did (vLLM
        refuses while blocks are in use: each is asked a few times, as rayattn's reset
        does)."""
        return all([reset_engine(url)[1] for url in self.urls])

    def stop_router(self) -> None:
        if self.router is not None:
            end_group(self.router)
            self.router = None

    def stop(self) -> None:
        self.stop_router()
        for p in self.engines:
            end_group(p)
        self.engines = []


def _wait(url: str, timeout: float, procs: list[subprocess.Popen]) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{dead[0].args[:3]} exited with {dead[0].returncode} "
                               "(see its log)")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not up in {timeout}s")


def end_group(p: subprocess.Popen, grace: float = 20) -> None:
    """SIGTERM the process group we started, SIGKILL what is left of it after `grace`
    seconds (its leader may be gone while the rest of the group is not)."""
    deadline = time.time() + grace
    try:
        os.killpg(p.pid, signal.SIGTERM)
        while time.time() < deadline:
            os.killpg(p.pid, 0)  # ProcessLookupError once nothing of the group is left
            time.sleep(0.2)
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        pass


def reset_engine(url: str) -> tuple[int, bool]:
    """Empty one `vllm serve`'s prefix cache and host KV tier (reset_external: vllm serve
    --kv-offloading-size), asked again while it refuses, as rayattn's /admin/reset does:
    (HTTP status, whether it emptied). vLLM 0.32 answers {"success": bool} (False while
    blocks are in use), older versions an empty 200."""
    for attempt in range(4):
        if attempt:
            time.sleep(0.5)
        r = httpx.post(f"{url}/reset_prefix_cache", params={"reset_external": "true"},
                       timeout=60)
        r.raise_for_status()
        try:
            body = r.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or body.get("success", True):
            return r.status_code, True
    return r.status_code, False
