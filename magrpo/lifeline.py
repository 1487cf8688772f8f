"""Every process magrpo starts dies with the trainer, however the trainer ends (SIGKILL included) and
whatever the process does (`setsid`, a double fork, ignoring SIGTERM): issue 44.

`command(argv)` is the argv that runs `argv` under a supervisor: this file run as a script,
`python -I -S lifeline.py TRAINER_PID GRACE -- ARGV...` (stdlib only, no site-packages: a quick start;
on Python 3.10 `-I` still puts this folder first on sys.path, and no module here has a stdlib name).
The supervisor
1. watches the trainer through a pidfd, which becomes readable when the trainer's process exits, even
   by SIGKILL, when no code of the trainer's runs;
2. where the machine allows it (CAP_SYS_ADMIN: root), forks the init (PID 1) of a new PID namespace, with
   a /proc of its own, and that init runs the rest. When the init dies, by any signal, the kernel kills
   every process in the namespace (no fork succeeds meanwhile); no process inside can SIGKILL or SIGSTOP
   it, or see the supervisor outside, which kills it when the trainer dies and passes SIGTERM and SIGHUP
   on; the init dies with the supervisor (its parent-death signal). Elsewhere (an unprivileged user)
   the supervisor makes itself a child subreaper instead: a descendant whose parent exits (a `setsid`
   daemon, a double fork) is re-parented to it instead of to init, so it stays in its tree, found by /proc;
3. starts ARGV with its own stdin, stdout, stderr and passed fds (the caller's pipes), then lets go of
   them, so the caller still sees EOF when the program exits; reaps every orphan as it ends;
4. when the program exits, the trainer dies, or GRACE seconds after a SIGTERM (passed on to the
   program), SIGKILLs the program and ends (the namespace: the kernel kills and reaps the rest before
   the caller sees the exit) or SIGKILLs every descendant and reaps them (the subreaper), and exits with
   the program's status.

`watch(pids)` covers children a library starts itself (vLLM's engine core), where no argv of ours
runs: a small watcher ends them (SIGTERM, then SIGKILL) when the trainer dies. They stay in the
trainer's PID namespace.

Why not less: PR_SET_PDEATHSIG covers one process (a fork or `setsid` below it escapes, and it fires
when the spawning *thread* ends); a process group or session is left by `setsid`. The program runs with
no_new_privs, so no descendant changes its uid through a setuid program (one that had refused our
SIGKILL). In a namespace the program sees its own pids (the supervisor's init is 1, itself 2) and only
its own processes in /proc; its mounts stay in its own mount namespace. Limits (docs/tools.md,
"Sessions"): an unprivileged supervisor makes no namespace (a user namespace would show other users'
files and the user's other groups as 65534), so there a SIGKILL of the supervisor itself (by a process
of the same user) ends the program (its parent-death signal) but not the daemons it started, a SIGSTOP
of it leaves them all, and a process that forks and exits in a loop is chased by the /proc scan until
caught, so it escapes when the supervisor dies first. As root, code that sets out to leave (setns into
another namespace with CAP_SYS_ADMIN) can.
"""
from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import time

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38  # <linux/prctl.h>
CLONE_NEWNS, CLONE_NEWPID = 0x20000, 0x20000000  # <sched.h>
SHARED_PIDS = "--shared-pids"  # the supervisor's flag for command(own_pids=False)
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_SLAVE = 0x2, 0x4, 0x8, 0x4000, 0x80000  # <sys/mount.h>
# SIGINT is not passed on: a terminal sends it to the whole foreground group, the program too.
PASSED_ON = (signal.SIGTERM, signal.SIGHUP)
KILL_GIVE_UP_S = 5.0  # descendants that all refuse SIGKILL (another uid) are left after this long


def command(argv: list[str], grace_s: float | None = None, own_pids: bool = True) -> list[str]:
    """The argv that runs `argv` under a supervisor tied to this process (the trainer). `grace_s`: how
    long the program has after a SIGTERM before everything is killed (None: as long as it takes;
    the trainer's death still ends it at once). `own_pids=False`: never a PID namespace, for a program
    that must see the host's processes: a trainer (magrpo.pinned), whose start-up sweeps judge other
    trainers' leftovers by their pids in /proc, and in a namespace took every live trainer for dead
    (it removed another test process's sandbox cgroups: "could not make the sandbox's cgroup")."""
    grace = "-" if grace_s is None else repr(float(grace_s))
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), grace,
            *([] if own_pids else [SHARED_PIDS]), "--", *argv]


NO_TREE_WARNING = ("tools.mcp: this user may make no PID namespace, so each MCP server's supervisor holds its "
                   "process tree by a /proc scan: a server (or code its tools run) that SIGKILLs or SIGSTOPs its "
                   "supervisor leaves the processes it started running after the run (docs/tools.md, Sessions)")


