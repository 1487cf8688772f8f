"""Tolerant reading of an expert reply that should be a JSON object of edits, e.g. {"aux": ..., "main": ...}."""
from __future__ import annotations

import json
import re
from typing import Any, Iterator, Sequence

# strict=False: LLMs often put raw newlines/tabs inside JSON strings of code; accept them.
_DECODER = json.JSONDecoder(strict=False)
# A markdown fence line (```json, ```python, ```); only whole lines, so a ``` inside a value stays.
_FENCE_LINE = re.compile(r"^[ \t]*```[^\n]*$", re.MULTILINE)


def parse_edits(text: str, keys: Sequence[str]) -> dict[str, str] | None:
    """The first JSON object in `text` holding at least one of `keys`, as {key: str}; None if there is none.

    Each '{' is tried with a real JSON decoder (braces inside code strings and prose around the
    object are fine), first with markdown fence lines removed, then on the raw text. A requested
    key that is missing or null maps to "".
    """
    for candidate in _candidates(text):
        for obj in _objects(candidate):
            if any(k in obj for k in keys):
                return {k: _as_text(obj.get(k)) for k in keys}
    return None


def _candidates(text: str) -> Iterator[str]:
    unfenced = _FENCE_LINE.sub("", text)
    if unfenced != text:
        yield unfenced
    yield text


def _objects(text: str) -> Iterator[dict[str, Any]]:
    """Every JSON object that decodes starting at some '{', in order of position."""
    start = text.find("{")
    while start != -1:
        try:
            obj, _ = _DECODER.raw_decode(text, start)
        except (ValueError, RecursionError):  # RecursionError: ~1000 `[` or `{`, as a looping model writes
            obj = None
        if isinstance(obj, dict):
            yield obj
        # Go on from the next '{' even after a success: an outer object without the keys may
        # wrap the one we want.
        start = text.find("{", start + 1)


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else str(value)
