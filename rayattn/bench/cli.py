"""`rayattn bench` (real engines through the OpenAI API) and `rayattn simulate`."""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict
from pathlib import Path

POLICIES = ["affinity", "round_robin", "power_of_two", "ray_prefix"]


def start_local(port: int, config: str = "deployments/local.yaml") -> tuple[str, float]:
    """Start the local deployment once in this process (Ray + Serve); returns URL, start-up s."""
    import os
    import time

    import ray
    import yaml
    from ray import serve

    from rayattn.app import build_app

    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(k, "1")
    args = yaml.safe_load(Path(config).read_text())["applications"][0]["args"]
    ray.init(num_cpus=4, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    t0 = time.time()
    serve.run(build_app(args), name="rayattn", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    return url, time.time() - t0


def wait_healthy(url: str, timeout: float = 300) -> dict:
    """Poll /health until every engine replica is up."""
    import time

    import httpx

    deadline = time.time() + timeout
    last: object = None
    while time.time() < deadline:
        try:
            r = httpx.get(f"{url}/health", timeout=10)
            last = r.json()
            if r.status_code == 200 and len(last["replicas_up"]) == len(last["engines"]):
                return last
        except (httpx.HTTPError, ValueError) as e:  # proxy or route not up yet
            last = repr(e)
        time.sleep(1)
    raise TimeoutError(f"deployment not healthy: {last}")


def compare(url: str, model: str, workloads: dict, policies: list[str], concurrency: int,
            block_size: int, tokenizer, rate: float | None = None,
            progress: bool = False) -> tuple[dict, dict]:
    """Each policy on each workload, caches reset in between (needs router.admin_api)."""
    import httpx

    from rayattn.bench.driver import oracle, results_json, run_workload, summarize

    table: dict = {}
    raw: dict = {}
    for wname, wl in workloads.items():
        for pol in policies:
            r = httpx.post(f"{url}/admin/reset", json={"policy": pol}, timeout=60)
            r.raise_for_status()
            res, wall = asyncio.run(run_workload(url, model, wl, concurrency=concurrency,
                                                 rate=rate, progress=progress))
            s = summarize(res, wall)
            s.update(oracle(res, wl, tokenizer, block_size))
            s["hit_vs_block_oracle"] = s["hit_rate"] / max(s["oracle_block_hit_rate"], 1e-9)
            s["hit_vs_token_oracle"] = s["hit_rate"] / max(s["oracle_token_hit_rate"], 1e-9)
            table.setdefault(wname, {})[pol] = s
            raw[f"{wname}/{pol}"] = results_json(res)
            print(f"{wname:14s} {pol:13s} hit={s['hit_rate']:.3f} "
                  f"oracle={s['oracle_block_hit_rate']:.3f} ttft p50={s['ttft_p50_s']:.3f} "
                  f"p90={s['ttft_p90_s']:.3f} share={s['max_replica_share']:.2f}", flush=True)
    return table, raw


def cmd_bench(a: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from rayattn.bench.report import write_run
    from rayattn.bench.workloads import long_doc_qa, mix, multi_turn, shared_prefix
    from rayattn.models.embedded import resolve_embedded

    url = a.target
    if url is None:
        url, startup = start_local(a.port)
        print(f"local deployment up in {startup:.1f}s at {url}")
    wl_all = {"shared_prefix": shared_prefix(groups=a.groups, prompts_per_group=a.prompts,
                                             seed=a.seed),
              "multi_turn": multi_turn(conversations=a.conversations, turns=a.turns,
                                       seed=a.seed),
              "long_doc_qa": long_doc_qa(seed=a.seed), "mix": mix(seed=a.seed)}
    workloads = {k: v for k, v in wl_all.items() if k in a.workload.split(",")}
    tok = AutoTokenizer.from_pretrained(a.tokenizer or
                                        str(resolve_embedded("rayattn://smollm2-135m")))
    table, raw = compare(url, a.model, workloads, a.policies.split(","), a.concurrency,
                         a.block_size, tok, rate=a.rate, progress=True)
    write_run(Path(a.out), table, raw)
    print((Path(a.out) / "policies.md").read_text())
    return 0


def cmd_simulate(a: argparse.Namespace) -> int:
    from rayattn.bench.report import markdown, plot_sim
    from rayattn.bench.simulate import (
        EngineModel,
        multi_turn_trace,
        shared_prefix_trace,
        simulate,
    )

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.workload == "shared_prefix":
        per_group = max(1, a.requests // a.groups)
        trace = shared_prefix_trace(a.groups, per_group, a.system_tokens, a.question_tokens,
                                    a.output_tokens, a.rate, a.block_size, a.seed)
    else:
        trace = multi_turn_trace(a.requests // a.turns, a.turns, a.groups, a.system_tokens,
                                 a.question_tokens, a.output_tokens, a.rate,
                                 block_size=a.block_size, seed=a.seed)
    model = EngineModel(a.prefill_s_per_token, a.ctx_s_per_token, a.itl_base_s,
                        a.itl_per_seq_s, a.capacity_blocks, a.block_size)
    rows = []
    for pol in a.policies.split(","):
        for index in a.index.split(","):
            for routers in [int(x) for x in a.routers.split(",")]:
                r = simulate(trace, a.replicas, pol, model, routers=routers, seed=a.seed,
                             index=index)
                d = asdict(r)
                d.pop("per_replica")
                d["index"] = index
                rows.append(d)
                print(f"{pol:13s} index={index:9s} routers={routers} hit={r.hit_rate:.3f} oracle="
                  f"{r.oracle_hit_rate:.3f} ttft p50={r.ttft_p50_s:.3f} p90={r.ttft_p90_s:.3f} "
                      f"p99={r.ttft_p99_s:.3f} imbalance={r.load_imbalance:.2f} "
                      f"({r.wall_s:.1f}s)", flush=True)
    name = f"sim_{a.workload}_{a.replicas}r"
    (out / f"{name}.json").write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2,
                                                 default=str))
    table = {a.workload: {f"{r['policy']} {r['index']} ×{r['routers']}": r for r in rows}}
    md = markdown(table, ["hit_rate", "oracle_hit_rate", "ttft_p50_s", "ttft_p90_s",
                          "ttft_p99_s", "load_imbalance", "max_replica_share"])
    (out / f"{name}.md").write_text(md)
    plot_sim(out, rows, name)
    print(md)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="compare routing policies on real engines")
    b.add_argument("--target", help="URL of a running rayattn (admin_api on); "
                                    "default: start deployments/local.yaml here")
    b.add_argument("--port", type=int, default=8123)
    b.add_argument("--model", default="smollm2")
    b.add_argument("--tokenizer", help="tokenizer path for the oracle (default: SmolLM2)")
    b.add_argument("--workload", default="shared_prefix,multi_turn",
                   help="comma list of shared_prefix, multi_turn, long_doc_qa, mix")
    b.add_argument("--rate", type=float, default=None,
                   help="open loop: Poisson conversation arrivals per second "
                        "(default: closed loop at --concurrency)")
    b.add_argument("--policies", default=",".join(POLICIES))
    b.add_argument("--concurrency", type=int, default=8)
    b.add_argument("--groups", type=int, default=6)
    b.add_argument("--prompts", type=int, default=8)
    b.add_argument("--conversations", type=int, default=12)
    b.add_argument("--turns", type=int, default=4)
    b.add_argument("--block-size", type=int, default=32)
    b.add_argument("--seed", type=int, default=11)
    b.add_argument("--out", default="bench/results/bench")
    b.set_defaults(fn=cmd_bench)

    s = sub.add_parser("simulate", help="discrete-event fleet simulation with the real router")
    s.add_argument("--replicas", type=int, default=64)
    s.add_argument("--requests", type=int, default=100_000)
    s.add_argument("--workload", choices=["shared_prefix", "multi_turn"],
                   default="shared_prefix")
    s.add_argument("--policies", default=",".join(POLICIES))
    s.add_argument("--routers", default="1", help="ingress replicas, e.g. 1,4")
    s.add_argument("--index", default="events,predicted",
                   help="router index modes to compare: events, predicted")
    s.add_argument("--groups", type=int, default=512)
    s.add_argument("--turns", type=int, default=4)
    s.add_argument("--system-tokens", type=int, default=1024)
    s.add_argument("--question-tokens", type=int, default=128)
    s.add_argument("--output-tokens", type=int, default=128)
    s.add_argument("--rate", type=float, default=200.0, help="arrivals per second")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--capacity-blocks", type=int, default=8192)
    # MI300X-class defaults (per replica of TP8): see docs/benchmarks.md
    s.add_argument("--prefill-s-per-token", type=float, default=2e-5)
    s.add_argument("--ctx-s-per-token", type=float, default=2e-7)
    s.add_argument("--itl-base-s", type=float, default=0.02)
    s.add_argument("--itl-per-seq-s", type=float, default=2e-4)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", default="bench/results/sim")
    s.set_defaults(fn=cmd_simulate)
