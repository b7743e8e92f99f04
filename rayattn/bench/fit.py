"""Engine coefficients for the simulator, fitted from a real `rayattn bench` run.

Every request's account (`rayattn` in the response) carries the engine's own timings; the
step model of rayattn/bench/simulate.py is fitted to them by least squares:

  * decode: a request's inter-token latency = itl_base_s + itl_per_seq_s × the requests
    running beside it on its replica (from the run's own start/end times);
  * prefill: scheduled → first token = one step with the co-running decodes, plus
    prefill_s_per_token × the tokens it computed + ctx_s_per_token × those it reused;
  * hop_s: the median of client TTFT minus engine TTFT (router, proxy, streaming).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import replace

from rayattn.bench.driver import Result
from rayattn.bench.simulate import EngineModel


def _lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Non-negative least squares by clipping (two or three columns; numpy is there)."""
    import numpy as np

    a, b = np.array(rows, dtype=float), np.array(ys, dtype=float)
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    return [max(float(c), 0.0) for c in coef]


def _concurrency(ok: list[Result]) -> dict[int, float]:
    """For each request, the mean number of other requests in flight on its replica while
    it decoded (from the client's own clock)."""
    by_replica: dict[str, list[tuple[int, Result]]] = defaultdict(list)
    for i, r in enumerate(ok):
        by_replica[r.replica].append((i, r))
    out: dict[int, float] = {}
    for group in by_replica.values():
        for i, r in group:
            a, b = r.start_s + r.ttft_s, r.start_s + r.e2e_s
            if b <= a:
                continue
            overlap = sum(max(0.0, min(b, o.start_s + o.e2e_s) - max(a, o.start_s))
                          for j, o in group if j != i)
            out[i] = overlap / (b - a)
    return out


def fit_engine_model(results: list[Result], base: EngineModel) -> EngineModel:
    """`base`'s coefficients refitted to `results` (its capacity, block size and batch
    limits are the deployment's, not fitted)."""
    ok = [r for r in results if r.status == 200 and r.engine_prefill_s is not None]
    if len(ok) < 8:
        raise ValueError(f"{len(ok)} requests with engine timings: too few to fit")
    running = _concurrency(ok)
    rows, ys = [], []
    for i, r in enumerate(ok):
        if r.engine_itl_s and r.completion_tokens > 2 and i in running:
            rows.append([1.0, 1.0 + running[i]])
            ys.append(r.engine_itl_s)
    itl_base, itl_per_seq = _lstsq(rows, ys) if len(rows) >= 4 else (base.itl_base_s,
                                                                     base.itl_per_seq_s)
    rows, ys = [], []
    for i, r in enumerate(ok):
        step = itl_base + itl_per_seq * running.get(i, 0.0)
        computed = r.prompt_tokens - r.cached_tokens
        rows.append([float(computed), float(r.cached_tokens)])
        ys.append(max(0.0, r.engine_prefill_s - step))  # type: ignore[operator]
    prefill, ctx = _lstsq(rows, ys)
    hops = [r.ttft_s - r.engine_ttft_s for r in ok if r.engine_ttft_s is not None]
    return replace(base, prefill_s_per_token=prefill or base.prefill_s_per_token,
                   ctx_s_per_token=ctx, itl_base_s=itl_base, itl_per_seq_s=itl_per_seq,
                   hop_s=max(0.0, statistics.median(hops)) if hops else base.hop_s)


def results_from_json(rows: list[dict]) -> list[Result]:
    """Results as `rayattn bench` saves them (raw.json) back into Result objects."""
    from dataclasses import fields

    names = {f.name for f in fields(Result)}
    return [Result(**{k: v for k, v in row.items() if k in names}) for row in rows]


def base_model(url: str, engine_cfg: dict) -> EngineModel:
    """The deployment's fixed facts (block size, KV capacity from /health; batch limits from
    the engine settings), with the default coefficients."""
    import httpx

    engine = next(iter(httpx.get(f"{url}/health", timeout=10).json()["engines"].values()))
    return EngineModel(capacity_blocks=engine["kv_blocks"], block_size=engine["block_size"],
                       max_batched_tokens=engine_cfg.get("max_num_batched_tokens") or 2048,
                       max_seqs=engine_cfg.get("max_num_seqs") or 256)
