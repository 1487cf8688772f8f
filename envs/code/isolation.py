"""How a candidate process is started: inside a bubblewrap sandbox (`env.sandbox=bwrap`, the default), or
as a plain child process with rlimits only (`env.sandbox=unsafe`, an explicit opt-in).

bubblewrap (https://github.com/containers/bubblewrap) is the engine Flatpak builds on; we only choose
its flags. Every candidate gets fresh user, IPC, PID, network, UTS and cgroup namespaces, a read-only
view of /usr and of the Python installation (its site-packages hidden) and nothing else of the host
(no checkout, dataset, home, /etc or judge), a private tmpfs /tmp, a seccomp filter (syscalls.py), and
dies with the driver's kill of its PID 1 (PID namespace). As root, bwrap itself runs under a fresh unprivileged uid: the
kernel never enforces RLIMIT_NPROC on root-owned processes, even inside a user namespace.
docs/environments.md lists what each mode does and does not protect against.
"""
from __future__ import annotations

import atexit
import functools
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from . import syscalls

HERE = Path(__file__).resolve().parent
MODES = ("bwrap", "unsafe")
INSTALL = ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap; "
           "Arch: pacman -S bubblewrap) or, knowing that a program can then forge its reward and escape, "
           "set env.sandbox=unsafe")
UNSAFE_WARNING = ("env.sandbox=unsafe: model-written programs run as plain child processes with rlimits "
                  "only; a program can read the tests, forge its reward and leave processes behind")
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", **dict.fromkeys(THREAD_VARS, "1")}
SANDBOX_LIB = "/magrpo"  # where the candidate's own two modules appear inside the sandbox
# `python -I -S -c BOOT FOLDER ARG`: MODULE.main(ARG) imported from FOLDER with cached bytecode,
# without site-packages (a faster start; the candidate must not see them anyway).
BOOT = "import sys; sys.path.insert(0, sys.argv[1]); import {0}; {0}.main(sys.argv[2])"


UID_BASE = 2_000_000_000  # sandbox uids: far above real accounts
UID_SPAN = 2 ** 31 - 1 - UID_BASE  # and below 2^31: bwrap cannot map a larger one
_uids_in_use: set[int] = set()
_uid_lock = threading.Lock()


class SandboxUnavailable(RuntimeError):
    """No usable bubblewrap: the message says why and what to install."""


@dataclass(frozen=True)
class Interpreter:
    executable: str  # the real binary, symlinks resolved
    prefix: str  # the installation to mount read-only (a subtree of /usr needs no mount of its own)
    hidden: tuple[str, ...]  # its site-packages: hidden under empty tmpfs


