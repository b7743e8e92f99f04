"""Extend-first scheduling with real engines: the router's priority is what vLLM's
scheduler orders a request by, and no client brings its own."""

from __future__ import annotations

import random

import httpx
import pytest

from rayattn.bench.workloads import _text
from rayattn.config.loader import parse_args
from tests.conftest import local_args

pytestmark = pytest.mark.integration
MODEL = "smollm2"


def _chat(server: str, messages: list[dict], **extra) -> httpx.Response:
    return httpx.post(f"{server}/v1/chat/completions", timeout=120, headers={
        "x-session-id": "extend-first"}, json={"model": MODEL, "max_tokens": 8,
                                               "messages": messages, **extra})


def test_vllm_schedules_by_the_routers_priority_and_clients_bring_none(server, reset):
    """The shared deployment's engines run vLLM's priority scheduler
    (engine.scheduling_policy). With router.extend_first on, each request reaches vLLM's
    generate() with the router's priority: its send time plus extend_first × its predicted
    prefill time, so a turn that extends its cached history is allowed far less than the
    cold first turn. A client's own `priority` is refused: it would let one tenant's
    requests overtake everyone's."""
    reset("affinity", extend_first=4.0)
    messages = [{"role": "system", "content": _text(random.Random(11), 400)},
                {"role": "user", "content": "Summarise the notes above."}]
    first = _chat(server, messages)
    assert first.status_code == 200, first.text
    messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]
                  ["content"]}, {"role": "user", "content": "And in one word?"}]
    later = _chat(server, messages)
    assert later.status_code == 200, later.text

    allowance, uncached = [], []
    for r in (first, later):
        ext = r.json()["rayattn"]
        prio = ext["engine_priority"]
        assert isinstance(prio, int), ext
        # The router sends the request router_s after it arrived (to the millisecond):
        # what is left of the priority is the allowance for its predicted prefill.
        allowance.append(prio / 1e6 - (ext["arrived_at"] + ext["router_s"]))
        uncached.append(r.json()["usage"]["prompt_tokens"] - ext["predicted_cached_tokens"])
    assert first.json()["rayattn"]["predicted_cached_tokens"] == 0
    assert later.json()["rayattn"]["predicted_cached_tokens"] > 400
    # The first request after the reset is priced at the configured prefill rate (the
    # cost model refits from its timings afterwards): 4 × its whole prompt × that rate.
    rate = parse_args(local_args()).router.prefill_s_per_token
    assert allowance[0] == pytest.approx(4.0 * uncached[0] * rate, abs=0.02), allowance
    # The later turn computes only what its history lacks, at the refitted rate.
    assert 0 < uncached[1] < uncached[0] / 4
    assert 0 < allowance[1] / (4.0 * uncached[1]) < 0.1, (allowance, uncached)

    bad = _chat(server, messages, priority=-100)
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "priority"

    # Off: the router sends no priority of its own; vLLM gets the body's (0).
    reset("affinity", extend_first=0.0)
    off = _chat(server, messages)
    assert off.status_code == 200 and off.json()["rayattn"]["engine_priority"] in (None, 0)
