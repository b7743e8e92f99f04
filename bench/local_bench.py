"""Benchmarks against deployments/local.yaml (2 CPU engines, SmolLM2), one Ray cluster:

1. serving: start-up time, then 32 concurrent chat requests -> TTFT p50/p90, output tok/s;
2. policies: every routing policy on the same engines (prefix caches reset between runs)
   on two workloads (shared-prefix groups, multi-turn chat): hit rate vs oracle, TTFT
   p50/p90, throughput, balance; JSON, CSV and PNG plots (same code as `rayattn bench`).

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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                  RAY_USAGE_STATS_ENABLED="0")

from rayattn.bench.cli import POLICIES, run_matrix, start_local  # noqa: E402
from rayattn.bench.report import write_run  # noqa: E402
from rayattn.bench.workloads import multi_turn, shared_prefix  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--skip-policies", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    url, startup = start_local(a.port, str(ROOT / "deployments/local.yaml"))
    print(f"startup: {startup:.1f}s", flush=True)
    s = asyncio.run(serving(url))
    s["startup_s"] = startup
    print("serving:", json.dumps(s), flush=True)
    (out / "serving.json").write_text(json.dumps(s, indent=2))
    if not a.skip_policies:
        from transformers import AutoTokenizer

        from rayattn.models.embedded import resolve_embedded

        tok = AutoTokenizer.from_pretrained(str(resolve_embedded("rayattn://smollm2-135m")))
        workloads = {"shared_prefix": shared_prefix(groups=6, prompts_per_group=8,
                                                    system_words=300, seed=11),
                     "multi_turn": multi_turn(conversations=12, turns=4, shared_systems=3,
                                              seed=12)}
        table: dict = {}
        raw: dict = {}

        def prepare(policy: str) -> bool | None:
            r = httpx.post(f"{url}/admin/reset", json={"policy": policy}, timeout=60)
            r.raise_for_status()
            cold: bool | None = r.json().get("cold")
            return cold

        run_matrix("rayattn", url, "smollm2", workloads, POLICIES, prepare, 8, 32, tok, 1,
                   None, table, raw)
        write_run(out, table, raw)
        print((out / "policies.md").read_text())


if __name__ == "__main__":
    main()
