"""Throughput with vs without rayattn's per-path metrics, in one run.

Two engine replicas of deployments/local.yaml are built in this process (same code as the
Serve replica, `EngineReplica(..., metrics_enabled=...)`), then the same batch runs on each in
alternation (A B A B …) so machine noise hits both alike.

    .venv/bin/python bench/metrics_overhead.py [--rounds 4] [--requests 48] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                  RAY_USAGE_STATS_ENABLED="0")


async def batch(engine, n: int, tokens: int) -> float:
    from rayattn.engine.protocol import OpenAIRequest

    async def one(i: int) -> int:
        rid = uuid.uuid4().hex
        req = OpenAIRequest("completion", {"model": "smollm2", "prompt": [1, 2, 3, 100 + i] * 8,
                                           "max_tokens": tokens, "ignore_eos": True,
                                           "temperature": 0, "request_id": rid}, rid)
        got = 0
        async for item in engine.serve(None, req):
            got += item.completion_tokens if item.final else 0
        return got

    t0 = time.monotonic()
    total = sum(await asyncio.gather(*(one(i) for i in range(n))))
    return total / (time.monotonic() - t0)


async def main_async(a: argparse.Namespace) -> dict:
    import ray

    from rayattn.engine.replica import EngineReplica

    ray.init(num_cpus=2, include_dashboard=False)
    args = yaml.safe_load((ROOT / "deployments/local.yaml").read_text())["applications"][0]
    engines = {"with_metrics": EngineReplica(args["args"], metrics_enabled=True),
               "without_metrics": EngineReplica(args["args"], metrics_enabled=False)}
    for e in engines.values():  # warm-up
        await batch(e, 4, 8)
    runs: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(a.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for k in order:
            runs[k].append(await batch(engines[k], a.requests, a.tokens))
            print(f"round {r} {k}: {runs[k][-1]:.1f} tok/s", flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"runs_tok_per_s": runs, "median_tok_per_s": med,
            "overhead_pct": 100 * (1 - med["with_metrics"] / med["without_metrics"]),
            "requests": a.requests, "tokens": a.tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default="bench/results/metrics_overhead.json")
    a = ap.parse_args()
    res = asyncio.run(main_async(a))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    os._exit(0)  # engine core processes are daemons; skip slow interpreter teardown


if __name__ == "__main__":
    main()
