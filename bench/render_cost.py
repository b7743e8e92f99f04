"""The router's own work per chat request, in this process, without Serve or engines: JSON
parse, vLLM's request validation, vLLM's rendering (chat template + tokenizing, on
`serve.router_render_threads` threads) and block hashing, as the router runs them. Users'
chats (`doc_chat` shapes): each conversation's first turn once, then its second turn; at
concurrency 1 (one request at a time) and at concurrency N (all second turns at once).

    .venv/bin/python bench/render_cost.py [--config deployments/local.yaml] [--model DIR]
        [--doc-words 650] [--concurrency 1,64] [--threads 1,8] [--processes 1,4] [--out FILE]

Prints p50 / p99 / max per stage (ms) for each threads × concurrency: `first` rows render
turns nobody has seen (all tokenized), `later` rows the second turns, which the incremental
tokenizer mostly reuses from the first turn's head. `--processes N`: N router processes (as
`serve.ingress_replicas` runs them), each batch of concurrent requests dealt among them
round robin and started together."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from rayattn import compat  # noqa: E402
from rayattn.bench.stats import percentile  # noqa: E402
from rayattn.bench.workloads import doc_chat  # noqa: E402
from rayattn.config.loader import app_args, load_serve_config, parse_args  # noqa: E402
from rayattn.config.plan import build_plan  # noqa: E402
from rayattn.config.schema import RayAttnConfig  # noqa: E402
from rayattn.routing.core import RoutingCore  # noqa: E402
from rayattn.server.prompts.rendering import PromptRenderer  # noqa: E402

STAGES = ("parse", "validate", "render", "hash", "total")
BARRIER_TIMEOUT_S = 300.0
"""How long a router process waits for the others at a batch's start (start-up included)."""


def bodies(n: int, doc_words: int, user_words: int, name: str) -> list[tuple[str, bytes, bytes]]:
    wl = doc_chat(conversations=n, turns=2, doc_words=doc_words, user_words=user_words,
                  max_tokens=64, seed=5)
    out = []
    for c in wl.conversations:
        first = [{"role": "system", "content": c.system}, {"role": "user", "content": c.turns[0]}]
        later = first + [{"role": "assistant", "content": "noted " * 60},
                         {"role": "user", "content": c.turns[1]}]
        out.append((c.session, *(json.dumps({"model": name, "messages": m, "max_tokens": 64,
                                             "stream": True}).encode() for m in (first, later))))
    return out


def load(config: str, model: str | None) -> tuple[RayAttnConfig, dict]:
    args = app_args(load_serve_config(config)["applications"][0])
    if model:
        args["model"]["source"] = model
    cfg = parse_args(args)
    kwargs = dict(build_plan(cfg, prepare_model=True).engine_kwargs)
    kwargs["max_model_len"] = max(kwargs.get("max_model_len") or 0, 8192)  # the documents
    return cfg, kwargs


async def measure(cfg: RayAttnConfig, kwargs: dict, threads: int, concurrency: int,
                  doc_words: int, user_words: int, proc: int = 0, procs: int = 1,
                  barrier: Any = None) -> list[dict]:
    """One router process's phases (first turns, then later turns). With `procs` > 1 this
    is router `proc` of several: of each batch of `concurrency` requests it takes every
    procs-th one (round robin), and every batch starts when all routers reach `barrier`."""
    cfg.serve.router_render_threads = threads
    renderer = await PromptRenderer.create(cfg, kwargs)
    core = RoutingCore(cfg.router.routing_settings(), cfg.attention.block_size or 16,
                       hash_algo=cfg.engine.prefix_caching_hash_algo,
                       hash_seed=cfg.engine.hash_seed)
    phases: list[dict] = []
    reqs = bodies(max(concurrency, 24), doc_words, user_words, cfg.model.name)

    async def one(session: str, raw: bytes, stages: dict[str, list[float]]) -> int:
        t0 = time.perf_counter()
        data = json.loads(raw)
        t1 = time.perf_counter()
        body = compat.openai_model("chat").model_validate(data)
        t2 = time.perf_counter()
        out = await renderer.render("chat", body)
        t3 = time.perf_counter()
        core.request(out.token_ids, session, out.text)
        t4 = time.perf_counter()
        for k, a, b in zip(STAGES, (t0, t1, t2, t3, t0), (t1, t2, t3, t4, t4), strict=True):
            stages[k].append((b - a) * 1e3)
        return len(out.token_ids)

    def together() -> None:
        if barrier is not None:
            # Blocks this router's loop, which has nothing else to run.
            barrier.wait(timeout=BARRIER_TIMEOUT_S)

    await one(reqs[0][0], reqs[0][1], {k: [] for k in STAGES})  # warm (template compiled)
    for turn in (1, 2):
        stages: dict[str, list[float]] = {k: [] for k in STAGES}
        todo = [(s, r[turn - 1]) for s, *r in reqs[1:]]
        inc = renderer.incremental
        pieced_before = inc.pieced_tokens if inc else 0
        lens: list[int] = []
        together()  # the wall time starts when every router is ready
        t = time.perf_counter()
        for i in range(0, len(todo), concurrency):
            together()
            share = todo[i:i + concurrency][proc::procs]
            lens += await asyncio.gather(*(one(s, raw, stages) for s, raw in share))
        phases.append({"turn": "first" if turn == 1 else "later",
                       "incremental": inc is not None,
                       # Tokens tokenized in pieces on several cores in this phase
                       # (rayattn/server/parallel_tokenizing.py).
                       "pieced_tokens": (inc.pieced_tokens if inc else 0) - pieced_before,
                       "lens": lens, "wall_ms": (time.perf_counter() - t) * 1e3,
                       "stages": stages})
    return phases


