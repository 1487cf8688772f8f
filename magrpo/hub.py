"""The Hugging Face hub: offline mode, and whether the hub answers at all. Without the probe, a model
that is neither a local folder nor cached costs minutes of download retries, each logged, before
its one clear error; with it, a hub that cannot be reached means loading from the cache only."""
from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from typing import Iterator
from urllib.parse import urlparse

TIMEOUT_S = 3.0
TRUE = {"1", "ON", "YES", "TRUE"}


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: the libraries use their cache only."""
    return any(os.environ.get(var, "").upper() in TRUE for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def endpoint() -> tuple[str, int]:
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    return url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)


def reachable() -> bool:
    """One TCP connection to the hub's endpoint within TIMEOUT_S."""
    try:
        socket.create_connection(endpoint(), timeout=TIMEOUT_S).close()
        return True
    except OSError:
        return False


@contextmanager
def cache_only(on: bool) -> Iterator[None]:
    """While on: huggingface_hub in offline mode, as HF_HUB_OFFLINE=1 would set it at import. Loading with
    local_files_only alone still sends a request of its own (huggingface_hub's agent registry)."""
    if not on:
        yield
        return
    import huggingface_hub.constants

    before = huggingface_hub.constants.HF_HUB_OFFLINE
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        huggingface_hub.constants.HF_HUB_OFFLINE = before
