"""The extend-path gain per attention backend, offline vLLM on one GPU (docs/results.md).

For each backend: TTFT of a cold prefill (prefix + 64-token suffix, nothing cached) against
the same prefix cached + a new 64-token suffix (vLLM's extend path), at 1k, 8k and 32k tokens
of context (median of --reps, a fresh random prefix each time); decode inter-token latency
(single stream at 1k and 32k of context, and batches of 16 and 64 at 1k). Each figure is the
wall time of `LLM.generate` with token-id prompts, after a warm-up at every length (Triton
JIT, CUDA graphs). Chunked prefill with 8192-token steps, as deployments/h200.yaml serves.

Driver: `python3 bench/gpu/backends.py --models mha=DIR1,mla=DIR2 --runs
FLASH_ATTN@mha,TRITON_MLA@mla --gpus 0,1 --out OUT` runs one subprocess per (backend, model),
each on the next free GPU, and writes OUT/backends.json. One backend alone:
`--one BACKEND --model DIR` (on the visible GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

LENS = (1024, 8192, 32768)
SUFFIX = 64


def bench_one(a: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    block = 64 if a.one in ("FLASHMLA", "FLASHMLA_SPARSE") else 16
    t0 = time.perf_counter()
    llm = LLM(model=a.model, attention_backend=a.one, dtype="bfloat16", block_size=block,
              gpu_memory_utilization=a.gpu_mem, max_model_len=max(LENS) + 2 * SUFFIX + 512,
              enable_prefix_caching=True, max_num_batched_tokens=8192, max_num_seqs=64,
              seed=0, compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]})
    vc = llm.llm_engine.vllm_config
    res: dict = {"backend": a.one, "model": a.model,
                 "startup_s": round(time.perf_counter() - t0, 1),
                 "block_size": vc.cache_config.block_size,
                 "num_gpu_blocks": vc.cache_config.num_gpu_blocks,
                 "attention_config": str(getattr(vc, "attention_config", None)),
                 "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens}
    print("engine up:", json.dumps(res), flush=True)
    rng = random.Random(0)
    vocab = vc.model_config.get_vocab_size()

    def toks(n: int) -> list[int]:
        return [rng.randrange(5, vocab) for _ in range(n)]

    def gen(prompts: list[list[int]], max_tokens: int):
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp,
                            use_tqdm=False)
        return time.perf_counter() - t, outs

    for n in LENS:  # warm-up at every length: prefill and extend kernels, Triton JIT
        p = toks(n)
        gen([p + toks(SUFFIX)], 1)
        gen([p + toks(SUFFIX)], 1)
    for n in LENS:
        cold, warm, cached = [], [], []
        for _ in range(a.reps):
            prefix = toks(n)
            dt, _ = gen([prefix + toks(SUFFIX)], 1)
            cold.append(dt)
            dt, outs = gen([prefix + toks(SUFFIX)], 1)
            warm.append(dt)
            cached.append(outs[0].num_cached_tokens or 0)
        c, w = statistics.median(cold), statistics.median(warm)
        res[f"prefill_{n}_ms"] = round(1000 * c, 2)
        res[f"extend_{n}_ms"] = round(1000 * w, 2)
        res[f"extend_over_prefill_{n}"] = round(w / c, 3)
        res[f"prefill_{n}_spread_ms"] = [round(1000 * min(cold), 2), round(1000 * max(cold), 2)]
        res[f"extend_{n}_spread_ms"] = [round(1000 * min(warm), 2), round(1000 * max(warm), 2)]
        res[f"extend_{n}_cached_tokens"] = statistics.median(cached)
        print(f"{a.one} len {n}: prefill {res[f'prefill_{n}_ms']} ms, extend "
              f"{res[f'extend_{n}_ms']} ms (x{res[f'extend_over_prefill_{n}']}, "
              f"cached {cached})", flush=True)

    def itl(batch: int, ctx: int, steps: int = 128) -> float:
        prompts = [toks(ctx) for _ in range(batch)]
        gen(prompts, 1)  # cache the prompts: both timed runs below start from the cache
        t1 = min(gen(prompts, 1)[0] for _ in range(2))
        tn = min(gen(prompts, steps + 1)[0] for _ in range(2))
        return (tn - t1) / steps

    for batch, ctx in ((1, 1024), (1, 32768), (16, 1024), (64, 1024)):
        v = itl(batch, ctx)
        res[f"itl_b{batch}_ctx{ctx}_ms"] = round(1000 * v, 3)
        print(f"{a.one} decode ITL batch {batch} ctx {ctx}: {1000 * v:.3f} ms", flush=True)
    print("result:", json.dumps(res), flush=True)
    return res


def drive(a: argparse.Namespace) -> int:
    """A work queue of (backend, model) runs; each GPU takes the next run when it is free."""
    models = dict(kv.split("=", 1) for kv in a.models.split(","))
    queue = [tuple(r.split("@", 1)) for r in a.runs.split(",")]
    gpus = a.gpus.split(",")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/rayattn-gpu")
    (work / "logs").mkdir(parents=True, exist_ok=True)
    running: dict[str, tuple[subprocess.Popen, str, float]] = {}
    results: dict[str, dict] = {}
    t0 = time.time()

    def launch(g: str) -> None:
        while queue:
            b, m = queue.pop(0)
            key = f"{b}@{m}"
            if time.time() - t0 > a.deadline_s:
                results[key] = {"backend": b, "model": m, "skipped": "deadline"}
                continue
            logf = open(work / "logs" / f"backend-{b}-{m}.log", "w")
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": g}
            cmd = [sys.executable, __file__, "--one", b, "--model", models[m], "--reps",
                   str(a.reps), "--gpu-mem", str(a.gpu_mem), "--json", str(work / f"{key}.json")]
            # own process group: a run past its time is killed with its engine-core child
            running[g] = (subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                           start_new_session=True), key, time.time())
            print(f"{time.strftime('%H:%M:%S')} GPU {g}: {key} started", flush=True)
            return

    for g in gpus:
        launch(g)
    while running:
        time.sleep(2)
        for g, (p, key, ts) in list(running.items()):
            if p.poll() is None and time.time() - ts < a.timeout_s:
                continue
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            del running[g]
            b, m = key.split("@")
            jf = work / f"{key}.json"
            log = (work / "logs" / f"backend-{b}-{m}.log").read_text(errors="replace")
            if p.returncode == 0 and jf.exists():
                results[key] = json.loads(jf.read_text())
            else:
                tail = [ln for ln in log.splitlines() if "rror" in ln or "Traceback" in ln]
                results[key] = {"backend": b, "model": m, "error": f"exit {p.returncode}",
                                "log_errors": tail[-15:], "log_tail": log[-2500:]}
            results[key]["wall_s"] = round(time.time() - ts, 1)
            results[key]["gpu"] = g
            results[key]["model_key"] = m
            status = results[key].get("error", "ok")
            print(f"{time.strftime('%H:%M:%S')} GPU {g}: {key} finished ({status}, "
                  f"{results[key]['wall_s']} s)", flush=True)
            for ln in results[key].get("log_errors", [])[-6:]:
                print("    ", ln[:240], flush=True)
            launch(g)
    (out / "backends.json").write_text(json.dumps(results, indent=1))
    cols = ["startup_s"] + [f"{k}_{n}_ms" for n in LENS for k in ("prefill", "extend")] + [
        f"extend_over_prefill_{n}" for n in LENS] + ["itl_b1_ctx1024_ms", "itl_b1_ctx32768_ms",
                                                     "itl_b64_ctx1024_ms"]
    print("run | " + " | ".join(cols))
    for key, r in results.items():
        print(key + " | " + " | ".join(str(r.get(c, "-")) for c in cols), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="(with --one) model directory")
    ap.add_argument("--models", default="", help="KEY=DIR,... for --runs")
    ap.add_argument("--runs", default="", help="BACKEND@KEY,... in the order to start them")
    ap.add_argument("--gpus", default="0")
    ap.add_argument("--out", default="/tmp/rayattn-gpu/out")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gpu-mem", type=float, default=0.85)
    ap.add_argument("--timeout-s", type=float, default=400)
    ap.add_argument("--deadline-s", type=float, default=400,
                    help="start no backend after this many seconds")
    ap.add_argument("--one", help="(internal) run one backend on the visible GPU")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.one:
        res = bench_one(a)
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
        return 0
    return drive(a)


if __name__ == "__main__":
    sys.exit(main())
