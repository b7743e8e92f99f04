"""Shared fixtures: ONE Ray cluster and ONE local deployment (2 real vLLM CPU engines) per
test session; every integration test talks to it over HTTP."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import hypothesis  # noqa: F401  (why: below)
import pytest
import yaml

from rayattn import cluster_env
from rayattn.bench.cli import wait_healthy
from rayattn.ports import pick_port
from rayattn.server import front_door
from tests import areas, beside
from tests.own_apps import Collector, own_apps_config

# hypothesis is imported here, at a shallow stack, because otherwise a run of tests that do
# not use it imports it from its pytest plugin's terminal summary, deep in pytest's hooks,
# where CPython 3.11.7's parser raises "AST constructor recursion depth mismatch" while
# pytest rewrites its asserts (fixed in 3.11.8): the run passes and exits 1.
ROOT = Path(__file__).resolve().parents[1]
for k, v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
             "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(k, v)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(beside.OPTION, action="store_true",
                     help="run the unit tests in a process of their own beside the "
                          "integration tests (tests/beside.py; make test does)")


_UNIT_BESIDE = pytest.StashKey[beside.Splitter]()


def pytest_configure(config: pytest.Config) -> None:
    areas.configure(config)
    splitter = beside.configure(config)
    if splitter is not None:
        config.stash[_UNIT_BESIDE] = splitter


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    splitter = session.config.stash.get(_UNIT_BESIDE, None)
    if splitter is None or splitter.child is None:
        return
    out = splitter.child.finish(interrupted=exitstatus == pytest.ExitCode.INTERRUPTED)
    areas.add("unit", out.counts, out.seconds, out.output_end)
    if out.exit_code != pytest.ExitCode.OK and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def local_config() -> dict:
    return yaml.safe_load((ROOT / "deployments" / "local.yaml").read_text())


def local_args() -> dict:
    """The local app's settings, router included (for routers the tests start themselves)."""
    from rayattn.config.loader import app_args

    return app_args(local_config()["applications"][0])


def session_header() -> str:
    """The conversation header of the local deployment's router."""
    from rayattn.config.loader import rayattn_apps

    return rayattn_apps(local_config())[0][1].router.session_header


# Before Ray starts: the session's cluster takes requests through Serve's HAProxy ingress and
# runs its workers at normal CPU priority, as `make serve` and the KubeRay pods do.
cluster_env.apply(session_header())
# A router replica that stops stays reachable this long for HAProxy to drop it (Serve's
# default is 30 s per stopped replica: minutes over the tests that replace apps). Not less:
# an HAProxy process replaced by a reload still forwards the requests of the client
# connections it holds to the routers it knew, and at 2 s a router updated under load was
# gone before them (a 500 and two cut connections in 591 requests).
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "10")
# The ports of this session's Serve, chosen once where no other process can take them
# (rayattn/ports.py): the lifecycle tests start and stop `rayattn serve` on them before the
# session's cluster starts on them again. HAProxy's stats and metrics and Serve's fallback
# proxy have fixed ports by default: free ones let the suite run beside a `make serve`.
PORTS = {"http": pick_port(), "metrics": pick_port()}
for _var in front_door.HAPROXY_PORTS:
    if _var not in os.environ:
        os.environ[_var] = str(pick_port())


def still_running(pids: list[int], until: float) -> list[int]:
    """Which of `pids` still run (zombies count as gone) once `until` passes, or earlier
    when all are gone."""
    import psutil

    def running(p: int) -> bool:
        try:
            return psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False
    while True:
        left = [p for p in pids if running(p)]
        if not left or time.time() >= until:
            return left
        time.sleep(0.5)


