"""Drive an OpenAI endpoint with a workload (streaming, closed loop) and score the run:
cache-hit rate against the trace's oracle, TTFT percentiles, throughput, balance."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from rayattn.bench.stats import percentile
from rayattn.bench.workloads import Conversation, Workload
from rayattn.server.loop_watch import LoopWatch


@dataclass
class Result:
    session: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    e2e_s: float
    replica: str
    path: str
    reason: str
    status: int
    start_s: float
    prompt_ids: list[int] | None = None
    output_text: str = ""
    output_ids: list[int] | None = None
    """The tokens the engine generated (vLLM's `return_token_ids`); None where the server
    does not send them."""
    predicted_cached_tokens: int = -1
    """What the router predicted (-1: not a rayattn endpoint)."""
    engine_ttft_s: float | None = None
    """TTFT inside the engine replica; ttft_s minus this is the serving hops' share."""
    engine_prefill_s: float | None = None
    """The engine's scheduled → first token (its own clock)."""
    engine_queue_s: float | None = None
    engine_itl_s: float | None = None
    router_s: float | None = None
    """The router's own hop: request in → engine call issued."""
    hops: dict[str, float] | None = None
    """The rest of the way to the first token: to_engine_s, in_engine_s, from_engine_s."""
    to_router_s: float | None = None
    """Client send → the router's handler (HTTP proxy, Serve's hand-off), by wall clock."""
    back_to_client_s: float | None = None
    """The first item at the router → the first token at the client (the router relaying
    it, the HTTP proxy, the client's own parsing), by wall clock."""
    rendered_by_router: bool | None = None
    """The engine served the router's rendering of the prompt (render once)."""
    loads: str = ""
    """The router's in-flight estimate per candidate at the decision ("engine-0:3 …")."""
    costs: str = ""
    """The policy's predicted cost (s) per candidate, where it has a cost model."""
    moved_from: str | None = None
    """The replica of this conversation's previous turn, when the router chose another."""
    regret_tokens: int = 0
    """Tokens another replica held beyond the chosen one's, when the router chose."""


async def _lines(body: aiohttp.StreamReader) -> AsyncIterator[str]:
    """The response's lines, however long (aiohttp's own line reader stops at 64 KiB)."""
    buf = bytearray()
    async for chunk in body.iter_any():
        start = len(buf)
        buf += chunk
        while (end := buf.find(b"\n", start)) >= 0:
            yield bytes(buf[:end]).rstrip(b"\r").decode()
            del buf[:end + 1]
            start = 0
    if buf:
        yield bytes(buf).decode()


async def chat_turn(client: aiohttp.ClientSession, url: str, model: str, messages: list[dict],
               conv: Conversation, turn: int, t_origin: float, run: str = "") -> Result:
    # return_token_ids: the oracle needs the tokens the engine generated and cached, which
    # a random-weight model's text does not give back when re-tokenized.
    body = {"model": model, "messages": messages, "max_tokens": conv.max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    t0, sent_at = time.monotonic(), time.time()
    ttft, first_at, text, usage, ext, status = None, None, [], {}, {}, 0
    ids: list[int] | None = None
    async with client.post(f"{url}/v1/chat/completions", json=body,
                           headers={"x-session-id": conv.session + run}) as r:
        status = r.status
        async for line in _lines(r.content):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                status = ev["error"].get("code", 500)
                break
            for ch in ev.get("choices", []):
                if ch["delta"].get("content"):
                    if ttft is None:
                        ttft, first_at = time.monotonic() - t0, time.time()
                    text.append(ch["delta"]["content"])
                if ch.get("token_ids"):
                    ids = ids or []
                    ids.extend(ch["token_ids"])
            usage = ev.get("usage") or usage
            ext = ev.get("rayattn") or ext
    end = time.monotonic()
    details = usage.get("prompt_tokens_details") or {}
    return Result(conv.session, turn, usage.get("prompt_tokens", 0),
                  details.get("cached_tokens", 0), usage.get("completion_tokens", 0),
                  ttft if ttft is not None else end - t0, end - t0, ext.get("replica", ""),
                  ext.get("path", ""), ext.get("route_reason", ""), status, t0 - t_origin,
                  output_text="".join(text), output_ids=ids,
                  predicted_cached_tokens=ext.get("predicted_cached_tokens", -1),
                  engine_ttft_s=ext.get("engine_ttft_s"),
                  engine_prefill_s=ext.get("engine_prefill_s"),
                  engine_queue_s=ext.get("engine_queue_s"),
                  engine_itl_s=ext.get("engine_itl_s"), router_s=ext.get("router_s"),
                  hops=ext.get("hops"), rendered_by_router=ext.get("rendered_by_router"),
                  to_router_s=_since(sent_at, ext.get("arrived_at")),
                  back_to_client_s=_since(ext.get("first_item_at"), first_at),
                  loads=_pairs(ext.get("loads")), costs=_pairs(ext.get("costs")),
                  moved_from=ext.get("moved_from"), regret_tokens=ext.get("regret_tokens") or 0)


def _since(start: float | None, end: float | None) -> float | None:
    return end - start if start is not None and end is not None else None


def _pairs(d: dict[str, Any] | None) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted((d or {}).items()))


CLIENT_STALLS: dict[str, float] = {}
"""The last run_workload's client stalls (LoopWatch.counts)."""


async def run_workload(url: str | list[str], model: str, workload: Workload,
                       concurrency: int = 8, timeout: float = 300, rate: float | None = None,
                       seed: int = 0, progress: bool = False,
                       think_s: float = 0.0) -> tuple[list[Result], float]:
    """Closed loop: conversations run concurrently (up to `concurrency`), turns of one in
    order, each next turn a uniform 0..`think_s` after the previous answer (a user reading,
    a tool running). Open loop (`rate` req/s): conversations start as a Poisson process.
    Several URLs (independent routers): turn t of every conversation goes to url[t % n]."""
    # Whatever the client holds from before this run (earlier runs' results, tokenizers) out
    # of the collector's reach, before the clock starts: a full collection over it can stop
    # the client for a large part of a second inside one run (the same run each time, as
    # the stacks run in a fixed order), and that run's TTFT and wall would count it.
    gc.collect()
    gc.freeze()
    try:
        return await _run_workload(url, model, workload, concurrency=concurrency,
                                   timeout=timeout, rate=rate, seed=seed, progress=progress,
                                   think_s=think_s)
    finally:
        gc.unfreeze()


async def _run_workload(url: str | list[str], model: str, workload: Workload, *,
                        concurrency: int, timeout: float, rate: float | None, seed: int,
                        progress: bool, think_s: float) -> tuple[list[Result], float]:
    urls = [url] if isinstance(url, str) else list(url)
    sem = asyncio.Semaphore(concurrency if rate is None else 10**6)
    results: list[Result] = []
    t_origin = time.monotonic()
    starts, t = [], 0.0
    rng = random.Random(seed)
    # Each run's own session ids: routers remember where a conversation's last turn went, and
    # one run's placements would steer the next (with several routers, a reset reaches one).
    run = f".{uuid.uuid4().hex[:8]}"
    for _ in workload.conversations:
        starts.append(t)
        if rate:
            t += rng.expovariate(rate)

    async def conversation(c: Conversation, client: aiohttp.ClientSession,
                           start: float) -> None:
        await asyncio.sleep(max(0.0, start - (time.monotonic() - t_origin)))
        async with sem:
            messages = [{"role": "system", "content": c.system}]
            # Each conversation's own pauses: the same in every run, whatever the order in
            # which conversations finish.
            pause = random.Random(f"{seed}:{c.session}")
            for t, user in enumerate(c.turns):
                messages.append({"role": "user", "content": user})
                res = await chat_turn(client, urls[t % len(urls)], model, list(messages), c, t,
                                 t_origin, run)
                res.prompt_ids = None
                results.append(res)
                if progress:
                    done = len(results)
                    print(f"\r  {done}/{workload.num_requests} requests", end="", flush=True)
                messages.append({"role": "assistant", "content": res.output_text})
                if think_s and t + 1 < len(c.turns):
                    await asyncio.sleep(pause.uniform(0, think_s))

    # The client's own stalls: a stalled client delays the TTFT it measures.
    watch = LoopWatch()
    watch.start()
    # aiohttp, as vLLM's own benchmark client. httpx's connection pool re-scans every
    # request against every connection on each event (httpcore
    # `_assign_requests_to_connections`): driven by 128 streams at once it held requests back
    # for seconds before sending them, even against a trivial SSE server on loopback, and
    # every stack's TTFT counted that wait as its own (docs/log/gpu-one-gpu-contest.md).
    connector = aiohttp.TCPConnector(limit=concurrency * 2 if rate is None else 0)
    # `timeout` bounds connecting and each wait for the next bytes, not a whole stream.
    limit = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=limit) as client:
        await asyncio.gather(*(conversation(c, client, s)
                               for c, s in zip(workload.conversations, starts, strict=True)))
    watch.stop()
    CLIENT_STALLS.update(watch.counts())
    if progress:
        print()
    return results, time.monotonic() - t_origin


