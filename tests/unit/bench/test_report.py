"""The run's figure is drawn for a peer-only run too (peers report no per-request path)."""

from __future__ import annotations

from pathlib import Path

from rayattn.bench.report import plot_run


def test_a_peer_only_run_is_plotted(tmp_path: Path):
    rows = [{"ttft_s": 0.1 * i, "status": 200, "start_s": float(i), "replica": "server-0",
             "path": None} for i in range(1, 5)]
    table = {"multi_turn": {"ray-serve-llm prefix_cache_affinity": {
        "hit_rate": 0.5, "oracle_block_hit_rate": 0.6}}}
    plot_run(tmp_path, table, {"multi_turn/ray-serve-llm prefix_cache_affinity": rows})
    assert (tmp_path / "multi_turn.png").stat().st_size > 0
