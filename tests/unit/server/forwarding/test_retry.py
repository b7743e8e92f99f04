"""The one retry loop, against attempts that fail where a replica would: before their first
item, after one, while the caller takes the answer whole or streamed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from rayattn.server.forwarding.retry import EngineCallError, retrying


class Script:
    """Attempt n yields `items[n]`, then fails where `fail_after[n]` says (None: completes)."""

    def __init__(self, items: list[list[str]], fail_after: list[int | None]) -> None:
        self.items, self.fail_after = items, fail_after
        self.started: list[int] = []
        self.closed: list[int] = []
        self.judged: list[tuple[int, bool]] = []

    async def attempt(self, n: int) -> AsyncIterator[str]:
        self.started.append(n)
        try:
            for i, item in enumerate(self.items[n]):
                if self.fail_after[n] == i:
                    raise EngineCallError(ConnectionError(f"attempt {n}"))
                yield item
            if self.fail_after[n] == len(self.items[n]):
                raise EngineCallError(ConnectionError(f"attempt {n}"))
        finally:
            self.closed.append(n)

    def retry_while(self, limit: int):
        def retry(err: EngineCallError, n: int, delivered: bool) -> bool:
            self.judged.append((n, delivered))
            return not delivered and n < limit
        return retry


async def collect(gen: AsyncIterator[str]) -> list[str]:
    return [x async for x in gen]


def test_a_failure_before_the_first_item_is_retried_on_the_next_attempt():
    s = Script([["a0"], ["b0", "b1"]], fail_after=[0, None])
    assert asyncio.run(collect(retrying(s.attempt, s.retry_while(2)))) == ["b0", "b1"]
    assert s.started == [0, 1] and s.judged == [(0, False)]


def test_a_streamed_failure_after_output_is_final_and_says_so():
    s = Script([["a0", "a1"], ["b0"]], fail_after=[1, None])
    got: list[str] = []

    async def go() -> None:
        async for x in retrying(s.attempt, s.retry_while(2)):
            got.append(x)

    with pytest.raises(EngineCallError):
        asyncio.run(go())
    assert got == ["a0"] and s.started == [0] and s.judged == [(0, True)]


def test_a_buffered_answer_is_retried_at_any_point_and_drops_the_failed_items():
    s = Script([["a0", "a1"], ["b0", "b1"]], fail_after=[2, None])
    out = asyncio.run(collect(retrying(s.attempt, s.retry_while(2), buffered=True)))
    assert out == ["b0", "b1"] and s.judged == [(0, False)]


def test_retries_stop_where_the_judge_says_and_its_own_answer_propagates():
    s = Script([["a"], ["b"], ["c"]], fail_after=[0, 0, 0])
    with pytest.raises(EngineCallError):
        asyncio.run(collect(retrying(s.attempt, s.retry_while(1))))
    assert s.started == [0, 1] and s.judged == [(0, False), (1, False)]

    class Refused(Exception):
        pass

    def refuse(err: EngineCallError, n: int, delivered: bool) -> bool:
        raise Refused from err.cause

    s = Script([["a"]], fail_after=[0])
    with pytest.raises(Refused):
        asyncio.run(collect(retrying(s.attempt, refuse)))


def test_a_caller_that_leaves_closes_the_attempt_at_once():
    s = Script([["a0", "a1", "a2"]], fail_after=[None])

    async def go() -> None:
        gen = retrying(s.attempt, s.retry_while(2))
        assert await anext(gen) == "a0"
        await gen.aclose()
        assert s.closed == [0]  # the engine call under it hangs up now

    asyncio.run(go())
