"""The one retry loop around calls to engine replicas, with no routing or transport in it:
an attempt is a stream of items; a failed attempt is retried while nothing of it reached the
caller (always before its first item, and at any point when the caller takes the answer
whole), as long as the caller's judgement of the failure allows."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

T = TypeVar("T")


class EngineCallError(Exception):
    """An exception raised by the call to an engine replica (not by the router's code)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


async def retrying(attempt: Callable[[int], AsyncIterator[T]],
                   retry: Callable[[EngineCallError, int, bool], bool],
                   buffered: bool = False) -> AsyncIterator[T]:
    """The items of the first attempt that completes. `attempt(n)` starts attempt n (from
    0); when it raises EngineCallError, `retry(error, n, delivered)` decides: True starts
    attempt n + 1, False re-raises the error (or it raises its own answer). `delivered`:
    whether an item of this attempt reached the caller. With `buffered`, an attempt's items
    are held until it completes, so a failure is never after delivery; a failed attempt's
    held items are dropped."""
    n = 0
    while True:
        held: list[T] = []
        delivered = False
        try:
            # aclosing: a caller that leaves mid-stream ends the attempt (and the engine
            # call under it) now, not when the generator is collected.
            async with contextlib.aclosing(attempt(n)) as items:
                async for item in items:
                    if buffered:
                        held.append(item)
                    else:
                        delivered = True
                        yield item
        except EngineCallError as err:
            if not retry(err, n, delivered):
                raise
            n += 1
            continue
        for item in held:
            yield item
        return
