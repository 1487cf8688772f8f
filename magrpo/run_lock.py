"""One writer per run dir: an exclusive `flock` on RUN_DIR/run.lock, held for the whole run.

The kernel drops a flock when its holder dies (kill -9 included), so a lock left by a dead process
is free to take: nothing to detect or clean up. The file holds the holder's pid, host and start
time for the message a second writer gets; the holder removes it when it ends."""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from .errors import ConfigError

LOCK = "run.lock"


class RunLock:
    """The lock on one run dir, held until release()."""

    def __init__(self, run_dir: Path, fd: int):
        self.dir, self.fd = run_dir, fd

    def release(self) -> None:
        if self.fd < 0:
            return
        # Removed while still held: a writer that opens the file now finds it gone when it checks (acquire).
        (self.dir / LOCK).unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = -1


def acquire(run_dir: Path) -> RunLock:
    """Lock run_dir (which exists) for this process; raises ConfigError naming the holder when another
    process holds it."""
    path = run_dir / LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ConfigError("logging.run_dir", f"{run_dir} is in use by another run ({holder}); wait for it to "
                                                 f"end or stop it, or pick another logging.run_dir; nothing was "
                                                 f"changed") from None
        if _same_file(fd, path):
            break
        os.close(fd)  # locked a file its holder removed as it ended: lock the one there now
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
    return RunLock(run_dir, fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _holder(fd: int) -> str:
    """`pid P on host H, since T` from the holder's record (it may not have written it yet)."""
    try:
        record = json.loads(os.pread(fd, 4096, 0))
        return f"pid {record['pid']} on host {record['host']}, since {record['since']}"
    except (OSError, ValueError, TypeError, KeyError):
        return "its pid is not recorded yet"
