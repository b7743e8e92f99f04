"""Who may call what: the router's API keys against a request's Authorization header."""

from __future__ import annotations

from fastapi import Request

from rayattn.server.errors import APIError
from rayattn.server.tenancy.keys import Keys


class Access:
    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        """Replaced whole when router settings change (Ingress.apply_router_config): every
        route reads the current keys through this one object."""

    def caller(self, request: Request, admin: bool = False) -> str | None:
        """The caller's key (None where no keys are configured); 401 without a valid one,
        or, for `admin`, without an admin key."""
        return self.keys.check(request.headers.get("authorization"), admin)

    def is_admin(self, request: Request) -> bool:
        """Whether the caller could open the admin API (every caller where no keys are
        configured). Only such callers see the router's account of a request (replica,
        predicted cache hits, other replicas' load) and /health's details: to a tenant,
        where another tenant's prompt is cached is an oracle on that prompt."""
        try:
            self.caller(request, admin=True)
            return True
        except APIError:
            return False
