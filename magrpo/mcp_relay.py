"""Between a stdio MCP server and the trainer (issue 44): passes the server's stdout on one line (one
JSON-RPC message) at a time, and never a line longer than MAX_BYTES.

A tool's answer can be as long as the tool makes it (a file read whole, a shell tool running `yes`),
and the MCP SDK's client joins a line's chunks by copying the whole line each time: an answer of
20 MB took it 28 s and 265 MB of the trainer's memory, one of 80 MB several minutes, in the thread that
serves every other call. So a longer line is dropped here as it streams (at most MAX_BYTES held), and an
answer to a request is answered instead with a JSON-RPC error for the same id, naming the size and
the limit: the call fails at once (`raised`) and the session goes on. Anything else that long (a
request or notification from the server) is dropped, and said on stderr.

`python -I -S mcp_relay.py MAX_BYTES -- ARGV...` (stdlib only) runs ARGV with this process's stdin and
stderr, its stdout through a pipe, passes a SIGTERM on to it and exits with its status.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

# The start of a response as JSON-RPC servers write it (the SDK's: jsonrpc, then id, then result/error)
RESPONSE = re.compile(rb'\s*\{\s*"jsonrpc"\s*:\s*"2\.0"\s*,\s*"id"\s*:\s*(-?\d+|"(?:[^"\\]|\\.){0,200}")\s*,'
                      rb'\s*"(?:result|error)"')
HEAD = 512  # bytes of a dropped line kept to find its id


def too_long(head: bytes, size: int, max_bytes: int) -> bytes:
    """What to send for a dropped line: an error answer to the same request, or nothing."""
    found = RESPONSE.match(head)
    message = f"the server's answer was {size:,} bytes, past max_message_bytes ({max_bytes:,})"
    print(f"mcp_relay: dropped a message of {size:,} bytes (max_message_bytes {max_bytes:,})",
          file=sys.stderr, flush=True)
    if found is None:
        return b""
    answer = {"jsonrpc": "2.0", "id": json.loads(found[1]), "error": {"code": -32603, "message": message}}
    return json.dumps(answer).encode() + b"\n"


def relay(source: int, sink: int, max_bytes: int) -> None:
    """Copy lines from `source` to `sink` until EOF, a line past `max_bytes` replaced (see above)."""
    line, head, dropped = bytearray(), b"", 0  # dropped > 0: inside a line being dropped
    while chunk := os.read(source, 1 << 16):
        start = 0
        while start < len(chunk):
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            if dropped:
                dropped += len(piece)
            else:
                line += piece
                if len(line) > max_bytes:
                    head, dropped = bytes(line[:HEAD]), len(line)
                    line.clear()
            if end < 0:
                break
            out = too_long(head, dropped, max_bytes) if dropped else bytes(line) + b"\n"
            line.clear()
            dropped = 0
            while out:  # a blocking pipe: a write may take part of it
                out = out[os.write(sink, out):]
            start = end + 1


def main(max_bytes: int, argv: list[str]) -> int:
    read, write = os.pipe()
    try:
        proc = subprocess.Popen(argv, stdout=write)
    except OSError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 127
    os.close(write)  # EOF once the server and whatever it started with its stdout are gone
    signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))  # its own grace, then ours
    try:
        relay(read, sys.stdout.fileno(), max_bytes)
    except BrokenPipeError:  # the trainer closed its end: nothing more to pass on
        pass
    code = proc.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[3:]))
