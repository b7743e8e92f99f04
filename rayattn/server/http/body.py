"""Request bodies, read one way for every route that takes one: within the size limit and
the time limit of the router's settings, then parsed as a JSON object."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request

from rayattn.config.schema import RouterConfig
from rayattn.server.errors import APIError


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, read chunk by chunk with the limit checked as it grows: a body declared or
    grown past `limit` is refused without reading the rest (a chunked upload of any size
    costs the router at most `limit` bytes), and one that takes longer than `timeout_s`
    is refused too."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} "
                            "(router.max_body_bytes)")
    parts, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body exceeds the limit of {limit} bytes "
                                        "(router.max_body_bytes)")
                parts.append(chunk)
    except TimeoutError:
        raise APIError(408, f"request body not received within {timeout_s:g} s "
                            "(router.body_timeout_s)") from None
    return b"".join(parts)


def parse_object(raw: bytes, empty_ok: bool = False) -> dict[str, Any]:
    """`raw` as a JSON object. `empty_ok`: an empty body is `{}` (the admin routes, whose
    every field is optional); elsewhere it is malformed like any other non-JSON."""
    if empty_ok and not raw:
        return {}
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # ValueError covers non-UTF-8 bytes too
        raise APIError(400, f"malformed JSON body: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    return data


async def read_object(request: Request, rc: RouterConfig,
                      empty_ok: bool = False) -> dict[str, Any]:
    """The body as a JSON object, read within `rc`'s body limits (router.max_body_bytes,
    router.body_timeout_s)."""
    raw = await read_body(request, rc.max_body_bytes, rc.body_timeout_s)
    return parse_object(raw, empty_ok)
