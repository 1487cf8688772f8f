"""One model-written snippet run as a script (the `run_python` tool): in the judge's sandbox, started
the same way (bubblewrap flags, a fresh uid as root, the candidate's rlimits; `unsafe`: a plain child
process), under a wall-clock limit, its stdout and stderr capped, and the sandbox killed afterwards
with every process the snippet started. No judge: nothing is graded, nothing secret is near.
"""
from __future__ import annotations

import os
import selectors
import time
from dataclasses import asdict, dataclass

from .sandbox import (
    DRAIN_S,
    SandboxLimits,
    Slot,
    _Capped,
    _kill,
    _pump,
    _signalled,
    _spawn,
    _status,
    check_started,
    confinement,
    watch_pid1,
)

MAX_SOURCE_BYTES = 60_000  # the whole snippet waits in a pipe (64 KiB on Linux) before the sandbox starts


@dataclass
class ScriptResult:
    returncode: int | None  # None: still running at the time limit (then killed); < 0: killed by that signal
    stdout: str
    stderr: str
    stdout_cut: bool  # more than limits.output_bytes were written (the rest dropped)
    stderr_cut: bool
    duration_s: float
    isolation: str  # the mode that confined the run: bwrap | unsafe

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


class _Counted(_Capped):
    """A capped sink that remembers whether anything was dropped."""

    def __init__(self, cap: int) -> None:
        super().__init__(cap)
        self.cut = False

    def add(self, chunk: bytes) -> None:
        self.cut = self.cut or len(self.data) + len(chunk) > self.cap
        super().add(chunk)


def run_script(source: str, limits: SandboxLimits) -> ScriptResult:
    """Runs `source` with `python -I -S` (the standard library only) confined by `limits` (its mode,
    timeout_s, output_bytes and rlimits). ValueError for a snippet over MAX_SOURCE_BYTES; RuntimeError
    when the sandbox could not start (the machine's fault: nothing ran)."""
    data = source.encode("utf-8", "replace")
    if len(data) > MAX_SOURCE_BYTES:
        raise ValueError(f"the snippet has {len(data)} bytes, more than {MAX_SOURCE_BYTES}")
    with confinement(limits) as slot:  # as the judge's candidates
        return _run(data, limits, slot)


def _run(data: bytes, limits: SandboxLimits, slot: Slot) -> ScriptResult:
    start = time.monotonic()
    out, err, status = _Counted(limits.output_bytes), _Counted(limits.output_bytes), _Capped(4096)
    script_r, script_w = os.pipe()
    status_r, status_w = os.pipe()
    os.write(script_w, data)  # fits in the pipe: the writer never waits for a sandbox that did not start
    os.close(script_w)
    setup = {"limits": asdict(limits), "status_fd": status_w, "script_fd": script_r, "tmp_mb": 4 * limits.file_size_mb}
    try:
        proc = _spawn(setup, limits.mode, slot, (script_r, status_w))
    finally:
        os.close(script_r)  # only the sandbox holds these ends now
        os.close(status_w)
    watch_pid1(proc, limits.timeout_s)
    try:
        pidfd = os.pidfd_open(proc.pid)  # readable when the runner exits: no wait for its pipes' EOF
    except (AttributeError, OSError):
        pidfd = None
    with proc, selectors.DefaultSelector() as sel:
        for fileobj, sink in ((proc.stdout.fileno(), out), (proc.stderr.fileno(), err), (status_r, status)):
            sel.register(fileobj, selectors.EVENT_READ, sink)
        if pidfd is not None:
            sel.register(pidfd, selectors.EVENT_READ, None)
        try:
            _pump(sel, start + limits.timeout_s, lambda: proc.poll() is not None)
        finally:
            returncode = proc.poll()
            _kill(proc)  # the sandbox and everything in it (unsafe: the process group)
            _pump(sel, time.monotonic() + DRAIN_S, lambda: False)  # output still in flight
            if pidfd is not None:
                os.close(pidfd)
            os.close(status_r)
    facts = _status(bytes(status.data))
    check_started(facts, returncode, bytes(err.data))
    if returncode is not None and limits.mode == "bwrap":
        returncode = _signalled(returncode)
    return ScriptResult(returncode, out.data.decode("utf-8", "replace"), err.data.decode("utf-8", "replace"),
                        out.cut, err.cut, time.monotonic() - start, limits.mode)
