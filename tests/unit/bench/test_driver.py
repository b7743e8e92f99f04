"""The benchmark client (`rayattn.bench.driver.run_workload`) against an SSE server on
loopback: what it reads from a stream, what it sends each turn, and how many requests it
keeps in flight. Every table in docs/ is measured through it."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

from rayattn.bench.driver import Result, run_workload, summarize
from rayattn.bench.workloads import Conversation, Workload

LONG = "y" * 100_000  # one SSE line beyond aiohttp's own 64 KiB line limit


class Server:
    def __init__(self) -> None:
        self.inflight = self.max_inflight = 0
        self.seen: list[tuple[str, list[dict]]] = []
        self.headers: list[str] = []

    async def chat(self, req: web.Request) -> web.StreamResponse:
        arrived = time.time()
        body = await req.json()
        raw = req.headers["x-session-id"]
        session = raw.rsplit(".", 1)[0]  # the run's tag off
        self.headers.append(raw)
        self.seen.append((session, body["messages"]))
        if session == "refused":
            return web.json_response({"error": {"message": "bad", "code": 400}}, status=400)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(req)
        try:
            await asyncio.sleep(0.02)
            if session == "fails":
                await self._event(resp, {"error": {"message": "engine died", "code": 503}})
                return resp
            turn = sum(1 for m in body["messages"] if m["role"] == "user") - 1
            pieces = [f"{session}:{turn} ", LONG if session == "long" else "", "end"]
            for k, p in enumerate(pieces):
                choice: dict[str, Any] = {"delta": {"content": p}}
                if body.get("return_token_ids"):  # vLLM's: the piece's generated ids
                    choice["token_ids"] = [1000 * turn + k]
                await self._event(resp, {"choices": [choice]})
            await self._event(resp, {"choices": [], "usage": {
                "prompt_tokens": 100 + turn, "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 64}},
                "rayattn": {"replica": "engine-1", "path": "extend", "arrived_at": arrived,
                            "predicted_cached_tokens": 64}})
            await resp.write(b"data: [DONE]\n\n")
        finally:
            self.inflight -= 1
        return resp

    @staticmethod
    async def _event(resp: web.StreamResponse, ev: dict[str, Any]) -> None:
        await resp.write(f"data: {json.dumps(ev)}\n\n".encode())


async def _serve(server: Server) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def test_reads_streams_and_carries_each_answer_into_the_next_turn() -> None:
    server = Server()
    runner, url = await _serve(server)
    try:
        convs = [Conversation(f"doc {i}", ["first", "second", "third"], f"c{i}", 8)
                 for i in range(6)]
        convs += [Conversation("doc", ["q"], "long"), Conversation("doc", ["q"], "fails"),
                  Conversation("doc", ["q"], "refused")]
        res, _ = await run_workload(url, "m", Workload("w", convs), concurrency=3)
    finally:
        await runner.cleanup()
    by = {(r.session, r.turn): r for r in res}
    assert len(res) == 6 * 3 + 3
    first = by[("c2", 1)]
    assert (first.status, first.prompt_tokens, first.cached_tokens, first.replica,
            first.path, first.predicted_cached_tokens) == (200, 101, 64, "engine-1", "extend",
                                                           64)
    assert first.output_text == "c2:1 end"
    assert first.output_ids == [1000, 1001, 1002]  # asked for, and joined across chunks
    assert first.to_router_s is not None and 0 <= first.to_router_s < 5
    assert by[("long", 0)].output_text == "long:0 " + LONG + "end"
    assert by[("fails", 0)].status == 503
    assert by[("refused", 0)].status == 400
    # Turn 2 of a conversation carries turns 0 and 1 and the answers the server gave them.
    msgs = next(m for s, m in server.seen if s == "c4" and len(m) == 6)
    assert [m["content"] for m in msgs] == ["doc 4", "first", "c4:0 end", "second",
                                             "c4:1 end", "third"]
    assert server.max_inflight <= 3


async def test_each_run_sends_its_own_session_ids() -> None:
    """Routers remember where a conversation's last turn went: a run that reused the last
    run's ids would be steered by that run's placements."""
    server = Server()
    runner, url = await _serve(server)
    try:
        convs = [Conversation("doc", ["first", "second"], "c0", 4)]
        for _ in range(2):
            await run_workload(url, "m", Workload("w", convs), concurrency=1)
    finally:
        await runner.cleanup()
    first, second = server.headers[:2], server.headers[2:]
    assert len(set(first)) == 1 and len(set(second)) == 1  # one id for a conversation's turns
    assert first[0] != second[0] and first[0].startswith("c0.")


async def test_every_conversation_has_its_request_in_flight_at_once() -> None:
    """128 conversations (more than aiohttp's default of 100 connections) start together:
    the server holds each first turn until all 128 are in its hands. A client that caps its
    connections below the concurrency would queue requests behind others' streams and add
    that wait to every stack's TTFT."""
    server = Server()
    everyone = asyncio.Event()
    chat = server.chat

    async def held(req: web.Request) -> web.StreamResponse:
        if server.inflight + 1 >= 128:
            everyone.set()
        server.inflight += 1
        server.max_inflight = max(server.max_inflight, server.inflight)
        try:
            await asyncio.wait_for(everyone.wait(), 20)
        except TimeoutError:
            pass
        server.inflight -= 1
        return await chat(req)

    server.chat = held  # type: ignore[method-assign]
    runner, url = await _serve(server)
    try:
        convs = [Conversation(f"doc {i}", ["a"], f"b{i}", 8) for i in range(128)]
        res, _ = await run_workload(url, "m", Workload("w", convs), concurrency=128)
    finally:
        await runner.cleanup()
    assert all(r.status == 200 for r in res) and len(res) == 128
    assert server.max_inflight == 128


async def test_open_loop_over_two_routers_sends_turn_t_to_router_t_mod_2() -> None:
    a, b = Server(), Server()
    (ra, ua), (rb, ub) = await _serve(a), await _serve(b)
    try:
        convs = [Conversation(f"doc {i}", ["one", "two", "three"], f"o{i}", 8)
                 for i in range(4)]
        res, _ = await run_workload([ua, ub], "m", Workload("w", convs), rate=50.0, seed=1)
    finally:
        await ra.cleanup()
        await rb.cleanup()
    assert all(r.status == 200 for r in res) and len(res) == 12
    turns = {name: sorted(sum(1 for m in msgs if m["role"] == "user") - 1 for _, msgs in s.seen)
             for name, s in (("a", a), ("b", b))}
    assert turns == {"a": [0] * 4 + [2] * 4, "b": [1] * 4}


def test_the_oracle_counts_the_generated_tokens_an_engine_caches():
    """A random-weight model's output does not tokenize back to the ids it generated: the
    next turn's prompt then shares nothing past the previous prompt with what the engine
    cached, and the oracle must not count the re-tokenized text as cacheable. Of the
    generated ids, the last is never cached (no step computes its KV)."""
    from transformers import AutoTokenizer

    from rayattn.bench.driver import cached_output, oracle
    from rayattn.models.embedded import resolve_embedded

    tok = AutoTokenizer.from_pretrained(resolve_embedded("rayattn://smollm2-135m"))
    answer = "The capital of France is Paris. " * 8
    text_ids = tok(answer, add_special_tokens=False)["input_ids"]
    assert cached_output(None, answer, tok) == cached_output(text_ids, answer, tok) == \
        text_ids[:-1]
    wl = Workload("w", [Conversation("be brief " * 40, ["first " * 40, "second"], "c", 8)])

    def run(output_ids: list[int] | None) -> float:
        res = [Result("c", t, 0, 0, 0, 0.1, 0.2, "", "", "", 200, float(t),
                      output_text=answer, output_ids=output_ids) for t in range(2)]
        return oracle(res, wl, tok, 16)["oracle_block_hit_rate"]

    # The ids the engine generated are the text's own (a real model): the answer's blocks
    # count. Other ids (a random model's): only the earlier prompt's blocks do.
    assert run(None) == run(text_ids) > run([7] * len(text_ids)) > 0


def test_the_summary_says_why_the_router_moved_conversations():
    """Moves are counted with the router's reason for each (the GPU bench's log line), and
    a peer, which says nothing of its choices, has none."""
    def result(turn: int, reason: str, moved_from: str | None, predicted: int) -> Result:
        return Result("c", turn, 100, 0, 4, 0.1, 0.2, "r0", "extend", reason, 200, 0.0,
                      predicted_cached_tokens=predicted, moved_from=moved_from)

    ours = [result(1, "session", None, 64), result(2, "batch_wait", "r1", 0),
            result(3, "load_guard", "r1", 0), result(4, "load_guard", "r0", 0)]
    s = summarize(ours, 1.0)
    assert s["moves"] == 3 and s["move_reasons"] == {"load_guard": 2, "batch_wait": 1}
    assert summarize([result(1, "", None, -1)], 1.0)["move_reasons"] is None
