"""What the router adds to or makes of vLLM's answers: its account of a request on the last
SSE event, validation errors as OpenAI error bodies."""

from __future__ import annotations

import json

from rayattn.server.http.replies import with_ext


def _events(sse: str) -> list[str]:
    return [e for e in sse.split("\n\n") if e]


def test_ext_goes_on_the_last_json_event_and_done_stays_last():
    usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": 3}}
    sse = (f"data: {json.dumps({'id': 'c', 'choices': [{'delta': {'content': 'x'}}]})}\n\n"
           f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n")
    out = _events(with_ext(sse, {"replica": "engine-1"}))
    assert out[-1] == "data: [DONE]"
    assert json.loads(out[-2][6:]) == {**usage, "rayattn": {"replica": "engine-1"}}
    assert "rayattn" not in json.loads(out[0][6:])


def test_an_error_event_is_left_as_vllm_wrote_it():
    err = {"error": {"message": "boom", "code": 400}}
    sse = f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n"
    assert with_ext(sse, {"replica": "engine-0"}) == sse
    assert with_ext("", {"replica": "engine-0"}) == ""


def test_a_whole_body_validation_error_reads_as_vllm_wrote_it():
    from pydantic import BaseModel, ValidationError, model_validator

    from rayattn.server.errors import from_validation

    class Body(BaseModel):  # like vLLM 0.25's request models: checks in a model validator
        tool_choice: str | None = None

        @model_validator(mode="after")
        def _tools(self):
            raise ValueError("When using `tool_choice`, `tools` must be set.")

    try:
        Body(tool_choice="required")
    except ValidationError as e:
        err = from_validation(e)
    assert err.status == 400
    assert err.message == "When using `tool_choice`, `tools` must be set."


def test_observation_keeps_choice_zero_and_the_engines_first_token_latency():
    from types import SimpleNamespace as NS

    from rayattn.engine.observed import Observation

    def out(choices, finished=False, metrics=None):
        return NS(outputs=[NS(index=i, token_ids=t) for i, t in choices], finished=finished,
                  prompt_token_ids=[1] * 40, num_cached_tokens=32 if finished else 0,
                  metrics=metrics)

    obs = Observation()
    # n=2, streamed: each output holds whichever choices advanced in that step.
    obs.output(out([(1, [7]), (0, [5])]), True)
    obs.output(out([(1, [8])]), True)
    m = NS(scheduled_ts=10.0, queued_ts=9.5, first_token_ts=10.25, last_token_ts=10.5,
           first_token_latency=0.75)
    obs.output(out([(0, [6])], finished=True, metrics=m), True)
    assert obs.token_ids == [5, 6]
    assert obs.completion_tokens == 4 and obs.prompt_tokens == 40
    t = obs.timings
    assert t["path"] == "extend" and t["queue_s"] == 0.5 and t["prefill_s"] == 0.25
    assert t["itl_s"] == 0.25  # over choice 0's two tokens, not all four
    assert t["ttft_s"] <= 0.75
