"""What crosses between the judge and the candidate process: plain data and length-prefixed frames.

Plain data is None, bool, int, float, complex, str, bytes and list, tuple, dict, set, frozenset of
plain data, of exactly these types: a subclass of int, an object with its own `__eq__`, a generator
or a function is not plain. `encode` turns a value into JSON-able lists and dicts, `decode` builds it
back and accepts nothing else: whatever bytes a candidate writes, the judge only ever gets builtin
values whose comparisons it can trust. Dict subclasses of `collections` (Counter, OrderedDict,
defaultdict) encode as a dict, which they compare equal to.

Stdlib only and no package imports: the candidate runner loads this file by path (`python -I -S`).
"""
from __future__ import annotations

import json
import os
import select
import struct
import time

MAX_DEPTH = 200  # nesting of containers; deeper values are refused, never a recursion crash
HEADER = struct.Struct(">I")
JSON_INTS = 1 << 53  # larger ints travel as hex: decimal strings of big ints hit Python's digit limit


class PlainDataError(ValueError):
    """A value that is not plain data, or bytes that do not decode to plain data."""


class ChannelClosed(EOFError):
    """The other end closed its pipe (it exited or was killed)."""


class ChannelTimeout(TimeoutError):
    pass


def _dict_types() -> tuple[type, ...]:
    import collections

    return collections.Counter, collections.OrderedDict, collections.defaultdict


_DICTS = (dict, *_dict_types())


def encode(value, depth: int = 0):
    if depth > MAX_DEPTH:
        raise PlainDataError(f"nested deeper than {MAX_DEPTH} levels")
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return value if -JSON_INTS < value < JSON_INTS else {"I": hex(value)}
    if kind is float:
        return {"F": value.hex()}  # exact, and inf/nan without JSON extensions
    if kind is complex:
        return {"C": [value.real.hex(), value.imag.hex()]}
    if kind is bytes:
        return {"B": value.hex()}
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind is tuple:
        return {"T": [encode(v, depth + 1) for v in value]}
    if kind in _DICTS:
        return {"D": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is set or kind is frozenset:
        return {"S" if kind is set else "Z": [encode(v, depth + 1) for v in value]}
    raise PlainDataError(f"a value of type {describe_type(value)}, which is not plain data")


def describe_type(value) -> str:
    kind = type(value)
    for base in (bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset):
        if isinstance(value, base):
            return f"{kind.__name__} (a subclass of {base.__name__})"
    return kind.__name__


def decode(obj, depth: int = 0):
    if depth > MAX_DEPTH:
        raise PlainDataError(f"nested deeper than {MAX_DEPTH} levels")
    kind = type(obj)
    if obj is None or kind is bool or kind is str or kind is int:
        return obj
    if kind is list:
        return [decode(v, depth + 1) for v in obj]
    if kind is not dict or len(obj) != 1:
        raise PlainDataError(f"malformed value ({kind.__name__})")
    (tag, body), = obj.items()
    try:
        if tag == "I":
            return int(_str(body), 16)
        if tag == "F":
            return float.fromhex(_str(body))
        if tag == "C":
            real, imag = _list(body, 2)
            return complex(float.fromhex(_str(real)), float.fromhex(_str(imag)))
        if tag == "B":
            return bytes.fromhex(_str(body))
        if tag == "T":
            return tuple(decode(v, depth + 1) for v in _list(body))
        if tag == "D":
            return {decode(k, depth + 1): decode(v, depth + 1) for k, v in (_list(p, 2) for p in _list(body))}
        if tag in ("S", "Z"):
            items = (decode(v, depth + 1) for v in _list(body))
            return set(items) if tag == "S" else frozenset(items)
    except PlainDataError:
        raise
    except (TypeError, ValueError, OverflowError) as e:  # unhashable keys, bad hex, ...
        raise PlainDataError(f"malformed value: {type(e).__name__}: {e}") from None
    raise PlainDataError(f"malformed value (tag {tag!r})")


def _str(x) -> str:
    if type(x) is not str:
        raise PlainDataError("malformed value")
    return x


def _list(x, n: int | None = None) -> list:
    if type(x) is not list or (n is not None and len(x) != n):
        raise PlainDataError("malformed value")
    return x


# ---- frames: 4-byte big-endian length, then that many bytes of UTF-8 JSON --------------------------

def send(fd: int, message, deadline: float | None = None) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        _wait(fd, deadline, write=True)
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:  # a non-blocking pipe that filled up since select said it had room
            continue


def receive(fd: int, max_bytes: int, deadline: float | None = None):
    """One message; ChannelClosed at EOF, ChannelTimeout past `deadline`, PlainDataError when the
    frame is larger than `max_bytes` or not JSON."""
    (size,) = HEADER.unpack(_read_exactly(fd, HEADER.size, deadline))
    if size > max_bytes:
        raise PlainDataError(f"a message of {size} bytes (more than {max_bytes})")
    try:
        return json.loads(_read_exactly(fd, size, deadline))
    except (ValueError, RecursionError) as e:
        raise PlainDataError(f"malformed message: {type(e).__name__}") from None


def _read_exactly(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        _wait(fd, deadline, write=False)
        try:
            chunk = os.read(fd, min(n - got, 1 << 20))
        except BlockingIOError:
            continue
        if not chunk:
            raise ChannelClosed()
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _wait(fd: int, deadline: float | None, write: bool) -> None:
    if deadline is None:
        return
    remaining = deadline - time.monotonic()
    ready = select.select([], [fd], [], max(0.0, remaining)) if write else select.select([fd], [], [], max(0.0, remaining))
    if not any(ready):
        raise ChannelTimeout()
