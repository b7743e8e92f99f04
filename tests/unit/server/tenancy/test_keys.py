"""API keys come from the router's environment; checks are exact and fail closed."""

from __future__ import annotations

import pytest

from rayattn.config.schema import RouterConfig
from rayattn.server.errors import APIError
from rayattn.server.tenancy.keys import Keys


def _keys(monkeypatch, **env: str) -> Keys:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return Keys.from_env(RouterConfig(api_keys_env="K_API" if "K_API" in env else None,
                                      admin_keys_env="K_ADMIN" if "K_ADMIN" in env else None))


def test_no_keys_configured_means_open(monkeypatch):
    keys = _keys(monkeypatch)
    keys.check(None, admin=False)
    keys.check(None, admin=True)


def test_api_keys_checked_exactly(monkeypatch):
    keys = _keys(monkeypatch, K_API="alpha,beta")
    keys.check("Bearer beta", admin=False)
    keys.check("bearer alpha", admin=False)  # the scheme is case-insensitive (RFC 7235)
    for bad in (None, "", "Bearer ", "Bearer alph", "Bearer alpha,beta", "Basic alpha",
                "alpha"):
        with pytest.raises(APIError) as e:
            keys.check(bad, admin=False)
        assert e.value.status == 401
    with pytest.raises(APIError):  # an API key is not an admin key
        keys.check("Bearer alpha", admin=True)


def test_admin_keys_separate(monkeypatch):
    keys = _keys(monkeypatch, K_API="alpha", K_ADMIN="root")
    keys.check("Bearer root", admin=True)
    with pytest.raises(APIError):
        keys.check("Bearer root", admin=False)


def test_named_but_empty_variable_fails_closed(monkeypatch):
    monkeypatch.setenv("K_API", " , ")
    with pytest.raises(ValueError, match="router.api_keys_env"):
        Keys.from_env(RouterConfig(api_keys_env="K_API"))
    monkeypatch.delenv("K_API")
    with pytest.raises(ValueError, match="K_API"):
        Keys.from_env(RouterConfig(api_keys_env="K_API"))


def test_cache_namespaces_per_key_hide_the_key_and_keep_a_clients_salt():
    from rayattn.server.tenancy.keys import cache_salt

    a, b = (cache_salt("auto", k, None, keys_configured=True) for k in ("key-a", "key-b"))
    assert a != b and "key-a" not in a
    assert cache_salt("auto", "key-a", None, True) == a  # stable: every router agrees
    # A client's own salt narrows its namespace further, within its key's.
    assert cache_salt("per_key", "key-a", "mine", True) == f"{a}:mine"
    # Shared: the client's salt as given, none made up; no keys configured: nothing to key.
    assert cache_salt("shared", "key-a", "mine", True) == "mine"
    assert cache_salt("shared", "key-a", None, True) is None
    assert cache_salt("auto", None, None, keys_configured=False) is None
    # Not a string: left for vLLM's validation to refuse.
    assert cache_salt("shared", None, 5, False) == 5
