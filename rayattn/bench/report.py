"""Writing benchmark results: JSON, CSV, a markdown table and PNG plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

COLUMNS = ["hit_rate", "oracle_block_hit_rate", "hit_vs_block_oracle", "ttft_p50_s",
           "ttft_p90_s", "later_ttft_p50_s", "later_ttft_p90_s", "output_tok_per_s", "wall_s",
           "max_replica_share",
           "moves", "regret_tokens", "cold_runs"]
"""`cold_runs`: of the runs, those whose reset emptied every cache and host tier (– where
the stack cannot tell)."""
# With --peer: each row against the peer's best policy in the same run.
RATIO_COLUMNS = ["vs_peer", "wall_ratio", "ttft_p90_ratio", "later_ttft_p50_ratio",
                 "later_ttft_p90_ratio", "throughput_ratio"]


def markdown(table: dict[str, dict[str, dict[str, Any]]], columns: list[str]) -> str:
    head = "| workload | policy | " + " | ".join(columns) + " |"
    lines = [head, "|" + "---|" * (len(columns) + 2)]
    for w, rows in table.items():
        for p, s in rows.items():
            cells = [f"{s[c]:.3f}" if isinstance(s.get(c), float)
                     else "–" if s.get(c) is None else str(s[c]) for c in columns]
            lines.append(f"| {w} | {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_run(out: Path, table: dict, raw: dict[str, list[dict]]) -> None:
    """Real-engine comparison: table.json/md, per-request CSV, plots."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "policies.json").write_text(json.dumps(table, indent=2))
    peer = any("wall_ratio" in r for rows in table.values() for r in rows.values())
    (out / "policies.md").write_text(markdown(table, COLUMNS + (RATIO_COLUMNS if peer else [])))
    with open(out / "requests.csv", "w", newline="") as f:
        w = None
        for key, rows in raw.items():
            for r in rows:
                row = {"series": key, **{k: v for k, v in r.items() if k != "output_text"}}
                if w is None:
                    w = csv.DictWriter(f, fieldnames=list(row))
                    w.writeheader()
                w.writerow(row)
    plot_run(out, table, raw)


def plot_run(out: Path, table: dict, raw: dict[str, list[dict]]) -> None:
    # matplotlib is optional (the test extra): only plots need it.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for wname, rows in table.items():
        fig, ax = plt.subplots(2, 2, figsize=(12, 8))
        for pol in rows:
            res = raw[f"{wname}/{pol}"]
            ttft = sorted(r["ttft_s"] for r in res if r["status"] == 200)
            ax[0][0].plot(ttft, [i / len(ttft) for i in range(len(ttft))], label=pol)
        ax[0][0].set(title="TTFT CDF", xlabel="seconds", ylabel="fraction")
        ax[0][0].legend()
        pols = list(rows)
        ax[0][1].bar(pols, [rows[p]["hit_rate"] for p in pols], label="hit rate")
        oracle = next(iter(rows.values()))["oracle_block_hit_rate"]
        ax[0][1].axhline(oracle, color="k", ls="--", label="block oracle")
        ax[0][1].set(title="Cache hit rate vs oracle")
        ax[0][1].legend()
        for pol in pols:
            res = sorted(raw[f"{wname}/{pol}"], key=lambda r: r["start_s"])
            reps = sorted({r["replica"] for r in res})
            for rep in reps:
                xs = [r["start_s"] for r in res if r["replica"] == rep]
                ax[1][0].plot(xs, range(1, len(xs) + 1), label=f"{pol}/{rep}")
        ax[1][0].set(title="Requests per replica over time", xlabel="s", ylabel="cumulative")
        ax[1][0].legend(fontsize=6)
        data, labels = [], []
        for pol in pols:
            for path in ("prefill", "extend"):
                xs = [r["ttft_s"] for r in raw[f"{wname}/{pol}"] if r["path"] == path]
                if xs:
                    data.append(xs)
                    labels.append(f"{pol}\n{path}")
        if data:  # only rayattn reports each request's path; a peer-only run has none
            ax[1][1].boxplot(data, tick_labels=labels)
        ax[1][1].set(title="TTFT by path", ylabel="seconds")
        ax[1][1].tick_params(axis="x", labelsize=6)
        fig.suptitle(f"rayattn policies — {wname}")
        fig.tight_layout()
        fig.savefig(out / f"{wname}.png", dpi=90)
        plt.close(fig)


def plot_sim(out: Path, rows: list[dict], name: str) -> None:
    # matplotlib is optional (the test extra): only plots need it.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    labels = [f"{r['policy']}\n{r['routers']} router(s)" for r in rows]
    ax[0].bar(labels, [r["hit_rate"] for r in rows])
    ax[0].axhline(rows[0]["oracle_hit_rate"], color="k", ls="--", label="oracle")
    ax[0].set(title="hit rate")
    ax[0].legend()
    ax[1].bar(labels, [r["ttft_p90_s"] for r in rows])
    ax[1].set(title="TTFT p90 (s)")
    ax[2].bar(labels, [r["load_imbalance"] for r in rows])
    ax[2].set(title="load imbalance (max/mean in-flight)")
    for a in ax:
        a.tick_params(axis="x", labelsize=7)
    fig.suptitle(name)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=90)
    plt.close(fig)


def plot_ramp(out: Path, rows: list[dict], name: str, target_s: float | None) -> None:
    """A scaling fleet's runs over time: engines serving and TTFT p90 per stretch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for r in rows:
        t = [w["start_s"] for w in r["timeline"]]
        label = f"{r['policy']} ×{r['routers']} warm {'on' if r.get('warm') else 'off'}"
        ax[0].step(t, [w["engines"] for w in r["timeline"]], where="post", label=label)
        ax[1].plot(t, [w["ttft_p90_s"] for w in r["timeline"]], marker=".", label=label)
    ax[0].set(ylabel="engines serving")
    ax[0].legend(fontsize=7)
    if target_s is not None:
        ax[1].axhline(target_s, color="k", ls="--", lw=0.8, label="target")
    ax[1].set(ylabel="TTFT p90 (s)", xlabel="simulated s", yscale="log")
    fig.suptitle(name)
    fig.tight_layout()
    fig.savefig(out / f"{name}_timeline.png", dpi=90)
    plt.close(fig)
