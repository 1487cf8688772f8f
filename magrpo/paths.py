"""Where magrpo keeps what it builds, converts and caches (models, expert replies)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """cache_dir, else $MAGRPO_CACHE, else ~/.cache/magrpo."""
    if cache_dir is None:
        cache_dir = os.environ.get("MAGRPO_CACHE") or Path.home() / ".cache" / "magrpo"
    return Path(cache_dir).expanduser()
