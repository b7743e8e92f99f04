"""How a policy is registered: its name, the typed parameters it reads, and its factory (one
`SPEC` per policy module, collected in rayattn/routing/policies/__init__.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Self, TypeVar

from pydantic import BaseModel, ConfigDict

from rayattn.routing.policies.base import Policy, PolicyContext


class PolicyParams(BaseModel):
    """A policy's parameters, frozen: what its factory is built from. A policy that reads
    none registers this class itself.

    A policy with parameters declares their fields once, in a field group of its module
    (`router:` spells them flat, so RouterConfig takes the group as it is, through
    rayattn/routing/settings.py's RouterFields), and its params class is that group plus
    this base."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @classmethod
    def of(cls, source: object) -> Self:
        """These parameters as `source` holds them: any object with an attribute of each
        field's name (RouterConfig, which carries every policy's fields flat)."""
        return cls.model_validate({name: getattr(source, name) for name in cls.model_fields})

    def replace(self, **changes: object) -> Self:
        """A copy with `changes`, validated (the frozen way to change a parameter)."""
        return self.model_validate({**dict(self), **changes})


P = TypeVar("P", bound=PolicyParams)


@dataclass(frozen=True)
class PolicySpec(Generic[P]):
    name: str
    """The name `router.policy` selects it by."""
    summary: str
    """One line on how it picks a replica."""
    params: type[P]
    """The parameters its factory reads. A live change of one of them rebuilds the policy;
    other settings never do (a rebuilt policy forgets what it learned)."""
    factory: Callable[[PolicyContext, P], Policy]
    uses_prefix_cache: bool = True
    """Routes by what engines cache: needs engine.enable_prefix_caching."""
    warms_engines: bool = False
    """Engines that join or leave are warmed for it (router.warm_engines,
    routing/warm_plan.py); the comparison policies reproduce routers that do not."""
