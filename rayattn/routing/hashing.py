"""Block hashes keyed exactly like vLLM's prefix cache.

We call vLLM's own `hash_block_tokens` with the engines' hash function and the same
PYTHONHASHSEED-derived NONE_HASH, so a block the router indexes is the block the engine
caches (tests/unit/routing/test_hashing.py checks parity with vLLM's request block
hasher). Index keys are the low 64 bits of the hash as an int, exactly what vLLM's KV events carry
(`maybe_convert_block_hash`), so events from the engines and the router's own predictions
land on the same keys.
"""

from __future__ import annotations

from collections.abc import Sequence

from rayattn.integrations import vllm_hashing


class BlockHasher:
    def __init__(self, block_size: int, algo: str = "sha256", seed: str = "0"):
        self.block_size = block_size
        self._hash_fn = vllm_hashing.hash_function(algo)
        # vLLM's first block chains from NONE_HASH = hash_fn(PYTHONHASHSEED of the engine).
        # We hold our own instead of vLLM's module global so several hashers (policies in
        # the simulator, tests) can coexist in one process.
        self._none_hash = self._hash_fn(seed)
        self._hash_block = vllm_hashing.block_hasher()

    def full_hashes(self, token_ids: Sequence[int], known: Sequence[bytes] = (),
                    salt: str | None = None,
                    adapter: tuple[str, str] | None = None) -> list[bytes]:
        """vLLM BlockHash values of every full block of `token_ids`, chained. `known` are
        already-computed hashes of its leading blocks (a conversation's earlier turns), so
        only the new blocks are hashed. `salt` is the request's `cache_salt`, which vLLM
        hashes into the first block (and so, by chaining, into every block); `adapter`
        (name, path) its LoRA adapter, which vLLM hashes into every block."""
        out: list[bytes] = list(known)
        parent = out[-1] if out else self._none_hash
        bs = self.block_size
        keyed = salt is not None or adapter is not None
        for start in range(len(out) * bs, len(token_ids) - bs + 1, bs):
            extra = vllm_hashing.block_extra_keys(salt, adapter, start == 0) if keyed else None
            parent = self._hash_block(self._hash_fn, parent, token_ids[start:start + bs], extra)
            out.append(parent)
        return out

    def keys(self, token_ids: Sequence[int], salt: str | None = None,
             adapter: tuple[str, str] | None = None) -> list[int]:
        return [to_key(h) for h in self.full_hashes(token_ids, salt=salt, adapter=adapter)]


def to_key(block_hash: bytes | int) -> int:
    """Index key of a vLLM block hash: its low 64 bits (KV events may already carry the int)."""
    if isinstance(block_hash, int):
        return block_hash & _MASK64
    return int.from_bytes(block_hash[-8:], "big")


_MASK64 = (1 << 64) - 1
