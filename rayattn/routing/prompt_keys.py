"""A prompt's block keys as the engines will hash them, hashing a conversation's new turn only
past what it shares with its previous one."""

from __future__ import annotations

from collections.abc import Mapping

from rayattn.routing.hashing import BlockHasher, to_key
from rayattn.routing.known_prefixes import KnownPrefixes
from rayattn.routing.policies import RouteRequest


class PromptKeys:
    def __init__(self, block_size: int, hash_algo: str = "sha256", hash_seed: str = "0",
                 adapters: Mapping[str, str] | None = None) -> None:
        """`adapters`: the LoRA adapters the engines serve (name: the path they load it
        from, which vLLM hashes into its blocks)."""
        self._hash = (hash_algo, hash_seed)
        self.hasher = BlockHasher(block_size, hash_algo, hash_seed)
        self.adapter_paths = dict(adapters or {})
        """Kept as this one dict: the server's adapter registry adds and drops in it."""
        self.prefixes = KnownPrefixes(block_size)
        self.hashed_blocks = 0
        """Blocks hashed so far (a conversation's known prefix is not hashed again)."""

    @property
    def block_size(self) -> int:
        return self.hasher.block_size

    def rehash(self, block_size: int) -> None:
        """Hash `block_size`-token blocks from now on."""
        self.hasher = BlockHasher(block_size, *self._hash)
        self.prefixes.clear(block_size)  # hashed with the other block size

    def route(self, token_ids: list[int], session: str | None = None, text: str = "",
              salt: str | None = None, adapter: str | None = None) -> RouteRequest:
        """The routing view of a prompt (RoutingCore.request)."""
        session = session or None  # an empty header names no conversation
        if session and (salt or adapter):
            session = "\0".join((salt or "", adapter or "", session))
        known = self.prefixes.known(token_ids, session) if session else []
        hashes = self.hasher.full_hashes(token_ids, known, salt, self._adapter(adapter))
        self.hashed_blocks += len(hashes) - len(known)
        if session:
            self.prefixes.remember(session, token_ids, hashes, salt, adapter)
        keys = [to_key(h) for h in hashes]
        head = keys[0] if keys else hash((adapter, tuple(token_ids[: self.block_size])))
        return RouteRequest(keys, len(token_ids), head, session, text, hashes, token_ids,
                            adapter=adapter, salt=salt,
                            continued_tokens=len(known) * self.block_size)

    def continuation(self, route: RouteRequest, output_ids: list[int]) -> list[int]:
        """The block keys the engine caches once `route` ran to its end with `output_ids`:
        the prompt and all of the output but its last id, whose KV was never computed."""
        cached = route.token_ids + output_ids[:-1]
        full = self.hasher.full_hashes(cached, route.block_hashes, route.salt,
                                       self._adapter(route.adapter))
        self.hashed_blocks += len(full) - len(route.block_hashes)
        if route.session:
            # The next turn starts with this prompt and, re-rendered, usually the answer.
            self.prefixes.remember(route.session, cached, full, route.salt, route.adapter)
        return route.keys + [to_key(h) for h in full[len(route.block_hashes):]]

    def _adapter(self, name: str | None) -> tuple[str, str] | None:
        if name is None:
            return None
        try:
            return name, self.adapter_paths[name]
        except KeyError:
            raise ValueError(f"unknown LoRA adapter {name!r}") from None
