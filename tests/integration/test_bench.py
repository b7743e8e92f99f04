"""`rayattn bench` end to end on the local deployment (CI-sized), and the simulator validated
against that very run."""

from __future__ import annotations

import json

import httpx
import pytest

from rayattn.cli import main

pytestmark = pytest.mark.integration


def test_bench_smoke_and_simulator_agrees(server, tmp_path, reset):
    out = tmp_path / "bench"
    assert main(["bench", "--target", server, "--workload", "shared_prefix",
                 "--policies", "affinity,round_robin", "--groups", "3", "--prompts", "8",
                 # an odd group count, or round-robin lines groups up with the two
                 # replicas by accident and scores like affinity
                 "--concurrency", "2", "--out", str(out)]) == 0
    table = json.loads((out / "policies.json").read_text())["shared_prefix"]
    for pol in ("rayattn affinity", "rayattn round_robin"):
        s = table[pol]
        for field in ("hit_rate", "oracle_block_hit_rate", "ttft_p50_s", "ttft_p90_s",
                      "output_tok_per_s", "max_replica_share", "per_replica", "paths"):
            assert field in s
        assert s["ok"] == 24
    assert table["rayattn affinity"]["hit_rate"] > table["rayattn round_robin"]["hit_rate"]
    assert (out / "shared_prefix.png").stat().st_size > 10_000
    assert (out / "requests.csv").read_text().count("\n") == 49

    # Replay the affinity run's exact trace in the simulator with the engines' real capacity.
    from transformers import AutoTokenizer

    from rayattn.bench.driver import Result
    from rayattn.bench.simulate import EngineModel, simulate, trace_from_run
    from rayattn.bench.workloads import shared_prefix
    from rayattn.models.embedded import resolve_embedded

    reset("affinity")
    import asyncio

    from rayattn.bench.driver import run_workload, summarize

    wl = shared_prefix(groups=4, prompts_per_group=6, seed=11)
    res, wall = asyncio.run(run_workload(server, "smollm2", wl, concurrency=2))
    real = summarize(res, wall)["hit_rate"]
    tok = AutoTokenizer.from_pretrained(str(resolve_embedded("rayattn://smollm2-135m")))
    blocks = min(e["kv_blocks"] for e in
                 httpx.get(f"{server}/health").json()["engines"].values())
    trace = trace_from_run([r for r in res if isinstance(r, Result)], wl, tok, 32)
    # Closed loop at the run's concurrency, the router following the engines' events.
    sim = simulate(trace, 2, "affinity", EngineModel(capacity_blocks=blocks, block_size=32),
                   index="events", concurrency=2)
    print(f"\nreal hit rate {real:.3f}, simulated {sim.hit_rate:.3f}")
    assert abs(sim.hit_rate - real) <= 0.05


def test_open_loop_long_document_workload(server, reset):
    import asyncio

    from rayattn.bench.driver import run_workload, summarize
    from rayattn.bench.workloads import long_doc_qa

    reset("affinity")
    wl = long_doc_qa(documents=2, questions_per_doc=4, doc_words=250, seed=5)
    res, wall = asyncio.run(run_workload(server, "smollm2", wl, rate=4.0, seed=1))
    s = summarize(res, wall)
    assert s["ok"] == 8
    assert s["paths"]["extend"] >= 4  # later questions reuse their document's cached prefix
    starts = sorted(r.start_s for r in res)
    assert starts[-1] - starts[0] > 0.3  # arrivals were spread by the Poisson process
