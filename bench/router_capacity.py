"""The router tier's capacity: requests per second at a given router overhead, against a
fleet of simulated engines (engine.simulated) that answer within milliseconds (a simulated
step is 5 ms, `--step-ms`), so what is measured is the router (HAProxy, the router
replicas, their hop to the engines), not an engine.

    .venv/bin/python bench/router_capacity.py [--engines 64] [--routers 1,2,4,8,16]
        [--tokens 2000,8000,32000] [--turns new,continuing]
        [--rates 100,200,400,800,1600,3200]
        [--duration-s 15] [--clients 4] [--model DIR] [--out FILE]

Starts Ray and Serve here with deployments/local.yaml's app, its engines simulated, and for
each router count × turn kind × prompt size, offers Poisson arrivals at each rate (open
loop, streamed chat requests of 2 output tokens) for `--duration-s`. A request's router
overhead is the client's time to first token less the engine's own (the `engine_ttft_s` the
router's account carries): HAProxy, the router's parse, render, tokenize, hash and choice,
both hops, the first chunk's relay. `new` turns are documents nobody sent before;
`continuing` turns extend conversations of that size by a question (each conversation's
first turn, and a new conversation once its history passes 1.25× the size, are not
counted in the overhead). Per point: offered and answered requests/s, overhead p50/p99
(ms) and hit rate (cached / prompt tokens) of the measured turns, balance (busiest
engine's requests / the mean). Stops a sweep at
the first rate whose p99 passes `--stop-ms` or that achieves < 90 % of its offer."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import sys
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "smollm2"
WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river mountain "
         "valley forest ocean desert city harbor bridge tower garden market engine kernel "
         "cache block token router replica prefix decode extend prefill latency budget").split()
TOKENS_PER_WORD = 1.3
"""SmolLM2's tokenizer on WORDS; main() measures the model's own."""


def words(rng: random.Random, tokens: int, per_word: float = TOKENS_PER_WORD) -> str:
    return " ".join(rng.choices(WORDS, k=max(1, int(tokens / per_word))))


def tokens_per_word(model_dir: str) -> float:
    from transformers import AutoTokenizer

    sample = words(random.Random(0), 2000)
    tok = AutoTokenizer.from_pretrained(model_dir)
    return len(tok.encode(sample, add_special_tokens=False)) / len(sample.split())


def serve_config(engines: int, sim: dict[str, Any], max_model_len: int,
                 model: str | None) -> dict[str, Any]:
    import yaml

    cfg = yaml.safe_load((ROOT / "deployments" / "local.yaml").read_text())
    cfg["http_options"]["port"] = int(os.environ.get("CAPACITY_PORT", "8000"))
    app = cfg["applications"][0]
    args = app["args"]
    if model is not None:  # another model's tokenizer and chat template, same served name
        args["model"]["source"] = model
    args["model"]["max_model_len"] = max_model_len
    # Each simulated engine is one small process: many fit a host's cores.
    args["platform"]["cpus_per_engine"] = 0.01
    args["engine"].update(simulated=sim, max_num_seqs=256, max_num_batched_tokens=65536)
    args["serve"]["max_ongoing_requests"] = 256
    for d in app["deployments"]:
        if d["name"] == "engine":
            d["autoscaling_config"].update(min_replicas=engines, max_replicas=engines)
        if d["name"] == "router":
            d["user_config"].update(max_inflight=100_000, request_timeout_s=60)
    return cfg


class Conversations:
    """One client process's conversations of about `tokens` tokens, each with at most one
    turn in flight."""

    def __init__(self, rng: random.Random, tokens: int, name: str, per_word: float) -> None:
        self.rng, self.tokens, self.name, self.n = rng, tokens, name, 0
        self.per_word = per_word
        self.ready: list[dict[str, Any]] = []

    def new(self) -> dict[str, Any]:
        self.n += 1
        return {"session": f"{self.name}-{self.n}", "first": True, "tokens": self.tokens,
                "messages": [{"role": "user",
                              "content": words(self.rng, self.tokens, self.per_word)}]}

    def take(self) -> dict[str, Any]:
        return self.ready.pop() if self.ready else self.new()

    def answered(self, conv: dict[str, Any], answer: str) -> None:
        conv["first"] = False
        conv["tokens"] += 60
        if conv["tokens"] > 1.25 * self.tokens:
            return  # retired: a new conversation takes its place
        conv["messages"] += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": words(self.rng, 50, self.per_word)}]
        self.ready.append(conv)


async def one(client: Any, url: str, messages: list[dict[str, Any]],
              session: str) -> dict[str, Any]:
    from rayattn.bench.driver import chat_turn
    from rayattn.bench.workloads import Conversation

    r = await chat_turn(client, url, MODEL, messages, Conversation("", [], session, 2), 0, 0.0)
    ok = r.status == 200 and r.engine_ttft_s is not None
    return {"status": r.status, "overhead": r.ttft_s - r.engine_ttft_s if ok else None,
            "prompt": r.prompt_tokens, "cached": r.cached_tokens, "replica": r.replica,
            "answer": r.output_text}


async def offer(url: str, rate: float, duration_s: float, kind: str, tokens: int, seed: int,
                warm_s: float, per_word: float) -> list[dict[str, Any]]:
    """Poisson arrivals at `rate` for `warm_s` (not counted) then `duration_s`."""
    import aiohttp

    rng = random.Random(seed)
    convs = Conversations(rng, tokens, f"c{seed}", per_word)
    out: list[dict[str, Any]] = []
    tasks: set[asyncio.Task] = set()
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=120)) as client:
        async def go(conv: dict[str, Any], counted: bool) -> None:
            try:
                res = await one(client, url, conv["messages"], conv["session"])
            except Exception as e:  # counted as failed, the load goes on
                res = {"status": -1, "error": repr(e)[:200], "overhead": None}
            if counted:
                # Every answer counts toward the rate; only continuing turns (or new ones,
                # when those are measured) toward the overhead and the hit rate.
                res["measured"] = kind == "new" or not conv["first"]
                out.append(res)
            if kind == "continuing" and res.get("status") == 200:
                convs.answered(conv, res["answer"])

        loop = asyncio.get_running_loop()
        start = loop.time()
        t = start
        while t < start + warm_s + duration_s:
            t += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, t - loop.time()))
            conv = convs.new() if kind == "new" else convs.take()
            task = asyncio.create_task(go(conv, t >= start + warm_s))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    return out


def _client(args: tuple) -> list[dict[str, Any]]:
    return asyncio.run(offer(*args))


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def point(url: str, rate: float, a: argparse.Namespace, kind: str, tokens: int,
          pool: Any) -> dict[str, Any]:
    per = rate / a.clients
    # Documents nobody sent before: a seed per point and client (the engines keep their
    # caches from one point to the next).
    point_seed = zlib.crc32(f"{a.routers_now} {kind} {tokens} {rate}".encode()) % 1_000_000
    jobs = [(url, per, a.duration_s, kind, tokens, point_seed * 100 + i, a.warm_s,
             a.per_word) for i in range(a.clients)]
    res = [r for part in pool.map(_client, jobs) for r in part]
    answered = sum(1 for r in res if r["status"] == 200)
    res = [r for r in res if r["measured"]]
    ok = [r for r in res if r["status"] == 200 and r["overhead"] is not None]
    over = [r["overhead"] * 1e3 for r in ok]
    per_replica = Counter(r["replica"] for r in ok)
    prompt = sum(r["prompt"] for r in ok)
    return {"offered_rps": rate, "achieved_rps": round(answered / a.duration_s, 1),
            "requests": len(res), "failed": len(res) - len(ok),
            "overhead_p50_ms": round(percentile(over, 0.5) or 0, 2),
            "overhead_p99_ms": round(percentile(over, 0.99) or 0, 2),
            "prompt_tokens_mean": round(prompt / len(ok)) if ok else None,
            "hit_rate": round(sum(r["cached"] for r in ok) / prompt, 4) if prompt else None,
            "balance": round(max(per_replica.values()) / (len(ok) / a.engines), 2)
            if ok else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", type=int, default=64)
    ap.add_argument("--routers", default="1,2,4,8,16")
    ap.add_argument("--tokens", default="2000,8000,32000")
    ap.add_argument("--turns", default="new,continuing")
    ap.add_argument("--rates", default="100,200,400,800,1600,3200")
    ap.add_argument("--duration-s", type=float, default=15)
    ap.add_argument("--warm-s", type=float, default=5)
    ap.add_argument("--clients", type=int, default=4, help="client processes")
    ap.add_argument("--stop-ms", type=float, default=10)
    ap.add_argument("--step-ms", type=float, default=5.0, help="simulated engine step")
    ap.add_argument("--model", help="model directory (default: the embedded SmolLM2)")
    ap.add_argument("--out", default="bench/results/router_capacity.json")
    a = ap.parse_args()
    tokens = [int(x) for x in a.tokens.split(",")]
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # 32k on a 8k-context model
    from rayattn.bench.cli import deploy_router, start_local_config

    sim = {"step_ms": a.step_ms, "prefill_us_per_token": 0.0, "decode_us_per_seq": 0.0,
           "num_blocks": 1_000_000, "max_tokens": 2}
    cfg = serve_config(a.engines, sim, max(tokens) * 2 + 1024, a.model)
    from rayattn.config.architecture import local_model_dir

    model_dir = a.model or str(local_model_dir(cfg["applications"][0]["args"]["model"]["source"],
                                               prepare=True))
    a.per_word = tokens_per_word(model_dir)
    url, startup = start_local_config(cfg)
    print(f"{a.engines} simulated engines serving in {startup:.0f}s", flush=True)
    rows = []
    pool = mp.get_context("spawn").Pool(a.clients)
    try:
        for routers in [int(x) for x in a.routers.split(",")]:
            deploy_router(cfg, routers, {})
            a.routers_now = routers
            for kind in a.turns.split(","):
                for n in tokens:
                    for rate in [float(x) for x in a.rates.split(",")]:
                        row = {"routers": routers, "turn": kind, "tokens": n,
                               **point(url, rate, a, kind, n, pool)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                        Path(a.out).write_text(json.dumps(rows, indent=1))
                        if row["overhead_p99_ms"] > a.stop_ms or \
                                row["achieved_rps"] < 0.9 * rate:
                            break
    finally:
        pool.terminate()
        from rayattn.bench.cli import stop_local

        stop_local()


if __name__ == "__main__":
    main()
