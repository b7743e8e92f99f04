"""The router's own work per chat request, in this process, without Serve or engines: JSON
parse, vLLM's request validation, vLLM's rendering (chat template + tokenizing, on
`serve.router_render_threads` threads) and block hashing, as the router runs them. Users'
chats (`doc_chat` shapes): each conversation's first turn once, then its second turn; at
concurrency 1 (one request at a time) and at concurrency N (all second turns at once).

    .venv/bin/python bench/render_cost.py [--config deployments/local.yaml] [--model DIR]
        [--doc-words 650] [--concurrency 1,64] [--threads 1,8] [--out FILE]

Prints p50 / p99 / max per stage (ms) for each threads × concurrency: `first` rows render
turns nobody has seen (all tokenized), `later` rows the second turns, which the incremental
tokenizer mostly reuses from the first turn's head."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from rayattn import compat  # noqa: E402
from rayattn.bench.stats import percentile  # noqa: E402
from rayattn.bench.workloads import doc_chat  # noqa: E402
from rayattn.config.loader import app_args, load_serve_config, parse_args  # noqa: E402
from rayattn.config.plan import build_plan  # noqa: E402
from rayattn.routing.core import RoutingCore  # noqa: E402
from rayattn.server.rendering import PromptRenderer  # noqa: E402

STAGES = ("parse", "validate", "render", "hash", "total")


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


async def measure(cfg, kwargs: dict, threads: int, concurrency: int, doc_words: int,
                  user_words: int) -> list[dict]:
    cfg.serve.router_render_threads = threads
    renderer = await PromptRenderer.create(cfg, kwargs)
    core = RoutingCore(cfg.router.model_dump(), cfg.attention.block_size or 16,
                       hash_algo=cfg.engine.prefix_caching_hash_algo,
                       hash_seed=cfg.engine.hash_seed)
    rows = []
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

    await one(reqs[0][0], reqs[0][1], {k: [] for k in STAGES})  # warm (template compiled)
    for turn in (1, 2):
        stages: dict[str, list[float]] = {k: [] for k in STAGES}
        todo = [(s, r[turn - 1]) for s, *r in reqs[1:]]
        inc = renderer.incremental
        pieced_before = inc.pieced_tokens if inc else 0
        t = time.perf_counter()
        if concurrency == 1:
            lens = [await one(s, raw, stages) for s, raw in todo]
        else:
            lens = []
            for i in range(0, len(todo), concurrency):
                lens += await asyncio.gather(*(one(s, raw, stages)
                                               for s, raw in todo[i:i + concurrency]))
        wall = time.perf_counter() - t
        rows.append({"threads": threads, "concurrency": concurrency,
                     "turn": "first" if turn == 1 else "later",
                     "incremental": renderer.incremental is not None,
                     # Tokens tokenized in pieces on several cores in this phase
                     # (rayattn/server/parallel_tokenizing.py).
                     "pieced_tokens": (inc.pieced_tokens if inc else 0) - pieced_before,
                     "prompt_tokens": sum(lens) / len(lens), "requests": len(lens),
                     "wall_ms": wall * 1e3,
                     **{k: {"p50": percentile(sorted(v), 0.5), "p99": percentile(sorted(v), 0.99),
                            "max": max(v)} for k, v in stages.items()}})
    return rows


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(ROOT / "deployments/local.yaml"))
    ap.add_argument("--model", help="model directory (else the config's model)")
    ap.add_argument("--doc-words", type=int, default=650)
    ap.add_argument("--user-words", type=int, default=160)
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--threads", default="1,8")
    ap.add_argument("--out")
    a = ap.parse_args()
    args = app_args(load_serve_config(a.config)["applications"][0])
    if a.model:
        args["model"]["source"] = a.model
    cfg = parse_args(args)
    kwargs = dict(build_plan(cfg, prepare_model=True).engine_kwargs)
    kwargs["max_model_len"] = max(kwargs.get("max_model_len") or 0, 8192)  # the documents
    rows = []
    for threads in map(int, a.threads.split(",")):
        for conc in map(int, a.concurrency.split(",")):
            rows += await measure(cfg, kwargs, threads, conc, a.doc_words, a.user_words)
    print("| threads | concurrency | turn | tokens | pieced | parse | validate | "
          "render p50 / p99 | hash | total p50 / p99 / max ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['threads']} | {r['concurrency']} | {r['turn']} | {r['prompt_tokens']:.0f} | "
              f"{r['pieced_tokens']} | "
              f"{r['parse']['p50']:.2f} | {r['validate']['p50']:.2f} | "
              f"{r['render']['p50']:.2f} / {r['render']['p99']:.2f} | {r['hash']['p50']:.2f} | "
              f"{r['total']['p50']:.2f} / {r['total']['p99']:.2f} / {r['total']['max']:.2f} |")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
