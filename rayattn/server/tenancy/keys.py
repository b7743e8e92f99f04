"""Who is calling: API keys, and the cache namespace each caller's prompts live in.

Keys come from environment variables of the router process (a Kubernetes Secret in the
rendered manifests), never from the Serve config. The namespace is vLLM's `cache_salt`:
requests with different salts never share a cached block, so with `router.cache_isolation`
per key no tenant can learn from a cache hit, a faster answer or `cached_tokens` what another
tenant sent.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
from typing import Any

from rayattn.server.errors import APIError


class Keys:
    """API keys from environment variables of the router process (a Kubernetes Secret in
    the rendered manifests), never from the Serve config. No variable named: no auth."""

    def __init__(self, api: list[str] | None, admin: list[str]) -> None:
        self.api, self.admin = api, admin

    @classmethod
    def from_env(cls, rc: Any) -> Keys:
        def read(var: str | None, field: str) -> list[str]:
            if var is None:
                return []
            keys = [k.strip() for k in os.environ.get(var, "").split(",") if k.strip()]
            if not keys:
                raise ValueError(f"router.{field}: environment variable {var} holds no key on "
                                 "the router (refusing to serve without the keys it names)")
            return keys
        api = read(rc.api_keys_env, "api_keys_env") if rc.api_keys_env else None
        return cls(api, read(rc.admin_keys_env, "admin_keys_env"))

    def check(self, authorization: str | None, admin: bool) -> str | None:
        """The caller's key (None where no key is configured); 401 without a valid one."""
        wanted = self.admin if admin else self.api
        if wanted is None or (admin and self.api is None and not self.admin):
            return None  # no auth configured
        scheme, _, token = (authorization or "").strip().partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        # Compared in constant time with every key: no timing tells how much of a key
        # was right, nor which key matched.
        found = None
        for k in wanted:
            if hmac.compare_digest(given, k.encode()) and given:
                found = k
        if found is None:
            raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)"
                           + (" for the admin API" if admin else ""), code="invalid_api_key")
        return found


def key_id(key: str | None) -> str:
    """The name a key's requests are counted under (fair shares, rates); "" where no key is
    configured. A digest: these names may be shown, the keys not."""
    return "" if key is None else _digest("key id", key)[:12]


@functools.lru_cache(maxsize=4096)
def _digest(purpose: str, key: str) -> str:
    """A one-way digest of `key` for one purpose (names differ per purpose, so one cannot
    be matched against another); cached, as every request needs it."""
    return hashlib.sha256(f"rayattn {purpose}\0{key}".encode()).hexdigest()


def cache_salt(isolation: str, key: str | None, given: Any, keys_configured: bool) -> Any:
    """The `cache_salt` a request runs under: the client's own (`given`, left for vLLM to
    validate when it is not a string), prefixed per API key where isolation is per key.
    The key's part is a one-way digest of the key: the salt reaches engines and logs, the
    key must not."""
    per_key = isolation == "per_key" or (isolation == "auto" and keys_configured)
    if not per_key or key is None:
        return given
    tenant = _digest("cache namespace", key)[:32]
    if isinstance(given, str) and given:
        return f"{tenant}:{given}"
    return tenant
