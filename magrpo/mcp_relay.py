"""Between a stdio MCP server and the trainer (issue 44): passes the server's stdout on one line (one
JSON-RPC message) at a time, and never a line longer than MAX_BYTES.

A tool's answer can be as long as the tool makes it (a file read whole, a shell tool running `yes`),
and the MCP SDK's client joins a line's chunks by copying the whole line each time: an answer of
20 MB took it 28 s and 265 MB of the trainer's memory, one of 80 MB several minutes, in the thread that
serves every other call. So a longer line is dropped here as it streams (at most MAX_BYTES held), and an
answer to a request is answered instead with a JSON-RPC error for the same id, naming the size and
the limit: the call fails at once (`raised`) and the session goes on. Anything else that long (a
request or notification from the server) is dropped, and said on stderr.

The server's stderr passes through here too: the trainer keeps it in a temporary file, to quote its last
line when the server cannot start, and a server writes there for the whole run (the SDK's MCPServer logs
every request at its default level INFO; a tool may log its arguments). The file holds at most
STDERR_BYTES: past that it is emptied and starts again from the last TAIL bytes.

`python -I -S mcp_relay.py MAX_BYTES -- ARGV...` (stdlib only) runs ARGV with this process's stdin, its
stdout and stderr through pipes, passes a SIGTERM on to it and exits with its status.
"""
from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys

# The start of a response as JSON-RPC servers write it (the SDK's: jsonrpc, then id, then result/error)
RESPONSE = re.compile(rb'\s*\{\s*"jsonrpc"\s*:\s*"2\.0"\s*,\s*"id"\s*:\s*(-?\d+|"(?:[^"\\]|\\.){0,200}")\s*,'
                      rb'\s*"(?:result|error)"')
HEAD = 512  # bytes of a dropped line kept to find its id
STDERR_BYTES, TAIL = 1 << 20, 4096


def too_long(head: bytes, size: int, max_bytes: int) -> bytes:
    """What to send for a dropped line: an error answer to the same request, or nothing."""
    found = RESPONSE.match(head)
    message = f"the server's answer was {size:,} bytes, past max_message_bytes ({max_bytes:,})"
    print(f"mcp_relay: dropped a message of {size:,} bytes (max_message_bytes {max_bytes:,})",
          file=sys.stderr, flush=True)
    try:
        request = json.loads(found[1]) if found else None
    except ValueError:  # a string id with a bad escape: no request of ours has it
        request = None
    if request is None:
        return b""
    answer = {"jsonrpc": "2.0", "id": request, "error": {"code": -32603, "message": message}}
    return json.dumps(answer).encode() + b"\n"


class Lines:
    """The server's stdout, copied to `sink` a line at a time, a line past `max_bytes` replaced (see above)."""

    def __init__(self, sink: int, max_bytes: int) -> None:
        self.sink, self.max_bytes = sink, max_bytes
        self.line, self.head, self.dropped = bytearray(), b"", 0  # dropped > 0: inside a line being dropped

    def add(self, chunk: bytes) -> None:
        start = 0
        while start < len(chunk):
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            if self.dropped:
                self.dropped += len(piece)
            else:
                self.line += piece
                if len(self.line) > self.max_bytes:
                    self.head, self.dropped = bytes(self.line[:HEAD]), len(self.line)
                    self.line.clear()
            if end < 0:
                return
            out = too_long(self.head, self.dropped, self.max_bytes) if self.dropped else bytes(self.line) + b"\n"
            self.line.clear()
            self.dropped = 0
            write_all(self.sink, out)
            start = end + 1


class Bounded:
    """The server's stderr, copied to `sink`; a regular file there (the trainer's) holds at most
    STDERR_BYTES: past that it is emptied and starts again from the last TAIL bytes."""

    def __init__(self, sink: int) -> None:
        self.sink, self.size, self.tail = sink, 0, b""

    def add(self, chunk: bytes) -> None:
        self.tail = (self.tail + chunk)[-TAIL:]
        if self.size + len(chunk) > STDERR_BYTES:
            try:  # the sink shares its offset with the trainer's file: both start over at 0
                os.ftruncate(self.sink, 0)
                os.lseek(self.sink, 0, os.SEEK_SET)
            except OSError:  # a pipe or a terminal: it keeps nothing, so nothing to bound
                pass
            else:
                chunk, self.size = self.tail, 0
        write_all(self.sink, chunk)
        self.size += len(chunk)


def write_all(fd: int, data: bytes) -> None:
    while data:  # a blocking pipe: a write may take part of it
        data = data[os.write(fd, data):]


def relay(out: int, err: int, lines: Lines, bounded: Bounded) -> None:
    """Copy the server's stdout (`out`) and stderr (`err`) until its stdout ends, then what its stderr
    already holds (the last words of a server that could not start), not waiting for more."""
    sources = {out: lines, err: bounded}
    while out in sources:
        for fd in select.select(list(sources), [], [])[0]:
            chunk = os.read(fd, 1 << 16)
            if chunk:
                sources[fd].add(chunk)
            else:
                del sources[fd]
    if err in sources:
        os.set_blocking(err, False)
        while chunk := os.read(err, 1 << 16) if select.select([err], [], [], 0)[0] else b"":
            bounded.add(chunk)


def main(max_bytes: int, argv: list[str]) -> int:
    (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
    try:
        proc = subprocess.Popen(argv, stdout=out_w, stderr=err_w)
    except OSError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 127
    os.close(out_w)  # EOF once the server and whatever it started with its stdout are gone
    os.close(err_w)
    signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))  # its own grace, then ours
    try:
        relay(out_r, err_r, Lines(sys.stdout.fileno(), max_bytes), Bounded(sys.stderr.fileno()))
    except BrokenPipeError:  # the trainer closed its end: nothing more to pass on
        pass
    code = proc.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[3:]))
