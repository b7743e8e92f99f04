"""The router's account of a request rides on vLLM's last SSE event, nowhere else."""

from __future__ import annotations

import json

from rayattn.server.ingress import _with_ext


def _events(sse: str) -> list[str]:
    return [e for e in sse.split("\n\n") if e]


def test_ext_goes_on_the_last_json_event_and_done_stays_last():
    usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": 3}}
    sse = (f"data: {json.dumps({'id': 'c', 'choices': [{'delta': {'content': 'x'}}]})}\n\n"
           f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n")
    out = _events(_with_ext(sse, {"replica": "engine-1"}))
    assert out[-1] == "data: [DONE]"
    assert json.loads(out[-2][6:]) == {**usage, "rayattn": {"replica": "engine-1"}}
    assert "rayattn" not in json.loads(out[0][6:])


def test_an_error_event_is_left_as_vllm_wrote_it():
    err = {"error": {"message": "boom", "code": 400}}
    sse = f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n"
    assert _with_ext(sse, {"replica": "engine-0"}) == sse
    assert _with_ext("", {"replica": "engine-0"}) == ""
