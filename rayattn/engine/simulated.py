"""A simulated engine replica (engine.simulated): the engine replica's protocol as routers
use it (replica.py: the probe, the KV event relay and its snapshots, streamed answers with
token ids and in-flight counts, the direct transport), over sim_core's scheduler instead of
vLLM. For router benchmarks and fleet-scale tests, where one machine holds the real router
tier against tens or hundreds of engines; never a default.

Answers are vLLM's OpenAI shapes (chat and completions, streamed or whole, usage with
cached tokens). The output is one word repeated, whose token id comes from the model's own
tokenizer, so a conversation's next turn, rendered by the router, starts with the blocks
this engine cached, as with a real model. KV events go out through vLLM's own publisher and
the replica's KVMirror, as a real engine's do.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from rayattn import logs
from rayattn.config.architecture import local_model_dir
from rayattn.config.loader import parse_args
from rayattn.config.plan import build_plan
from rayattn.engine import wire
from rayattn.engine.direct_server import DirectServer
from rayattn.engine.inflight import InflightCounts
from rayattn.engine.kv_mirror import TOPIC, KVMirror, node_ip, private_ipc_endpoints
from rayattn.engine.load_signals import LoadSignals
from rayattn.engine.protocol import (
    DirectAddress,
    EngineInfo,
    Misrouted,
    OpenAIRequest,
    RankInfo,
    Reply,
    check_target,
    error_json,
)
from rayattn.engine.replica import serve_identity
from rayattn.engine.sim_core import SimCore, SimRequest
from rayattn.integrations.vllm_renderer import prompt_token_ids
from rayattn.routing.hashing import BlockHasher, to_key
from rayattn.routing.kv_events import Snapshot

log = logging.getLogger("rayattn.engine")

WORD = " the"
"""What every simulated answer says, token after token."""


class SimulatedEngineReplica:
    def __init__(self, args: dict[str, Any]) -> None:
        logs.setup()
        t0 = time.monotonic()
        cfg = parse_args(args)
        plan = build_plan(cfg, prepare_model=True)
        assert cfg.engine.simulated is not None
        self.cfg, self.sim = cfg, cfg.engine.simulated
        self.replica_id, self.rank = serve_identity()
        self.block_size = plan.block_size
        self.max_model_len = cfg.model.max_model_len or 4096
        if self.sim.num_blocks * self.block_size < self.max_model_len:
            # As vLLM refuses to start: a longest request could never be scheduled.
            raise ValueError(f"engine.simulated.num_blocks: {self.sim.num_blocks} blocks of "
                             f"{self.block_size} tokens hold less than model.max_model_len "
                             f"({self.max_model_len})")
        max_seqs = cfg.engine.max_num_seqs or 256
        self.core = SimCore(self.sim, self.block_size, max_seqs,
                            cfg.engine.max_num_batched_tokens or 8192)
        self.hasher = BlockHasher(self.block_size, cfg.engine.prefix_caching_hash_algo,
                                  cfg.engine.hash_seed)
        self.word_id = _word_id(str(local_model_dir(cfg.model.source, prepare=True)))
        self.inflight = InflightCounts()
        self.model_name = cfg.model.name
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._direct: DirectServer | None = None
        self.load_signals = LoadSignals()
        from vllm.distributed.kv_events import ZmqEventPublisher

        self.mirror: KVMirror | None = None
        self.publisher: Any = None
        if cfg.engine.kv_events and cfg.engine.enable_prefix_caching:
            ipc_dir, pub, replay = private_ipc_endpoints()
            self.publisher = ZmqEventPublisher(0, pub, replay, topic=TOPIC)
            self.mirror = KVMirror(pub, replay, node_ip(), ipc_dir, rank=0)
        self._facts = {"replica": self.replica_id, "pid": os.getpid(), "backend": "SIMULATED",
                       "block_size": self.block_size, "num_gpu_blocks": self.sim.num_blocks,
                       "max_model_len": self.max_model_len, "max_num_seqs": max_seqs,
                       "startup_s": round(time.monotonic() - t0, 2)}
        log.info("simulated engine %s ready: %s", self.replica_id, self._facts)

    def _pinned(self, target: str | None) -> None:
        check_target(target, self.replica_id)

    async def info(self, target: str | None) -> EngineInfo:
        self._pinned(target)
        self.rank = serve_identity()[1]
        rank = RankInfo(None, None, self.sim.num_blocks, self.inflight.of(0))
        if self.mirror is not None:
            rank.kv_events, rank.kv_events_key = (self.mirror.endpoint,
                                                  self.mirror.server_key.decode())
        return EngineInfo(**self._facts, rank=self.rank, ranks=[rank],
                          unfinished=self.core.unfinished, direct=await self._direct_address(),
                          **self.inflight.report())

    async def _direct_address(self) -> DirectAddress | None:
        if self._direct is None:
            self._direct = DirectServer(self.serve, _classify)
        return await self._direct.address(node_ip())

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """As a vLLM engine replica reports them (rayattn/engine/load_signals.py)."""
        return self.load_signals.read()

    async def check_health(self) -> None:
        if self._loop_task is not None and self._loop_task.done():
            self._loop_task.result()  # the step loop's failure, as Serve's reason

    async def kv_snapshot(self, target: str | None, rank: int = 0) -> Any:
        self._pinned(target)
        return self.mirror.snapshot() if self.mirror is not None else Snapshot(-1, [])

    async def kv_subscribe(self, target: str | None, router_key: str) -> None:
        self._pinned(target)
        if self.mirror is not None:
            self.mirror.admit(router_key.encode())

    async def reset_prefix_cache(self, target: str | None) -> bool:
        self._pinned(target)
        mark = self.mirror.mark() if self.mirror is not None else -1
        if not self.core.cache.clear():
            return False
        self._publish(cleared=True)
        if self.mirror is not None:
            self.mirror.reset(mark)
        return True

    async def models(self, target: str | None = None) -> dict[str, Any]:
        self._pinned(target)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "owned_by": "rayattn", "root": self.model_name,
                                            "max_model_len": self.max_model_len}]}

    async def load_adapter(self, target: str | None, name: str, path: str) -> Reply:
        self._pinned(target)
        return Reply(error_json(400, "a simulated engine serves no LoRA adapters"), 400,
                     final=True)

    async def unload_adapter(self, target: str | None, name: str) -> Reply:
        return await self.load_adapter(target, name, "")

    def __del__(self) -> None:
        if getattr(self, "mirror", None) is not None:
            self.mirror.close()
        if getattr(self, "publisher", None) is not None:
            self.publisher.shutdown()

    # The engine
    def _publish(self, cleared: bool = False) -> None:
        events = self.core.cache.take_events()
        if self.publisher is None or not (events or cleared):
            return
        from vllm.distributed.kv_events import (
            AllBlocksCleared,
            BlockRemoved,
            BlockStored,
            KVEventBatch,
        )

        out: list[Any] = [AllBlocksCleared()] if cleared else []
        for kind, keys in events:
            if kind == "stored":
                out.append(_event(BlockStored, block_hashes=keys, parent_block_hash=None,
                                  token_ids=[], block_size=self.block_size, lora_id=None,
                                  medium="GPU", lora_name=None))
            else:
                out.append(_event(BlockRemoved, block_hashes=keys, medium="GPU"))
        self.publisher.publish(KVEventBatch(ts=time.time(), events=out, data_parallel_rank=0))

    async def _steps(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            step = self.core.schedule(loop.time())
            if step.empty:
                self._publish()
                self._wake.clear()
                await self._wake.wait()
                continue
            kv_usage = self.core.cache.usage  # as vLLM reports it: after scheduling
            before = {id(r): r.last_token_at for r in step.decoding}
            await asyncio.sleep(step.duration_s)
            now = loop.time()
            got = self.core.finish(step, now)
            for r in got:
                r.waker.set()
            # Measured, as TTFT is: a busy host stretches the step beyond its nominal time.
            self.load_signals.record(
                kv_usage, [now - r.arrived for r in got if r.generated == 1],
                [now - t for r in got if (t := before.get(id(r))) is not None])
            self._publish()

    def _submit(self, token_ids: list[int], max_tokens: int, salt: str | None) -> SimRequest:
        if self._loop_task is None or self._loop_task.done():
            # A fresh event with the loop: an asyncio.Event first awaited in an earlier loop
            # (a test's asyncio.run) raises when awaited in this one.
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._steps())
        # The output's tokens are known in advance: the keys of every block it will fill.
        hashes = self.hasher.full_hashes([*token_ids, *[self.word_id] * max_tokens], salt=salt)
        r = SimRequest([to_key(h) for h in hashes], len(token_ids), max_tokens,
                       asyncio.get_running_loop().time(), waker=asyncio.Event())
        self.core.add(r)
        self._wake.set()
        return r

    async def prefill(self, target: str | None, token_ids: list[int],
                      engine_rank: int | None = None, cache_salt: str | None = None) -> int:
        """As the vLLM engine replica's: `token_ids` through the engine for one token."""
        self._pinned(target)
        with self.inflight.counting(engine_rank, ""):
            r = self._submit(token_ids, 1, cache_salt)
            try:
                while not r.done:
                    await r.waker.wait()
                    r.waker.clear()
            finally:
                if not r.done:  # the router gave up on it: the engine request ends
                    self.core.abort(r)
        return r.cached_tokens

    async def serve(self, target: str | None, req: OpenAIRequest) -> AsyncIterator[Reply]:
        """One request, answered as vLLM's OpenAI layer would, counted in this engine's
        in-flight requests per sending router while it runs."""
        self._pinned(target)
        received = time.time()
        if req.kind not in ("chat", "completion"):
            yield Reply(error_json(404, f"a simulated engine serves no /v1/{req.kind}",
                               "NotFoundError"), 404,
                        final=True, **self.inflight.report())
            return
        token_ids = _prompt_ids(req)
        if token_ids is None:
            yield Reply(error_json(400, "a simulated engine needs the router's rendering"), 400,
                        final=True, **self.inflight.report())
            return
        if len(token_ids) >= self.max_model_len:
            yield Reply(error_json(400, f"This model's maximum context length is "
                                    f"{self.max_model_len} tokens. However, your request has "
                                    f"{len(token_ids)} input tokens."), 400, final=True,
                        **self.inflight.report())
            return
        body = req.body
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens")
                         or self.sim.max_tokens)
        max_tokens = max(1, min(max_tokens, self.max_model_len - len(token_ids)))
        stream = bool(body.get("stream"))
        usage = stream and bool((body.get("stream_options") or {}).get("include_usage"))
        fmt = _Format(req, self.model_name)
        with self.inflight.counting(req.engine_rank, req.origin):
            r = self._submit(token_ids, max_tokens, body.get("cache_salt"))
            try:
                sent, last_sent, parts = 0, 0.0, []
                while not r.done:
                    await r.waker.wait()
                    r.waker.clear()
                    if not stream or r.done:
                        continue
                    new = r.generated - sent
                    if new <= 0:
                        continue
                    if sent == 0:
                        parts.append(fmt.role())
                    parts.append(fmt.chunk(WORD * new))
                    sent = r.generated
                    now = time.monotonic()
                    if last_sent == 0.0 or now - last_sent >= req.stream_interval_s:
                        first = last_sent == 0.0
                        yield Reply("".join(parts), **(
                            {"stamps": {"engine_in": received, "engine_out": time.time()},
                             **self.inflight.report(req.engine_rank)} if first else {}))
                        parts, last_sent = [], now
            finally:
                if not r.done:
                    self.core.abort(r)  # the router hung up: the engine request ends
                    self._wake.set()
            cached, n = r.cached_tokens, r.generated
            if stream:
                if sent == 0:
                    parts.append(fmt.role())
                if n > sent:
                    parts.append(fmt.chunk(WORD * (n - sent)))
                parts.append(fmt.finish())
                if usage:
                    parts.append(fmt.usage(len(token_ids), n, cached))
                parts.append("data: [DONE]\n\n")
                data = "".join(parts)
            else:
                data = fmt.whole(WORD * n, len(token_ids), n, cached)
            # A stream whose one item is the final one: stamped as a first item is.
            stamps = ({"engine_in": received, "engine_out": time.time()}
                      if stream and sent == 0 else {})
            yield Reply(data, final=True, prompt_tokens=len(token_ids), num_cached_tokens=cached,
                        stamps=stamps,
                        completion_tokens=n, token_ids=[self.word_id] * n,
                        timings=_timings(r), served_by={"engine": self.replica_id,
                                                        "rank": self.rank, "pid": os.getpid()},
                        rendered_by_router=True, **self.inflight.report(req.engine_rank))