def vllm_processes() -> list[int]:
    """vLLM engine processes (VLLM::EngineCore, VLLM::Worker) on this machine."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd and cmd[0].startswith("VLLM::"):
            out.append(p.info["pid"])
    return out


@pytest.fixture(scope="session")
def ray_cluster():
    import ray
    from ray import serve

    metrics_port, http_port = PORTS["metrics"], PORTS["http"]
    areas.progress("starting Ray and Serve (the CPUs Ray finds here, as `make serve` does)")
    # Metrics pushed every second so tests need not wait 10 s.
    ray.init(include_dashboard=False, _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 1000})
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    before = set(vllm_processes())  # someone else's, if any: not ours to judge
    yield {"metrics_port": metrics_port, "http_port": http_port}
    ours = [p for p in vllm_processes() if p not in before]
    # Ray's stop, as `ray stop` does, without serve.shutdown(): that would hold every router
    # reachable for RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S (set at the top of this
    # file), for clients that no longer exist.
    ray.shutdown()
    # Stopping Ray must not leave engine processes behind.
    left = still_running(ours, until=time.time() + 30)
    assert not left, f"vLLM engine processes outlived ray.shutdown: {left}"


@pytest.fixture(scope="module")
def prometheus(ray_cluster, tmp_path_factory):
    """A real Prometheus scraping Ray's metrics endpoint, started afresh for each stretch of
    the metrics module's tests (the suite's order splits them): every scrape makes Ray's
    metrics agent render all of the cluster's series, a tenth of a core at one a second,
    which the rest of the suite's engines would otherwise share with it."""
    PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
    assert PROMETHEUS and PROMTOOL, \
        "prometheus/promtool not on PATH: run ./scripts/install-prometheus.sh (make test does)"
    d = tmp_path_factory.mktemp("prom")
    port = pick_port()
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
           "scrape_configs": [{"job_name": "ray", "static_configs": [
               {"targets": [f"127.0.0.1:{ray_cluster['metrics_port']}"]}]}]}
    (d / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={d / 'prometheus.yml'}",
                             f"--storage.tsdb.path={d / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(60):
        try:
            if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session")
def otlp():
    """A local OTLP/HTTP traces receiver for the multi-model app's traces."""
    c = Collector()
    yield c
    c.server.shutdown()


@pytest.fixture(scope="session")
def own_apps(ray_cluster, otlp) -> dict[str, str]:
    """The applications of their own (tests/own_apps.py), deployed side by side in place of
    the shared one once every engine of both serves; their URLs by application name."""
    from rayattn.app import deploy_config, wait_running

    t0 = time.time()
    cfg = own_apps_config(
        (ROOT / "deployments" / "local-multi.yaml").read_text(), local_config(), otlp.url)
    names = [a["name"] for a in cfg["applications"]]
    areas.progress(f"deploying {' and '.join(names)} side by side")
    deploy_config(cfg)
    base = f"http://127.0.0.1:{ray_cluster['http_port']}"
    urls = {a["name"]: base + a["route_prefix"].rstrip("/") for a in cfg["applications"]}
    for name, url in urls.items():
        wait_running(name)
        wait_healthy(url)
    areas.progress(f"{' and '.join(names)} ready in {time.time() - t0:.1f}s")
    return urls


@pytest.fixture(scope="session")
def server(ray_cluster):
    from rayattn.app import deploy_config, wait_running

    t0 = time.time()
    areas.progress("deploying deployments/local.yaml (2 vLLM CPU engines)")
    # Declaratively, as `serve run deployments/local.yaml` (make serve) does.
    deploy_config(local_config())
    wait_running("rayattn")
    url = f"http://127.0.0.1:{ray_cluster['http_port']}"
    wait_healthy(url)
    areas.progress(f"local deployment ready in {time.time() - t0:.1f}s")
    return url


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def reset(server):
    """Cold caches and a chosen policy for one test; back to affinity afterwards."""
    import httpx

    def _reset(policy: str = "affinity") -> None:
        r = httpx.post(f"{server}/admin/reset", json={"policy": policy}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["policy"] == policy

    yield _reset
    _reset("affinity")


def pytest_collection_modifyitems(config, items):
    # Disruptive tests kill replicas of the shared deployment: run them last, then the few
    # that need what they leave behind (retry/failure counters).
    # Tests on an application of their own replace the shared one: after everything else.
    # The lifecycle tests start and stop whole clusters (`ray stop --force` ends every Ray
    # of the machine): before the session's own cluster starts.
    def order(it) -> int:
        if it.get_closest_marker("lifecycle"):
            return -1
        if it.get_closest_marker("own_app"):
            return 3
        if it.get_closest_marker("after_disruptive"):
            return 2
        return 1 if it.get_closest_marker("disruptive") else 0
    items.sort(key=order)
