"""An engine's in-flight counts per sending router and pinned DP rank, as probes and chunks
report them."""

from __future__ import annotations

import pytest

from rayattn.engine.inflight import InflightCounts


def test_counts_per_origin_and_rank_while_requests_run_and_stamps_every_change():
    c = InflightCounts()
    stamps = [c.report()["inflight_stamp"]]
    with c.counting(0, "router-a"), c.counting(1, "router-a"), c.counting(None, "router-b"):
        stamps.append(c.report()["inflight_stamp"])
        assert c.of(None) == {"router-a": 2, "router-b": 1}
        assert c.of(0) == {"router-a": 1} and c.of(1) == {"router-a": 1}
        assert c.report(1)["inflight_by_origin"] == {"router-a": 1}
    stamps.append(c.report()["inflight_stamp"])
    assert c.of(None) == {}
    seqs = [s[1] for s in stamps]
    assert seqs == sorted(set(seqs)) and seqs[-1] - seqs[0] == 6  # 3 starts, 3 ends


def test_a_request_that_fails_is_uncounted_too():
    c = InflightCounts()
    with pytest.raises(RuntimeError), c.counting(None, "r"):
        raise RuntimeError("engine died")
    assert c.of(None) == {}