def _router(proc: int, procs: int, barrier: Any, out: Any, a: argparse.Namespace,
            threads: int, concurrency: int) -> None:
    """One router process of a `--processes` measurement. A failure breaks the barrier
    (the others stop waiting) and is reported as None."""
    try:
        cfg, kwargs = load(a.config, a.model)
        out.put((proc, asyncio.run(measure(cfg, kwargs, threads, concurrency, a.doc_words,
                                           a.user_words, proc, procs, barrier))))
    except BaseException:
        barrier.abort()
        out.put((proc, None))
        raise


def measure_processes(a: argparse.Namespace, procs: int, threads: int,
                      concurrency: int) -> list[dict]:
    """`procs` router processes (serve.ingress_replicas), each with its own renderer, the
    requests of every batch dealt round robin; their phases merged."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_router, args=(k, procs, barrier, out, a, threads,
                                                 concurrency)) for k in range(procs)]
    for w in workers:
        w.start()
    results = sorted(out.get(timeout=BARRIER_TIMEOUT_S * 4) for _ in workers)
    for w in workers:
        w.join()
    if any(phases is None for _, phases in results):
        raise RuntimeError("a router process failed (its traceback is above)")
    merged = []
    for i, proc0 in enumerate(results[0][1]):
        ph = [r[1][i] for r in results]
        merged.append({**proc0, "lens": [n for p in ph for n in p["lens"]],
                       "pieced_tokens": sum(p["pieced_tokens"] for p in ph),
                       "wall_ms": max(p["wall_ms"] for p in ph),
                       "stages": {k: [x for p in ph for x in p["stages"][k]] for k in STAGES}})
    return merged


def row(phase: dict, procs: int, threads: int, concurrency: int) -> dict:
    lens = phase["lens"]
    return {"processes": procs, "threads": threads, "concurrency": concurrency,
            "turn": phase["turn"], "incremental": phase["incremental"],
            "pieced_tokens": phase["pieced_tokens"],
            "prompt_tokens": sum(lens) / len(lens), "requests": len(lens),
            "wall_ms": phase["wall_ms"],
            **{k: {"p50": percentile(sorted(v), 0.5), "p99": percentile(sorted(v), 0.99),
                   "max": max(v)} for k, v in phase["stages"].items()}}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(ROOT / "deployments/local.yaml"))
    ap.add_argument("--model", help="model directory (else the config's model)")
    ap.add_argument("--doc-words", type=int, default=650)
    ap.add_argument("--user-words", type=int, default=160)
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--threads", default="1,8")
    ap.add_argument("--processes", default="1",
                    help="router processes (serve.ingress_replicas) sharing each batch; "
                         "above 1 only for concurrency above 1")
    ap.add_argument("--out")
    a = ap.parse_args()
    loaded: tuple[RayAttnConfig, dict] | None = None  # for the in-process measurements
    rows = []
    for procs in map(int, a.processes.split(",")):
        for threads in map(int, a.threads.split(",")):
            for conc in map(int, a.concurrency.split(",")):
                if procs == 1:
                    loaded = loaded or load(a.config, a.model)
                    cfg, kwargs = loaded
                    phases = await measure(cfg, kwargs, threads, conc, a.doc_words,
                                           a.user_words)
                elif conc > 1:
                    phases = await asyncio.to_thread(measure_processes, a, procs, threads, conc)
                else:
                    continue
                rows += [row(p, procs, threads, conc) for p in phases]
    print("| processes | threads | concurrency | turn | tokens | pieced | parse | validate | "
          "render p50 / p99 | hash | total p50 / p99 / max ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['processes']} | {r['threads']} | {r['concurrency']} | {r['turn']} | "
              f"{r['prompt_tokens']:.0f} | {r['pieced_tokens']} | "
              f"{r['parse']['p50']:.2f} | {r['validate']['p50']:.2f} | "
              f"{r['render']['p50']:.2f} / {r['render']['p99']:.2f} | {r['hash']['p50']:.2f} | "
              f"{r['total']['p50']:.2f} / {r['total']['p99']:.2f} / {r['total']['max']:.2f} |")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
