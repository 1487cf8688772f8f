"""Every process magrpo starts dies with the trainer, however the trainer ends (SIGKILL included) and
whatever the process does (`setsid`, a double fork, ignoring SIGTERM): issue 44.

`command(argv)` is the argv that runs `argv` under a supervisor: this file run as a script,
`python -I -S lifeline.py TRAINER_PID GRACE -- ARGV...` (stdlib only, no site-packages: a quick start;
on Python 3.10 `-I` still puts this folder first on sys.path, and no module here has a stdlib name).
The supervisor
1. makes itself a child subreaper: a descendant whose parent exits (a `setsid` daemon, a double fork)
   is re-parented to it instead of to init, so every descendant stays in its tree, where it finds them;
2. watches the trainer through a pidfd, which becomes readable when the trainer's process exits, even
   by SIGKILL, when no code of the trainer's runs;
3. starts ARGV with its own stdin, stdout, stderr and passed fds (the caller's pipes), then lets go of
   them, so the caller still sees EOF when the program exits;
4. when the program exits, the trainer dies, or GRACE seconds after a SIGTERM (passed on to the
   program), SIGKILLs every descendant, reaps them, and exits with the program's status.

`watch(pids)` covers children a library starts itself (vLLM's engine core), where no argv of ours
runs: a small watcher ends them (SIGTERM, then SIGKILL) when the trainer dies.

Why not less: PR_SET_PDEATHSIG covers one process (a fork or `setsid` below it escapes, and it fires
when the spawning *thread* ends); a process group or session is left by `setsid`; a PID namespace
needs privileges. A subreaper works as root and as any user. The program runs with no_new_privs, so no
descendant changes its uid through a setuid program (one that had refused our SIGKILL). Limits, and why
no fix here (docs/tools.md, "Sessions"): a SIGKILL of the supervisor itself ends the program (its
parent-death signal) but not the daemons it started, and a SIGSTOP of it leaves them all (it never
sees the trainer die); and a process that forks and exits in a loop is chased by the /proc scan until
caught, so it escapes when the supervisor dies first. Only the kernel holding the tree (a PID namespace
whose init is the supervisor, or a cgroup) closes these.
"""
from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import time

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38  # <linux/prctl.h>
KILL_GIVE_UP_S = 5.0  # descendants that all refuse SIGKILL (another uid) are left after this long


def command(argv: list[str], grace_s: float | None = None) -> list[str]:
    """The argv that runs `argv` under a supervisor tied to this process (the trainer). `grace_s`: how
    long the program has after a SIGTERM before everything is killed (None: as long as it takes;
    the trainer's death still ends it at once)."""
    grace = "-" if grace_s is None else repr(float(grace_s))
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), grace, "--", *argv]


def watch(pids: list[int], grace_s: float = 5.0) -> None:
    """For children this process did not start through `command` (a library's: vLLM's engine core): a
    watcher that, when this process dies (SIGKILL too), sends them SIGTERM and, `grace_s` later, SIGKILL.
    It holds pidfds taken here, while they are our unreaped children, so a reused pid is never hit;
    it exits by itself once they have all ended. Their own children are theirs to end."""
    import subprocess

    fds = [os.pidfd_open(pid) for pid in pids]
    try:
        subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), "--watch", str(os.getpid()),
                          repr(float(grace_s)), *map(str, fds)], pass_fds=fds, start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        for fd in fds:
            os.close(fd)


# ---- the process tree, by /proc ------------------------------------------------------------------

