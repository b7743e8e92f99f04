"""Hostile requests against the real router in front of the shared engines (issue 25):
each one asks for work far beyond what one request may cost, and must get a 400 naming the
field and the limit before it reaches an engine; the surfaces that list the router's routes
are closed."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.integration
MODEL = "smollm2"
CHAT = {"model": MODEL, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hi."}]}
SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string", "enum": [
    f"value-{i}-{j}" for j in range(40)]} for i in range(400)}}


@pytest.mark.parametrize("field,extra,path", [
    ("n", {"n": 1000}, "chat"),
    ("stop", {"stop": [f"s{i}" for i in range(5000)]}, "chat"),
    ("logit_bias", {"logit_bias": {str(i): 1 for i in range(20000)}}, "chat"),
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "big", "schema": SCHEMA}}}, "chat"),
    ("prompt", {"prompt": ["Say hi."] * 500}, "completion"),
])
def test_amplifying_fields_are_refused_with_the_limit_named(server, field, extra, path):
    if path == "chat":
        url, body = f"{server}/v1/chat/completions", {**CHAT, **extra}
    else:
        url, body = f"{server}/v1/completions", {"model": MODEL, "max_tokens": 4, **extra}
    before = _engine_requests(server)
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "router.limits." in err["message"], err
    # Refused in the router: no engine saw it.
    assert _engine_requests(server) == before


def test_within_the_limits_the_same_fields_are_served(server):
    r = httpx.post(f"{server}/v1/chat/completions", timeout=120, json={
        **CHAT, "n": 2, "stop": ["\n\n", "###"], "logit_bias": {"42": -1}})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


def test_an_oversized_session_id_is_refused(server):
    r = httpx.post(f"{server}/v1/chat/completions", json=CHAT, timeout=60,
                   headers={"x-session-id": "s" * 10_000})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "x-session-id"
    ok = httpx.post(f"{server}/v1/chat/completions", json=CHAT, timeout=60,
                    headers={"x-session-id": "conversation-1"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_no_route_listing(server, path):
    assert httpx.get(f"{server}{path}", timeout=30).status_code == 404


def _engine_requests(server: str) -> int:
    """Requests the router has sent to engines (its own count, /health)."""
    return httpx.get(f"{server}/health", timeout=30).json()["counts"]["sent"]
