"""A load ramp (quiet → peak → quiet) against one fleet autoscaled by each policy in turn, in
one invocation: Serve's own (requests in flight per engine) and rayattn's (a TTFT p90 target
and KV usage; rayattn/engine/scaling_policy.py).

    .venv/bin/python bench/autoscale_ramp.py [--policies ongoing:16,ongoing:2,ttft:1.0]
        [--system-words 0]
        [--engines 1,3] [--quiet 6] [--peak 24] [--phases-s 60,120,90] [--rise-s 0]
        [--think-s 2]
        [--runs 1] [--out bench/results/autoscale_ramp.json] [--plot docs/img/ramp.png]
        [--config deployments/local.yaml] [--real-engines] [--model PATH] [--set K=V]...

Ray and Serve start here with `--config`'s application (deployments/local.yaml), its
engines simulated (their step time models a GPU engine's: `--prefill-us-per-token`,
`--step-ms`) or, with `--real-engines`, its own vLLM engines (bench/gpu/run.sh ramp:
deployments/h200.yaml on a GPU host); the router, HAProxy and Serve's autoscaler are the
real ones. The engines are autoscaled between `--engines` bounds. For each
policy and run the app is deleted and deployed anew (fresh engines, cold caches, the fleet at
its minimum), the policies' order rotating from run to run; then the same conversations (one
seed per run) run closed loop: a document, then turns of the whole history plus a question,
each after a think time (exponential, mean `--think-s`), all behind one system prompt of
`--system-words` (none by default); `--quiet` of them, then `--peak`, then `--quiet`
again (a step, or a straight line over `--rise-s`); a conversation of `--turns` turns makes
way for a new one. Every second
Serve's status says how many engine replicas hold resources (starting, running or stopping).
Per 10-s window, by the requests' start: engines, requests, TTFT p90 of all turns (what the
policy's target bounds) and of later turns. Per run: the share of whole minutes, of windows
and of the peak's windows whose TTFT p90 is within `--ttft-target-s`, engine-seconds (also
per 100 requests), failed
requests (a turn that raised, or still running 120 s after the ramp, counts), later turns'
uncached prompt tokens, the share of their prompt tokens found cached and the share of their
own history's whole blocks (the previous turn's prompt and output) found cached; of the
later turns that ran on another replica than their previous turn (moved), the count, cached
share and TTFT p50.

A policy may carry router settings for its run: `ttft:1.5@warm_engines=false` (the router's
user_config, values as YAML reads them)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# After what PYTHONPATH names: bench/gpu/run.sh serves a snapshot of rayattn from there.
sys.path.append(str(ROOT))

WINDOW_S = 10.0
WORDS = ("river mountain valley forest ocean desert city harbor bridge tower garden market "
         "engine kernel cache block token router replica prefix decode extend prefill").split()


def router_settings(policy: str) -> dict[str, Any]:
    """The router settings a policy names after `@` (`ttft:1.5@warm_engines=false`)."""
    import yaml

    out: dict[str, Any] = {}
    for item in policy.split("@")[1:]:
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--policies: {item!r} is not key=value")
        out[key] = yaml.safe_load(value)
    return out


def autoscaling(policy: str, lo: int, hi: int, ttft_target: float) -> dict[str, Any]:
    """`ongoing:N`: Serve's own policy at N requests in flight per engine; `ttft:S`:
    rayattn's, TTFT p90 target S s and KV usage 0.85 (requests in flight never ask for more)."""
    kind, _, value = policy.split("@")[0].partition(":")
    timing = {"min_replicas": lo, "max_replicas": hi, "upscale_delay_s": 5,
              "downscale_delay_s": 20, "look_back_period_s": 10, "metrics_interval_s": 2}
    if kind == "ongoing":
        return {**timing, "target_ongoing_requests": float(value)}
    if kind == "ttft":
        return {**timing, "target_ongoing_requests": 1000, "policy": {
            "policy_function": "rayattn.engine.scaling_policy:EnginesForTargets",
            "policy_kwargs": {"ttft_p90_s": float(value or ttft_target), "kv_usage": 0.85}}}
    raise SystemExit(f"--policies: {policy!r} is neither ongoing:N nor ttft:S")


