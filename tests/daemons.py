"""Daemons that escape their parent's reach, for the tests that check every process magrpo starts dies
with the trainer (tests/test_lifeline.py, the MCP test server's `daemon` tool). stdlib only: an
unprivileged run starts it under the system's Python.

`python tests/daemons.py [EXIT_CODE [SLEEP_S]]` starts one daemon of each kind, prints their pids (one a
line), sleeps SLEEP_S seconds (`stdin`: until a line or EOF on its stdin), then exits with EXIT_CODE.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

KINDS = ("setsid", "double_fork")
MARKER = "magrpo-test-daemon"  # in every daemon's argv
# Ignores SIGTERM (a polite stop does not end it) and sleeps an hour.
SLEEPER = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"


def start(kind: str) -> int:
    """Start a daemon outside this process's group and session; its pid. `setsid`: a child in a session
    of its own; `double_fork`: fork, setsid, fork, and the middle process exits (an orphan of init)."""
    argv = [sys.executable, "-c", SLEEPER, MARKER]
    if kind == "setsid":
        return subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL).pid
    if kind != "double_fork":
        raise ValueError(f"no daemon kind {kind!r}; kinds: {', '.join(KINDS)}")
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.setsid()
        pid = os.fork()
        if pid == 0:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # holds none of its parent's pipes: a reader of them sees EOF
                os.dup2(null, fd)
            os.execv(sys.executable, argv)
        os.write(write, str(pid).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(middle, 0)
    with os.fdopen(read) as f:
        return int(f.read())


def hanging_build(out: str, seconds: float) -> None:
    """A warm-start build (magrpo.sft.build_pinned's target) that starts a daemon of each kind, says
    `pid N` for itself and each of them on stderr, and hangs."""
    for pid in (os.getpid(), *map(start, KINDS)):
        print(f"pid {pid}", file=sys.stderr, flush=True)
    time.sleep(seconds)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie has ended; only its parent's wait is missing)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def survivors(pids, seconds: float) -> list[int]:
    """The pids still alive after up to `seconds` (at once when all have ended). Those are killed: a
    failing test's processes are its own, and must not be left for an hour."""
    until = time.monotonic() + seconds
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < until:
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def said_pid(pid: int) -> int | None:
    """What `os.getpid()` says in process `pid` (its own PID namespace's pid; the same where it has
    none), from the last field of NSpid in its /proc status; None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[-1]) for line in f if line.startswith("NSpid:"))
    except (OSError, StopIteration, ValueError):
        return None


def host_pids(root: int, pids) -> list[int]:
    """`pids` as processes below `root` said them (their `os.getpid()`: a supervised program's is its PID
    namespace's, where magrpo/lifeline.py made one) as this process sees them. They must all name live
    processes of one namespace below `root`, and only one namespace may hold them all (two supervised
    programs below `root` each have their own pid 2), else AssertionError."""
    from magrpo.lifeline import descendants

    spaces: dict[str, dict[int, int]] = {}  # namespace -> said pid -> our pid
    for pid in descendants(root):
        try:
            if alive(pid):
                spaces.setdefault(os.readlink(f"/proc/{pid}/ns/pid"), {})[said_pid(pid)] = pid
        except OSError:  # gone meanwhile
            continue
    found = [space for space in spaces.values() if all(pid in space for pid in pids)]
    assert len(found) == 1, f"{len(found)} PID namespaces below {root} hold processes that say {pids}"
    return [found[0][pid] for pid in pids]


def after_sigkill(trainer: subprocess.Popen, pids, seconds: float = 5) -> list[int]:
    """SIGKILL the trainer (no code of its runs), then `survivors(pids, seconds)`."""
    trainer.kill()
    trainer.wait()
    return survivors(pids, seconds)


if __name__ == "__main__":
    for kind in KINDS:
        print(start(kind), flush=True)
    if sys.argv[2:3] == ["stdin"]:
        sys.stdin.readline()
    else:
        time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0)
    sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
