"""rayattn's own log lines in Ray worker processes.

Ray configures its own loggers, vLLM its own; records of `rayattn.*` would otherwise reach only
Python's last-resort handler (warnings and up). One stderr handler at INFO makes the few
one-off lines (engine ready, router settings applied) and the per-request lines of
`router.log_requests` land in the replica's log next to vLLM's.
"""

from __future__ import annotations

import logging
import sys


def setup() -> None:
    root = logging.getLogger("rayattn")
    if any(getattr(h, "_rayattn", False) for h in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
    handler._rayattn = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False