def serve_config(a: argparse.Namespace, policy: str) -> dict[str, Any]:
    """`--config`'s Serve config with the policy's autoscaling on its engine deployment, the
    engines simulated unless `--real-engines`, then `--model` and `--set` over its args."""
    import yaml

    from bench.gpu.common import set_setting

    cfg = yaml.safe_load(Path(a.config).read_text())
    cfg["http_options"]["port"] = a.port
    app = cfg["applications"][0]
    args = app["args"]
    # The engine count is the autoscaler's (a fixed data_parallel_size would conflict).
    args.setdefault("parallelism", {})["data_parallel_size"] = 1
    if not a.real_engines:
        args["platform"]["cpus_per_engine"] = 0.01
        args["engine"]["simulated"] = {
            "step_ms": a.step_ms, "prefill_us_per_token": a.prefill_us_per_token,
            "decode_us_per_seq": a.decode_us_per_seq, "num_blocks": 16384,
            "max_tokens": a.max_tokens}
    if a.model:
        args["model"]["source"] = a.model
    for setting in a.set:
        set_setting(args, setting)
    lo, hi = (int(x) for x in a.engines.split(","))
    deployments = app.setdefault("deployments", [])
    for name in ("engine", "router"):
        if not any(d["name"] == name for d in deployments):
            deployments.append({"name": name})
    for d in deployments:
        if d["name"] == "engine":
            d["autoscaling_config"] = autoscaling(policy, lo, hi, a.ttft_target_s)
        if d["name"] == "router":
            d.setdefault("user_config", {}).update(router_settings(policy))
    return cfg


def wanted(t: float, phases: list[float], quiet: int, peak: int, rise_s: float = 0.0) -> int:
    """Conversations the ramp wants running `t` s after its start (0 once it is over): its
    phases alternate quiet and peak (quiet, peak, quiet[, peak, quiet ...]); each change is
    a step, or over the first `rise_s` of the phase a straight line (users' traffic rises
    over minutes, not at once)."""
    start = 0.0
    for i, length in enumerate(phases):
        if t < start + length:
            here, before = (peak, quiet) if i % 2 else (quiet, peak)
            ramp, since = (min(rise_s, length) if i else 0.0), t - start
            return here if since >= ramp else round(before + (here - before) * since / ramp)
        start += length
    return 0


def peak_spans(phases: list[float]) -> list[tuple[float, float]]:
    """(start, end) of each peak phase."""
    starts = [sum(phases[:i]) for i in range(len(phases))]
    return [(starts[i], starts[i] + phases[i]) for i in range(1, len(phases), 2)]


def engines_held() -> int:
    """Engine replicas holding resources: starting, running or stopping (Serve's status)."""
    from ray import serve

    app = serve.status().applications.get("rayattn")
    dep = app.deployments.get("engine") if app else None
    return sum(dep.replica_states.values()) if dep else 0


