"""Run a command as `nobody` with the trainer's own interpreter, packages and checkout: the unprivileged
cases of issue 44 (tests/test_lifeline.py, tests/test_mcp_tools.py) then run the real code path (the
venv's `mcp` SDK included), not a copy of a few files under the system's Python.

The venv's Python often lives where `nobody` cannot search (pyenv under /root, mode 0700), and so may a
checkout (a clone in a `mktemp -d` folder). `command(argv, paths)` runs `argv` as `nobody` in a mount
namespace of its own, made by this file run as a script as root, in which each such folder on the way
to `paths` is replaced by a tmpfs of mode 0755 holding only the next step of that way, bound back from
the real folder. Nothing changes outside that namespace; the command's own rights are `nobody`'s (real,
effective and saved ids, no supplementary groups, no capabilities: setpriv), and every file it reads
keeps its own mode. stdlib only: it runs as `python -I -S nobody.py PATH... -- ARGV...`.
"""
from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

NOBODY = 65534
CANNOT = 77  # the script's exit status when this machine cannot make the view (not root, no mount rights)
CLONE_NEWNS, MS_REC, MS_PRIVATE, MS_BIND = 0x20000, 0x4000, 0x40000, 0x1000  # <sched.h>, <sys/mount.h>


def as_nobody() -> list[str]:
    """The argv prefix that drops to `nobody`: uid, gid, no groups (capabilities go with uid 0)."""
    return [shutil.which("setpriv") or "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


def python_paths() -> list[str]:
    """What this interpreter needs to start: its venv and the installation the venv points at."""
    return sorted({sys.prefix, sys.base_prefix, os.path.realpath(sys.executable)})


def command(argv: list[str], paths: list[str]) -> list[str]:
    """The argv that runs `argv` as `nobody`, with `paths` and this interpreter's own reachable."""
    return [sys.executable, "-I", "-S", __file__, *python_paths(), *map(str, paths), "--", *as_nobody(), *argv]


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why `command` cannot run here, or None: a skip reason for the tests."""
    if os.geteuid() != 0:
        return "needs root to become `nobody`"
    if shutil.which("setpriv") is None:
        return "needs setpriv (util-linux) to become `nobody`"
    try:
        done = subprocess.run(command([sys.executable, "-c", "import sys; print(sys.base_prefix)"], []),
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "`nobody` could not start this Python within 120 s"
    if done.returncode != 0:
        return f"cannot run this Python as `nobody` here: {done.stderr.strip().splitlines()[-1:]}"
    # A Python that cannot read its own installation still starts, with another one's stdlib (Debian's
    # /usr/lib/python3.X, found by its search): that would not be the code under test.
    if done.stdout.strip() != sys.base_prefix:
        return f"this Python as `nobody` took its stdlib from {done.stdout.strip()}, not {sys.base_prefix}"
    return None


def blocked(path: str) -> list[tuple[str, str]]:
    """Each folder on the way to `path` that others cannot search, with the next step below it; and
    `path` itself when it is such a folder, with every entry in it (a checkout in a `mktemp -d` folder:
    its files are what the command reads)."""
    parts = Path(path).parts
    out = [(str(Path(*parts[:i])), parts[i]) for i in range(1, len(parts))
           if not os.stat(Path(*parts[:i])).st_mode & stat.S_IXOTH]
    if os.path.isdir(path) and not os.stat(path).st_mode & stat.S_IXOTH:
        out += [(path, entry) for entry in os.listdir(path)]
    return out


def open_up(paths: list[str]) -> None:
    """In a new mount namespace, make every blocked folder on the way to `paths` searchable (see above)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            print(f"nobody.py: {what}: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
            sys.exit(CANNOT)

    check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "making / private")  # nothing leaks out
    steps: dict[str, set[str]] = {}
    for path in paths:
        for folder, step in blocked(os.path.realpath(path)):
            steps.setdefault(folder, set()).add(step)
    for folder in sorted(steps, key=len):  # outer folders first: the inner ones are reached through them
        real = os.open(folder, os.O_PATH | os.O_DIRECTORY)  # the real folder, under the tmpfs to come
        check(libc.mount(b"tmpfs", folder.encode(), b"tmpfs", 0, b"mode=0755"), f"a tmpfs on {folder}")
        for step in steps[folder]:
            source, target = f"/proc/self/fd/{real}/{step}", os.path.join(folder, step)
            if os.path.isdir(source):
                os.mkdir(target)
            else:
                open(target, "x").close()
            check(libc.mount(source.encode(), target.encode(), None, MS_BIND | MS_REC, None), f"binding {target}")


if __name__ == "__main__":
    split = sys.argv.index("--")
    open_up(sys.argv[1:split])
    os.execvp(sys.argv[split + 1], sys.argv[split + 1:])
