"""vLLM's engine surface as rayattn uses it: engine arguments (AsyncEngineArgs) from the plan's
keyword arguments, the config objects they hold, and what vLLM raises when its engine dies."""

from __future__ import annotations

import functools
from typing import Any

from rayattn.integrations import vllm_facts


def engine_args(engine_kwargs: dict[str, Any]) -> Any:
    """vLLM's AsyncEngineArgs from rayattn's engine arguments."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(**config_objects(engine_kwargs))


def config_objects(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Config sections given as mappings (engine.extra_engine_kwargs in YAML, the plan's
    kv_transfer_config) as vLLM's config objects, where AsyncEngineArgs does not convert
    them itself."""
    kw = dict(engine_kwargs)
    so = kw.get("structured_outputs_config")
    if isinstance(so, dict):
        from vllm.config import StructuredOutputsConfig

        kw["structured_outputs_config"] = StructuredOutputsConfig(**so)
    kt = kw.get("kv_transfer_config")
    if isinstance(kt, dict):
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(**kt)
    return kw


@functools.cache
def engine_crash_types() -> tuple[type[BaseException], ...]:
    """What vLLM raises to the requests it was running when its engine died (empty where
    its layout differs)."""
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:  # pragma: no cover - vLLM layout differs
        return ()
    return (EngineDeadError,)


def engine_arg_names() -> frozenset[str] | None:
    """AsyncEngineArgs' field names (what engine.extra_engine_kwargs may set), or None
    without vLLM."""
    names = vllm_facts.cached("engine_args", _read_engine_arg_names)
    return frozenset(names) if names is not None else None


def _read_engine_arg_names() -> list[str] | None:
    try:
        import dataclasses

        from vllm.engine.arg_utils import AsyncEngineArgs
    except Exception:
        return None
    return sorted(f.name for f in dataclasses.fields(AsyncEngineArgs))


async def prefill(engine: Any, token_ids: list[int], request_id: str,
                  data_parallel_rank: int | None = None, cache_salt: str | None = None) -> int:
    """Run `token_ids` through `engine` (vLLM's AsyncLLM) for one output token, so that their
    KV is computed and cached; returns the prompt tokens it found cached already."""
    from vllm import SamplingParams

    prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    cached = 0
    async for out in engine.generate(prompt, SamplingParams(max_tokens=1, detokenize=False),
                                     request_id, data_parallel_rank=data_parallel_rank):
        cached = out.num_cached_tokens or 0
    return cached
