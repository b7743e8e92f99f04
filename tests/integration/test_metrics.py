"""Per-path metrics through Ray's metrics endpoint into a real Prometheus server; every
dashboard and alert expression parses and returns data."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import time

import httpx
import pytest
import yaml

from rayattn.bench.driver import run_workload
from rayattn.bench.workloads import shared_prefix
from rayattn.metrics.dashboard import all_queries
from tests.conftest import ROOT

pytestmark = pytest.mark.integration
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


def query(prom: str, expr: str) -> list[dict]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert r["status"] == "success", (expr, r)
    return r["data"]["result"]


def by_path(prom: str, metric: str) -> dict[str, float]:
    return {s["metric"]["path"]: float(s["value"][1])
            for s in query(prom, f"sum by (path) ({metric})")}


def settled(prom: str, metrics: list[str], quiet_s: float = 3.0, timeout_s: float = 60) -> None:
    """Wait until `metrics` stop changing: earlier tests' requests reach Prometheus up to a
    report interval plus a scrape interval after they end, and must not count here."""
    def read() -> list[dict[str, float]]:
        return [by_path(prom, m) for m in metrics]

    deadline = time.time() + timeout_s
    # Prometheus starts with the first test that needs it: nothing is known before its
    # first scrape of Ray's endpoint.
    while not any(r["value"][1] == "1" for r in query(prom, 'up{job="ray"}')):
        if time.time() > deadline:
            pytest.fail("Prometheus never scraped Ray's metrics endpoint")
        time.sleep(0.5)
    last, since = read(), time.time()
    while time.time() < deadline:
        time.sleep(0.5)
        now = read()
        if now != last:
            last, since = now, time.time()
        elif time.time() - since >= quiet_s:
            return
    pytest.fail(f"{metrics} still changing after {timeout_s} s: {last}")


def test_per_path_metrics_in_prometheus(server, prometheus, reset):
    reset("affinity")
    settled(prometheus, ["ray_rayattn_ttft_seconds_count", "ray_rayattn_prefill_seconds_count"])
    before_sum = by_path(prometheus, "ray_rayattn_prefill_seconds_sum")
    before_cnt = by_path(prometheus, "ray_rayattn_ttft_seconds_count")
    before_pcnt = by_path(prometheus, "ray_rayattn_prefill_seconds_count")
    # Shared-prefix phase: 3 long system prompts (cold = prefill), then 5 more questions
    # each (cache hits = extend), run serially so TTFTs are not queueing artefacts.
    wl = shared_prefix(groups=3, prompts_per_group=6, system_words=700, question_words=10,
                       max_tokens=8, seed=7)
    res, _ = asyncio.run(run_workload(server, "smollm2", wl, concurrency=1))
    assert all(r.status == 200 for r in res)
    n = len(res)

    deadline = time.time() + 60
    while time.time() < deadline:
        cnt = by_path(prometheus, "ray_rayattn_ttft_seconds_count")
        pcnt = by_path(prometheus, "ray_rayattn_prefill_seconds_count")
        done = sum(cnt.values()) - sum(before_cnt.values())
        if done >= n and sum(pcnt.values()) - sum(before_pcnt.values()) >= n:
            break
        time.sleep(1)
    assert done >= n, (cnt, before_cnt)
    # This phase's requests only (the means below are over them).
    assert sum(pcnt.values()) - sum(before_pcnt.values()) == n, (pcnt, before_pcnt)

    tokens = {s["metric"]["path"]: float(s["value"][1]) for s in query(
        prometheus, "sum by (path) (ray_rayattn_tokens_total)")}
    assert tokens.get("prefill", 0) > 0 and tokens.get("extend", 0) > 0
    assert tokens.get("decode", 0) > 0

    # The engine's own time from scheduling to first token: the work each path does.
    # (Client-side TTFT adds the hops and any queue, which on 2 shared cores can be as
    # large as a 900-token prefill and hide the difference.)
    s = by_path(prometheus, "ray_rayattn_prefill_seconds_sum")
    mean = {p: (s[p] - before_sum.get(p, 0)) / (pcnt[p] - before_pcnt.get(p, 0))
            for p in ("prefill", "extend")}
    print(f"\nmean engine prefill time over the shared-prefix phase: {mean}")
    assert mean["extend"] < mean["prefill"]

    # Steps split by batch part, engine layout, router decisions, vLLM's own metrics.
    assert query(prometheus, 'ray_rayattn_step_tokens_total{part="context"}')
    assert query(prometheus, 'ray_rayattn_engine_info{backend="CPU_ATTN"}')
    assert query(prometheus, 'ray_rayattn_router_decisions_total{reason="affinity_hit"}')
    assert query(prometheus, '{__name__=~"ray_vllm.*prompt_tokens.*"}')


@pytest.mark.after_disruptive  # retries and failures exist only once replicas were killed
def test_every_dashboard_and_alert_expression_parses_and_returns_data(server, prometheus,
                                                                     reset):
    rules = ROOT / "dashboards" / "rayattn-alerts.yaml"
    out = subprocess.run([PROMTOOL, "check", "rules", str(rules)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    # The router's regret counters move only when it sends a conversation away from its
    # history: round_robin does, on the second turn of a conversation.
    reset("round_robin")
    history = [{"role": "user", "content": "remember the harbor " * 40}]
    for turn in range(2):
        r = httpx.post(f"{server}/v1/chat/completions", timeout=60,
                       headers={"x-session-id": "metrics-moves"},
                       json={"model": "smollm2", "max_tokens": 4, "messages": history})
        assert r.status_code == 200, r.text
        if turn:
            assert r.json()["rayattn"]["moved_from"] is not None
            assert r.json()["rayattn"]["regret_tokens"] > 0
        history += [{"role": "assistant", "content": r.json()["choices"][0]["message"]
                     ["content"]}, {"role": "user", "content": "and then?"}]
    reset("affinity")
    # a little traffic so rates over the last minute are defined
    for _ in range(3):
        httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
            "model": "smollm2", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello there"}]})
    # `or vector(0)` keeps panels drawn before a counter first moves; strip it here so a
    # misnamed metric cannot pass as an all-zero series.
    exprs = [re.sub(r"\s*or\s+vector\(\s*0\s*\)", "", e).replace("$model", ".*")
             .replace("$replica", ".*") for e in all_queries(host_tier=False, fleet_change=False)]
    assert not any("vector(" in e for e in exprs), exprs
    # Engine replicas the disruptive tests replaced register their metrics with Ray's
    # agent anew: on a loaded 2-core machine their first export took over a minute once,
    # and over 150 s on a slower one of the same kind (an Intel Xeon without AMX).
    deadline = time.time() + 300
    while True:
        empty = [e for e in exprs if not query(prometheus, e)]
        if not empty or time.time() > deadline:
            break
        httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
            "model": "smollm2", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello again"}]})
        time.sleep(2)
    assert not empty, empty


def test_generated_dashboard_files_are_current():
    import json

    from rayattn.metrics.dashboard import alert_rules, dashboard

    d = ROOT / "dashboards"
    assert json.loads((d / "rayattn-dashboard.json").read_text()) == dashboard()
    assert yaml.safe_load((d / "rayattn-alerts.yaml").read_text()) == alert_rules()