def private_copy(prefix: str, names: tuple[str, ...], python: str, mode: int) -> str:
    """A fresh folder holding only `names` from this package, byte-compiled by `python`, removed at exit.
    The judge imports from such a folder (nothing else of the checkout is on its path); the candidate's
    folder is what bwrap mounts at SANDBOX_LIB."""
    from magrpo.paths import owned_folder, sweep

    # Named by its owner's pid, held by an flock (as long as this process lives); a SIGKILLed run's is swept
    sweep(tempfile.gettempdir(), prefix)
    folder = str(owned_folder(tempfile.gettempdir(), prefix)[0])
    for name in names:
        shutil.copy2(HERE / name, folder)
    subprocess.run([python, "-I", "-S", "-m", "compileall", "-q", folder], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for root, _, files in os.walk(folder):
        for name in files:
            os.chmod(os.path.join(root, name), mode & 0o444)
        os.chmod(root, mode)
    atexit.register(remove, folder)
    return folder


def remove(folder: str) -> None:
    """Remove a private copy, write bits first: its folders are read-only (the judge's 0500), which root
    ignores but an unprivileged owner does not (rmtree then left every /tmp/magrpo-judge-* behind)."""
    for root, _, _ in os.walk(folder):
        try:
            os.chmod(root, 0o700)
        except OSError:
            pass
    shutil.rmtree(folder, ignore_errors=True)


def _others_can_read(path: str) -> bool:
    """Every directory above `path` is searchable by other users, and `path` readable: what a fresh
    unprivileged uid needs to open it (bwrap resolves its mount sources as that uid)."""
    parts = Path(path).parts
    try:
        for depth in range(1, len(parts)):
            if not os.stat(Path(*parts[:depth])).st_mode & 0o001:
                return False
        return bool(os.stat(path).st_mode & 0o004)
    except OSError:
        return False


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _installation(executable: str) -> Interpreter:
    own = executable == os.path.realpath(sys._base_executable)
    prefix = sys.base_prefix if own else str(Path(executable).parents[1])
    # Package folders under what is mounted: hidden (the trainer's and the system's alike)
    found = [*Path(prefix).glob("lib/python3*/site-packages"), *Path("/usr").glob("lib/python3*/dist-packages"),
             *Path("/usr/local").glob("lib/python3*/*-packages"), *(Path(p) for p in sys.path if own)]
    hidden = sorted({os.path.realpath(p) for p in found if p.name.endswith(("site-packages", "dist-packages"))
                     and p.is_dir() and any(_under(os.path.realpath(p), m) for m in ("/usr", prefix))})
    return Interpreter(executable, prefix, tuple(hidden))


@functools.lru_cache(maxsize=1)
def interpreter() -> Interpreter:
    """The trainer's own Python; as root, one an unprivileged uid can read: the trainer's, or else the
    system's of the same version (a Python installed under /root, by pyenv, uv or conda, is not)."""
    own = os.path.realpath(sys._base_executable)
    if os.geteuid() != 0 or _others_can_read(own) and _others_can_read(sys.base_prefix):
        return _installation(own)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for folder in ("/usr/bin", "/usr/local/bin"):
        path = os.path.realpath(os.path.join(folder, version))
        if path.startswith("/usr/") and os.path.isfile(path) and _others_can_read(path):
            return _installation(path)
    raise SandboxUnavailable(
        f"as root, bubblewrap runs candidates under an unprivileged uid, which cannot read this Python "
        f"({own}: a folder above it is private) and there is no {version} in /usr/bin or /usr/local/bin; "
        f"install {version} from the system's packages, train as a non-root user, or make the folders "
        f"above {sys.base_prefix} searchable (chmod o+x)")


@functools.lru_cache(maxsize=1)
def bwrap() -> tuple[str, tuple[int, ...]]:
    """The bwrap binary and its version; SandboxUnavailable if there is none."""
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(f"bubblewrap (bwrap) is not installed; {INSTALL}")
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    return path, tuple(int(x) for x in match.groups()) if match else (0, 0, 0)


@functools.lru_cache(maxsize=1)
def _root_dirs() -> tuple[str, ...]:
    """/usr and the top-level links or folders of the OS's programs and libraries (merged /usr or not);
    read once, not for every program."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return tuple(args)


# --unshare-all spelled out, so that the benchmark can drop one at a time (bench/bench_sandbox.py)
UNSHARE = ("--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try")


def bwrap_command(lib: str, tmp_mb: int, drop: frozenset[str] = frozenset(), seccomp_fd: int | None = None,
                  info_fd: int | None = None) -> list[str]:
    """The bwrap argv up to `--`. `seccomp_fd`: a read end holding the syscall filter (syscalls.pipe());
    `info_fd`: where bwrap writes its PID 1's pid (`child-pid`, JSON). `drop`: flags to leave out, for
    bench/bench_sandbox.py only."""
    path, version = bwrap()
    python = interpreter()
    args = [path, *UNSHARE, "--die-with-parent", "--new-session", "--clearenv"]
    for flag, fd in (("--seccomp", seccomp_fd), ("--info-fd", info_fd)):
        if fd is not None:
            args += [flag, str(fd)]
    if version >= (0, 8, 0):
        args.append("--disable-userns")  # no nested user namespaces: less of the kernel within reach
    for key, value in {**ENV, "HOME": "/tmp", "TMPDIR": "/tmp"}.items():
        args += ["--setenv", key, value]
    args += _root_dirs()
    if not _under(python.prefix, "/usr"):
        args += ["--ro-bind", python.prefix, python.prefix]
    for site in python.hidden:
        args += ["--tmpfs", site, "--remount-ro", site]
    size = ["--size", str(tmp_mb << 20)] if version >= (0, 8, 0) else []
    args += ["--proc", "/proc", "--dev", "/dev", *size, "--tmpfs", "/tmp", *size, "--tmpfs", "/dev/shm",
             "--ro-bind", lib, SANDBOX_LIB,
             # bwrap's own / and /dev are tmpfs with no size: read-only, or a program fills memory there
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp", "--"]
    return _without(args, drop)


def _without(args: list[str], drop: frozenset[str]) -> list[str]:
    """args minus the flags in `drop` (with their operands: `--tmpfs /tmp` is dropped as "--tmpfs /tmp")."""
    out, i = [], 0
    while i < len(args):
        for width in (4, 3, 2, 1):
            if " ".join(args[i:i + width]) in drop:
                i += width
                break
        else:
            out.append(args[i])
            i += 1
    return out


@functools.lru_cache(maxsize=None)  # one per mode: a bound of 1 re-copied it each time the mode changed
def candidate_lib(mode: str) -> str:
    """The candidate's modules, in a folder of their own (readable by the sandbox uid as root)."""
    python = interpreter().executable if mode == "bwrap" else sys.executable
    return private_copy("magrpo-candidate-", ("candidate.py", "wire.py"), python, 0o755)


@functools.lru_cache(maxsize=None)
def check(mode: str) -> None:
    """Start-up check: in bwrap mode, the syscall filter must build and one sandboxed interpreter start
    under it and exit cleanly, or SandboxUnavailable says why (no bwrap, no libseccomp, user namespaces
    disabled, an unreadable Python)."""
    if mode != "bwrap":
        return
    try:  # refused without it: the policy is the attacker, and it ptraced PID 1 without a filter
        syscalls.program()
    except syscalls.FilterUnavailable as e:
        raise SandboxUnavailable(f"{e}; or, knowing that a program can then forge its reward and escape, "
                                 f"set env.sandbox=unsafe") from None
    uid = acquire_uid() if os.geteuid() == 0 else None
    filter_fd = syscalls.pipe()
    try:
        command, keywords = as_user(uid, [*bwrap_command(candidate_lib(mode), 1, seccomp_fd=filter_fd),
                                          interpreter().executable, "-I", "-S", "-c", "pass"])
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, pass_fds=(filter_fd,),
                              **keywords)
    finally:
        os.close(filter_fd)
        if uid is not None:
            release_uid(uid)
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        hint = ("; user namespaces may be disabled (sysctl kernel.unprivileged_userns_clone=1, or Ubuntu's "
                "kernel.apparmor_restrict_unprivileged_userns=0)" if "namespace" in reason.lower() else "")
        raise SandboxUnavailable(f"bubblewrap cannot start a sandbox here: {reason}{hint}; or, knowing that "
                                 f"a program can then forge its reward and escape, set env.sandbox=unsafe")


