"""Facts of the installed vLLM that cost seconds of imports to read (its attention backend
classes, its engine arguments), kept on disk per vLLM installation: Serve's build of the
application, `rayattn serve` and `rayattn check` read them there after the first time
instead of importing vLLM."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rayattn import compat
from rayattn.cache_dir import cache_root

log = logging.getLogger(__name__)


def _installation() -> str | None:
    """What names one vLLM installation: its version, where it is and when it was written
    (a reinstall of the same version elsewhere, or over it, is another)."""
    version = compat.vllm_version()
    spec = importlib.util.find_spec("vllm")
    if version is None or spec is None or spec.origin is None:
        return None
    return f"{version}|{spec.origin}|{os.stat(spec.origin).st_mtime_ns}|{sys.version_info[:2]}"


def _path(installation: str) -> Path:
    digest = hashlib.sha256(installation.encode()).hexdigest()[:16]
    return cache_root() / "vllm-facts" / f"{compat.vllm_version()}-{digest}.json"


def cached(key: str, read: Callable[[], Any], keep_none: bool = False) -> Any:
    """`read()`'s JSON-able answer for this vLLM installation, from disk where an earlier
    process read it, else read now and kept. Without vLLM, read every time. A None answer
    is kept only with `keep_none` (a backend class that does not import on this build
    never will); elsewhere it may be a passing failure, read again next time."""
    installation = _installation()
    if installation is None:
        return read()
    path = _path(installation)
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    value = read()
    if value is None and not keep_none:
        return None
    known[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, path)  # processes reading it see the old file or the new, whole
    except OSError as e:  # a read-only home: facts are read each time, as before
        log.debug("vLLM facts not kept at %s: %r", path, e)
    return value
