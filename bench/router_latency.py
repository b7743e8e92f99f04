"""Micro-benchmark: affinity routing decision latency at 64 replicas and 1M indexed blocks.

    .venv/bin/python bench/router_latency.py [--replicas 64] [--blocks 1000000]

Times Affinity.choose() (index lookup + cost + guard + tie-break) — the work on the router's
per-request path besides hashing, which is measured separately per prompt length.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from rayattn.config.schema import RouterConfig
from rayattn.routing import policies
from rayattn.routing.hashing import BlockHasher
from rayattn.routing.load import LoadTracker
from rayattn.routing.policies import PolicyContext, RouteRequest
from rayattn.routing.prefix_index import PrefixIndex


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--prompt-blocks", type=int, default=64, help="blocks per prompt")
    ap.add_argument("--out", default="bench/results/router_latency.json")
    a = ap.parse_args()
    rng = random.Random(0)
    names = [f"engine-{i}" for i in range(a.replicas)]
    idx, load = PrefixIndex(), LoadTracker()
    for n in names:
        idx.add_replica(n, 2 * a.blocks // a.replicas + 1)  # room for ≥ a.blocks in all
    # --blocks distinct blocks as chains of shared prefixes: blocks / 500 "documents" of 500
    # blocks (2,000 for 1M), each held by 1–3 replicas.
    t0 = time.perf_counter()
    chains: list[list[int]] = []
    for _ in range(a.blocks // 500):
        chain = [rng.getrandbits(63) for _ in range(500)]
        chains.append(chain)
        for r in rng.sample(names, rng.randint(1, 3)):
            idx.insert(r, chain)
    build_s = time.perf_counter() - t0
    total = sum(idx.size(n) for n in names)
    pol = policies.build("affinity", PolicyContext(idx, load, 32),
                         RouterConfig().routing_settings().affinity)
    for n in names:
        for _ in range(rng.randint(0, 8)):
            load.acquire(n, rng.randint(0, 4000))
    lat = []
    for _ in range(a.requests):
        base = rng.choice(chains)
        cut = rng.randint(0, a.prompt_blocks)
        keys = base[:cut] + [rng.getrandbits(63) for _ in range(a.prompt_blocks - cut)]
        req = RouteRequest(keys, a.prompt_blocks * 32, keys[0])
        t = time.perf_counter_ns()
        pol.choose(req, names)
        lat.append(time.perf_counter_ns() - t)
    lat.sort()

    def pct(p: float) -> float:
        return lat[int(p * (len(lat) - 1))] / 1e6

    hasher = BlockHasher(32)
    toks = [rng.randrange(50_000) for _ in range(a.prompt_blocks * 32)]
    t = time.perf_counter()
    for _ in range(200):
        hasher.keys(toks)
    hash_ms = (time.perf_counter() - t) / 200 * 1e3
    res = {"replicas": a.replicas, "documents": len(chains),
           "distinct_blocks": sum(map(len, chains)), "index_entries": total,
           "index_build_s": round(build_s, 2),
           "decision_ms": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99),
                           "max": lat[-1] / 1e6},
           "hash_ms_per_prompt": {"tokens": len(toks), "ms": round(hash_ms, 3)}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
