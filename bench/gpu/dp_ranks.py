"""One engine replica running vLLM's DP-attention inside itself: the router's
rank-aware routing (router.dp_rank_routing: each DP rank a target of its own, vLLM told the
rank) against vLLM's internal DP balancer (one target per replica), on the same engine.

On a node of 2 GPUs: the random-weight DeepSeek-V2-Lite-shape model (MLA + MoE, TRITON_MLA),
`parallelism: {tensor_parallel_size: 2, enable_expert_parallel: true, dp_attention: true}`,
i.e. vLLM data_parallel_size 2 × tensor_parallel_size 1 inside one Serve replica, experts
split over both GPUs. Checks that both GPUs hold a rank and that each variant routes to the
targets it should (/health), warms both ranks up, then runs rayattn's doc_chat workload
(closed loop, think time) cold for every variant, variants interleaved (ABBA), --repeats
times, switching the setting and emptying the caches with POST /admin/reset. Per run:
hit / oracle (report.py's block oracle, the model's tokenizer), later-turn TTFT p50/p90,
output tok/s, wall, the per-rank split from vLLM's own counters; then each variant's means
over the last variant's. Writes OUT/dp-ranks.json in routing.json's layout (report.py reads
it too).

Device (after bench/gpu/run.sh install):  bash bench/gpu/run.sh dp-ranks [flags]
Here, the table again from what came back:
  .venv/bin/python bench/gpu/dp_ranks.py --summarize OUT/dp-ranks.json \
      --tokenizer .gpuwhl/b07/tok --out bench/gpu/results/dp-ranks
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import math
import os
import re
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RayattnApp, dump, fail, gpu_processes, gpus, log, rayattn_args  # noqa: E402
from report import block_oracle  # noqa: E402
from routing import chat, workloads  # noqa: E402

from rayattn.bench.cli import variant, variant_base  # noqa: E402

GIB = 1 << 30
ENGINE: dict[str, Any] = {
    "attention.backend": "TRITON_MLA",
    "parallelism.tensor_parallel_size": 2,
    "parallelism.data_parallel_size": 1,
    "parallelism.enable_expert_parallel": True,
    "parallelism.dp_attention": True,
    "platform.kind": "cuda",
    "platform.gpus_per_node": 2,
    # doc_chat's last turns are 7.5-7.7k tokens with this tokenizer, + 64 to generate: 8192
    # would leave ~400 tokens for re-rendered random-weight answers, which can be longer.
    "model.max_model_len": 10240,
    # Per GPU: ~16.4 GB of weights (attention, dense layer, shared experts and embeddings
    # whole, 32 of the 64 routed experts) + 28 GiB of KV = 966k tokens of MLA cache (576 ×
    # 2 B × 27 layers a token); 64 conversations' histories are ~490k tokens, so nothing is
    # evicted even where the internal balancer copies histories to both ranks: the variants
    # differ only in where histories are found. ~50 GB a GPU in all.
    "engine.kv_cache_memory_bytes": 28 * GIB,
    "engine.gpu_memory_utilization": 0.5,  # only vLLM's start-up check of free memory
    # No torch.compile / CUDA graphs: 1–2 min less start-up for an MoE of 27 layers with DP
    # padding, inside one 10-minute call. Both variants share the engine, and later turns'
    # TTFT is prefill/extend, which graphs barely change; decode-bound figures (tok/s, wall)
    # are lower than a graphed engine's. --set engine.enforce_eager=false to graph.
    "engine.enforce_eager": True,
}
# vLLM's per-rank counters (label `engine` = DP rank), as Ray's exporter names them.
RANK_METRICS = ("vllm_request_success", "vllm_prompt_tokens", "vllm_generation_tokens",
                "vllm_prefix_cache_hits", "vllm_prefix_cache_queries")
_LINE = re.compile(r"^ray_(vllm_[a-z_]+?)(?:_total)?\{(.*)\} (\S+)$")
_RANK = re.compile(r'(?:^|,)engine="(\d+)"')
STARTUP_LINES = (r"Loading weights took|Model loading took|init engine|GPU KV cache size|"
                 r"Maximum concurrency|existing placement group|Defaulting to use|"
                 r"data parallel|EngineCore_DP\d.*(?:rror|died)")
ERROR_LINES = r"Traceback|[A-Za-z]+Error\b|Exception:|FAILED|Waiting for|not schedulable"


def per_rank(text: str) -> dict[str, dict[str, float]]:
    """{DP rank: {counter: value}} from Ray's Prometheus text."""
    out: dict[str, dict[str, float]] = {}
    for ln in text.splitlines():
        m = _LINE.match(ln)
        r = _RANK.search(m.group(2)) if m and m.group(1) in RANK_METRICS else None
        if m and r:
            d = out.setdefault(r.group(1), {})
            d[m.group(1)] = d.get(m.group(1), 0.0) + float(m.group(3))
    return out


