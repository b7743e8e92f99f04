"""rayattn vs vllm-router on the same GPUs, same engines, one run (docs/results.md).

On a node of 2 GPUs this starts, side by side and with identical engine settings (taken from
rayattn's own plan of deployments/h200.yaml):
  * rayattn: DP2 × TP1 (one engine replica per GPU) behind its router, `router.admin_api` on,
    policies switched with POST /admin/reset (which also empties both prefix caches);
  * the peer: two `vllm serve` processes (CUDA_VISIBLE_DEVICES=0 and 1) and `vllm-router` in
    front of them, restarted for every run, prefix caches emptied with /reset_prefix_cache.
Then it asserts that rayattn's two engines report distinct GPU UUIDs, warms both stacks up,
drives every (stack, policy) with the same multi-turn and shared-prefix workloads of
rayattn.bench.workloads (rayattn.bench.driver.run_workload, closed loop), scrapes Ray's
Prometheus endpoint for the per-path metrics, and writes everything (per-request results
included, for the oracle) to OUT/routing.json. bench/gpu/report.py turns that into tables.

Usage (device, vLLM + ray[serve] + vllm-router installed, model made by bench/gpu/run.sh):
  python3 bench/gpu/routing.py --model /tmp/rayattn-gpu/llama-0.85b --out $OUT
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    RayattnApp,
    dump,
    fail,
    gpu_processes,
    gpus,
    log,
    parse_setting,
    rayattn_args,
    series,
    total,
    wait_http,
)

from rayattn.bench.cli import variant, variant_base  # noqa: E402

PEER_PORTS = (8101, 8102)


ROUTER_PORT = 8100
DOC_WORDS, USER_WORDS = 1500, 350  # doc_chat's document and notes per turn, in words


def workloads(scale: int, doc_words: int = DOC_WORDS, user_words: int = USER_WORDS) -> dict:
    from rayattn.bench.workloads import agent_loop, doc_chat, multi_turn, shared_prefix

    return {
        # Users' chats: 64 × scale conversations × 4 turns, each with a document of its own,
        # new notes every turn, 64-token answers. With bench/gpu's 32000-token random
        # tokenizer (~3.1 tokens a word) the defaults make 4.7k → 7.6k-token prompts;
        # --doc-words 650 --user-words 160 the 2k-token document and ~500 tokens a turn of
        # the router-tier workload.
        "doc_chat": doc_chat(conversations=64 * scale, turns=4, doc_words=doc_words,
                             user_words=user_words, max_tokens=64, seed=3),
        # Agents: 4 long tool prompts (~1.6k tokens) shared by 64 × scale sessions of 6 turns,
        # each appending a short tool result.
        "agent_loop": agent_loop(agents=4, sessions=64 * scale, turns=6,
                                 tool_prompt_words=1200, result_words=60, max_tokens=32,
                                 seed=4),
        # ~3.6k-token system prompts (4 shared by all conversations), +~0.5k tokens of user
        # text and 64 generated tokens per turn: 4 turns, prompts 3.6k → 5.3k tokens.
        "multi_turn": multi_turn(conversations=64 * scale, turns=4, shared_systems=4,
                                 system_words=1500, user_words=200, max_tokens=64, seed=1),
        # 16 documents of ~6k tokens per scale unit, 16 questions each, interleaved.
        "shared_prefix": shared_prefix(groups=16 * scale, prompts_per_group=16,
                                       system_words=2500, question_words=100, max_tokens=64,
                                       seed=2),
    }


def peer_command(kw: dict, port: int, name: str) -> list[str]:
    """`vllm serve` with the engine arguments rayattn's plan gives its own engines."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
           "--port", str(port), "--model", kw["model"], "--served-model-name", name,
           "--enable-prompt-tokens-details"]
    flags = {"dtype": "--dtype", "max_model_len": "--max-model-len",
             "attention_backend": "--attention-backend", "kv_cache_dtype": "--kv-cache-dtype",
             "block_size": "--block-size", "kv_cache_memory_bytes": "--kv-cache-memory-bytes",
             "gpu_memory_utilization": "--gpu-memory-utilization",
             "max_num_seqs": "--max-num-seqs",
             "max_num_batched_tokens": "--max-num-batched-tokens",
             "prefix_caching_hash_algo": "--prefix-caching-hash-algo",
             # the same host KV tier as rayattn's engines (engine.kv_offload)
             "kv_offloading_size": "--kv-offloading-size",
             "kv_offloading_backend": "--kv-offloading-backend"}
    for k, flag in flags.items():
        if kw.get(k) is not None:
            cmd += [flag, str(kw[k])]
    if kw.get("enable_prefix_caching"):
        cmd.append("--enable-prefix-caching")
    if kw.get("enforce_eager"):
        cmd.append("--enforce-eager")
    return cmd


