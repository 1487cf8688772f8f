"""The candidate process: confines itself, loads the model-written program, and answers calls.

Started by the sandbox driver as `python -I -S -c BOOT FOLDER SETUP`, BOOT importing this file
and `wire.py` from their folder (cached bytecode) (stdlib only, no site-packages: a fast start-up, and nothing of the
trainer's packages). It never sees a test case:
the judge process sends `load` (the program) and then `call` messages (function name and plain-data
arguments) on one pipe and reads the plain-data results on another. Whatever this process writes
there is a return value, never a verdict: it cannot make a case pass that its values do not pass.

Confinement as root (the usual case in training containers), all before the program is loaded:
* new mount, PID and network namespaces. The runner forks; the child is PID 1 of the new PID
  namespace, so when the driver kills it every process the program started dies with it (setsid
  and double forks included). No network at all, not even loopback.
* a filesystem view of the OS only: every top-level directory but /usr, /bin, /sbin, /lib*, /etc,
  /dev, /proc and /sys is an empty read-only tmpfs (the checkout, datasets, caches, home dirs, /work,
  /opt, /var, /run), the Python installation is bind-mounted back read-only with its site-packages
  hidden, as are the site-packages and paths the driver names; /tmp and /dev/shm are fresh private
  tmpfs (gone with the namespace: nothing is left behind), and /proc shows this namespace only.
* a random unused uid, where RLIMIT_NPROC holds (it is not enforced for uid 0); rlimits on CPU,
  address space, processes and file size.
Where the namespaces cannot be created (no CAP_SYS_ADMIN), the uid switch and rlimits still apply
and the driver removes the uid's processes and /tmp files afterwards. Not root: rlimits only.
"""
import os
import sys

if __package__:
    from . import wire
else:  # started by the driver: its boot line puts this folder first on sys.path
    import wire

NEWNS, NEWPID, NEWNET, NEWIPC = 0x00020000, 0x20000000, 0x40000000, 0x08000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
KEEP = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "dev", "proc", "sys"}


# ---- confinement -------------------------------------------------------------------------------

class _Libc:
    def __init__(self):
        import ctypes

        self.ctypes, self.lib = ctypes, ctypes.CDLL(None, use_errno=True)

    def call(self, name: str, *args) -> None:
        if getattr(self.lib, name)(*args) != 0:
            errno = self.ctypes.get_errno()
            raise OSError(errno, f"{name}{args[:2]}: {os.strerror(errno)}")

    def mount(self, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        def enc(s: str | None) -> bytes | None:
            return s.encode() if s is not None else None

        self.call("mount", enc(source), enc(target), enc(fstype), flags, enc(data))


def _hide_filesystem(libc: _Libc, hide: list[str], keep: list[str], tmp_mb: int) -> None:
    """Private mounts: the OS stays visible, everything else is an empty read-only tmpfs."""
    libc.mount(None, "/", None, MS_REC | MS_PRIVATE)
    empty = MS_NOSUID | MS_NODEV
    # Opened before the empty dirs cover them; bind-mounted back through /proc/self/fd.
    kept = {path: os.open(path, os.O_RDONLY | os.O_DIRECTORY) for path in keep
            if os.path.isdir(path) and not _visible(path)}
    top = [d for d in os.listdir("/") if d not in KEEP and d != "tmp" and os.path.isdir("/" + d)
           and not os.path.islink("/" + d)]
    for name in top:
        libc.mount("tmpfs", "/" + name, "tmpfs", empty, "size=1m,mode=0755")
    for path, fd in kept.items():  # the Python installation, back at its own path under the empty dirs
        os.makedirs(path, exist_ok=True)  # (the tmpfs is still writable here)
        libc.mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        libc.mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)
    for path in hide:
        if os.path.isdir(path):
            libc.mount("tmpfs", path, "tmpfs", empty | MS_RDONLY, "size=1m,mode=0755")
    for name in top:
        libc.mount(None, "/" + name, None, MS_REMOUNT | empty | MS_RDONLY)
    for path in ("/tmp", "/dev/shm"):
        if os.path.isdir(path):
            libc.mount("tmpfs", path, "tmpfs", empty, f"size={tmp_mb}m,mode=1777")
    try:  # this PID namespace's processes only
        libc.mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass


def _visible(path: str) -> bool:
    """Reachable without the bind mount: under a kept top-level directory."""
    return path.strip("/").split("/", 1)[0] in KEEP


def _reroot_imports() -> None:
    """Import through fds opened while root: after the uid switch only the final directories'
    permissions then matter (the stdlib: world-readable), not a 0700 /root above them."""
    moved: dict[str, str] = {}
    for entry in sys.path:
        try:
            moved[entry] = f"/proc/self/fd/{os.open(entry, os.O_RDONLY | os.O_DIRECTORY)}"
        except OSError:
            continue

    def reroot(path: str) -> str:
        for old, new in moved.items():
            if path == old or path.startswith(old + os.sep):
                return new + path[len(old):]
        return path

    sys.path[:] = list(moved.values())
    for module in list(sys.modules.values()):  # already imported packages find submodules on __path__
        if isinstance(getattr(module, "__path__", None), list):
            module.__path__[:] = [reroot(p) for p in module.__path__]
    sys.path_importer_cache.clear()


