"""Placement on a multi-GPU node: rayattn with TP > 1 (DP1 × TP2 on 2 GPUs, DP2 × TP2 on 4),
asserting from what the engines report (rayattn.integrations.devices' worker extension):
  * each engine's workers run on distinct GPUs (and the DP ranks on disjoint sets);
  * every worker runs inside its replica's own placement group (vLLM's Ray executor reused
    the group Serve made from the plan's bundles; no second group, none pending).
Writes OUT/placement-dp{DP}-tp{TP}.json.

Usage (device): python3 bench/gpu/placement.py --model DIR --tp 2 --dp 1 --out $OUT
"""

from __future__ import annotations

import argparse
import glob
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RayattnApp, dump, fail, gpu_processes, gpus, log, rayattn_args  # noqa: E402


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: still write results
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--config", default="deployments/h200.yaml")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    t0 = time.time()
    n = a.tp * a.dp
    args = rayattn_args(a.config, a.model, **{"parallelism.tensor_parallel_size": a.tp,
                                               "parallelism.data_parallel_size": a.dp,
                                               "platform.gpus_per_node": n})
    report: dict = {"args": vars(a), "gpus": gpus(), "checks": {}}
    app = None
    try:
        import httpx
        import ray

        app = RayattnApp(args, num_gpus=n)
        report["startup_s"] = app.wait(500)
        log(f"DP{a.dp} x TP{a.tp} healthy after {report['startup_s']:.0f} s")
        infos = app.engine_infos()
        report["engines"] = infos
        table = ray.util.placement_group_table()
        report["placement_groups"] = table
        report["gpu_processes"] = gpu_processes()
        node = {g["uuid"] for g in report["gpus"]}
        devs = [i.get("devices") or [] for i in infos]
        flat = [d for ds in devs for d in ds]
        ok_dev = (all(len(d) == a.tp for d in devs) and len(set(flat)) == n
                  and set(flat) <= node)
        report["checks"]["distinct_gpus"] = {"pass": ok_dev, "devices": devs}
        log(f"ASSERT distinct_gpus: {'PASS' if ok_dev else 'FAIL'} {devs}")
        ok_pg = True
        for i in infos:
            pg, workers = i.get("placement_group"), i.get("worker_placement_groups") or []
            good = pg is not None and len(workers) == a.tp and all(w == pg for w in workers)
            entry = table.get(pg, {}) if pg else {}
            gpu_bundles = sum(1 for b in (entry.get("bundles") or {}).values()
                              if b.get("GPU", 0) >= 1)
            good = good and gpu_bundles == a.tp and entry.get("state") == "CREATED"
            log(f"  engine rank {i.get('rank')}: replica group {pg} ({entry.get('name')}, "
                f"{gpu_bundles} GPU bundles, {entry.get('state')}); workers in {workers}")
            ok_pg = ok_pg and good
        states = {k: v.get("state") for k, v in table.items()}
        others = [k for k, s in states.items()
                  if s != "REMOVED" and k not in {i.get("placement_group") for i in infos}]
        ok_pg = ok_pg and not others
        report["checks"]["workers_in_replica_placement_group"] = {
            "pass": ok_pg, "groups": states, "other_live_groups": others}
        log(f"ASSERT workers_in_replica_placement_group: {'PASS' if ok_pg else 'FAIL'} "
            f"(other live groups: {others})")
        lines = []
        for f in glob.glob("/tmp/ray/session_latest/logs/*"):
            try:
                lines += [ln.strip()[:300] for ln in open(f, errors="replace")
                          if "existing placement group" in ln]
            except OSError:
                continue
        report["vllm_placement_log"] = lines[:10]
        log(f"vLLM log lines about the placement group: {lines[:2]}")
        chats = []
        for k in range(3):
            r = httpx.post(f"{app.url}/v1/chat/completions", timeout=120, json={
                "model": args["model"]["served_name"], "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": f"placement check {k}"}]})
            chats.append(r.status_code)
        report["chats"] = chats
        log(f"chats: {chats}")
        for p in report["gpu_processes"]:
            log("  gpu process", p)
    except Exception as e:
        report["error"] = repr(e)
        fail(repr(e))
    finally:
        dump(Path(a.out) / f"placement-dp{a.dp}-tp{a.tp}.json", report)
        if app is not None:
            app.shutdown()
    log(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
