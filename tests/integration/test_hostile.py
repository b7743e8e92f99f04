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
        **CHAT, "temperature": 1.0, "n": 2, "stop": ["\n\n", "###"],
        "logit_bias": {"42": -1}})  # vLLM takes n > 1 only when sampling
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


def _rss(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def _proxy_pid() -> int:
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        if any("ProxyActor" in part for part in p.info["cmdline"] or []):
            return p.pid
    raise AssertionError("no Serve proxy process")


def test_a_huge_chunked_upload_is_refused_before_it_is_read(server):
    """Issue 25, item 5: the router read the whole body before checking max_body_bytes, so
    a chunked upload (no Content-Length) grew its memory without limit. Now the limit is
    checked while reading: 413 after a few MiB of a 1 GiB upload, and neither the router
    nor Serve's proxy grows by more than a small multiple of the limit."""
    import select
    import socket
    from urllib.parse import urlparse

    router_pid = httpx.get(f"{server}/health", timeout=30).json()["router_pid"]
    pids = {"router": router_pid, "proxy": _proxy_pid()}
    before = {k: _rss(p) for k, p in pids.items()}
    url = urlparse(server)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"[" * (1 << 20)
    framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    sent, answer = 0, b""
    try:
        while sent < (1 << 30):
            if select.select([sock], [], [], 0)[0]:
                break  # the router answered before the body ended
            sock.sendall(framed)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass  # closed on us after the answer
    sock.settimeout(30)
    try:
        while b"\r\n\r\n" not in answer:
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < 256 << 20, f"{sent >> 20} MiB were read before the refusal"
    grown = {k: (_rss(p) - before[k]) >> 20 for k, p in pids.items()}
    assert all(g < 64 for g in grown.values()), grown
