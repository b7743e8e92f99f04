"""Attention-backend facts (head sizes, block sizes, KV dtypes, sinks) read from the installed
vLLM's backend classes where they import; rayattn/backends.py overlays them on its static
table."""

from __future__ import annotations

import functools
import logging
from typing import Any

from rayattn import compat
from rayattn.integrations import vllm_facts

log = logging.getLogger(__name__)


_TUPLES = ("head_sizes", "block_sizes", "kv_dtypes")


@functools.lru_cache(maxsize=1)
def installed_backend_names() -> frozenset[str] | None:
    """Names of the installed vLLM's AttentionBackendEnum, or None without vLLM."""
    if compat.vllm_version() is None:
        return None
    names = vllm_facts.cached("attention_backends", _read_names)
    return frozenset(names) if names is not None else None


@functools.cache
def backend_facts(name: str) -> dict[str, Any] | None:
    """The facts rayattn checks, read from the installed vLLM's backend class: kind,
    supports_sinks, head_sizes, block_sizes, block_size_multiple, kv_dtypes. None when vLLM
    is absent, does not know the name, or the class does not import on this build (CUDA
    kernels on a CPU build, say)."""
    names = installed_backend_names()
    if not names or name not in names:
        return None
    facts = vllm_facts.cached(f"attention_backend/{name}", lambda: _read_facts(name),
                              keep_none=True)
    return None if facts is None else {k: tuple(v) if k in _TUPLES else v
                                       for k, v in facts.items()}


def _read_names() -> list[str] | None:
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except Exception:
        return None
    return sorted(AttentionBackendEnum.__members__)


def _read_facts(name: str) -> dict[str, Any] | None:
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        cls = AttentionBackendEnum[name].get_class()
        sizes = list(cls.get_supported_kernel_block_sizes())
        exact = tuple(sorted(s for s in sizes if isinstance(s, int)))
        multiples = [s.base for s in sizes if not isinstance(s, int)]
        return {
            "kind": "mla" if cls.is_mla() else "mha",
            "supports_sinks": bool(cls.supports_sink()),
            "head_sizes": tuple(sorted(cls.get_supported_head_sizes())),
            "block_sizes": exact,
            "block_size_multiple": multiples[0] if multiples else None,
            "kv_dtypes": tuple(str(d) for d in cls.supported_kv_cache_dtypes),
        }
    except Exception as e:  # import of CUDA/ROCm-only kernels, or an API we do not know
        log.debug("backend %s: facts not readable from vLLM %s: %r", name,
                  compat.vllm_version(), e)
        return None