def ray_log_lines(pattern: str, since: float, limit: int = 40) -> list[str]:
    """Lines of this session's Ray logs (Serve replicas and the vLLM processes they start)
    written since `since` that match `pattern`: what start-up took, or why it failed, in
    the device call's own output (the logs stay on the device)."""
    rx, hits = re.compile(pattern), []
    for f in sorted(glob.glob("/tmp/ray/session_latest/logs/**/*", recursive=True)):
        try:
            if not os.path.isfile(f) or os.path.getmtime(f) < since:
                continue
            with open(f, errors="replace") as fh:
                hits += [f"{Path(f).name}: {ln.strip()[:300]}" for ln in fh if rx.search(ln)]
        except OSError:
            continue
    return list(dict.fromkeys(hits))[-limit:]


def load_tokenizer(path: str | None) -> Any:
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # the runs still count; --summarize adds the oracle later
        log(f"no tokenizer for the oracle ({e!r})")
        return None


def add_oracle(run: dict, wl: Any, tok: Any) -> None:
    s = run.get("summary")
    if tok is None or s is None or "hit_over_oracle" in s:
        return
    s["oracle_block_hit_rate"] = block_oracle(run["results"], wl, tok)
    s["hit_over_oracle"] = s["hit_rate"] / max(s["oracle_block_hit_rate"], 1e-9)


def rank_cells(ranks: dict[str, dict[str, float]]) -> tuple[str, str]:
    """Requests per DP rank and each rank's own prefix-cache hit rate (tokens)."""
    rows = [v for _, v in sorted(ranks.items())]
    reqs = " / ".join(f"{v.get('vllm_request_success', 0):.0f}" for v in rows)
    rates = [v.get("vllm_prefix_cache_hits", 0) / max(v.get("vllm_prefix_cache_queries", 0), 1)
             for v in rows]
    hits = " / ".join(f"{r:.3f}" for r in rates)
    return reqs, hits


COLUMNS = {"hit_over_oracle": ".3f", "hit_rate": ".3f", "later_ttft_p50_s": ".3f",
           "later_ttft_p90_s": ".3f", "output_tok_per_s": ".0f", "wall_s": ".1f"}


def summarize(rep: dict, tok: Any) -> dict:
    """Per-run table, means per variant and their ratios to the last variant (the
    baseline); stored in rep["ratios"]."""
    wl = workloads(rep["args"]["scale"])["doc_chat"]
    by: dict[str, list[dict]] = {}
    print("\n| variant | run | " + " | ".join(COLUMNS) + " | requests per rank | "
          "engine hit per rank | targets |")
    print("|---|---|" + "---|" * (len(COLUMNS) + 3))
    for run in rep["runs"]:
        add_oracle(run, wl, tok)
        s = run.get("summary")
        if s is None:
            why = run.get("error") or run.get("skipped")
            print(f"| {run['policy']} | {run['repeat']} | {why} |")
            continue
        by.setdefault(run["policy"], []).append(s)
        reqs, hits = rank_cells(run.get("ranks") or {})
        print(f"| {run['policy']} | {run['repeat']} | "
              + " | ".join(format(s.get(k, math.nan), f) for k, f in COLUMNS.items())
              + f" | {reqs} | {hits} | {len(run.get('targets') or [])} |")
    means = {p: {k: statistics.mean(s.get(k, math.nan) for s in runs) for k in COLUMNS}
             for p, runs in by.items()}
    base = rep["args"]["variants"].split(",")[-1]
    ratios = {p: {k: (m[k] / means[base][k] if means[base][k] else None) for k in COLUMNS}
              for p, m in means.items() if p != base and base in means}
    rep["ratios"] = {"baseline": base, "means": means, "by_variant": ratios}
    print(f"\nmeans over runs, and / {base}:")
    for p, m in means.items():
        r = ratios.get(p)
        print(f"  {p}: " + "  ".join(
            f"{k} {m[k]:{f}}" + (f" (x{r[k]:.2f})" if r and r[k] is not None else "")
            for k, f in COLUMNS.items()))
    return rep


