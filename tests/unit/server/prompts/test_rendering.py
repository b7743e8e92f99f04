"""Render once: which of the router's renderings an engine may serve as they are, how the
engine's vLLM serving layer takes them, and the streaming message budget of the router."""

from __future__ import annotations

import asyncio
import contextvars
from types import SimpleNamespace

from rayattn.config.schema import RouterConfig
from rayattn.integrations import patches
from rayattn.server.prompts.rendering import _reusable


def test_a_plain_token_prompt_is_reused_without_the_routers_clock():
    one = {"type": "token", "prompt_token_ids": [1, 2, 3], "prompt": "abc",
           "arrival_time": 1.5}
    assert _reusable([one]) == [{"type": "token", "prompt_token_ids": [1, 2, 3],
                                 "prompt": "abc"}]
    assert one["arrival_time"] == 1.5  # the router's own copy is left alone


def test_anything_but_one_plain_token_prompt_is_rendered_by_the_engine():
    token = {"type": "token", "prompt_token_ids": [1]}
    assert _reusable([token, token]) is None  # a completion with several prompts
    assert _reusable([{"type": "embeds", "prompt_embeds": None}]) is None
    assert _reusable([{**token, "multi_modal_data": {"image": []}}]) is None
    assert _reusable([]) is None


class _Renderer:
    def __init__(self) -> None:
        self.calls = 0

    async def render_chat(self, request, **kw):
        self.calls += 1
        return ["conversation"], [{"type": "token", "prompt_token_ids": [9]}]

    async def render_completion(self, request, **kw):
        self.calls += 1
        return [{"type": "token", "prompt_token_ids": [8]}]


def test_the_engine_serves_given_inputs_and_renders_the_rest():
    r = _Renderer()
    state = SimpleNamespace(openai_serving_chat=SimpleNamespace(online_renderer=r),
                            openai_serving_completion=SimpleNamespace(online_renderer=r))
    given: contextvars.ContextVar = contextvars.ContextVar("given", default=None)
    assert patches.serve_rendered_prompts(state, given)
    mine = [{"type": "token", "prompt_token_ids": [1, 2]}]

    async def go():
        # Each request runs in its own task; the variable is set in that task only.
        async def with_inputs():
            given.set(mine)
            return await r.render_chat(None), await r.render_completion(None)
        served = await asyncio.create_task(with_inputs())
        rendered = await r.render_chat(None)
        return served, rendered
    (chat, completion), rendered = asyncio.run(go())
    assert chat == ([], mine) and completion == mine
    assert rendered == (["conversation"], [{"type": "token", "prompt_token_ids": [9]}])
    assert r.calls == 1


def test_serving_objects_without_the_renderer_hook_render_everything():
    state = SimpleNamespace(openai_serving_chat=SimpleNamespace(),
                            openai_serving_completion=None)
    assert not patches.serve_rendered_prompts(state, contextvars.ContextVar("g", default=None))


def test_stream_chunks_coarsen_with_the_streams_in_flight():
    from rayattn.server.dispatch import Dispatcher
    from rayattn.server.tenancy.admission import Admission

    rc = RouterConfig(stream_interval_ms=20, stream_messages_per_s=1000)
    admission = Admission(1000)
    d = SimpleNamespace(cfg=SimpleNamespace(router=rc), gates=SimpleNamespace(admission=admission))
    interval = Dispatcher.stream_interval_s
    assert interval(d) == 0.02
    for _ in range(128):
        admission.acquire()
    assert abs(interval(d) - 0.128) < 1e-9  # 128 streams share 1000 messages a second


def test_loop_watch_sees_a_held_loop_and_lets_go_of_the_collector():
    import gc
    import time

    from rayattn.server.loop_watch import LoopWatch

    async def go() -> LoopWatch:
        w = LoopWatch(slow_s=0.1)
        w.start()
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # holds the loop, as a long callback would
        await asyncio.sleep(0.05)
        gc.collect()
        w.stop()
        return w
    w = asyncio.run(go())
    c = w.counts()
    assert c["loop_lag_slow"] >= 1 and c["loop_lag_max_ms"] >= 150
    assert c["gc_max_ms"] > 0
    assert w._gc not in gc.callbacks