def replay_tokens(results: list[Result], workload: Workload, tokenizer: Any
                  ) -> list[tuple[Result, list[int], list[int]]]:
    """(result, prompt ids, cached output ids) in the order requests ran, prompts rebuilt
    with the served model's chat template exactly as the router built them."""
    convs = {c.session: c for c in workload.conversations}
    out = []
    for r in sorted(results, key=lambda x: x.start_s):
        c = convs[r.session]
        msgs = [{"role": "system", "content": c.system}]
        prior = [x for x in results if x.session == r.session and x.turn < r.turn]
        for p in sorted(prior, key=lambda x: x.turn):
            msgs += [{"role": "user", "content": c.turns[p.turn]},
                     {"role": "assistant", "content": p.output_text}]
        msgs.append({"role": "user", "content": c.turns[r.turn]})
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append((r, ids, cached_output(r.output_ids, r.output_text, tokenizer)))
    return out


def cached_output(output_ids: list[int] | None, output_text: str, tokenizer: Any
                  ) -> list[int]:
    """The generated tokens an engine's prefix cache holds after a request: all but the
    last (no step ever computes the last sampled token's KV). Without the engine's own ids,
    the re-tokenized text stands in for them, which overstates it where the text does not
    tokenize back to the same ids (random-weight models)."""
    if output_ids is None:
        output_ids = tokenizer(output_text, add_special_tokens=False)["input_ids"]
    return output_ids[:-1]