def health(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/health", timeout=30).json()


def warm_up(url: str, name: str) -> None:
    """Both ranks through prefill and extend at three lengths (eager Triton kernels JIT on
    first use): four documents at once spread over the ranks, then each asked again."""
    with ThreadPoolExecutor(4) as pool:
        for words in (300, 1500, 3000):
            for _ in range(2):
                list(pool.map(lambda k, w=words: chat(url, name, w, f"warm-{w}-{k}"), range(4)))


def main() -> int:
    # `timeout` sends SIGTERM: exit through the finally blocks so the results are written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="the deepseek-v2-lite directory run.sh install made")
    ap.add_argument("--config", default="deployments/h200.yaml")
    ap.add_argument("--out", default="/tmp/rayattn-gpu/out")
    ap.add_argument("--variants", default="affinity,affinity@dp_rank_routing=false",
                    help="policy[@setting=value;...], the last one the ratios' baseline")
    ap.add_argument("--scale", type=int, default=1, help="doc_chat: 64 × scale conversations")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--think-s", type=float, default=0.3)
    ap.add_argument("--deadline-s", type=float, default=470,
                    help="start no new run after this many seconds")
    ap.add_argument("--startup-timeout-s", type=float, default=360)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a dotted override of the deployment's args (repeatable)")
    ap.add_argument("--tokenizer", help="for the oracle (default: the model's directory)")
    ap.add_argument("--summarize", metavar="JSON", help="only print a finished run's table")
    a = ap.parse_args()
    if a.summarize:  # here: the device's files are read-only, the summary goes to --out
        rep = summarize(json.loads(Path(a.summarize).read_text()), load_tokenizer(a.tokenizer))
        for run in rep["runs"]:
            run.pop("results", None)
        dump(Path(a.out) / "dp-ranks-summary.json", rep)
        return 0
    if not a.model:
        ap.error("--model is required")
    t_start = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    import httpx

    import rayattn
    from rayattn.bench.driver import results_json, run_workload
    from rayattn.bench.driver import summarize as summarize_run
    from rayattn.bench.stats import percentile
    from rayattn.config.loader import parse_args
    from rayattn.config.plan import build_plan

    over = {**ENGINE, **dict(common.parse_setting(kv) for kv in a.set)}
    args = rayattn_args(a.config, a.model, **over)
    name = args["model"]["served_name"]
    variants = a.variants.split(",")
    # Every run sets every setting some variant changes (back to the config's value where
    # its own variant does not name it). A setting unknown here: refresh the snapshot
    # (bench/gpu/stage.sh --snapshot-only).
    base_settings = variant_base(variants, parse_args(args).router)
    report: dict[str, Any] = {"args": vars(a), "gpus": gpus(), "runs": [], "checks": {},
                              "bench_overrides": {}}
    plan = build_plan(parse_args(args), prepare_model=True)
    report |= {"rayattn_args": args, "rayattn_from": str(Path(rayattn.__file__).parent),
               "plan": plan.describe(), "engine_kwargs": plan.engine_kwargs,
               "bundles": plan.bundles}
    log("plan:\n" + plan.describe())
    wl = workloads(a.scale)["doc_chat"]
    tok = load_tokenizer(a.tokenizer or a.model)
    app = None
    try:
        app = RayattnApp(args, num_gpus=2)
        try:
            report["startup_s"] = app.wait(a.startup_timeout_s)
        finally:
            report["startup_log"] = ray_log_lines(STARTUP_LINES, t_start)
            for ln in report["startup_log"][-12:]:
                log("  start-up:", ln)
        log(f"rayattn healthy after {report['startup_s']:.0f} s")

        # --- the two ranks on the two GPUs -----------------------------------------------
        # From nvidia-smi, beside the engine's own report (one GPU per rank, read from the
        # replica's visible devices: vLLM's DP client answers collective_rpc with rank 0's
        # workers only).
        try:
            used = {g["index"]: float(g["mem_used_mib"]) for g in gpus()}
            ok = len(used) >= 2 and all(v > 10_000 for v in list(used.values())[:2])
            report["checks"]["dp_ranks_on_two_gpus"] = {"pass": ok, "mem_used_mib": used}
            log(f"ASSERT dp_ranks_on_two_gpus: {'PASS' if ok else 'FAIL'} MiB used {used}")
            report["gpu_processes"], report["engines"] = gpu_processes(), app.engine_infos()
            log(f"engine reports devices {[i.get('devices') for i in report['engines']]}")
            # What per_rank() reads, should Ray's exporter name vLLM's counters otherwise.
            report["vllm_series"] = sorted({ln.split("{")[0] for ln in app.scrape().splitlines()
                                            if ln.startswith("ray_vllm_")})
        except Exception as e:  # the runs matter more than the report of them
            fail(f"device check: {e!r}")

        httpx.post(f"{app.url}/admin/reset", json={"policy": "affinity",
                                                   "settings": base_settings}, timeout=120)
        t = time.time()
        warm_up(app.url, name)
        log(f"warm-up done ({time.time() - t:.0f} s)")

        for rep in range(a.repeats):
            for pol in variants if rep % 2 == 0 else variants[::-1]:
                run: dict[str, Any] = {"stack": "rayattn", "policy": pol,
                                       "workload": "doc_chat", "repeat": rep}
                report["runs"].append(run)
                if time.time() - t_start > a.deadline_s:
                    run["skipped"] = "deadline"
                    log(f"deadline: skipping {pol} #{rep}")
                    continue
                try:
                    policy, settings = variant(pol)
                    settings = {**base_settings, **settings}
                    httpx.post(f"{app.url}/admin/reset", json={
                        "policy": policy, "settings": settings}, timeout=120).raise_for_status()
                    # One target per rank, or one for the replica: the switch took effect.
                    run["targets"] = sorted(health(app.url).get("engines", {}))
                    want = 2 if settings.get("dp_rank_routing", True) else 1
                    run["targets_ok"] = len(run["targets"]) == want
                    before_text = app.scrape()
                    res, wall = asyncio.run(run_workload(app.url, name, wl,
                                                         concurrency=a.concurrency,
                                                         timeout=300, think_s=a.think_s))
                    s = summarize_run(res, wall)
                    later = sorted(x.ttft_s for x in res if x.status == 200 and x.turn > 0)
                    s["later_ttft_p50_s"] = percentile(later, 0.5)
                    s["later_ttft_p90_s"] = percentile(later, 0.9)
                    run["summary"], run["results"] = s, results_json(res)
                    h = health(app.url)
                    run["router"] = {k: h.get(k) for k in ("counts", "engines",
                                                           "session_moves", "regret_tokens")}
                    time.sleep(3)  # Ray's metrics agent exports every second
                    before, after = per_rank(before_text), per_rank(app.scrape())
                    run["ranks"] = {r: {m: v - before.get(r, {}).get(m, 0.0)
                                        for m, v in after[r].items()} for r in after}
                    add_oracle(run, wl, tok)
                    split, _ = rank_cells(run["ranks"])
                    ho = s.get("hit_over_oracle", math.nan)
                    log(f"{pol:34s} #{rep} ok={s['ok']}/{s['requests']} "
                        f"hit={s['hit_rate']:.3f} hit/oracle={ho:.3f} "
                        f"later p50={s['later_ttft_p50_s']:.3f} p90={s['later_ttft_p90_s']:.3f} "
                        f"out tok/s={s['output_tok_per_s']:.0f} wall={wall:.1f}s "
                        f"rank split={split} targets={len(run['targets'])}"
                        f"{'' if run['targets_ok'] else ' (WRONG)'} moves={s['moves']}")
                except Exception as e:
                    run["error"] = repr(e)
                    fail(f"{pol} #{rep}: {e!r}")
    except Exception as e:
        report["error"] = repr(e)
        report["log_errors"] = ray_log_lines(ERROR_LINES, t_start)
        fail(repr(e))
        for ln in report["log_errors"][-25:]:
            log("  log:", ln)
    finally:
        try:
            if any("summary" in r for r in report["runs"]):
                summarize(report, tok)
        finally:
            dump(out / "dp-ranks.json", report)
            if app is not None:
                app.shutdown()
    log(f"done in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
