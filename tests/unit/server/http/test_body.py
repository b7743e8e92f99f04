"""Request bodies, read one way for every route (rayattn/server/http/body.py): within the size
and time limits, as a JSON object, with the same 400s for what is not one."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from starlette.requests import Request

from rayattn.config.schema import RouterConfig
from rayattn.server.errors import APIError
from rayattn.server.http.body import parse_object, read_body, read_object

Receive = Callable[[], Awaitable[dict[str, Any]]]


def _request(receive: Receive, headers: dict[str, str] | None = None) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": raw, "query_string": b""}
    return Request(scope, receive)


def _chunks(*parts: bytes) -> tuple[Receive, list[int]]:
    """A client sending `parts` one message each; the list counts the messages read."""
    read: list[int] = []

    async def receive() -> dict[str, Any]:
        i = len(read)
        read.append(i)
        return {"type": "http.request", "body": parts[i], "more_body": i < len(parts) - 1}

    return receive, read


def _refused(status: int, fragment: str, call: Callable[[], Any]) -> APIError:
    with pytest.raises(APIError) as e:
        call()
    assert e.value.status == status and fragment in e.value.message, e.value.message
    return e.value


async def test_the_body_is_read_whole_within_the_limit():
    receive, _ = _chunks(b'{"a": ', b"1}")
    assert await read_body(_request(receive), 8, 1.0) == b'{"a": 1}'  # exactly the limit


async def test_a_declared_length_past_the_limit_is_refused_before_reading():
    receive, read = _chunks(b"x" * 10)
    with pytest.raises(APIError) as e:
        await read_body(_request(receive, {"content-length": "11"}), 10, 1.0)
    assert e.value.status == 413 and "11 bytes" in e.value.message
    assert "router.max_body_bytes" in e.value.message
    assert read == []


async def test_a_chunked_body_growing_past_the_limit_is_refused_without_the_rest():
    receive, read = _chunks(*[b"[" * 4] * 100)
    with pytest.raises(APIError) as e:
        await read_body(_request(receive), 10, 1.0)
    assert e.value.status == 413 and "limit of 10 bytes" in e.value.message
    assert len(read) == 3  # the third chunk passed the limit: nothing more was read


async def test_a_body_sent_too_slowly_is_refused_with_408():
    async def trickle() -> dict[str, Any]:
        await asyncio.sleep(0.02)
        return {"type": "http.request", "body": b" ", "more_body": True}

    with pytest.raises(APIError) as e:
        await read_body(_request(trickle), 1 << 20, 0.1)
    assert e.value.status == 408 and "router.body_timeout_s" in e.value.message
    assert "0.1 s" in e.value.message


@pytest.mark.parametrize("raw", [b'{"model": "m", "messages": [', b"\xff\xfe{", b"",
                                 b"[" * 100_000])
def test_what_is_not_json_is_a_malformed_body(raw):
    err = _refused(400, "malformed JSON body: ", lambda: parse_object(raw))
    assert len(err.message) <= len("malformed JSON body: ") + 200


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"text"', b"3", b"null"])
def test_json_other_than_an_object_is_refused(raw):
    err = _refused(400, "request body must be a JSON object", lambda: parse_object(raw))
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_an_empty_body_is_an_empty_object_only_where_allowed():
    assert parse_object(b"", empty_ok=True) == {}
    assert parse_object(b'{"policy": "affinity"}', empty_ok=True) == {"policy": "affinity"}
    _refused(400, "request body must be a JSON object",
             lambda: parse_object(b"[]", empty_ok=True))


async def test_read_object_applies_the_router_settings_limits():
    rc = RouterConfig(max_body_bytes=18, body_timeout_s=1.0)
    receive, _ = _chunks(b'{"lora_name": ', b'"a"}')
    assert await read_object(_request(receive), rc) == {"lora_name": "a"}
    receive, _ = _chunks(b"")
    assert await read_object(_request(receive), rc, empty_ok=True) == {}
    receive, _ = _chunks(b'{"settings": {"max_inflight": 1}}')
    with pytest.raises(APIError) as e:
        await read_object(_request(receive), rc, empty_ok=True)
    assert e.value.status == 413
