"""Background tasks of the router process."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any


def detached(coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
    """A background task that does not inherit the current request's context: Serve keys
    child calls by the request id it finds there, and calls from a task started inside a
    request handler would all share that request's id."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
