"""Engine coefficients for the simulator, fitted from a real `rayattn bench` run.

Two stages. `fit_engine_model` reads the engine's own timings from every request's account
(`rayattn` in the response) and fits the step model of rayattn/bench/simulate.py, read as
additive, by least squares: a first guess, biased because a request's prefill and
inter-token times include the other requests batched into the same steps. `calibrate`
then replays the run's exact requests through the simulator (the shipped routing core
included) and adjusts the coefficients until the simulated run matches the real one's
engine-side TTFT and wall time.
`router_s` (the router's own time per request, in every account) and `hop_s` (the rest of
the way: proxy, engine calls, streaming; the median of client TTFT minus engine TTFT minus
the router's time) are measured directly; `frontend_s` (the engine replica's own work
before vLLM queues the request) starts from the lower quartile of engine TTFT minus vLLM's
queue and prefill times and is calibrated with the rest. `step_overlap` starts at 1 (a
roofline) and is calibrated too. Validate on other seeds than the ones calibrated on
(bench/sim_fidelity.py).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, fields, replace

import httpx
import numpy as np

from rayattn.bench.driver import Result
from rayattn.bench.simulate import EngineModel, SimRequest, simulate
from rayattn.bench.stats import percentile


def _lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Non-negative least squares by clipping (two or three columns; numpy is there)."""
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
    hops = [r.ttft_s - r.engine_ttft_s - (r.router_s or 0.0)
            for r in ok if r.engine_ttft_s is not None]
    router_times = [r.router_s for r in ok if r.router_s is not None]
    # Engine arrival → vLLM's queue: the engine replica's own intake (and its rendering,
    # where the router's could not be served as it is). On CPU it shares a core with the
    # engine's compute and stretches while a long prefill runs: start from the lower
    # quartile (uncontended); calibration adjusts it.
    front = sorted(r.engine_ttft_s - (r.engine_queue_s or 0.0) - r.engine_prefill_s
                   for r in ok if r.engine_ttft_s is not None)
    return replace(base, prefill_s_per_token=prefill or base.prefill_s_per_token,
                   ctx_s_per_token=ctx, itl_base_s=itl_base, itl_per_seq_s=itl_per_seq,
                   hop_s=max(0.0, statistics.median(hops)) if hops else base.hop_s,
                   router_s=statistics.mean(router_times) if router_times else base.router_s,
                   frontend_s=max(0.0, front[len(front) // 4]) if front else 0.0,
                   step_overlap=1.0)


def results_from_json(rows: list[dict]) -> list[Result]:
    """Results as `rayattn bench` saves them (raw.json) back into Result objects."""
    names = {f.name for f in fields(Result)}
    return [Result(**{k: v for k, v in row.items() if k in names}) for row in rows]


def base_model(url: str, engine_cfg: dict) -> EngineModel:
    """The deployment's fixed facts (block size, KV capacity from /health; batch limits from
    the engine settings), with the default coefficients."""
    engine = next(iter(httpx.get(f"{url}/health", timeout=10).json()["engines"].values()))
    return EngineModel(capacity_blocks=engine["kv_blocks"], block_size=engine["block_size"],
                       max_batched_tokens=engine_cfg.get("max_num_batched_tokens") or 2048,
                       max_seqs=engine_cfg.get("max_num_seqs") or 256)


@dataclass
class Case:
    """One real run to calibrate on: its exact requests and what the engines did."""

    trace: list[SimRequest]
    concurrency: int
    replicas: int
    engine_ttft_p50_s: float
    engine_ttft_p90_s: float
    engine_prefill_p50_s: float
    engine_itl_p50_s: float
    wall_s: float
    think_s: float = 0.0


def case_of(results: list[Result], trace: list[SimRequest], wall_s: float,
            concurrency: int, replicas: int, think_s: float = 0.0) -> Case:
    ok = [r for r in results if r.status == 200 and r.engine_ttft_s is not None]
    ttft = sorted(r.engine_ttft_s for r in ok)  # type: ignore[misc]
    prefill = sorted(r.engine_prefill_s or 0.0 for r in ok)
    itl = sorted(r.engine_itl_s for r in ok if r.engine_itl_s)
    return Case(trace, concurrency, replicas, percentile(ttft, 0.5), percentile(ttft, 0.9),
                percentile(prefill, 0.5), percentile(itl, 0.5), wall_s, think_s)


_CALIBRATED = ("prefill_s_per_token", "itl_base_s", "itl_per_seq_s", "ctx_s_per_token",
               "attn_s_per_token_pair", "frontend_s", "step_overlap", "contention")
# A share: past 1 a step would run for less than its longer part, or for less than nothing.
_CEILING = {"step_overlap": 1.0}


# Where a coefficient the least-squares stage left at 0 starts its search.
_START_VALUE = {"prefill_s_per_token": 1e-4, "itl_base_s": 1e-2, "itl_per_seq_s": 1e-4,
               "ctx_s_per_token": 1e-6, "attn_s_per_token_pair": 1e-8,
               "frontend_s": 1e-2, "step_overlap": 1.0, "contention": 0.1}

# Where calibration also starts, for engines that share a host: each step this much longer
# while another engine of the host has work, and faster alone. Coordinate descent does not
# find it from independent engines (every time coefficient must fall as contention rises),
# so both starts are searched and the better fit kept.
_SHARED_HOST_CONTENTION = 0.4
_TIMES = ("prefill_s_per_token", "itl_base_s", "itl_per_seq_s", "ctx_s_per_token",
          "attn_s_per_token_pair")


def calibrate(cases: list[Case], start: EngineModel, rounds: int = 6,
              policy: str = "affinity", seeds: int = 8) -> EngineModel:
    """Coordinate descent in log space on the step model's coefficients, minimising the
    squared log-ratios of simulated to real engine-side TTFT p50 / p90, prefill and
    inter-token medians and wall time over `cases`, each case simulated with `seeds` seeds
    where the run has chance in it (the router's time decides the order of
    near-simultaneous arrivals; think times). Searched from `start` and from a start with
    engines that share a host and slow each other down (`contention`); the better fit is
    kept. The runs' engines are taken to share one host, as they do in every setup
    calibrated here (the local CPU deployment, two engines on one GPU)."""
    random_runs = start.router_s > 0 or any(c.think_s > 0 for c in cases)
    sim_seeds = range(seeds if random_runs else 1)

    def loss(m: EngineModel) -> float:
        total = 0.0
        for c, k in ((c, k) for c in cases for k in sim_seeds):
            r = simulate(c.trace, c.replicas, policy, m, index="events",
                         concurrency=c.concurrency, think_s=c.think_s, seed=k)
            for sim, real in ((r.engine_ttft_p50_s, c.engine_ttft_p50_s),
                              (r.engine_ttft_p90_s, c.engine_ttft_p90_s),
                              (r.engine_prefill_p50_s, c.engine_prefill_p50_s),
                              (r.engine_itl_p50_s, c.engine_itl_p50_s),
                              (r.sim_wall_s, c.wall_s)):
                if math.isfinite(real):  # a target the run has (no ITL without decodes)
                    total += math.log(max(sim, 1e-4) / max(real, 1e-4)) ** 2
        return total

    def descend(best: EngineModel) -> tuple[float, EngineModel]:
        best_loss = loss(best)
        step = 2.0
        for _ in range(rounds):
            for name in _CALIBRATED:
                for factor in (step, 1 / step):
                    value = min(getattr(best, name) * factor or _START_VALUE[name] * factor,
                                _CEILING.get(name, math.inf))
                    if value == getattr(best, name):
                        continue
                    trial = replace(best, **{name: value})
                    trial_loss = loss(trial)
                    if trial_loss < best_loss:
                        best, best_loss = trial, trial_loss
            step = math.sqrt(step)
        return best_loss, best

    start = replace(start, engines_per_host=max(c.replicas for c in cases))
    slowed = 1 + _SHARED_HOST_CONTENTION
    shared = replace(start, contention=_SHARED_HOST_CONTENTION,
                     **{name: getattr(start, name) / slowed for name in _TIMES})
    return min((descend(start), descend(shared)), key=lambda fit: fit[0])[1]
