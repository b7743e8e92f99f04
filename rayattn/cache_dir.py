"""Where rayattn keeps what it prepares once per machine (models, facts of the installed
vLLM): ``RAYATTN_CACHE``, else ``~/.cache/rayattn``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("RAYATTN_CACHE", Path.home() / ".cache" / "rayattn"))
