"""EngineAutoscaling: the router's one answer to "does Serve autoscale the engine
deployment", on a fake of Serve's controller (no Ray)."""

from __future__ import annotations

import asyncio

import pytest

from rayattn.server.fleet import autoscaling
from rayattn.server.fleet.autoscaling import AUTOSCALING_TTL_S, EngineAutoscaling


class Controller:
    """Answers serve_autoscales with `answer`; counts the questions."""

    def __init__(self, answer: bool | None) -> None:
        self.answer, self.asked = answer, []

    async def __call__(self, app: str, deployment: str) -> bool | None:
        self.asked.append((app, deployment))
        return self.answer


@pytest.fixture
def controller(monkeypatch: pytest.MonkeyPatch) -> Controller:
    c = Controller(False)
    monkeypatch.setattr(autoscaling.serve_private, "serve_autoscales", c)
    return c


async def _settle() -> None:
    """Let the background question (a task around a wait_for) run to its end."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_keeps_to_serves_channel_until_the_controller_answers_then_follows_it(
        controller: Controller, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(autoscaling.time, "monotonic", lambda: clock[0])

    async def run() -> list[bool]:
        flag = EngineAutoscaling("app", "engine")
        seen = [flag.now]  # no answer yet: autoscaled, calls keep to Serve's channel
        flag.poll()
        await _settle()
        seen.append(flag.now)  # fixed bounds: direct calls allowed
        controller.answer = True  # a live change of the bounds...
        flag.poll()  # ...not asked again within the period
        await _settle()
        seen.append(flag.now)
        clock[0] += AUTOSCALING_TTL_S
        flag.poll()
        await _settle()
        seen.append(flag.now)
        controller.answer = None  # no answer (a controller restarting): the last one holds
        clock[0] += AUTOSCALING_TTL_S
        flag.poll()
        await _settle()
        seen.append(flag.now)
        return seen

    assert asyncio.run(run()) == [True, False, False, True, True]
    assert controller.asked == [("app", "engine")] * 3


def test_a_slow_controller_is_asked_once_at_a_time(controller: Controller,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(autoscaling.time, "monotonic", lambda: clock[0])
    release = asyncio.Event

    async def run() -> tuple[int, bool]:
        gate = release()

        async def slow(app: str, deployment: str) -> bool:
            controller.asked.append((app, deployment))
            await gate.wait()
            return False

        monkeypatch.setattr(autoscaling.serve_private, "serve_autoscales", slow)
        flag = EngineAutoscaling("app", "engine")
        for _ in range(3):  # the router's report loop ticks on while the answer is due
            flag.poll()
            clock[0] += AUTOSCALING_TTL_S
            await _settle()
        asked, before = len(controller.asked), flag.now
        gate.set()
        await _settle()
        return asked, before and not flag.now

    assert asyncio.run(run()) == (1, True)
