"""What the process that starts Ray needs in its environment, gathered in one place: Serve's
HAProxy front door (server/front_door.py) and normal-priority workers (engine/cpu_priority.py).
Ray reads both once, in each of its processes, from whatever started it."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from rayattn.engine import cpu_priority
from rayattn.server import front_door


def cluster_env(session_header: str = front_door.DEFAULT_SESSION_HEADER) -> dict[str, str]:
    """The variables (the Makefile and the KubeRay manifests carry the same)."""
    return {**front_door.cluster_env(session_header), **cpu_priority.cluster_env()}


def apply(session_header: str = front_door.DEFAULT_SESSION_HEADER,
          environ: MutableMapping[str, str] = os.environ) -> None:
    """Before `ray.init` starts a cluster in this process; an operator's own values win."""
    front_door.apply(session_header, environ)
    cpu_priority.apply(environ)
