"""What the router sends an engine replica and what comes back, item by streamed item."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class OpenAIRequest:
    kind: Literal["chat", "completion", "responses"]
    body: dict[str, Any]
    """The client's JSON body, validated by the router with vLLM's own request model; its
    `request_id` is the request's id (x-request-id), which vLLM prefixes into the engine
    request id and the response's `id`."""
    request_id: str
    stream_interval_s: float = 0.0
    """A streamed response's SSE events are merged into one item per this interval after
    the first (each item is a Ray streaming message through three processes)."""
    log: bool = False
    """Log one line for this request on the engine (router.log_requests)."""
    origin: str = ""
    """The sending router replica: engines count in-flight requests per origin, so each
    router knows its own share exactly and takes only the others' from the report."""
    engine_inputs: list[dict[str, Any]] | None = None
    """vLLM's engine inputs (token ids) as the router's renderer made them from `body`: the
    engine serves them instead of rendering the body again (server/prompts/rendering.py says when
    the router sends them)."""
    trace: dict[str, str] | None = None
    """W3C trace context of the router's span for this request (tracing on): the engine's
    spans join that trace."""
    engine_rank: int | None = None
    """The DP rank inside the engine that runs the request (the router's target,
    routing/targets.py); None lets vLLM's own balancer pick one."""


@dataclass
class Reply:
    data: str
    """SSE text (one or more `data: …` events) of a streamed response; the whole JSON body
    of a non-streamed one or of an error."""
    status: int = 200
    """HTTP status: vLLM's own for its errors (ErrorResponse.error.code)."""
    final: bool = False
    prompt_tokens: int = 0
    num_cached_tokens: int = 0
    completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    """On the final item: the generated ids of the first choice (the router indexes the
    conversation's continuation from them)."""
    timings: dict[str, Any] = field(default_factory=dict)
    """On the final item of a request that ran: ttft_s, prefill_s, queue_s, e2e_s, itl_s,
    path, and the prefill's span on the engine's clock (scheduled_ts, first_token_ts)."""
    served_by: dict[str, Any] = field(default_factory=dict)
    """On the final item: the engine's own identity (replica id, rank, pid), so clients
    and tests can check where a request really ran, independently of the router."""
    inflight_by_origin: dict[str, int] | None = None
    """On the first and the final item: the in-flight requests per sending router at that
    moment, of the DP rank the request ran on where the router chose one (else of the whole
    engine). Fresher than the periodic probe, which under saturation can lag by
    seconds: with several routers a stale report of the others' load fired the guard."""
    inflight_stamp: tuple[int, int] | None = None
    """(engine pid, change counter) of `inflight_by_origin`, so the newest report wins."""
    stamps: dict[str, float] = field(default_factory=dict)
    """On the first item: wall-clock times (time.time()) the call reached the engine replica
    (`engine_in`) and this item left it (`engine_out`); the router adds when it received
    the item (`router_in`). They split the way to the first token into its hops."""
    rendered_by_router: bool = False
    """On the final item: the engine served the router's rendering of the prompt."""


class Misrouted(RuntimeError):
    """Raised by an engine replica for a call aimed at another replica (it left, or was
    replaced, between the router's choice and the call's delivery): the router routes the
    request again (server/fleet/pinning.py)."""


def error_json(status: int, message: str, kind: str = "BadRequestError") -> str:
    """An engine's own error answer, in vLLM's OpenAI error shape."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": status}})


def check_target(target: str | None, replica: str) -> None:
    """Refuses a call the router meant for another replica (`target`; None: any)."""
    if target is not None and target != replica:
        raise Misrouted(f"call for engine replica {target} reached {replica}")


class EngineDown(RuntimeError):
    """Raised by an engine replica whose engine was already dead when a call arrived: the
    request never ran there, so routing it to another replica is safe (unlike a request
    that was running when its engine died, which may be what killed it)."""


@dataclass
class DirectAddress:
    """Where a router reaches an engine replica without Serve (router.engine_transport:
    direct; engine/direct_server.py)."""

    url: str
    token: str = field(repr=False)
    """The bearer token the endpoint admits: never logged (EngineInfo's repr shows none)."""


@dataclass
class EngineInfo:
    """An engine replica's answer to the router's probe: who it is, what its KV cache is
    like, and its load right now."""

    replica: str
    """Serve's id of the replica (the name the router routes to)."""
    rank: int
    """Its current rank among the deployment's replicas (Serve renumbers 0..n-1)."""
    pid: int
    """The replica's process: a new pid under the same name means it was replaced."""
    backend: str
    block_size: int
    """KV block size the engine really uses (the router hashes with it)."""
    num_gpu_blocks: int
    """KV cache capacity in blocks, over all its DP ranks (the predicted index is bounded
    by it)."""
    max_model_len: int
    max_num_seqs: int
    """Requests the engine runs in one batch (vLLM's scheduler limit)."""
    startup_s: float
    ranks: list[RankInfo] = field(default_factory=list)
    """The engine's DP ranks (one where it runs no DP inside), each with its own KV cache."""
    host_kv_gib: float = 0.0
    """Its host-memory KV tier (engine.kv_offload.size_gib; 0: none)."""
    engine_pids: list[int] = field(default_factory=list)
    devices: list[str | None] = field(default_factory=list)
    """GPU UUIDs, one per worker ([] on CPU)."""
    placement_group: str | None = None
    """The Ray placement group the replica runs in."""
    worker_placement_groups: list[str | None] = field(default_factory=list)
    """The placement group each engine worker runs in (TP/PP > 1: vLLM's Ray workers)."""
    unfinished: int = 0
    """Requests vLLM's output processor still holds."""
    adapters: dict[str, str] = field(default_factory=dict)
    """The LoRA adapters its serving layer answers to now, name: path (the configured ones,
    and those loaded at run time)."""
    inflight_by_origin: dict[str, int] = field(default_factory=dict)
    """All requests in the engine now, per sending router."""
    inflight_stamp: tuple[int, int] | None = None
    """(pid, change counter) of the in-flight counts, here and in `ranks`."""
    direct: DirectAddress | None = None
    """The replica's own endpoint for the direct transport (None: it has none)."""

    @property
    def dp_ranks(self) -> int:
        return len(self.ranks) or 1


@dataclass
class RankInfo:
    """One DP rank of an engine: its KV cache's events and the requests pinned to it."""

    kv_events: str | None
    """ZMQ endpoint of the rank's KV events (None: it publishes none): CurveZMQ, open to
    the routers whose keys the engine admitted (`kv_subscribe`)."""
    kv_events_key: str | None = None
    """The relay's CurveZMQ public key (Z85)."""
    num_gpu_blocks: int = 0
    """The rank's KV cache capacity in blocks (EngineInfo.num_gpu_blocks is the engine's,
    vLLM's sum over its ranks)."""
    inflight_by_origin: dict[str, int] = field(default_factory=dict)
    """Requests the routers pinned to this rank, in flight now, per sending router."""
