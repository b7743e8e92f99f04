"""Operations without downtime: router settings change live under a steady client load,
and no engine restarts (same PIDs, caches kept)."""

from __future__ import annotations

import copy
import threading
import time

import httpx
import pytest

from tests.conftest import local_config, still_running

pytestmark = pytest.mark.integration
MODEL = "smollm2"


class Load:
    """`streams` closed-loop clients, each streaming chat completions until stopped."""

    def __init__(self, url: str, streams: int = 8) -> None:
        self.url, self.codes, self._stop = url, [], threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(streams)]

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=120) as c:
            n = 0
            while not self._stop.is_set():
                n += 1
                try:
                    with c.stream("POST", f"{self.url}/v1/chat/completions", json={
                            "model": MODEL, "max_tokens": 8, "stream": True,
                            "messages": [{"role": "user", "content": f"stream {i} req {n}"}]},
                            headers={"x-session-id": f"s{i}"}) as r:
                        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
                    ok = r.status_code == 200 and lines[-1:] == ["data: [DONE]"] and \
                        not any('"error"' in ln for ln in lines)
                    self.codes.append(200 if ok else (r.status_code if r.status_code != 200
                                                      else 599))
                except httpx.HTTPError:
                    self.codes.append(-1)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()


def _router_settings(cfg: dict) -> dict:
    return next(d for d in cfg["applications"][0]["deployments"]
                if d["name"] == "router")["user_config"]


def test_router_reconfigure_live_under_load_keeps_engines(ray_cluster, server):
    """A changed router user_config in the Serve config (what `serve deploy` sends) reaches
    the running routers: no engine restarts, no request fails."""
    from rayattn.app import deploy_config

    before = _health(server)
    pids = {n: e["pid"] for n, e in before["engines"].items()}
    router_pid = before["router_pid"]
    cfg = local_config()
    changed = copy.deepcopy(cfg)
    _router_settings(changed).update(policy="round_robin", max_inflight=100)
    try:
        with Load(server) as load:
            time.sleep(3)
            t0 = time.time()
            deploy_config(changed)
            while _health(server)["policy"] != "round_robin":
                assert time.time() - t0 < 60, "new router settings never applied"
                time.sleep(0.5)
            applied = time.time() - t0
            time.sleep(3)
        during = _health(server)
    finally:
        deploy_config(cfg)
    print(f"\nreconfigure: {len(load.codes)} requests, {load.codes.count(200)} ok, "
          f"applied after {applied:.1f}s")
    assert load.codes and load.codes.count(200) == len(load.codes), load.codes
    assert during["limits"]["max_inflight"] == 100
    # Same engine and router processes, engine caches kept.
    assert {n: e["pid"] for n, e in during["engines"].items()} == pids
    assert during["router_pid"] == router_pid
    assert all(e["cache_view"]["blocks"] > 0 for e in during["engines"].values())
    deadline = time.time() + 60
    while _health(server)["policy"] != "affinity":
        assert time.time() < deadline
        time.sleep(0.5)
    after = _health(server)
    assert after["limits"]["max_inflight"] == 128
    assert {n: e["pid"] for n, e in after["engines"].items()} == pids


@pytest.mark.disruptive
def test_engine_setting_change_replaces_engines_and_leaves_no_process(ray_cluster, server):
    """An engine setting is part of the app's code version: Serve replaces the engine
    replicas. The old replicas' vLLM processes must be gone within 30 s of the new ones
    serving (a leftover engine would hold its GPU)."""
    from rayattn.app import deploy_config

    before = _health(server)["engines"]
    old_engine_pids = [p for e in before.values() for p in e["engine_pids"]]
    assert old_engine_pids
    cfg = local_config()
    changed = copy.deepcopy(cfg)
    changed["applications"][0]["args"]["engine"]["max_num_seqs"] = 24

    def replaced(old: dict) -> dict:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                h = _health(server)
                engines = h["engines"]
                if (len(h["replicas_up"]) == len(old) and
                        all(engines[n]["pid"] != old[n]["pid"] for n in old)):
                    return engines
            except (httpx.HTTPError, ValueError, KeyError):
                pass  # the router itself is being replaced too
            time.sleep(1)
        raise AssertionError("engine replicas were not replaced")

    try:
        deploy_config(changed)
        new = replaced(before)
        done = time.time()
        left = still_running(old_engine_pids, until=done + 30)
        assert not left, f"old engine processes still running 30 s later: {left}"
        assert all(e["engine_pids"] for e in new.values())
    finally:
        deploy_config(cfg)
        replaced(new if "new" in locals() else before)
