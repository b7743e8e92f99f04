"""How a policy is registered: its name, the router settings it reads, and its factory
(one `SPEC` per policy module, collected in rayattn/routing/policies/__init__.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rayattn.routing.policies.base import Policy, PolicyContext


@dataclass(frozen=True)
class PolicySpec:
    name: str
    summary: str
    settings: tuple[str, ...]
    """Router settings (fields of `router:` in the config) the factory reads. A live change
    of one of them rebuilds the policy; other settings never do (a rebuilt policy forgets
    what it learned)."""
    factory: Callable[[PolicyContext, Mapping[str, Any]], Policy]
    uses_prefix_cache: bool = True
    """Routes by what engines cache: needs engine.enable_prefix_caching."""
