"""The simulated engine replica (rayattn/engine/simulated.py) outside Serve, as a router
uses it: its probe, answers in vLLM's OpenAI shapes with the router's account fields, a
conversation's next turn served from the blocks its first turn cached, and KV events whose
keys are the router's own index keys for those prompts."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from rayattn.engine.protocol import OpenAIRequest
from rayattn.routing.hashing import BlockHasher, to_key
from tests.conftest import local_args

SIM = {"step_ms": 0.5, "prefill_us_per_token": 1.0, "decode_us_per_seq": 1.0,
       "num_blocks": 4096, "max_tokens": 4}


@pytest.fixture(scope="module")
def replica():
    from rayattn.engine.simulated import SimulatedEngineReplica

    args = local_args()
    args.pop("router", None)
    args["engine"] = {**args["engine"], "simulated": SIM}
    r = SimulatedEngineReplica(args)
    yield r
    r.__del__()


def _request(ids: list[int], stream: bool, rid: str) -> OpenAIRequest:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 3, "stream": stream, "stream_options": {"include_usage": True}}
    return OpenAIRequest("chat", body, rid, engine_inputs=[{"type": "token",
                                                            "prompt_token_ids": ids}])


async def _serve(replica, req: OpenAIRequest) -> list:
    return [item async for item in replica.serve(None, req)]


def test_a_second_turn_is_served_from_the_first_turns_blocks_and_events_carry_its_keys(
        replica):
    async def go():
        info = await replica.info(None)
        assert info.backend == "SIMULATED" and info.num_gpu_blocks == SIM["num_blocks"]
        assert info.ranks[0].kv_events and info.direct is not None
        first_ids = list(range(1000, 1000 + 200))
        first = await _serve(replica, _request(first_ids, True, "a"))
        # The next turn: the whole first turn, the answer, a question.
        second_ids = first_ids + first[-1].token_ids + list(range(5000, 5100))
        second = await _serve(replica, _request(second_ids, False, "b"))
        return info, first, second, first_ids, second_ids

    info, first, second, first_ids, second_ids = asyncio.run(go())
    bs = info.block_size
    # Streamed: the first item carries the role and the first token, stamped, with the
    # engine's in-flight count; the last one finish, usage and [DONE].
    head, last = first[0], first[-1]
    assert head.stamps.keys() == {"engine_in", "engine_out"}
    assert head.inflight_by_origin is not None
    events = [json.loads(e[6:]) for e in "".join(i.data for i in first).split("\n\n")
              if e.startswith("data: {")]
    assert events[0]["id"] == "chatcmpl-a"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
    assert text == " the" * 3
    assert events[-1]["usage"] == {"prompt_tokens": 200, "completion_tokens": 3,
                                   "total_tokens": 203,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    assert last.final and last.timings["path"] == "prefill" and last.completion_tokens == 3
    # Whole: vLLM's chat.completion body; the first turn's full blocks were cached.
    body = json.loads(second[-1].data)
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (len(first_ids) + 3 - 1) // bs * bs == second[-1].num_cached_tokens
    assert second[-1].timings["path"] == "extend"
    # The engine's view of its cache, as routers resync from it: the router's keys of both
    # prompts' full blocks (the salt-less hash with the engines' seed).
    hasher = BlockHasher(bs, "sha256", "0")
    want = {to_key(h) for h in hasher.full_hashes(second_ids)}
    deadline = time.monotonic() + 30
    while not want <= set(replica.mirror.snapshot().keys):
        assert time.monotonic() < deadline, "the mirror never saw the stored blocks"
        time.sleep(0.05)


def test_it_reports_its_load_as_a_vllm_engine_replica_does(replica):
    """What Serve's autoscaler reads (rayattn/engine/scaling_policy.py): KV usage over its
    steps since the last report, and first-token and inter-token p90s of the requests
    served in the last seconds."""
    async def go():
        await replica.record_autoscaling_stats()  # what the previous test left
        await asyncio.gather(*(_serve(replica, _request(list(range(i, i + 300)), False,
                                                       f"load{i}"))
                               for i in range(0, 12000, 1000)))
        return await replica.record_autoscaling_stats(), await replica.record_autoscaling_stats()

    busy, idle = asyncio.run(go())
    # Twelve 300-token prompts (+3 tokens each) held blocks of 4096 while they ran.
    assert 0 < busy["kv_usage"] <= 12 * -(-303 // 32) / SIM["num_blocks"]
    assert busy["ttft_p90_s"] > 0 and busy["itl_p90_s"] > 0
    # The twelve (and the previous test's, within the window); two tokens after each first.
    assert busy["ttft_samples"] >= 12 and busy["itl_samples"] >= 24
    # Nothing ran since: no KV held; the latencies are the window's (the last 10 s).
    assert idle == {**busy, "kv_usage": 0.0}