def as_user(uid: int | None, argv: list[str]) -> tuple[list[str], dict]:
    """(argv, Popen keywords) that start `argv` under `uid` (root only) with no supplementary groups.
    Through setpriv where there is one: Popen's own user=/group= rule out vfork, and forking a trainer
    that holds a model costs ~10 ms and more per program (measured: bwrap + `true` 14.4 ms via user=
    from a process with torch loaded, 3.5 ms from a small one)."""
    if uid is None:
        return argv, {}
    if not UID_BASE <= uid < UID_BASE + UID_SPAN:  # (uid_t)-1 would leave it root: never run as that
        raise ValueError(f"sandbox uid {uid} is outside {UID_BASE}..{UID_BASE + UID_SPAN - 1}")
    setpriv = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if setpriv is not None:
        return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv], {}
    return argv, {"user": uid, "group": uid, "extra_groups": []}


def acquire_uid() -> int:
    """A random uid: no other live run shares it (and, with overwhelming odds, no other trainer's), and
    none used it recently. That matters: a killed fork bomb's zombies count against their uid's
    RLIMIT_NPROC until init gets round to reaping them, which can take seconds."""
    with _uid_lock:
        while (uid := UID_BASE + secrets.randbelow(UID_SPAN)) in _uids_in_use:
            pass
        _uids_in_use.add(uid)
    return uid


def release_uid(uid: int) -> None:
    with _uid_lock:
        _uids_in_use.discard(uid)