class _Format:
    """vLLM's OpenAI response shapes for one request."""

    def __init__(self, req: OpenAIRequest, model: str) -> None:
        self.chat = req.kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{req.request_id}"
        self.model = req.body.get("model") or model
        self.created = int(time.time())

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat
               else "text_completion", "created": self.created, "model": self.model,
               "choices": choices, **extra}
        return f"data: {json.dumps(obj)}\n\n"

    def role(self) -> str:
        if not self.chat:
            return ""
        return self._event([{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def chunk(self, text: str) -> str:
        part = {"delta": {"content": text}} if self.chat else {"text": text}
        return self._event([{"index": 0, **part, "logprobs": None, "finish_reason": None}])

    def finish(self) -> str:
        part = {"delta": {}} if self.chat else {"text": ""}
        return self._event([{"index": 0, **part, "logprobs": None, "finish_reason": "length"}])

    def usage(self, prompt: int, completion: int, cached: int) -> str:
        return self._event([], usage=_usage(prompt, completion, cached))

    def whole(self, text: str, prompt: int, completion: int, cached: int) -> str:
        choice = ({"message": {"role": "assistant", "content": text}} if self.chat
                  else {"text": text})
        return json.dumps({"id": self.id, "object": "chat.completion" if self.chat
                           else "text_completion", "created": self.created,
                           "model": self.model,
                           "choices": [{"index": 0, **choice, "logprobs": None,
                                        "finish_reason": "length"}],
                           "usage": _usage(prompt, completion, cached)})


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _timings(r: SimRequest) -> dict[str, Any]:
    first = r.first_token_at or r.last_token_at or r.arrived
    scheduled = r.scheduled_at or r.arrived
    end = r.last_token_at or first
    return {"ttft_s": first - r.arrived, "prefill_s": first - scheduled,
            "queue_s": scheduled - r.arrived, "e2e_s": end - r.arrived,
            "itl_s": (end - first) / (r.generated - 1) if r.generated > 1 else None,
            "path": "extend" if r.cached_tokens else "prefill",
            "scheduled_ts": scheduled, "first_token_ts": first}


def _event(cls: Any, **fields: Any) -> Any:
    """One of vLLM's KV events with the fields this vLLM's version of it has (the GPU runs'
    vLLM and the CPU build's differ)."""
    return cls(**{k: v for k, v in fields.items() if k in cls.__struct_fields__})


def _prompt_ids(req: OpenAIRequest) -> list[int] | None:
    """The router's rendering of the prompt (None: it sent none)."""
    ids = prompt_token_ids(req.engine_inputs[0]) if req.engine_inputs else []
    return list(ids) or None


def _word_id(model_dir: str) -> int:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir).encode(WORD, add_special_tokens=False)
    return ids[-1]


def _classify(e: BaseException) -> wire.Raised:
    return wire.raised_of(e, (ValueError,), (Misrouted,), ())
