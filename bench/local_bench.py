"""Benchmarks against deployments/local.yaml (2 CPU engines, SmolLM2), one Ray cluster:

1. serving: start-up time, then 32 concurrent chat requests -> TTFT p50/p90, output tok/s;
2. policies: every routing policy on the same engines (prefix caches reset between runs)
   on two workloads (shared-prefix groups, multi-turn chat): hit rate vs oracle, TTFT
   p50/p90, throughput, balance.

    .venv/bin/python bench/local_bench.py [--skip-policies] [--out bench/results]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                  RAY_USAGE_STATS_ENABLED="0")

from rayattn.bench.driver import oracle, results_json, run_workload, summarize  # noqa: E402
from rayattn.bench.workloads import multi_turn, shared_prefix  # noqa: E402

POLICIES = ["affinity", "round_robin", "power_of_two", "ray_prefix"]


def start(port: int) -> tuple[str, float]:
    import ray
    from ray import serve

    from rayattn.app import build_app
    from tests.conftest import wait_healthy

    args = yaml.safe_load((ROOT / "deployments/local.yaml").read_text())["applications"][0]
    ray.init(num_cpus=4, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    t0 = time.time()
    serve.run(build_app(args["args"]), name="rayattn", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    return url, time.time() - t0


async def serving(url: str, n: int = 32) -> dict:
    async def one(i: int, c: httpx.AsyncClient) -> tuple[float, int, float]:
        t0 = time.monotonic()
        ttft, toks = None, 0
        async with c.stream("POST", f"{url}/v1/chat/completions", json={
                "model": "smollm2", "max_tokens": 64, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"Request {i}: describe a city."}]}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ev = json.loads(line[6:])
                    if ev.get("choices") and ev["choices"][0]["delta"].get("content"):
                        ttft = ttft or time.monotonic() - t0
                    if ev.get("usage"):
                        toks = ev["usage"]["completion_tokens"]
        return ttft or 0.0, toks, time.monotonic() - t0

    async with httpx.AsyncClient(timeout=600) as c:
        t0 = time.monotonic()
        res = await asyncio.gather(*(one(i, c) for i in range(n)))
        wall = time.monotonic() - t0
    ttfts = sorted(r[0] for r in res)
    return {"concurrency": n, "ttft_p50_s": ttfts[n // 2], "ttft_p90_s": ttfts[int(0.9 * n)],
            "output_tok_per_s": sum(r[1] for r in res) / wall, "wall_s": wall}


def policies(url: str) -> dict:
    from transformers import AutoTokenizer

    from rayattn.models.embedded import resolve_embedded

    tok = AutoTokenizer.from_pretrained(str(resolve_embedded("rayattn://smollm2-135m")))
    workloads = {"shared_prefix": shared_prefix(groups=6, prompts_per_group=8,
                                                system_words=300, seed=11),
                 "multi_turn": multi_turn(conversations=12, turns=4, shared_systems=3, seed=12)}
    table: dict = {}
    raw: dict = {}
    for wname, wl in workloads.items():
        for pol in POLICIES:
            r = httpx.post(f"{url}/admin/reset", json={"policy": pol}, timeout=60)
            r.raise_for_status()
            res, wall = asyncio.run(run_workload(url, "smollm2", wl, concurrency=8))
            s = summarize(res, wall)
            s.update(oracle(res, wl, tok, 32))
            s["hit_vs_block_oracle"] = s["hit_rate"] / s["oracle_block_hit_rate"]
            s["hit_vs_token_oracle"] = s["hit_rate"] / s["oracle_token_hit_rate"]
            table.setdefault(wname, {})[pol] = s
            raw[f"{wname}/{pol}"] = results_json(res)
            print(f"{wname:14s} {pol:13s} hit={s['hit_rate']:.3f} "
                  f"(oracle blk {s['oracle_block_hit_rate']:.3f}) "
                  f"ttft p50={s['ttft_p50_s']:.3f} p90={s['ttft_p90_s']:.3f} "
                  f"tok/s={s['output_tok_per_s']:.1f} max_share={s['max_replica_share']:.2f}",
                  flush=True)
    httpx.post(f"{url}/admin/reset", json={"policy": "affinity"}, timeout=60)
    return {"table": table, "raw": raw}


def markdown(table: dict) -> str:
    lines = ["| workload | policy | hit rate | block oracle | hit/oracle | TTFT p50 s | "
             "TTFT p90 s | out tok/s | max replica share |", "|" + "---|" * 9]
    for w, rows in table.items():
        for p, s in rows.items():
            lines.append(f"| {w} | {p} | {s['hit_rate']:.3f} | {s['oracle_block_hit_rate']:.3f}"
                         f" | {s['hit_vs_block_oracle']:.2f} | {s['ttft_p50_s']:.3f} | "
                         f"{s['ttft_p90_s']:.3f} | {s['output_tok_per_s']:.1f} | "
                         f"{s['max_replica_share']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--skip-policies", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    url, startup = start(a.port)
    print(f"startup: {startup:.1f}s", flush=True)
    s = asyncio.run(serving(url))
    s["startup_s"] = startup
    print("serving:", json.dumps(s), flush=True)
    (out / "serving.json").write_text(json.dumps(s, indent=2))
    if not a.skip_policies:
        p = policies(url)
        (out / "policies.json").write_text(json.dumps(p["table"], indent=2))
        (out / "policies_raw.json").write_text(json.dumps(p["raw"]))
        (out / "policies.md").write_text(markdown(p["table"]) + "\n")
        print(markdown(p["table"]))


if __name__ == "__main__":
    main()
