"""Where the serving time goes between the client and the engine, on the local deployment:

* router_s: the router's own hop (request in → engine call issued: parse, chat template,
  tokenize, hash, route), reported by the router per request;
* hop_s: client TTFT − engine TTFT, i.e. everything outside the engine on the way to the
  first token (HTTP proxy, router, Ray Serve handle calls and streaming, both directions).

    .venv/bin/python bench/router_hop.py [--target URL] [--tokens 2000]

at concurrency 1 and 64 with ~2k-token prompts (distinct, so every request prefills).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from rayattn.bench.cli import start_local  # noqa: E402
from rayattn.bench.driver import hop_summary, run_workload  # noqa: E402
from rayattn.bench.stats import percentile  # noqa: E402
from rayattn.bench.workloads import Conversation, Workload  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    return percentile(sorted(xs), p)


def workload(n: int, words: int, seed: int) -> Workload:
    import random

    rng = random.Random(seed)
    vocab = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()
    return Workload("hop", [Conversation(
        f"{i}-{seed} " + " ".join(rng.choice(vocab) for _ in range(words)), ["Summarise."],
        f"hop-{seed}-{i}", 4) for i in range(n)])


async def measure(url: str, concurrency: int, n: int, words: int, seed: int) -> dict:
    res, wall = await run_workload(url, "smollm2", workload(n, words, seed),
                                   concurrency=concurrency)
    ok = [r for r in res if r.status == 200 and r.engine_ttft_s is not None]
    router = [r.router_s * 1e3 for r in ok if r.router_s is not None]
    hop = [(r.ttft_s - r.engine_ttft_s) * 1e3 for r in ok]
    return {"concurrency": concurrency, "requests": len(ok),
            "prompt_tokens_mean": sum(r.prompt_tokens for r in ok) / max(len(ok), 1),
            "router_ms": {"p50": pct(router, 0.5), "p99": pct(router, 0.99),
                          "max": max(router, default=float("nan"))},
            "hop_ms": {"p50": pct(hop, 0.5), "p99": pct(hop, 0.99)},
            "legs": hop_summary(ok)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--words", type=int, default=1500, help="~1.8k prompt tokens")
    ap.add_argument("--out", default="bench/results/router_hop.json")
    a = ap.parse_args()
    url = a.target or start_local(a.port, str(ROOT / "deployments/local.yaml"))[0]
    rows = [asyncio.run(measure(url, 1, 24, a.words, 1)),
            asyncio.run(measure(url, 64, 64, a.words, 2))]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=2))
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
