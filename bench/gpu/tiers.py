"""The extend path from each KV tier, on one GPU (docs/results.md, "The KV hierarchy").

One vLLM engine with a host-memory KV tier (vLLM's native offloading, as rayattn's
`engine.kv_offload` configures it). For each context length L and repeat, with random token
ids so nothing is shared between measurements:

  cold  a prompt of L tokens + 64 new ones, after both tiers were emptied: a full prefill
  hbm   the same L tokens + 64 other new ones: the prefix is in the engine's own cache (extend)
  host  the GPU cache emptied (reset_prefix_cache without the connector, so the host copies
        stay), then the same L tokens + 64 more: vLLM reloads the prefix from host memory

Each is one request alone on the engine, TTFT measured in-process from submit to the first
token, with the tokens vLLM reports as cached (the check that the path is the one named).
Then the same with kv_cache_dtype fp8: KV tokens per GiB (from the blocks vLLM allocates in
the same bytes) and what the smaller KV does to each path.

Usage (device, vLLM installed, model made by `rayattn tiny-model llama-0.85b`):
  python3 bench/gpu/tiers.py --model /tmp/rayattn-gpu/llama-0.85b --out $OUT
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import uuid
from pathlib import Path
from typing import Any


def log(*a: Any) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)


async def first_token(engine: Any, ids: list[int]) -> tuple[float, int]:
    """(TTFT in seconds, tokens vLLM served from cache) of one request alone."""
    from vllm import SamplingParams

    t0 = time.perf_counter()
    ttft, cached = None, -1
    async for out in engine.generate({"prompt_token_ids": ids},
                                     SamplingParams(max_tokens=1, temperature=0),
                                     uuid.uuid4().hex):
        if ttft is None:
            ttft = time.perf_counter() - t0
        cached = out.num_cached_tokens if out.num_cached_tokens is not None else -1
    return float(ttft or 0.0), cached


async def measure(a: argparse.Namespace, kv_dtype: str) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kw: dict[str, Any] = dict(
        model=a.model, dtype=a.dtype, kv_cache_dtype=kv_dtype, block_size=a.block_size,
        kv_cache_memory_bytes=int(a.kv_gib * (1 << 30)), gpu_memory_utilization=a.gpu_util,
        max_model_len=max(max(a.contexts), 2048) + 2 * a.new + 64, enable_prefix_caching=True,
        max_num_batched_tokens=8192, max_num_seqs=16, disable_log_stats=True,
        enforce_eager=a.enforce_eager)
    if a.offload_gib:
        kw.update(kv_offloading_size=a.offload_gib, kv_offloading_backend="native")
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
    try:
        cache = engine.vllm_config.cache_config
        blocks = int(cache.num_gpu_blocks or 0)
        report: dict[str, Any] = {
            "kv_cache_dtype": kv_dtype, "kv_gib": a.kv_gib, "offload_gib": a.offload_gib,
            "gpu_blocks": blocks, "block_size": cache.block_size,
            "tokens_per_gib": round(blocks * cache.block_size / a.kv_gib), "rows": []}
        rng = random.Random(7)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(100, 30000) for _ in range(n)]

        for _ in range(2):  # warm-up: compile, allocate, the first transfers
            await engine.reset_prefix_cache(reset_connector=True)
            warm = tokens(min(2048, max(a.contexts)))
            await first_token(engine, warm + tokens(a.new))
            await first_token(engine, warm + tokens(a.new))
        for length in a.contexts:
            for rep in range(a.repeats):
                prefix = tokens(length)
                await engine.reset_prefix_cache(reset_connector=True)
                row: dict[str, Any] = {"context": length, "repeat": rep}
                row["cold_s"], row["cold_cached"] = await first_token(engine,
                                                                      prefix + tokens(a.new))
                row["hbm_s"], row["hbm_cached"] = await first_token(engine,
                                                                    prefix + tokens(a.new))
                if a.offload_gib:
                    await asyncio.sleep(a.settle_s)  # the host copies are written async
                    if not await engine.reset_prefix_cache():  # HBM only: host copies stay
                        log("GPU prefix cache reset refused")
                    row["host_s"], row["host_cached"] = await first_token(
                        engine, prefix + tokens(a.new))
                report["rows"].append(row)
                log(kv_dtype, json.dumps(row))
        return report
    finally:
        engine.shutdown()


def summary(reports: list[dict]) -> list[str]:
    lines = ["| kv dtype | tokens/GiB | context | cold prefill s | extend from HBM s | "
             "extend from host s | cached (hbm / host) |", "|---|---|---|---|---|---|---|"]
    for r in reports:
        for length in sorted({x["context"] for x in r["rows"]}):
            rows = [x for x in r["rows"] if x["context"] == length]

            def med(k: str, rows: list[dict] = rows) -> str:
                vals = [x[k] for x in rows if k in x]
                return f"{statistics.median(vals):.3f}" if vals else "-"
            cached = f"{rows[0]['hbm_cached']} / {rows[0].get('host_cached', '-')}"
            lines.append(f"| {r['kv_cache_dtype']} | {r['tokens_per_gib']:,} | {length:,} | "
                         f"{med('cold_s')} | {med('hbm_s')} | {med('host_s')} | {cached} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1024, 8192, 32768])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-dtypes", default="auto,fp8")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-gib", type=float, default=8.0)
    ap.add_argument("--offload-gib", type=float, default=16.0)
    ap.add_argument("--gpu-util", type=float, default=0.5)
    ap.add_argument("--new", type=int, default=64, help="new tokens after the prefix")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--settle-s", type=float, default=1.0)
    ap.add_argument("--enforce-eager", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = [asyncio.run(measure(a, d)) for d in a.kv_dtypes.split(",")]
    table = summary(reports)
    (out / "tiers.json").write_text(json.dumps({"args": vars(a), "reports": reports},
                                               indent=1))
    (out / "tiers.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