def start_peers(kw: dict, name: str, logdir: Path, one_gpu: bool) -> list[subprocess.Popen]:
    procs = []
    for k, port in enumerate(PEER_PORTS):
        gpu = 0 if one_gpu else k
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "VLLM_SERVER_DEV_MODE": "1",
               # own compile cache: the two servers and rayattn's engines start at once
               "VLLM_CACHE_ROOT": f"/tmp/vllm-cache-peer{k}"}
        if one_gpu and k:
            time.sleep(25)  # vLLM's start-up memory profile must not see the other's
        out = open(logdir / f"peer{k}.log", "w")
        procs.append(subprocess.Popen(peer_command(kw, port, name), env=env, stdout=out,
                                      stderr=subprocess.STDOUT))
    return procs


def router_command(policy: str) -> list[str]:
    exe = shutil.which("vllm-router")
    head = [exe] if exe else [sys.executable, "-m", "vllm_router.launch_router"]
    return head + ["--host", "127.0.0.1", "--port", str(ROUTER_PORT), "--policy", policy,
                   "--worker-urls", *[f"http://127.0.0.1:{p}" for p in PEER_PORTS]]


def start_router(policy: str, logdir: Path) -> tuple[subprocess.Popen, float]:
    out = open(logdir / f"router-{policy}.log", "a")
    t0 = time.time()
    p = subprocess.Popen(router_command(policy), stdout=out, stderr=subprocess.STDOUT)
    import httpx

    while time.time() - t0 < 120:
        if p.poll() is not None:
            raise RuntimeError(f"vllm-router exited {p.returncode}: "
                               + (logdir / f"router-{policy}.log").read_text()[-1500:])
        for path in ("/health", "/v1/models"):
            try:
                if httpx.get(f"http://127.0.0.1:{ROUTER_PORT}{path}", timeout=5).status_code \
                        == 200:
                    return p, time.time() - t0
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    p.terminate()
    raise TimeoutError("vllm-router not ready in 120 s")


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


def peer_counts() -> list[float]:
    import httpx

    out = []
    for port in PEER_PORTS:
        m = series(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text,
                   "vllm:request_success_total")
        out.append(total(m))
    return out


def reset_peers() -> list[tuple[int, bool]]:
    """(status, emptied) per peer engine (bench/peers/vllm_router.py reset_engine)."""
    from rayattn.bench.cli import PEER_MODULES, peer_module

    reset = peer_module(PEER_MODULES["vllm-router"]).reset_engine
    return [reset(f"http://127.0.0.1:{p}") for p in PEER_PORTS]


def chat(url: str, name: str, words: int, tag: str) -> dict:
    import random

    import httpx

    from rayattn.bench.workloads import _text

    text = _text(random.Random(hash(tag) & 0xFFFF), words)
    r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
        "model": name, "max_tokens": 32, "temperature": 0,
        "messages": [{"role": "user", "content": f"{tag}: {text}"}]})
    r.raise_for_status()
    return r.json().get("usage", {})


def moved_detail(res: list) -> dict:
    """What the router saw when it moved a conversation: whether its index still held the
    history on the previous turn's engine (regret > 0: the costs outweighed it; 0: the view
    had lost it), and a few moved requests' costs and loads as the router priced them."""
    from rayattn.bench.stats import percentile

    moved = [r for r in res if r.status == 200 and r.moved_from]
    held = sorted(r.regret_tokens for r in moved if r.regret_tokens > 0)
    return {"moved": len(moved), "index_held_history": len(held),
            "regret_tokens_p50": percentile(held, 0.5, empty=0),
            "examples": [{"turn": r.turn, "reason": r.reason, "from": r.moved_from,
                          "to": r.replica, "prompt": r.prompt_tokens, "cached": r.cached_tokens,
                          "regret": r.regret_tokens, "costs": r.costs, "loads": r.loads}
                         for r in moved[:4]]}


