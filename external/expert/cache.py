"""Disk cache of expert replies, so reruns and repeated prompts cost no requests."""
from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from pathlib import Path

from magrpo.paths import cache_root

from .errors import ExpertError


class ExpertCache:
    """sqlite3 table sha256(backend, model, prompt) -> reply; safe to share between threads."""

    def __init__(self, path: Path):
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One connection shared by the request threads, serialised by a lock; autocommit
        # (isolation_level=None) so every put is durable at once. WAL and the busy timeout let two
        # runs share the file.
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS replies (key TEXT PRIMARY KEY, reply TEXT NOT NULL)")

    def get(self, backend: str, model: str, prompt: str) -> str | None:
        with self._lock:
            row = self._db.execute(
                "SELECT reply FROM replies WHERE key = ?", (_key(backend, model, prompt),)
            ).fetchone()
        return None if row is None else row[0]

    def put(self, backend: str, model: str, prompt: str, reply: str) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO replies (key, reply) VALUES (?, ?)", (_key(backend, model, prompt), reply)
            )


def open_cache(setting: str) -> ExpertCache | None:
    """external.expert.cache: auto ($MAGRPO_CACHE/expert_cache.sqlite) | off | a file path."""
    if setting == "off":
        return None
    path = cache_root() / "expert_cache.sqlite" if setting == "auto" else Path(setting)
    try:
        return ExpertCache(path)
    except (OSError, sqlite3.Error) as e:
        raise ExpertError("external.expert.cache", f"cannot open {path}: {e}") from None


def _key(backend: str, model: str, prompt: str) -> str:
    # JSON keeps the three fields apart (no ambiguity from joining strings).
    return hashlib.sha256(json.dumps([backend, model, prompt]).encode()).hexdigest()