def _set_limits(limits: dict) -> None:
    import resource

    mb = 1 << 20
    for name, value in (("CORE", 0), ("CPU", limits["cpu_s"]), ("FSIZE", limits["file_size_mb"] * mb),
                        ("NPROC", limits["max_processes"]), ("AS", limits["memory_mb"] * mb)):
        which = getattr(resource, f"RLIMIT_{name}")
        hard = resource.getrlimit(which)[1]  # not root: we can only lower, never raise, a hard limit
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))
    try:  # no cgroup caps the sum over processes: if memory runs out, the OOM killer takes us first
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def _switch_uid(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # drops every capability too: RLIMIT_NPROC applies from here on
    if uid <= 0 or os.getresuid() != (uid, uid, uid):  # (uid_t)-1 would mean "unchanged": still root
        raise PermissionError(f"could not switch to uid {uid}")


def _enter_namespaces(libc: _Libc, status_fd: int, keep_fds: tuple[int, ...]) -> bool:
    """Unshare and fork. The parent stays outside as the child's waiter and never returns; the child
    (PID 1 inside) returns True. False: no namespaces here (no CAP_SYS_ADMIN), nothing changed."""
    try:
        # NEWIPC: SysV shared memory, semaphores and queues die with the run (they outlive processes,
        # so a program could keep state across runs and learn the judge's answers from its calls)
        libc.call("unshare", NEWNS | NEWPID | NEWNET | NEWIPC)
    except OSError:
        return False
    pid = os.fork()
    if pid == 0:
        return True
    for fd in keep_fds:
        os.close(fd)  # only the child talks to the judge: EOF there as soon as the child is gone
    _say(status_fd, {"pid": pid, "isolation": "namespaces"})
    os.close(status_fd)
    _wait_and_mirror(pid)


def _wait_and_mirror(pid: int) -> None:
    """Exit as the child did, so the driver reads its exit status or signal as ours."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the driver stops us with SIGKILL, or by killing the child
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def _say(status_fd: int, facts: dict) -> None:
    """A line for the driver (a Python literal): written before any of the program runs."""
    os.write(status_fd, repr(facts).encode() + b"\n")


def confine(setup: dict) -> None:
    status_fd = setup["status_fd"]
    uid = setup["uid"]
    isolation = "rlimits"
    if uid is not None:
        libc = _Libc()
        if setup["namespaces"] and _enter_namespaces(libc, status_fd, (setup["request_fd"], setup["reply_fd"])):
            _hide_filesystem(libc, setup["hide"], setup["keep"], setup["tmp_mb"])
            os.chdir("/tmp")
            isolation = None  # the waiter outside already said so
        else:
            isolation = "uid"
            try:
                libc.call("unshare", NEWNET)  # no network, where that alone is allowed
            except OSError:
                pass
            os.chown(".", uid, uid)
            _reroot_imports()
        _set_limits(setup["limits"])
        _switch_uid(uid)
    else:
        _set_limits(setup["limits"])
    if isolation:
        _say(status_fd, {"pid": os.getpid(), "isolation": isolation})
    os.close(status_fd)


# ---- serving calls ------------------------------------------------------------------------------

def serve(request_fd: int, reply_fd: int, max_message: int) -> None:
    # Bound now: the program may patch modules and builtins; that only breaks its own answers.
    receive, send, encode, decode, not_plain = wire.receive, wire.send, wire.encode, wire.decode, wire.PlainDataError
    exit_, getpid = os._exit, os.getpid
    me, streams = getpid(), (sys.stdout, sys.stderr)
    namespace: dict = {"__name__": "solution"}

    def flush() -> None:  # prints reach the driver before the answer that follows them
        for stream in streams:
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001  (the program may have broken its own streams)
                pass

    while True:
        try:
            message = receive(request_fd, max_message, trusted=True)
        except BaseException:  # noqa: BLE001  (the judge is done (EOF) or gone)
            exit_(0)  # the judge is done (EOF) or gone
        if message["op"] == "load":
            try:
                exec(compile(message["code"], "<code>", "exec", dont_inherit=True, optimize=0), namespace)
                if message["entry_point"] not in namespace:
                    raise NameError(f"entry point {message['entry_point']!r} is not defined")
                reply = {"id": message["id"], "loaded": True}
            except BaseException as e:  # noqa: BLE001  SystemExit / KeyboardInterrupt too: a definition failure
                reply = {"id": message["id"], "error": wire.describe(e)}
        else:
            try:
                fn = namespace[message["fn"]]
                value = fn(*decode(message["args"]), **decode(message["kwargs"]))
                try:
                    reply = {"id": message["id"], "value": encode(value)}
                except not_plain as e:  # the judge fails the case
                    reply = {"id": message["id"], "unplain": str(e)}
            except BaseException as e:  # noqa: BLE001  (whatever the program raised goes back to the judge)
                reply = {"id": message["id"], "raised": [type(e).__name__, wire.describe(e)]}
        if getpid() != me:  # a forked copy of this process: only the original answers
            exit_(0)
        flush()
        try:
            send(reply_fd, reply)
        except BaseException:  # noqa: BLE001  (the judge is gone)
            exit_(0)


def main(setup_text: str) -> None:
    setup = eval(setup_text, {"__builtins__": {}})  # a literal from the driver
    try:
        confine(setup)
    except Exception as e:  # noqa: BLE001  never run the program with fewer restrictions than asked for
        _say(setup["status_fd"], {"setup_error": wire.describe(e)})
        os._exit(3)
    serve(setup["request_fd"], setup["reply_fd"], setup["max_message"])