def routers_view(url: str, tries: int = 16) -> dict:
    """Every router's own account since its start (the balancer spreads /health calls
    without a session header over them): moves by reason, and per engine the times its
    probes failed or were slow and its KV event feed resynced or went stale."""
    import httpx

    seen: dict = {}
    for _ in range(tries):
        try:
            h = httpx.get(f"{url}/health", timeout=30).json()
        except Exception:  # one router busy: the others still answer
            continue
        seen[h.get("router_pid")] = {
            "moves": h.get("session_moves"),
            "engines": {n: {"downs": e["downs"], "slow_probes": e["slow_probes"],
                            "resyncs": e["cache_view"].get("resyncs"),
                            "stale": e["cache_view"].get("stale"),
                            "blocks": e["cache_view"].get("blocks")}
                        for n, e in (h.get("engines") or {}).items()}}
    return seen


def main() -> int:
    # `timeout` sends SIGTERM: exit through the finally blocks so the results are written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--config", default="deployments/h200.yaml")
    ap.add_argument("--out", required=True)
    ap.add_argument("--policies", default="affinity,round_robin,ray_prefix")
    ap.add_argument("--peer-policies", default="cache_aware,sticky_least_loaded")
    ap.add_argument("--workloads", default="multi_turn,shared_prefix")
    ap.add_argument("--scale", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--deadline-s", type=float, default=520,
                    help="start no new run after this many seconds")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--one-gpu", action="store_true",
                    help="two engines per stack on GPU 0 (the single-GPU kinds)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a dotted override of the deployment's args for rayattn, e.g. "
                         "serve.ingress_replicas=4 (repeatable)")
    ap.add_argument("--doc-words", type=int, default=DOC_WORDS, help="doc_chat's document")
    ap.add_argument("--user-words", type=int, default=USER_WORDS,
                    help="doc_chat's notes per turn")
    ap.add_argument("--think-s", type=float, default=0.0,
                    help="a uniform 0..think_s pause before a conversation's next turn")
    a = ap.parse_args()
    t_start = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logdir = Path("/tmp/rayattn-gpu/logs")
    logdir.mkdir(parents=True, exist_ok=True)

    from rayattn.bench.driver import CLIENT_STALLS, results_json, run_workload, summarize
    from rayattn.bench.stats import percentile
    from rayattn.config.loader import parse_args
    from rayattn.config.plan import build_plan

    over = dict(parse_setting(kv) for kv in a.set)
    if a.one_gpu:
        # Both engines on device 0: Ray still hands each replica "one GPU" of the two it is
        # told exist, but does not narrow CUDA_VISIBLE_DEVICES, so each sees GPU 0. vLLM
        # checks at start-up that gpu_memory_utilization × the GPU is free: 0.3 each.
        over = {"engine.gpu_memory_utilization": 0.3,
                "engine.env": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}, **over}
    args = rayattn_args(a.config, a.model, **over)
    name = args["model"]["served_name"]
    # Each run sets every setting some variant changes (the config's value where its own
    # variant does not name it); every variant checked before anything starts.
    base_settings = variant_base(a.policies.split(","), parse_args(args).router)
    plan = build_plan(parse_args(args), prepare_model=True)
    report: dict = {"args": vars(a), "rayattn_args": args, "plan": plan.describe(),
                    "engine_kwargs": plan.engine_kwargs, "gpus": gpus(), "runs": [],
                    "checks": {}}
    log("plan:\n" + plan.describe())
    peers = [] if a.no_peers else start_peers(plan.engine_kwargs, name, logdir, a.one_gpu)
    if peers:
        report["peer_command"] = " ".join(peer_command(plan.engine_kwargs, PEER_PORTS[0],
                                                       name))
    app = None
    try:
        app = RayattnApp(args, num_gpus=2)
        if peers:
            for port in PEER_PORTS:
                waited = wait_http(f"http://127.0.0.1:{port}/health", 400)
                log(f"peer :{port} up ({waited:.0f} s)")
        report["rayattn_startup_s"] = app.wait(400)
        report["peers_up_s"] = time.time() - t_start
        log(f"rayattn healthy after {report['rayattn_startup_s']:.0f} s")

        import httpx

        # --- DP2 × TP1: distinct GPUs, reported by the engines themselves ---------------
        try:
            infos = app.engine_infos()
            report["engines"], report["gpu_processes"] = infos, gpu_processes()
            report["health"] = httpx.get(f"{app.url}/health", timeout=30).json()
            devs = [i.get("devices") for i in infos]
            node = {g["uuid"] for g in report["gpus"]}
            one = all(d and len(d) == 1 for d in devs) and {d[0] for d in devs} <= node
            check = "two_engines_one_gpu" if a.one_gpu else "dp2_tp1_distinct_gpus"
            ok = one and (devs[0][0] == devs[1][0]) == a.one_gpu
            report["checks"][check] = {"pass": ok, "devices": devs}
            log(f"ASSERT {check}: {'PASS' if ok else 'FAIL'} {devs}")
            for p in report["gpu_processes"]:
                log("  gpu process", p)
        except Exception as e:
            report["checks"]["dp2_tp1_distinct_gpus"] = {"pass": False, "error": repr(e)}
            fail(f"device check: {e!r}")

        # --- warm-up (JIT, graphs): both engines of both stacks -------------------------
        try:
            httpx.post(f"{app.url}/admin/reset", json={"policy": "round_robin"}, timeout=60)
            for words in (200, 1500, 4000):
                for k in range(2):
                    chat(app.url, name, words, f"warm-r{words}-{k}")
                    if peers:
                        chat(f"http://127.0.0.1:{PEER_PORTS[k]}", name, words,
                             f"warm-p{words}")
            log("warm-up done")
        except Exception as e:
            fail(f"warm-up: {e!r}")

        wls = {k: v for k, v in workloads(a.scale, a.doc_words, a.user_words).items()
               if k in a.workloads.split(",")}
        plan_runs = []
        for rep in range(a.repeats):
            for wname in wls:
                plan_runs += [("rayattn", p, wname, rep) for p in a.policies.split(",")]
                if peers:
                    plan_runs += [("vllm-router", p, wname, rep)
                                  for p in a.peer_policies.split(",")]
        for stack, pol, wname, rep in plan_runs:
            if time.time() - t_start > a.deadline_s:
                log(f"deadline: skipping {stack} {pol} {wname} #{rep}")
                report["runs"].append({"stack": stack, "policy": pol, "workload": wname,
                                       "repeat": rep, "skipped": "deadline"})
                continue
            wl = wls[wname]
            run = {"stack": stack, "policy": pol, "workload": wname, "repeat": rep}
            router = None
            try:
                if stack == "rayattn":
                    name_, settings = variant(pol)
                    settings = {**base_settings, **settings}
                    if app.many_routers:
                        # Several routers: the settings reach each through user_config;
                        # the reset then finds them set and only empties the caches.
                        app.set_router({"policy": name_, **settings})
                    r = httpx.post(f"{app.url}/admin/reset", json={
                        "policy": name_, "settings": settings}, timeout=120)
                    r.raise_for_status()
                    run["cold"] = r.json().get("cold")
                    url, before = app.url, None
                else:
                    run["reset"] = reset_peers()
                    run["cold"] = all(ok for _, ok in run["reset"])
                    router, run["router_start_s"] = start_router(pol, logdir)
                    url, before = f"http://127.0.0.1:{ROUTER_PORT}", peer_counts()
                res, wall = asyncio.run(run_workload(url, name, wl, concurrency=a.concurrency,
                                                     timeout=300, think_s=a.think_s))
                s = summarize(res, wall)
                if stack == "rayattn":
                    s["routers"] = app.running_routers()  # what the tier sized itself to
                if before is not None:
                    after = peer_counts()
                    s["per_replica"] = {f"server-{i}": after[i] - before[i] for i in range(2)}
                    n = sum(s["per_replica"].values()) or 1
                    s["max_replica_share"] = max(s["per_replica"].values()) / n
                else:
                    run["router_counts"] = httpx.get(f"{app.url}/health",
                                                     timeout=30).json().get("counts")
                    stalls = {k: v for k, v in run["router_counts"].items()
                              if k.startswith(("loop_", "gc_"))}
                    log(f"  router stalls since start: {stalls}")
                    run["routers_view"] = routers_view(app.url)
                    for pid, v in run["routers_view"].items():
                        log(f"  router {pid}: moves {v['moves']} engines {v['engines']}")
                    run["moved"] = moved_detail(res)
                    log(f"  moved: {run['moved']}")
                run["client_stalls"] = dict(CLIENT_STALLS)
                log(f"  client stalls: {CLIENT_STALLS}")
                run["summary"], run["results"] = s, results_json(res)
                later = sorted(x.ttft_s for x in res if x.status == 200 and x.turn > 0)
                s["later_ttft_p50_s"] = percentile(later, 0.5)
                s["later_ttft_p90_s"] = percentile(later, 0.9)
                log(f"{stack:11s} {pol:19s} {wname:13s} #{rep} ok={s['ok']}/{s['requests']} "
                    f"hit={s['hit_rate']:.3f} ttft p50={s['ttft_p50_s']:.3f} "
                    f"p90={s['ttft_p90_s']:.3f} later p50={s['later_ttft_p50_s']:.3f} "
                    f"p90={s['later_ttft_p90_s']:.3f} out tok/s={s['output_tok_per_s']:.0f} "
                    f"wall={wall:.1f}s moves={s['moves']}"
                    + (f" {s['move_reasons']}" if s.get("move_reasons") else "")
                    + f" regret={s['regret_tokens']} "
                    f"split={s['per_replica']}{'' if run.get('cold') else ' NOT COLD'}"
                    + (f" routers={s['routers']}" if "routers" in s else "")
                    # One router's count since start (the one /health reached).
                    + (f" kv_held_total={run['router_counts'].get('kv_held')}"
                       if run.get("router_counts") else ""))
                if s.get("hops"):
                    log("  hops p50/p99 ms: " + "  ".join(
                        f"{k} {v['p50_ms']:.0f}/{v['p99_ms']:.0f}" for k, v in s["hops"].items()))
            except Exception as e:
                run["error"] = repr(e)
                fail(f"{stack} {pol} {wname}: {e!r}")
            finally:
                if router is not None:
                    stop(router)
            report["runs"].append(run)

        # --- per-path metrics from Ray's Prometheus endpoint ----------------------------
        time.sleep(4)
        text = app.scrape()
        m = series(text, "ray_rayattn_")
        checks = {
            "requests_prefill": total(m, "ray_rayattn_requests_total", 'path="prefill"'),
            "requests_extend": total(m, "ray_rayattn_requests_total", 'path="extend"'),
            "tokens_prefill_computed": total(m, "ray_rayattn_tokens_total", 'path="prefill"',
                                             'kind="computed"'),
            "tokens_extend_cached": total(m, "ray_rayattn_tokens_total", 'path="extend"',
                                          'kind="cached"'),
            "tokens_decode_generated": total(m, "ray_rayattn_tokens_total", 'path="decode"'),
            "ttft_count_prefill": total(m, "ray_rayattn_ttft_seconds_count", 'path="prefill"'),
            "ttft_count_extend": total(m, "ray_rayattn_ttft_seconds_count", 'path="extend"'),
            "decode_itl_count": total(m, "ray_rayattn_decode_itl_seconds_count"),
            "step_metrics_available": total(m, "ray_rayattn_step_metrics_available"),
            "step_tokens_total": total(m, "ray_rayattn_step_tokens_total"),
        }
        need = ["requests_prefill", "requests_extend", "tokens_decode_generated",
                "ttft_count_prefill", "ttft_count_extend", "decode_itl_count"]
        ok = all(checks[k] > 0 for k in need)
        report["checks"]["per_path_metrics_nonzero"] = {"pass": ok, **checks}
        log(f"ASSERT per_path_metrics_nonzero: {'PASS' if ok else 'FAIL'} {checks}")
        if parse_args(args).engine.kv_offload.enabled:
            # The dashboard's host-tier panels (CPU tests cannot run a host tier): every
            # series they read is exported here, and moved during the runs.
            from rayattn.metrics.dashboard import PANELS, metric_names

            every = series(text, "ray_")
            names = metric_names([e for p in PANELS if p.host_tier for e, _ in p.exprs])
            got = {n: total(every, n + "{") for n in sorted(names)}
            ok = all(v > 0 for v in got.values())
            report["checks"]["host_tier_series_nonzero"] = {"pass": ok, **got}
            log(f"ASSERT host_tier_series_nonzero: {'PASS' if ok else 'FAIL'} {got}")
        (out / "metrics.prom").write_text("\n".join(
            ln for ln in text.splitlines() if ln.startswith(("ray_rayattn_", "ray_vllm_"))))
    except Exception as e:
        report["error"] = repr(e)
        fail(repr(e))
    finally:
        for p in peers:
            stop(p)
        for f in sorted(logdir.glob("*.log")):
            report.setdefault("log_tails", {})[f.name] = f.read_text()[-3000:]
        dump(out / "routing.json", report)
        if app is not None:
            app.shutdown()
    log(f"done in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