def oracle(results: list[Result], workload: Workload, tokenizer: Any, block_size: int
           ) -> dict[str, float]:
    """Tokens an infinite cache could have served, in the order requests ran: each prompt's
    longest prefix shared with any earlier request's prompt + output. Reported at token
    granularity and block-aligned (what vLLM's block cache can serve at best)."""
    seen: list[list[int]] = []
    tok_hits = blk_hits = total = 0
    for _, ids, outs in replay_tokens(results, workload, tokenizer):
        best = 0
        for s in seen:
            n = 0
            for a, b in zip(ids, s, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        best = min(best, len(ids) - 1)
        tok_hits += best
        blk_hits += best // block_size * block_size
        total += len(ids)
        seen.append(ids + outs)
    return {"oracle_token_hit_rate": tok_hits / total if total else 0.0,
            "oracle_block_hit_rate": blk_hits / total if total else 0.0}


def summarize(results: list[Result], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200]
    ttfts = sorted(r.ttft_s for r in ok)
    per_replica: dict[str, int] = {}
    for r in ok:
        if r.replica:  # a peer does not say which of its engines answered
            per_replica[r.replica] = per_replica.get(r.replica, 0) + 1
    prompt = sum(r.prompt_tokens for r in ok)
    ours = any(r.predicted_cached_tokens >= 0 for r in ok)  # a rayattn endpoint answered
    return {
        "requests": len(results), "ok": len(ok),
        "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p90_s": percentile(ttfts, 0.9),
        "output_tok_per_s": sum(r.completion_tokens for r in ok) / wall_s if wall_s else 0.0,
        "req_per_s": len(ok) / wall_s if wall_s else 0.0, "wall_s": wall_s,
        "per_replica": per_replica,
        "max_replica_share": (max(per_replica.values()) / sum(per_replica.values())
                              if per_replica else None),
        "paths": {p: sum(1 for r in ok if r.path == p) for p in ("prefill", "extend")},
        # The router's own account (rayattn only): conversations it moved, and tokens it
        # sent to be recomputed although another replica held them.
        "moves": sum(1 for r in ok if r.moved_from) if ours else None,
        # Why they moved: the router's reason for each (load_guard, batch_wait, ...).
        "move_reasons": (dict(Counter(r.reason for r in ok if r.moved_from).most_common())
                         if ours else None),
        "regret_tokens": sum(r.regret_tokens for r in ok) if ours else None,
        "hops": hop_summary(ok) if ours else None,
        "rendered_by_router": sum(1 for r in ok if r.rendered_by_router) if ours else None,
    }


def hop_summary(ok: list[Result]) -> dict[str, dict[str, float]]:
    """Where the time to first token goes, p50 / p99 per leg (ms): the client's request to
    the router's handler, the router before the engine call, the call's way to the engine
    replica, the engine replica until its first item leaves (render, queue, prefill), the
    item's way back to the router, and from there to the client's first token; `outside`
    is the sum of the client's legs (client TTFT minus the rest)."""
    legs: dict[str, list[float]] = {k: [] for k in (
        "to_router", "router", "to_engine", "in_engine", "from_engine", "back_to_client",
        "outside")}
    for r in ok:
        if r.router_s is None or not r.hops:
            continue
        h = r.hops
        legs["router"].append(r.router_s)
        for k in ("to_engine", "in_engine", "from_engine"):
            legs[k].append(h[f"{k}_s"])
        legs["outside"].append(r.ttft_s - r.router_s - sum(h.values()))
        if r.to_router_s is not None and r.back_to_client_s is not None:
            legs["to_router"].append(r.to_router_s)
            legs["back_to_client"].append(r.back_to_client_s)
    return {k: {"p50_ms": percentile(sorted(v), 0.5) * 1e3,
                "p99_ms": percentile(sorted(v), 0.99) * 1e3, "n": len(v)}
            for k, v in legs.items()}


def results_json(results: list[Result]) -> list[dict]:
    return [{k: v for k, v in asdict(r).items() if k != "prompt_ids"} for r in results]
