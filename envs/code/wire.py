"""What crosses between the judge and the candidate process: plain data in length-prefixed frames.

Plain data is None, bool, int, float, complex, str, bytes and list, tuple, dict, set, frozenset of
plain data, of exactly these types: a subclass of int, an object with its own `__eq__`, a generator
or a function is not plain. `encode` turns a value into JSON-able lists and dicts, `decode` builds it
back and accepts nothing else: whatever bytes a candidate writes, the judge only ever gets builtin
values whose comparisons it can trust. Dict subclasses of `collections` (Counter, OrderedDict,
defaultdict) encode as a dict, which they compare equal to.

A frame is 4 bytes of big-endian length, then the encoded value as a Python literal (its repr).
The judge reads a candidate's frame with `ast.literal_eval`, which builds literals and runs nothing;
the candidate reads the judge's with `eval` (its input is trusted). No imports beyond `os`: the
candidate process starts with `python -I -S` and this module, and `json` alone would cost it 10 ms.
"""
import os

MAX_DEPTH = 200  # nesting of containers; deeper values are refused, never a recursion crash
ERROR_CHARS = 300  # an error message travels as one short line
HEADER_SIZE = 4
SMALL_INTS = 1 << 64  # larger ints travel as hex: decimal strings of big ints hit Python's digit limit


def describe(exc):
    """'Type: message', first line only, short (a user exception's __str__ may even raise)."""
    try:
        message = str(exc)
    except BaseException:  # noqa: BLE001  (str() of a hostile exception may raise anything)
        message = "<unprintable>"
    text = type(exc).__name__ + (f": {message}" if message else "")
    return text.split("\n", 1)[0][:ERROR_CHARS]


class PlainDataError(ValueError):
    """A value that is not plain data, or bytes that do not decode to plain data."""


class ChannelClosed(EOFError):
    """The other end closed its pipe (it exited or was killed)."""


class ChannelTimeout(TimeoutError):
    pass


_DICT_SUBCLASSES = {"Counter", "OrderedDict", "defaultdict"}  # of `collections` (not imported here: 2 ms)


def encode(value, depth=0):
    if depth > MAX_DEPTH:
        raise PlainDataError(f"nested deeper than {MAX_DEPTH} levels")
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return value if -SMALL_INTS < value < SMALL_INTS else {"I": hex(value)}
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
    if kind is dict or (kind.__module__ == "collections" and kind.__name__ in _DICT_SUBCLASSES):
        return {"D": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is set or kind is frozenset:
        return {"S" if kind is set else "Z": [encode(v, depth + 1) for v in value]}
    raise PlainDataError(f"a value of type {describe_type(value)}, which is not plain data")


def describe_type(value):
    kind = type(value)
    for base in (bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset):
        if isinstance(value, base):
            return f"{kind.__name__} (a subclass of {base.__name__})"
    return kind.__name__


def decode(obj, depth=0):
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


def _str(x):
    if type(x) is not str:
        raise PlainDataError("malformed value")
    return x


def _list(x, n=None):
    if type(x) is not list or (n is not None and len(x) != n):
        raise PlainDataError("malformed value")
    return x


# ---- frames ----------------------------------------------------------------------------------------

def send(fd, message, deadline=None):
    data = repr(message).encode("utf-8", "surrogatepass")
    view = memoryview(len(data).to_bytes(HEADER_SIZE, "big") + data)
    while view:
        _wait(fd, deadline, write=True)
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:  # a non-blocking pipe that filled up since select said it had room
            continue


def receive(fd, max_bytes, deadline=None, trusted=False):
    """One message; ChannelClosed at EOF, ChannelTimeout past `deadline`, PlainDataError when the
    frame is larger than `max_bytes` or not a literal. `trusted`: the sender is the judge."""
    size = int.from_bytes(_read_exactly(fd, HEADER_SIZE, deadline), "big")
    if size > max_bytes:
        raise PlainDataError(f"a message of {size} bytes (more than {max_bytes})")
    data = _read_exactly(fd, size, deadline)
    if trusted:
        return eval(data.decode("utf-8", "surrogatepass"), {"__builtins__": {}})
    import ast

    try:  # bytes that are not UTF-8 fail here too (UnicodeDecodeError is a ValueError a test could catch)
        return ast.literal_eval(data.decode("utf-8", "surrogatepass"))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
        raise PlainDataError(f"malformed message: {type(e).__name__}") from None


def _read_exactly(fd, n, deadline):
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


def _wait(fd, deadline, write):
    if deadline is None:
        return
    import select
    import time

    remaining = max(0.0, deadline - time.monotonic())
    ready = select.select([], [fd], [], remaining) if write else select.select([fd], [], [], remaining)
    if not any(ready):
        raise ChannelTimeout()