def children_of() -> dict[int, list[int]]:
    """Every live process's children, by the parent pids in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:  # "pid (comm) state ppid ...": comm may hold ')'
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
            children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(root: int) -> list[int]:
    """Every live process below `root`."""
    children = children_of()
    found, todo = [], [root]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def children(pid: int) -> list[int]:
    """The live children of `pid`."""
    return children_of().get(pid, [])


# ---- the supervisor and the watcher (run as a script: the stdlib only) -----------------------------


def kill_all() -> dict[int, int]:
    """SIGKILL every descendant and reap them until none is left; the wait statuses of those reaped.
    A process forked while we scan has a parent we kill: it is re-parented to us and found next round.
    A chain that forks and exits in a loop has a new pid each round; the kernel refuses a fork to a
    process with a SIGKILL pending, so some round catches it: we chase for as long as anything left takes
    the signal, and give up only on descendants that have all refused it (another uid) for KILL_GIVE_UP_S."""
    statuses, refused_since = {}, None
    while True:
        accepted = False
        for pid in descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
                accepted = True
            except ProcessLookupError:
                pass
            except PermissionError:
                refused_since = refused_since or time.monotonic()
        try:
            while (reaped := os.waitpid(-1, os.WNOHANG))[0]:
                statuses[reaped[0]] = reaped[1]
        except ChildProcessError:  # no child left, so no descendant: each one's ancestors lead here
            break
        if accepted:
            refused_since = None
        elif refused_since is not None and time.monotonic() - refused_since > KILL_GIVE_UP_S:
            break
        time.sleep(0.01)
    return statuses


def pidfd_of_parent(trainer: int) -> int | None:
    """A pidfd of the trainer, our parent; None when it has died already (then that pid may be another
    process's by now, which a pidfd opened by number would watch instead)."""
    try:
        fd = os.pidfd_open(trainer)
    except ProcessLookupError:
        return None
    if os.getppid() != trainer:
        os.close(fd)
        return None
    return fd


def spawn(libc, argv: list[str]) -> tuple[int, str]:
    """Fork and exec `argv`: (its pid, '') or (0, why it could not start). The program gets SIGKILL when
    the supervisor dies (PR_SET_PDEATHSIG; one thread here, so it means the process): a SIGKILL of the
    supervisor itself (`subprocess.run`'s timeout) then still ends the program, if not its daemons.
    A fork here is cheap: this process holds no model."""
    error_r, error_w = os.pipe()  # close-on-exec: EOF at a successful exec, else the error
    supervisor = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            # No exec below gains a user or a capability (setuid bits, file capabilities): a descendant
            # of another uid refuses our SIGKILL and outlived the trainer. Inherited, and cannot be unset.
            if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                raise RuntimeError(f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}")
            if os.getppid() == supervisor:  # else it died before the prctl: nothing to run for
                os.execvp(argv[0], argv)
        except BaseException as e:  # noqa: BLE001  (anything: the parent reports it)
            if isinstance(e, OSError) and e.filename is None:  # execvp's error names no file: say which
                e = type(e)(e.errno, e.strerror, argv[0])
            os.write(error_w, f"{type(e).__name__}: {e}".encode())
        os._exit(127)
    os.close(error_w)
    with os.fdopen(error_r, "rb") as f:
        error = f.read().decode(errors="replace")
    if error:
        os.waitpid(pid, 0)
        return 0, error
    return pid, ""


def supervise(trainer: int, grace_s: float | None, argv: list[str]) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"lifeline: prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        return 127
    trainer_fd = pidfd_of_parent(trainer)
    if trainer_fd is None:
        return 137
    # Signals wake the select below; a Python handler (not SIG_IGN) is reset to the default in the program.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
    pid, error = spawn(libc, argv)
    if error:
        print(error, file=sys.stderr)
        return 127
    program_fd = os.pidfd_open(pid)
    # The caller's pipes and passed fds are the program's alone now: EOF as soon as it exits.
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    for fd in map(int, os.listdir("/proc/self/fd")):
        if fd > 2 and fd not in (trainer_fd, program_fd, wake_r, wake_w):
            try:
                os.close(fd)
            except OSError:  # the listing's own fd, closed already
                pass
    deadline = None
    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = select.select([trainer_fd, program_fd, wake_r], [], [], timeout)[0]
        if trainer_fd in ready or program_fd in ready or (deadline is not None and time.monotonic() >= deadline):
            break
        for signum in os.read(wake_r, 64) if wake_r in ready else b"":
            # SIGINT is not passed on: a terminal sends it to the whole foreground group, the program too.
            if signum != signal.SIGINT:
                os.kill(pid, signum)
                if grace_s is not None and deadline is None:
                    deadline = time.monotonic() + grace_s
    status = kill_all().get(pid)
    if status is None:  # reaped by no one: cannot happen, but never report success for it
        return 137
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def watch_main(trainer: int, grace_s: float, fds: list[int]) -> int:
    """`watch`'s watcher: waits for the trainer's death, or for every watched process to end first."""
    trainer_fd = pidfd_of_parent(trainer)
    while fds and trainer_fd is not None:
        ready = select.select([trainer_fd, *fds], [], [])[0]
        if trainer_fd in ready:
            break
        fds = [fd for fd in fds if fd not in ready]  # these ended
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        for fd in fds:
            try:
                signal.pidfd_send_signal(fd, sig)
            except ProcessLookupError:
                pass
        until = time.monotonic() + wait_s
        while fds and (left := until - time.monotonic()) > 0:
            fds = [fd for fd in fds if fd not in select.select(fds, [], [], left)[0]]
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--watch":
        sys.exit(watch_main(int(sys.argv[2]), float(sys.argv[3]), [int(fd) for fd in sys.argv[4:]]))
    sys.exit(supervise(int(sys.argv[1]), None if sys.argv[2] == "-" else float(sys.argv[2]), sys.argv[4:]))