async def ramp(url: str, a: argparse.Namespace, seed: int, model: str, block: int
               ) -> tuple[list[dict], list[tuple]]:
    import aiohttp

    from rayattn.bench.driver import chat_turn
    from rayattn.bench.workloads import Conversation

    phases = [float(x) for x in a.phases_s.split(",")]
    results: list[dict] = []
    health: list[tuple] = []
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    running: set[asyncio.Task] = set()
    n = 0
    shared = random.Random(f"{seed}:system")
    system = [{"role": "system", "content": " ".join(shared.choices(WORDS, k=a.system_words))}] \
        if a.system_words else []

    async def conversation(client: aiohttp.ClientSession, name: str) -> None:
        # Its own generator: every policy gets the same conversations, however they interleave.
        rng = random.Random(f"{seed}:{name}")
        doc = " ".join(rng.choices(WORDS, k=a.doc_words))
        messages = [*system, {"role": "user", "content": f"{name}: {doc}\nWhat is this about?"}]
        conv = Conversation("", [], name, a.max_tokens)
        previous = None  # the replica of its previous turn
        history = 0  # the previous turn's prompt and output: what this turn could find cached
        for turn in range(a.turns):
            start = loop.time() - t0
            try:
                r = await chat_turn(client, url, model, messages, conv, turn, t0)
            except (TimeoutError, aiohttp.ClientError) as e:
                results.append({"t": start, "turn": turn, "status": -1, "error": repr(e)})
                return
            results.append({"t": start, "turn": turn, "status": r.status,
                            "ttft_s": r.ttft_s, "prompt": r.prompt_tokens,
                            "cached": r.cached_tokens, "replica": r.replica,
                            "moved": turn > 0 and r.replica != previous,
                            # Whole blocks of its own history, one token always computed:
                            # an upper bound (the last output token's KV is never cached).
                            "oracle": min(history, r.prompt_tokens - 1) // block * block})
            previous = r.replica
            history = r.prompt_tokens + r.completion_tokens
            if r.status != 200:
                return
            messages += [{"role": "assistant", "content": r.output_text},
                         {"role": "user", "content": " ".join(rng.choices(WORDS, k=30))}]
            await asyncio.sleep(rng.expovariate(1 / a.think_s))
            if len(running) > wanted(loop.time() - t0, phases, a.quiet, a.peak, a.rise_s):
                return  # the ramp wants fewer now

    async def sample(client: aiohttp.ClientSession) -> None:
        while True:
            try:
                held = await loop.run_in_executor(None, engines_held)
                async with client.get(f"{url}/health") as r:
                    h = await r.json()
                health.append((loop.time() - t0, held, len(h["replicas_up"])))
            except (aiohttp.ClientError, ValueError, KeyError):
                pass
            await asyncio.sleep(1.0)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as client:
        sampler = loop.create_task(sample(client))
        end = sum(phases)
        while loop.time() - t0 < end:
            while len(running) < wanted(loop.time() - t0, phases, a.quiet, a.peak,
                                         a.rise_s):
                n += 1
                task = loop.create_task(conversation(client, f"c{n}"))
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.sleep(0.2)
        # Over: the conversations running finish their turn; no new one starts.
        if running:
            await asyncio.wait(running, timeout=120)
        for task in list(running):
            task.cancel()
            results.append({"t": end, "turn": -1, "status": -2, "error": "still running"})
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    return results, health


def p90(xs: list[float]) -> float | None:
    from rayattn.bench.stats import percentile

    return percentile(sorted(xs), 0.9) if xs else None


def percentile50(xs: list[float]) -> float | None:
    from rayattn.bench.stats import percentile

    return percentile(sorted(xs), 0.5) if xs else None


def _r3(x: float | None) -> float | None:
    return round(x, 3) if x is not None else None


def summarize(results: list[dict], health: list[tuple], a: argparse.Namespace) -> dict:
    phases = [float(x) for x in a.phases_s.split(",")]
    end = sum(phases)
    peaks = peak_spans(phases)

    def in_peak(t: float) -> bool:
        return any(lo <= t < hi for lo, hi in peaks)
    ok = [r for r in results if r["status"] == 200]
    windows = []
    for i in range(int(end // WINDOW_S)):
        lo, hi = i * WINDOW_S, (i + 1) * WINDOW_S
        started = [r for r in ok if lo <= r["t"] < hi]
        eng = [h[1] for h in health if lo <= h[0] < hi]
        up = [h[2] for h in health if lo <= h[0] < hi]
        windows.append({
            "t": lo, "engines": max(eng) if eng else None, "up": min(up) if up else None,
            "requests": len(started), "ttft_p90_s": _r3(p90([r["ttft_s"] for r in started])),
            "later_ttft_p90_s": _r3(p90([r["ttft_s"] for r in started if r["turn"] > 0])),
            "later_cached_share": _r3(
                sum(r["cached"] for r in started if r["turn"] > 0)
                / max(1, sum(r["prompt"] for r in started if r["turn"] > 0)))})

    def share(p90s: list[float | None]) -> str:
        """Within the target, of the spans that had requests."""
        judged = [v for v in p90s if v is not None]
        return f"{sum(v <= a.ttft_target_s for v in judged)}/{len(judged)}"

    # What a target is judged on: the p90 of each whole minute of the ramp (the 10-s windows
    # show when; a minute's p90 is not theirs averaged).
    minutes = [p90([r["ttft_s"] for r in ok if i * 60.0 <= r["t"] < (i + 1) * 60.0])
               for i in range(int(end // 60.0))]

    later = [r for r in ok if r["turn"] > 0]
    engine_s = 0.0
    for (t, e, _), (t2, _, _) in zip(health, health[1:], strict=False):
        if t < end:
            engine_s += e * (min(t2, end) - t)
    in_ramp = sum(1 for r in ok if r["t"] < end)
    return {
        "requests": len(results), "failed": len(results) - len(ok),
        "minutes_within_target": share(minutes),
        "windows_within_target": share([w["ttft_p90_s"] for w in windows]),
        "peak_windows_within_target": share([w["ttft_p90_s"] for w in windows
                                             if in_peak(w["t"])]),
        "ttft_p90_s": _r3(p90([r["ttft_s"] for r in ok])),
        "peak_ttft_p90_s": _r3(p90([r["ttft_s"] for r in ok if in_peak(r["t"])])),
        "later_ttft_p90_s": _r3(p90([r["ttft_s"] for r in later])),
        "engine_seconds": round(engine_s),
        "engine_seconds_per_100_requests": round(100 * engine_s / in_ramp, 1)
        if in_ramp else None,
        "max_engines": max((h[1] for h in health), default=None),
        "later_uncached_tokens": sum(r["prompt"] - r["cached"] for r in later),
        "later_cached_share": _r3(sum(r["cached"] for r in later)
                                  / max(1, sum(r["prompt"] for r in later))),
        # Cached over what the conversation's own history offered, in whole blocks.
        "later_hit_vs_history": _r3(sum(r["cached"] for r in later)
                                    / max(1, sum(r["oracle"] for r in later))),
        # Later turns on another replica than their previous turn's (its engine left, or
        # the router balanced): what warming (router.warm_engines) prefills ahead.
        "moved_turns": len(moved := [r for r in later if r["moved"]]),
        "moved_cached_share": _r3(sum(r["cached"] for r in moved)
                                  / max(1, sum(r["prompt"] for r in moved))),
        "moved_ttft_p50_s": _r3(percentile50([r["ttft_s"] for r in moved])),
        "windows": windows}


def plot(runs: list[dict], a: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for run in runs:
        w = run["summary"]["windows"]
        label = f"{run['policy']} (run {run['run']})"
        # Serving (the router's view) solid, held (starting and stopping too) dotted: a
        # replica stopped and started again within a window shows only in the first.
        line, = ax1.step([x["t"] for x in w], [x["up"] for x in w], where="post",
                         label=label)
        ax1.step([x["t"] for x in w], [x["engines"] for x in w], where="post",
                 linestyle=":", color=line.get_color())
        ax2.plot([x["t"] for x in w], [x["ttft_p90_s"] for x in w], marker=".",
                 label=label)
    ax2.axhline(a.ttft_target_s, color="grey", linestyle="--", label="TTFT target")
    ax1.set_ylabel("engines serving (held: dotted)")
    ax2.set_ylabel("TTFT p90 (s), by start")
    rise = f", rising {a.rise_s:g} s" if getattr(a, "rise_s", 0) else ""  # older runs: a step
    ax2.set_xlabel(f"s since the ramp began ({a.phases_s} s at {a.quiet}/{a.peak}/{a.quiet} "
                   f"conversations{rise})")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.plot, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="ongoing:16,ongoing:2,ttft:1.5")
    ap.add_argument("--config", default=str(ROOT / "deployments" / "local.yaml"),
                    help="the Serve config whose first application runs (its engine "
                         "deployment autoscaled by each policy)")
    ap.add_argument("--real-engines", action="store_true",
                    help="the config's own engines (vLLM) instead of simulated ones")
    ap.add_argument("--model", help="model.source over the config's")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a dotted override of the application's args, the value read as "
                         "YAML, e.g. engine.max_num_seqs=16 (repeatable)")
    ap.add_argument("--num-gpus", type=int,
                    help="GPUs Ray is told the node has (more than it has: engines share "
                         "GPU 0, with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES set)")
    ap.add_argument("--engines", default="1,3", help="min,max engine replicas")
    ap.add_argument("--quiet", type=int, default=6)
    ap.add_argument("--peak", type=int, default=24)
    ap.add_argument("--phases-s", default="60,120,90",
                    help="seconds of quiet, peak, quiet[, peak, quiet ...]")
    ap.add_argument("--rise-s", type=float, default=0.0,
                    help="the peak's rise and fall, in a straight line (0: a step)")
    ap.add_argument("--think-s", type=float, default=2.0)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--doc-words", type=int, default=400)
    ap.add_argument("--system-words", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ttft-target-s", type=float, default=1.5)
    ap.add_argument("--step-ms", type=float, default=8.0)
    ap.add_argument("--prefill-us-per-token", type=float, default=1000.0)
    ap.add_argument("--decode-us-per-seq", type=float, default=300.0)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--out", default="bench/results/autoscale_ramp.json")
    ap.add_argument("--plot")
    ap.add_argument("--replot", metavar="JSON[,JSON...]",
                    help="only plot earlier --out files' runs (the first file's settings) to "
                         "--plot; runs nothing")
    a = ap.parse_args()
    if len(a.phases_s.split(",")) % 2 == 0:
        ap.error("--phases-s: quiet, peak, quiet[, peak, quiet ...] (an odd count)")
    if a.replot:
        if not a.plot:
            ap.error("--replot needs --plot")
        saved = [json.loads(Path(f).read_text()) for f in a.replot.split(",")]
        runs, seen = [], Counter()
        for run in (run for s in saved for run in s["runs"]):
            # Calls of one run each all say run 1: number them in the order given.
            seen[run["policy"]] += 1
            runs.append({**run, "run": seen[run["policy"]]})
        plot(runs,
             argparse.Namespace(**{**saved[0]["args"], "plot": a.plot}))
        return
    policies = a.policies.split(",")
    for p in policies:  # a typo fails before anything starts
        autoscaling(p, 1, 1, a.ttft_target_s)
        router_settings(p)
    import httpx

    from rayattn.app import deploy_config, wait_running
    from rayattn.bench.cli import start_local_config, stop_local, wait_healthy
    from rayattn.config.loader import rayattn_apps

    runs: list[dict] = []
    lo = int(a.engines.split(",")[0])
    first = serve_config(a, policies[0])
    [(_, cfg)] = rayattn_apps(first)
    # Without a block size in the config (vLLM's choice) the oracle counts tokens.
    model, block = cfg.model.name, cfg.attention.block_size or 1
    url, startup = start_local_config(first, num_gpus=a.num_gpus)
    from ray import serve  # after the start: it sets Serve's environment first

    kind = "real" if a.real_engines else "simulated"
    print(f"{kind} fleet serving in {startup:.0f}s", flush=True)
    try:
        for run in range(1, a.runs + 1):
            k = (run - 1) % len(policies)  # each policy in each place of the order
            for policy in policies[k:] + policies[:k]:
                if runs:  # fresh engines and router, cold caches, the fleet at its minimum
                    serve.delete("rayattn")
                    deploy_config(serve_config(a, policy))
                    wait_running("rayattn")
                    wait_healthy(url)
                deadline = time.time() + 300
                while not ((h := httpx.get(f"{url}/health", timeout=10).json())["replicas"]
                           == lo and len(h["replicas_up"]) == lo):
                    assert time.time() < deadline, f"the fleet never settled at {lo}: {h}"
                    time.sleep(1)
                results, health = asyncio.run(ramp(url, a, run, model, block))
                summary = summarize(results, health, a)
                runs.append({"policy": policy, "run": run, "summary": summary})
                print(json.dumps({"policy": policy, "run": run,
                                  **{k: v for k, v in summary.items() if k != "windows"}}),
                      flush=True)
                Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                Path(a.out).write_text(json.dumps({"args": vars(a), "runs": runs}, indent=1))
    finally:
        stop_local()
    if a.plot:
        plot(runs, a)


if __name__ == "__main__":
    main()
