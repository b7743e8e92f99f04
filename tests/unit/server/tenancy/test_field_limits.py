"""Request-size limits (rayattn/server/limits.py) on parsed bodies."""

from __future__ import annotations

import pytest

from rayattn.config.schema import RequestLimits
from rayattn.server.errors import APIError
from rayattn.server.tenancy.field_limits import check, check_session

L = RequestLimits(max_n=4, max_stop=3, max_logit_bias=5, max_schema_bytes=200, max_prompts=2,
                  max_session_id_bytes=8)


@pytest.mark.parametrize("kind,body,field", [
    ("chat", {"n": 5}, "n"),
    ("completion", {"best_of": 9}, "best_of"),
    ("chat", {"stop": ["a", "b", "c", "d"]}, "stop"),
    ("chat", {"stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids"),
    ("chat", {"logit_bias": {str(i): 1 for i in range(6)}}, "logit_bias"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"enum": ["x" * 50] * 5}}}}, "response_format"),
    ("chat", {"structured_outputs": {"regex": "a" * 300}}, "structured_outputs"),
    ("completion", {"prompt": ["a", "b", "c"]}, "prompt"),
    ("completion", {"prompt": [[1, 2], [3], [4]]}, "prompt"),
    ("responses", {"text": {"format": {"type": "json_schema", "name": "x",
                                       "schema": {"enum": ["x" * 50] * 5}}}}, "text"),
])
def test_each_limit_names_its_field(kind, body, field):
    with pytest.raises(APIError) as e:
        check(kind, body, L)
    assert e.value.status == 400 and e.value.param == field
    assert "router.limits.max_" in e.value.message


@pytest.mark.parametrize("kind,body", [
    ("chat", {"n": 4, "stop": ["a", "b", "c"], "logit_bias": {"1": 1},
              "response_format": {"type": "json_object"}}),
    ("completion", {"prompt": [1, 2, 3, 4, 5, 6, 7]}),  # one prompt of token ids
    ("completion", {"prompt": "a long prompt " * 100, "n": 2}),
    ("chat", {"n": None, "stop": "one string"}),
])
def test_within_the_limits_nothing_is_refused(kind, body):
    check(kind, body, L)


def test_a_background_response_is_refused_naming_the_field():
    """vLLM would answer at once and keep generating outside admission."""
    check("responses", {"input": "hi", "background": False}, L)
    with pytest.raises(APIError) as e:
        check("responses", {"input": "hi", "background": True}, L)
    assert e.value.status == 400 and e.value.param == "background"


def test_session_id_length():
    check_session("x-session-id", "12345678", L)
    check_session("x-session-id", None, L)
    with pytest.raises(APIError) as e:
        check_session("x-session-id", "123456789", L)
    assert e.value.param == "x-session-id"


def test_a_render_failure_is_the_clients_only_when_its_input_caused_it():
    """Issue 25, item 8: every rendering failure came back as 400 with its message, also
    the router's own (a missing file, a bug), which is a 500 naming only its type."""
    from jinja2 import TemplateError

    from rayattn.server.model_route import render_failure

    for e in (ValueError("bad role"), TypeError("content"), KeyError("x"),
              TemplateError("unknown tag")):
        err = render_failure(e, "messages")
        assert err.status == 400 and err.param == "messages", e
    err = render_failure(OSError("/secret/path/tokenizer.json missing"), "messages")
    assert err.status == 500 and "/secret" not in err.message and "OSError" in err.message
