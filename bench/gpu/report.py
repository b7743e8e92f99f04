"""Tables of docs/results.md (and docs/log/gpu-*.md) from what the device calls of
bench/gpu/run.sh brought back.

  python3 bench/gpu/report.py --routing DIR/routing.json --backends DIR/backends.json \
      --placement DIR/placement-dp1-tp2.json [--placement ...] --tokenizer TOKDIR \
      --out bench/gpu/results

Computes, per routing run, the block oracle (what one infinite vLLM prefix cache could have
served, requests in the order they ran, prompts rebuilt with the served chat template; the
same definition as rayattn.bench.driver.oracle, computed with chained block hashes so the
20 runs take seconds) and hit/oracle; then means over the repeats and the ratios of rayattn
affinity to each vllm-router policy. Writes routing-summary.json (no per-request texts) and
prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

BLOCK = 16


def _cold(flags: list[bool | None]) -> str:
    """How many runs started from emptied caches and host tiers ("?" for runs from before
    routing.py kept it)."""
    if any(f is None for f in flags):
        return "?"
    return f"{sum(flags)} of {len(flags)}"


def block_oracle(results: list[dict], workload, tok) -> float:
    """Block-aligned oracle hit rate of one run (see module doc)."""
    from rayattn.bench.driver import cached_output  # only --routing needs rayattn
    convs = {c.session: c for c in workload.conversations}
    by_session = defaultdict(list)
    for r in results:
        by_session[r["session"]].append(r)
    seen: set[int] = set()
    hits = total = 0
    for r in sorted(results, key=lambda x: x["start_s"]):
        if r["status"] != 200:
            continue
        c = convs[r["session"]]
        msgs = [{"role": "system", "content": c.system}]
        for p in sorted((x for x in by_session[r["session"]] if x["turn"] < r["turn"]),
                        key=lambda x: x["turn"]):
            msgs += [{"role": "user", "content": c.turns[p["turn"]]},
                     {"role": "assistant", "content": p["output_text"]}]
        msgs.append({"role": "user", "content": c.turns[r["turn"]]})
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        outs = cached_output(r.get("output_ids"), r["output_text"], tok)
        h, matched = 0, 0
        chain = []
        for i in range(0, len(ids) // BLOCK * BLOCK, BLOCK):
            h = hash((h, tuple(ids[i:i + BLOCK])))
            chain.append(h)
        for x in chain:
            if x not in seen:
                break
            matched += 1
        hits += min(matched * BLOCK, (len(ids) - 1) // BLOCK * BLOCK)
        total += len(ids)
        full = ids + outs
        h = 0
        for i in range(0, len(full) // BLOCK * BLOCK, BLOCK):
            h = hash((h, tuple(full[i:i + BLOCK])))
            seen.add(h)
    return hits / total if total else 0.0


def routing(path: Path, tok, out: Path) -> dict:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from routing import workloads

    rep = json.loads(path.read_text())
    args = rep["args"]  # runs from before --doc-words/--user-words get routing.py's defaults
    wls = workloads(args["scale"], **{k: args[k] for k in ("doc_words", "user_words")
                                      if k in args})
    rows = []
    for run in rep["runs"]:
        if "summary" not in run:
            rows.append({k: run.get(k) for k in ("stack", "policy", "workload", "repeat",
                                                 "error", "skipped")})
            continue
        s = dict(run["summary"])
        s["oracle_block_hit_rate"] = block_oracle(run["results"], wls[run["workload"]], tok)
        s["hit_over_oracle"] = s["hit_rate"] / max(s["oracle_block_hit_rate"], 1e-9)
        rows.append({"stack": run["stack"], "policy": run["policy"],
                     "workload": run["workload"], "repeat": run["repeat"],
                     "cold": run.get("cold"), **s})
    agg: dict = {}
    keys = ["hit_rate", "oracle_block_hit_rate", "hit_over_oracle", "ttft_p50_s", "ttft_p90_s",
            "later_ttft_p50_s", "later_ttft_p90_s", "output_tok_per_s", "wall_s",
            "max_replica_share"]
    for r in rows:
        if "hit_rate" not in r:
            continue
        a = agg.setdefault((r["workload"], r["stack"], r["policy"]), defaultdict(list))
        for k in keys:
            # later_* only in runs since 01d6db2; a share is None where no replica is known
            v = r.get(k)
            a[k].append(float("nan") if v is None else v)
        a["cold"].append(r.get("cold"))  # True / False; None: a run from before it was kept
    table = {f"{w}|{s}|{p}": {k: statistics.mean(v) for k, v in a.items() if k != "cold"} | {
        "n": len(a["hit_rate"]), "values": {k: v for k, v in a.items()}}
        for (w, s, p), a in agg.items()}
    ratios = {}
    keys = {"hit_over_oracle": "hit_over_oracle", "ttft_p50": "ttft_p50_s",
            "ttft_p90": "ttft_p90_s", "later_ttft_p50": "later_ttft_p50_s",
            "later_ttft_p90": "later_ttft_p90_s", "output_tok_per_s": "output_tok_per_s",
            "wall": "wall_s"}
    for w in wls:
        peers = {k.split("|")[2]: v for k, v in table.items()
                 if k.startswith(f"{w}|vllm-router|")}
        ours = {k.split("|")[2]: v for k, v in table.items() if k.startswith(f"{w}|rayattn|")}
        if not ours or not peers:
            continue
        best = min(peers, key=lambda p: peers[p]["ttft_p90_s"])
        # One row per rayattn policy (variants included) and peer policy; None where the
        # peer's figure is 0 (e.g. no hits at all).
        ratios[w] = {"best_peer_by_ttft_p90": best, "by_policy": {pol: {p: {
            k: (a[m] / v[m] if v[m] else None) for k, m in keys.items()}
            for p, v in peers.items()} for pol, a in ours.items()}}
    summary = {"rows": rows, "table": table, "ratios": ratios,
               "checks": rep.get("checks"), "engines": rep.get("engines"),
               "gpu_processes": rep.get("gpu_processes"), "plan": rep.get("plan"),
               "peer_command": rep.get("peer_command"), "args": rep.get("args"),
               "rayattn_startup_s": rep.get("rayattn_startup_s"),
               "peers_up_s": rep.get("peers_up_s")}
    summary["first_turns"] = first_turns(rep["runs"])
    (out / "routing-summary.json").write_text(json.dumps(summary, indent=1))
    print("\n| workload | stack | policy | hit/oracle | hit | oracle | TTFT p50 s | TTFT p90 s |"
          " later-turn TTFT p50 s | p90 s | output tok/s | wall s | max share | cold runs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key, v in table.items():
        w, s, p = key.split("|")
        vals = v["values"]

        def both(k: str, fmt: str, vals=vals) -> str:
            return " / ".join(format(x, fmt) for x in vals[k])
        print(f"| {w} | {s} | {p} | {both('hit_over_oracle', '.3f')} | "
              f"{both('hit_rate', '.3f')} | {both('oracle_block_hit_rate', '.3f')} | "
              f"{both('ttft_p50_s', '.3f')} | {both('ttft_p90_s', '.3f')} | "
              f"{both('later_ttft_p50_s', '.3f')} | {both('later_ttft_p90_s', '.3f')} | "
              f"{both('output_tok_per_s', '.0f')} | {both('wall_s', '.1f')} | "
              f"{both('max_replica_share', '.2f')} | {_cold(vals['cold'])} |")
    print("\nrayattn's way to the first token, p50 / p99 ms per run (driver.hop_summary):")
    header = False
    for r in rows:
        if r.get("stack") != "rayattn" or not r.get("hops"):
            continue
        if not header:
            print("| workload | policy | " + " | ".join(k.replace("_", " ") for k in r["hops"])
                  + " | rendered by router |")
            print("|---|---|" + "---|" * (len(r["hops"]) + 1))
            header = True
        legs = " | ".join(f"{v['p50_ms']:.0f} / {v['p99_ms']:.0f}" for v in r["hops"].values())
        print(f"| {r['workload']} | {r['policy']} | {legs} | "
              f"{r.get('rendered_by_router')}/{r['ok']} |")
    print("\nratios rayattn policy / vllm-router policy (means over repeats; - where the "
          "peer's figure is 0):")
    print("| workload | rayattn policy | peer policy | hit/oracle | TTFT p50 | TTFT p90 | "
          "later p50 | later p90 | output tok/s | wall |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def fmt(x: float | None, f: str) -> str:
        return "-" if x is None else format(x, f)
    for w, r in ratios.items():
        for pol, by_peer in r["by_policy"].items():
            for p, v in by_peer.items():
                mark = " (best TTFT p90)" if p == r["best_peer_by_ttft_p90"] else ""
                print(f"| {w} | {pol} | {p}{mark} | {fmt(v['hit_over_oracle'], '.3f')} | "
                      + " | ".join(fmt(v[k], ".2f") for k in (
                          "ttft_p50", "ttft_p90", "later_ttft_p50", "later_ttft_p90",
                          "output_tok_per_s", "wall")) + " |")
    return summary


def first_turns(runs: list[dict]) -> list[dict]:
    """Each conversation's first turn per run (in doc_chat, a document nobody has seen
    yet): client TTFT p50 / p90 (s) for every stack and, for rayattn, the p50 of each leg
    before the engine's first token (ms, driver.hop_summary's legs)."""
    from rayattn.bench.stats import percentile

    rows = []
    for run in runs:
        first = [x for x in run.get("results", []) if x["turn"] == 0 and x["status"] == 200]
        if not first:
            continue
        ttft = sorted(x["ttft_s"] for x in first)
        row = {"stack": run["stack"], "policy": run["policy"], "workload": run["workload"],
               "repeat": run["repeat"], "n": len(first), "ttft_p50_s": percentile(ttft, 0.5),
               "ttft_p90_s": percentile(ttft, 0.9)}
        timed = [x for x in first if x.get("router_s") is not None and x.get("hops")]
        if timed:
            legs = {"to_router": [x["to_router_s"] for x in timed
                                  if x.get("to_router_s") is not None],
                    "router": [x["router_s"] for x in timed],
                    "to_engine": [x["hops"]["to_engine_s"] for x in timed],
                    "in_engine": [x["hops"]["in_engine_s"] for x in timed]}
            row["legs_p50_ms"] = {k: percentile(sorted(v), 0.5) * 1e3 for k, v in legs.items()}
        rows.append(row)
    print("\nfirst turns per run: TTFT p50 / p90 s; rayattn's legs p50 ms (to router, "
          "router, to engine, in engine):")
    print("| workload | stack | policy | run | TTFT p50 | TTFT p90 | to router | router | "
          "to engine | in engine |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        legs = r.get("legs_p50_ms")
        cells = [f"{v:.0f}" for v in legs.values()] if legs else ["-"] * 4
        print(f"| {r['workload']} | {r['stack']} | {r['policy']} | {r['repeat']} | "
              f"{r['ttft_p50_s']:.3f} | {r['ttft_p90_s']:.3f} | " + " | ".join(cells) + " |")
    return rows


def backends(path: Path, out: Path) -> dict:
    res = json.loads(path.read_text())
    (out / "backends.json").write_text(json.dumps(res, indent=1))
    print("\n| backend | model | ctx | prefill TTFT ms | extend TTFT ms | extend/prefill |")
    print("|---|---|---|---|---|---|")
    for key, r in res.items():
        if "error" in r:
            print(f"| {key} | error: {r['error']} |")
            continue
        for n in (1024, 8192, 32768):
            print(f"| {r['backend']} | {r['model_key']} | {n // 1024}k | {r[f'prefill_{n}_ms']} | "
                  f"{r[f'extend_{n}_ms']} | {r[f'extend_over_prefill_{n}']} |")
    print("\n| backend | model | start-up s | ITL b1 @1k ms | ITL b1 @32k ms | ITL b16 @1k ms |"
          " ITL b64 @1k ms | block | KV blocks |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res.values():
        if "error" in r:
            continue
        print(f"| {r['backend']} | {r['model_key']} | {r['startup_s']} | "
              f"{r['itl_b1_ctx1024_ms']} | {r['itl_b1_ctx32768_ms']} | "
              f"{r['itl_b16_ctx1024_ms']} | {r['itl_b64_ctx1024_ms']} | {r['block_size']} | "
              f"{r['num_gpu_blocks']} |")
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--routing")
    ap.add_argument("--backends")
    ap.add_argument("--placement", action="append", default=[])
    ap.add_argument("--tokenizer", default=".gpuwhl/b07/tok")
    ap.add_argument("--out", default="bench/gpu/results")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.routing:
        from transformers import AutoTokenizer

        routing(Path(a.routing), AutoTokenizer.from_pretrained(a.tokenizer), out)
    if a.backends:
        backends(Path(a.backends), out)
    for p in a.placement:
        rep = json.loads(Path(p).read_text())
        slim = {k: rep.get(k) for k in ("args", "startup_s", "checks", "engines",
                                        "gpu_processes", "vllm_placement_log", "chats",
                                        "error")}
        (out / Path(p).name).write_text(json.dumps(slim, indent=1))
        print(f"\n{Path(p).name}: startup {rep.get('startup_s')}, error {rep.get('error')}")
        for k, v in (rep.get("checks") or {}).items():
            print(f"  {k}: {'PASS' if v.get('pass') else 'FAIL'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
