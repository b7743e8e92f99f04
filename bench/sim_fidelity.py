"""Does `rayattn simulate` predict the real run? Real CPU engines and the simulator, same
workloads, same seeds, one invocation.

Starts deployments/local.yaml (2 engines), runs each workload closed-loop with the
affinity router on cold caches (runs.json), fits and calibrates the simulator's engine
coefficients on the runs of `--fit-seed` only (rayattn/bench/fit.py, engine_model.json),
then replays every other run's exact requests (prompts, outputs, conversation order)
through the simulator at the same concurrency and prints real vs simulated hit/oracle and
TTFT p50/p90. `--repeats N` runs every real case N times: the table compares the simulator
with the median of the real runs and shows their spread, the noise any prediction lives
with. The simulator draws the router's time per request (which request of a burst it
routes first), so every case is simulated `--sim-seeds` times and the table takes their
median too. `--runs runs.json` redoes the fit and the table from saved runs.

    .venv/bin/python bench/sim_fidelity.py --out bench/results/fidelity
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from rayattn.bench.cli import score, start_local, stop_local
from rayattn.bench.driver import results_json, run_workload
from rayattn.bench.fit import (
    base_model,
    calibrate,
    case_of,
    fit_engine_model,
    results_from_json,
)
from rayattn.bench.simulate import EngineModel, simulate, trace_from_run
from rayattn.bench.workloads import doc_chat, multi_turn, shared_prefix
from rayattn.models.embedded import resolve_embedded


def real_runs(a: argparse.Namespace, workloads) -> dict:
    url, startup = start_local(a.port)
    print(f"local deployment up in {startup:.1f}s")
    runs = []
    try:
        base = base_model(url, {"max_num_batched_tokens": 2048, "max_num_seqs": 32})
        for seed in [a.fit_seed] + [int(s) for s in a.seeds.split(",")]:
            for name, wl in workloads(seed).items():
                for policy in a.policies.split(","):
                    if seed == a.fit_seed and policy != "affinity":
                        continue  # calibrated on affinity runs only
                    for repeat in range(a.repeats):
                        httpx.post(f"{url}/admin/reset", json={"policy": policy},
                                   timeout=60).raise_for_status()
                        res, wall = asyncio.run(run_workload(url, "smollm2", wl,
                                                             concurrency=a.concurrency))
                        runs.append({"seed": seed, "workload": name, "policy": policy,
                                     "repeat": repeat, "wall_s": wall,
                                     "results": results_json(res)})
                        print(f"real {name} {policy} seed {seed} #{repeat}: wall {wall:.1f}s",
                              flush=True)
    finally:
        stop_local()
    return {"base": asdict(base), "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--fit-seed", type=int, default=0,
                    help="seed of the runs the coefficients are fitted from (not scored)")
    ap.add_argument("--out", default="bench/results/fidelity")
    ap.add_argument("--runs", help="runs.json of an earlier invocation: no real runs")
    ap.add_argument("--policies", default="affinity,round_robin",
                    help="policies run and simulated on the validation seeds")
    ap.add_argument("--repeats", type=int, default=1,
                    help="real runs of every case (the table takes their median)")
    ap.add_argument("--sim-seeds", type=int, default=11,
                    help="simulated runs of every case (the table takes their median)")
    a = ap.parse_args()
    if a.repeats < 1 or a.sim_seeds < 1:
        ap.error("--repeats and --sim-seeds must be at least 1")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(resolve_embedded("rayattn://smollm2-135m")))

    def workloads(seed: int) -> dict:
        return {"shared_prefix": shared_prefix(groups=4, prompts_per_group=8, seed=seed),
                "multi_turn": multi_turn(conversations=12, turns=4, shared_systems=4,
                                         seed=seed),
                "doc_chat": doc_chat(conversations=12, turns=4, seed=seed)}

    if a.runs:
        saved = json.loads(Path(a.runs).read_text())
    else:
        saved = real_runs(a, workloads)
        (out / "runs.json").write_text(json.dumps(saved))
    base = EngineModel(**saved["base"])
    runs = []
    for run in saved["runs"]:
        wl = workloads(run["seed"])[run["workload"]]
        res = results_from_json(run["results"])
        runs.append((run["seed"], run["workload"], run.get("policy", "affinity"), wl, res,
                     score(res, run["wall_s"], wl, tok, base.block_size)))
    fit = [(res, trace_from_run(res, wl, tok, base.block_size), real["wall_s"])
           for s, _, policy, wl, res, real in runs if s == a.fit_seed and policy == "affinity"]
    first = fit_engine_model([r for res, _, _ in fit for r in res], base)
    model = calibrate([case_of(res, tr, wall, a.concurrency, 2) for res, tr, wall in fit],
                      first)
    model.save(out / "engine_model.json")
    print("least squares:", asdict(first))
    print("calibrated:", asdict(model))
    cases: dict[tuple[int, str, str], list[tuple]] = defaultdict(list)
    for seed, name, policy, wl, res, real in runs:
        if seed != a.fit_seed:
            cases[(seed, name, policy)].append((wl, res, real))
    rows = []
    for (seed, name, policy), reals in cases.items():
        wl, res, _ = reals[0]  # the simulator replays the first run's requests
        trace = trace_from_run(res, wl, tok, model.block_size)
        sims = [simulate(trace, 2, policy, model, index="events", concurrency=a.concurrency,
                         seed=k) for k in range(a.sim_seeds)]
        row = {"workload": name, "seed": seed, "policy": policy, "real_runs": len(reals),
               "sim_runs": len(sims)}
        for key, sim_key in (("hit_vs_oracle", "hit_vs_oracle"), ("ttft_p50_s", "ttft_p50_s"),
                             ("ttft_p90_s", "ttft_p90_s"),
                             ("later_ttft_p90_s", "later_ttft_p90_s"), ("wall_s", "sim_wall_s")):
            row[f"sim_{key}"] = statistics.median(getattr(x, sim_key) for x in sims)
        for key, real_key in (("hit_vs_oracle", "hit_vs_block_oracle"),
                              ("ttft_p50_s", "ttft_p50_s"), ("ttft_p90_s", "ttft_p90_s"),
                              ("later_ttft_p90_s", "later_ttft_p90_s"), ("wall_s", "wall_s")):
            values = [r[real_key] for _, _, r in reals]
            row[f"real_{key}"] = statistics.median(values)
            row[f"real_{key}_range"] = [min(values), max(values)]
        rows.append(row)

    def measured(r: dict, key: str, fmt: str) -> str:
        lo, hi = r[f"real_{key}_range"]
        spread = f" ({lo:{fmt}}–{hi:{fmt}})" if r["real_runs"] > 1 else ""
        return f"{r[f'real_{key}']:{fmt}}{spread}"

    lines = ["| workload | policy | seed | hit/oracle real | sim | TTFT p50 real s | sim | "
             "ratio | TTFT p90 real s | sim | ratio | wall real s | sim |", "|" + "---|" * 13]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['policy']} | {r['seed']} | "
            f"{measured(r, 'hit_vs_oracle', '.3f')} | {r['sim_hit_vs_oracle']:.3f} | "
            f"{measured(r, 'ttft_p50_s', '.2f')} | {r['sim_ttft_p50_s']:.2f} | "
            f"{r['sim_ttft_p50_s'] / r['real_ttft_p50_s']:.2f} | "
            f"{measured(r, 'ttft_p90_s', '.2f')} | {r['sim_ttft_p90_s']:.2f} | "
            f"{r['sim_ttft_p90_s'] / r['real_ttft_p90_s']:.2f} | {measured(r, 'wall_s', '.1f')} | "
            f"{r['sim_wall_s']:.1f} |")
    md = "\n".join(lines)
    (out / "fidelity.md").write_text(md + "\n")
    (out / "fidelity.json").write_text(json.dumps({"model": asdict(model), "rows": rows},
                                                  indent=2))
    print(md)


if __name__ == "__main__":
    main()
