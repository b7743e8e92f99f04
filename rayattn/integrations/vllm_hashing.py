"""vLLM's prefix-cache block hashing, as the router repeats it (rayattn/routing/hashing.py):
the hash function named in the engines' config, vLLM's own chaining of a block's tokens onto
its parent's hash, and the extra keys (cache salt, LoRA adapter) it hashes beside the tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """vLLM's hash function of that name (`prefix_caching_hash_algo`)."""
    from vllm.utils.hashing import get_hash_fn_by_name

    return get_hash_fn_by_name(algo)


def block_hasher() -> Callable[..., Any]:
    """vLLM's `hash_block_tokens(hash_fn, parent_hash, token_ids, extra_keys)`."""
    from vllm.v1.core import kv_cache_utils

    return kv_cache_utils.hash_block_tokens


def request_stand_in(salt: str | None, lora: Any) -> SimpleNamespace:
    """What `block_extra_keys` hands vLLM's function in place of a request: no images, no
    prompt embeddings (the names of 0.25's and 0.32's fields alike)."""
    return SimpleNamespace(lora_request=lora, mm_features=[], mm_positions=[], mm_hashes=[],
                           cache_salt=salt, prompt_embeds=None,
                           _prompt_embeds_per_block_hashes={})


@functools.lru_cache(maxsize=1024)
def block_extra_keys(salt: str | None, adapter: tuple[str, str] | None,
                     first: bool) -> tuple[Any, ...] | None:
    """The extra keys vLLM hashes into a prompt's block beside its tokens: the `cache_salt`
    into the first block only, a LoRA adapter into every block. From vLLM's own function:
    their form changed across versions (the bare salt, then a ("cache_salt", salt) pair;
    the adapter's name, then ("lora", name, path))."""
    from vllm.lora.request import LoRARequest
    from vllm.v1.core import kv_cache_utils

    # No images, no prompt embeddings. The adapter's int id is per engine process (vLLM
    # numbers adapters as it loads them) and is not hashed.
    lora = LoRARequest(adapter[0], 1, adapter[1]) if adapter else None
    stand_in = request_stand_in(salt, lora)
    start = 0 if first else 1 << 20  # past the first block, whatever the block size
    keys, _ = kv_cache_utils.generate_block_hash_extra_keys(stand_in, start, start + 1, 0)
    return keys