def holds_tree() -> bool:
    """Whether a supervisor started here gets a PID namespace (the kernel then holds its tree): asked of a
    child, since unshare(CLONE_NEWPID) changes the namespace of the caller's later children."""
    import subprocess

    probe = f"import ctypes; print(ctypes.CDLL(None).unshare({CLONE_NEWPID}))"
    done = subprocess.run([sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True, timeout=60)
    return done.stdout.strip() == "0"


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
    supervisor itself (`subprocess.run`'s timeout) then still ends the program (its daemons too only in
    a namespace, whose init is the caller here).
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


def pid_namespace(libc) -> int | None:
    """Fork into a new PID namespace whose init (PID 1) is the child, where the machine allows one
    (CAP_SYS_ADMIN: root): the child's pid in the parent, 0 in the child; None where there is none.
    Its init's death has the kernel kill every process in it (no fork succeeds meanwhile), and no process
    in it can SIGKILL or SIGSTOP its init nor see the parent: the tree no longer depends on a scan."""
    if libc.unshare(CLONE_NEWPID) != 0:
        return None
    parent = os.pidfd_open(os.getpid())
    init = os.fork()
    if init:
        os.close(parent)
        return init
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # a SIGKILL of the parent ends the namespace
    if select.select([parent], [], [], 0)[0]:  # it died before the prctl (our getppid() says 0 either way)
        os._exit(137)
    os.close(parent)
    # The program's pids are this namespace's, so its /proc must be too (psutil, /proc/<getpid()>): one
    # of its own, in a mount namespace of its own that passes no mount back to the host (slave).
    if (libc.unshare(CLONE_NEWNS) or libc.mount(None, b"/", None, MS_REC | MS_SLAVE, None)
            or libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)):
        print(f"lifeline: no /proc of the PID namespace ({os.strerror(ctypes.get_errno())}): the program sees "
              f"the host's", file=sys.stderr)
    return 0


def on_signals() -> tuple[int, int]:
    """A pipe that each SIGTERM, SIGHUP, SIGINT and SIGCHLD writes its number to, to wake a select; its
    ends. A Python handler (not SIG_IGN) is reset to the default in a program exec'd later."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)  # a full pipe wakes the select all the same
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGCHLD):
        signal.signal(signum, lambda *_: None)
    return wake_r, wake_w


def reap(program: int) -> int | None:
    """Reap every child that has ended, orphans re-parented here included (their zombies, kept until the
    end, once filled the pid table under a fork chain); the program's wait status if it was one of them."""
    status = None
    try:
        while (reaped := os.waitpid(-1, os.WNOHANG))[0]:
            if reaped[0] == program:
                status = reaped[1]
    except ChildProcessError:
        pass
    return status


def let_go(keep: tuple[int, ...]) -> None:
    """Close every fd but `keep`, and 0-2 onto /dev/null: the caller's pipes and passed fds are the
    program's alone now, so the caller sees EOF as soon as it exits."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    for fd in map(int, os.listdir("/proc/self/fd")):
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:  # the listing's own fd, closed already
                pass


def exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def outside(init: int, trainer_fd: int, wake: tuple[int, int]) -> int:
    """The parent of a namespace's init: passes SIGTERM and SIGHUP on to it, SIGKILLs it when the
    trainer dies (whatever has stopped it: nothing inside can see this process), and exits with its status."""
    init_fd = os.pidfd_open(init)
    let_go((trainer_fd, init_fd, *wake))
    while True:
        ready = select.select([trainer_fd, init_fd, wake[0]], [], [])[0]
        if init_fd in ready:
            break
        if trainer_fd in ready:
            signal.pidfd_send_signal(init_fd, signal.SIGKILL)
            break
        for signum in os.read(wake[0], 4096):
            if signum in PASSED_ON:
                signal.pidfd_send_signal(init_fd, signum)
    return exit_code(os.waitpid(init, 0)[1])


def supervise(trainer: int, grace_s: float | None, argv: list[str], own_pids: bool = True) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    trainer_fd = pidfd_of_parent(trainer)
    if trainer_fd is None:
        return 137
    wake = on_signals()
    init = pid_namespace(libc) if own_pids else None
    if init:
        return outside(init, trainer_fd, wake)
    if init == 0:  # the namespace's init: a pipe of its own (the parent's is inherited, and read there)
        wake = on_signals()
    elif libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"lifeline: prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        return 127
    pid, error = spawn(libc, argv)
    if error:
        print(error, file=sys.stderr)
        return 127
    let_go((trainer_fd, *wake))
    deadline, status = None, None
    while status is None:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = select.select([trainer_fd, wake[0]], [], [], timeout)[0]
        if trainer_fd in ready or (deadline is not None and time.monotonic() >= deadline):
            break
        for signum in os.read(wake[0], 4096) if wake[0] in ready else b"":
            if signum in PASSED_ON:
                os.kill(pid, signum)
                if grace_s is not None and deadline is None:
                    deadline = time.monotonic() + grace_s
        status = reap(pid)
    if init == 0:  # our exit has the kernel kill and reap the rest of the namespace before the parent sees it
        if status is None:
            os.kill(pid, signal.SIGKILL)
            status = os.waitpid(pid, 0)[1]
    else:
        status = kill_all().get(pid, status)
    if status is None:  # reaped by no one: cannot happen, but never report success for it
        return 137
    return exit_code(status)


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
    shared = sys.argv[3] == SHARED_PIDS
    sys.exit(supervise(int(sys.argv[1]), None if sys.argv[2] == "-" else float(sys.argv[2]),
                       sys.argv[4 + shared:], own_pids=not shared))
