"""Users' data files read so that none can take the machine's memory: JSON Lines streamed line by
line, a line longer than a limit refused after reading only that much of it, a UTF-8 byte-order mark
(as some editors write) accepted. For envs that read their own files (a `.jsonl` split)."""
from __future__ import annotations

import gzip
import itertools
from pathlib import Path
from typing import Iterator

from .errors import ConfigError

MAX_LINE_BYTES = 64 * 2**20  # a record bigger than this is no problem statement


def jsonl_lines(path: Path, key: str, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of every non-blank line of a `.jsonl` (or `.jsonl.gz`) file. A line
    longer than max_line_bytes, or one that is not UTF-8, is a ConfigError on `key` (the setting that
    named the file) giving the file and line number."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        for number in itertools.count(1):
            raw = f.readline(max_line_bytes + 1)  # at most one byte past the limit is ever held
            if not raw:
                return
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                raise ConfigError(key, f"{path} line {number} is longer than {max_line_bytes:,} bytes; split or "
                                       f"shorten that record (nothing was read past its first {max_line_bytes:,} "
                                       f"bytes)")
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(key, f"{path} line {number} is not UTF-8 (byte {e.start}); save the file as "
                                       f"UTF-8") from None
            if text.strip():
                yield number, text
