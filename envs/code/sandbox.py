"""Grade untrusted, model-written Python programs against test cases: the verdict is decided outside
the program being graded.

Two processes per program, and the driver here in the trainer:
* the candidate process (`candidate.py`) runs the program inside a bubblewrap sandbox (isolation.py:
  its own namespaces, no view of the host but the OS and Python's stdlib, rlimits). It answers calls
  with plain data and never sees a test.
* a judge process (`judge.py`, warm, one per worker thread, a fresh fork per program) runs the test
  preamble and the cases with `candidate` bound to proxies that call into the candidate process.
  It alone decides pass/fail, and reports on a socket the candidate cannot reach.
The driver (this file) starts the candidate with its two pipe ends, hands the other two ends to a
judge, collects the verdict, caps the candidate's stdout/stderr (never parsed), enforces the
wall-clock timeout, and kills the sandbox (and with it every process the program started).
"""
from __future__ import annotations

import ast
import atexit
import contextlib
import functools
import json
import os
import re
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Iterator, Sequence

from magrpo import lifeline

from . import cgroups, isolation, syscalls, wire
from .isolation import BOOT, ENV, MODES, SANDBOX_LIB

DRAIN_S = 0.5  # after the candidate is gone: how long to wait for its output still in flight
JUDGE_GRACE_S = 1.0  # the judge's own deadline is the timeout; past this much more, it is replaced


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0  # wall clock per program (all its cases)
    cpu_s: int = 5  # RLIMIT_CPU
    memory_mb: int = 1024  # RLIMIT_AS, per process
    max_processes: int = 64  # RLIMIT_NPROC, per sandbox (its own user namespace; as root, its own uid)
    file_size_mb: int = 10  # RLIMIT_FSIZE; the private /tmp holds 4x this
    output_bytes: int = 10_000  # stdout/stderr kept per program, truncated beyond
    reply_mb: int = 16  # largest answer of one call (a bigger return value fails the case)
    mode: str = "bwrap"  # bwrap | unsafe (isolation.py; the env's `env.sandbox`)


@dataclass
class CaseResult:
    passed: bool
    error: str | None  # "Type: message" (first line), "timeout" or "crashed: ..."


@dataclass
class RunResult:
    cases: list[CaseResult]
    timed_out: bool
    crashed: bool  # the candidate died (or closed its channel) before every case was judged
    stdout: str
    stderr: str
    duration_s: float
    isolation: str = ""  # the mode that confined this run: bwrap | unsafe

    @property
    def passed(self) -> int:
        return sum(case.passed for case in self.cases)

    @property
    def fraction(self) -> float:
        return self.passed / len(self.cases) if self.cases else 0.0


@dataclass(frozen=True)
class Program:
    code: str  # the candidate program (defines functions); runs in the candidate process only
    preamble: str  # test preamble (imports, constants, helpers); runs in the judge only, before the cases
    cases: list[str]  # each an `assert ...` statement (may be multi-line source)
    entry_point: str  # name bound to `candidate` while the cases run


class _Capped:
    """Keeps the first `cap` bytes written to it and drops the rest (a program may print gigabytes)."""

    def __init__(self, cap: int) -> None:
        self.cap, self.data = cap, bytearray()

    def add(self, chunk: bytes) -> None:
        self.data += chunk[: max(0, self.cap - len(self.data))]


# ---- judges ---------------------------------------------------------------------------------------

class _Judge:
    """A warm judge process and the driver's end of its socket."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self.sock = ours
        # Isolated mode, importing from a folder of its own (judge_lib), under a lifeline supervisor: the
        # judge ends at EOF on its socket, but a judge busy in a slow preamble or case outlived a trainer
        # killed by SIGKILL for up to the timeout; now it dies with the trainer.
        argv = [sys.executable, "-I", "-S", "-c", BOOT.format("judge"), judge_lib(), str(theirs.fileno())]
        self.proc = subprocess.Popen(
            lifeline.command(argv, grace_s=0), pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            env=ENV)
        theirs.close()

    def send(self, job: dict, fds: list[int]) -> None:
        data = json.dumps(job).encode()
        socket.send_fds(self.sock, [len(data).to_bytes(wire.HEADER_SIZE, "big")], fds)
        self.sock.sendall(data)

    def kill(self) -> None:
        """End the judge and its child of the moment, and return once they are reaped: a SIGTERM to the
        supervisor (no grace) has it kill and reap them, then exit. A SIGKILL of the whole group would
        return while they may still be exiting (a check for leftovers then saw one)."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # never seen; a stuck supervisor must not hang the trainer
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.sock.close()


@functools.lru_cache(maxsize=1)
def judge_lib() -> str:
    """The judge's modules alone, in a private read-only folder: never a folder a candidate could see or
    write into (a `random.py` beside judge.py once took over every verdict)."""
    return isolation.private_copy("magrpo-judge-", ("judge.py", "wire.py"), sys.executable, 0o500)


class _JudgePool:
    def __init__(self) -> None:
        self.idle: list[_Judge] = []
        self.lock = threading.Lock()

    def acquire(self) -> _Judge:
        with self.lock:
            if self.idle:
                return self.idle.pop()
        return _Judge()

    def release(self, judge: _Judge) -> None:
        with self.lock:
            self.idle.append(judge)

    def close(self) -> None:
        with self.lock:
            judges, self.idle = self.idle, []
        for judge in judges:
            judge.kill()


_judges = _JudgePool()
atexit.register(_judges.close)


class _Frames(_Capped):
    """Sink for the judge's socket: complete when one length-prefixed message has arrived."""

    def message(self):
        head = wire.HEADER_SIZE
        if len(self.data) < head:
            return None
        size = int.from_bytes(self.data[:head], "big")
        if len(self.data) < head + size:
            return None
        return json.loads(self.data[head: head + size])


# ---- candidates -----------------------------------------------------------------------------------

def _pump(sel: selectors.BaseSelector, until: float, done) -> bool:
    """Reads ready fds into their sinks until `done()` or `until`; False on timeout."""
    while not done():
        remaining = until - time.monotonic()
        if remaining <= 0 or not sel.get_map():
            return done()
        for key, _ in sel.select(remaining):
            if key.data is None:  # a pidfd: the candidate's runner exited
                sel.unregister(key.fileobj)
                continue
            try:
                chunk = os.read(key.fd, 1 << 16) if isinstance(key.fileobj, int) else key.fileobj.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                continue
            if chunk:
                key.data.add(chunk)
            else:
                sel.unregister(key.fileobj)
    return True


def _exit_reason(returncode: int | None) -> str:
    if returncode is None:
        return "crashed: closed its channel to the judge"
    if returncode >= 0:
        return f"crashed: exit status {returncode}"
    try:
        return f"crashed: killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"crashed: killed by signal {-returncode}"


class _Runner(subprocess.Popen):
    """The candidate's runner: bwrap (or, unsafe, the candidate itself), and with bwrap the read end of
    its --info-fd, then a pidfd of the sandbox's PID 1 (`watch_pid1`), which `_kill` kills."""

    info_fd: int | None = None
    pid1: int | None = None


@dataclass
class Slot:
    """Where one sandboxed process runs: its working folder (unsafe), its uid (bwrap as root) and its
    cgroup (where the machine allows one: cgroups.py)."""

    workdir: str | None
    uid: int | None
    group: cgroups.Group | None


# The sandbox's first process, before it execs bwrap (or, unsafe, the candidate): it joins its cgroup, so
# that nothing of the sandbox ever runs outside it, and sets oom_score_adj to 1000; written by a process with
# CAP_SYS_RESOURCE (root, outside some containers) that is also a floor the program cannot go below.
JOIN = ('while [ "$1" != -- ]; do echo $$ > "$1" || { echo "magrpo-sandbox: cannot join the cgroup $1" >&2; '
        'exit 125; }; shift; done; shift; echo 1000 > /proc/self/oom_score_adj 2>/dev/null; exec "$@"')
SETUP_FAILED = (b"bwrap:", b"magrpo-sandbox:")  # stderr of a sandbox that never started: not the program's fault


def _spawn(setup: dict, mode: str, slot: Slot, fds: tuple[int, ...]) -> _Runner:
    workdir, uid = slot.workdir, slot.uid
    boot = ["-I", "-S", "-c", BOOT.format("candidate")]
    ours: tuple[int, ...] = ()  # this call's own fds for bwrap: closed here once it has them
    info_r = None
    if mode == "bwrap":  # bwrap clears the environment and sets the sandbox's own
        lib = isolation.candidate_lib(mode)
        filter_fd = syscalls.pipe()
        info_r, info_w = os.pipe()
        ours = (filter_fd, info_w)
        argv = [*isolation.bwrap_command(lib, setup["tmp_mb"], seccomp_fd=filter_fd, info_fd=info_w),
                isolation.interpreter().executable, *boot, SANDBOX_LIB, repr(setup)]
        cwd, env = "/", {}
    else:
        argv = [sys.executable, *boot, isolation.candidate_lib(mode), repr(setup)]
        cwd, env = workdir, {**ENV, "HOME": workdir, "TMPDIR": workdir}
    argv, keywords = isolation.as_user(uid, argv)
    if slot.group is not None or os.geteuid() == 0:
        argv = ["/bin/sh", "-c", JOIN, "magrpo-sandbox", *(slot.group.procs if slot.group else []), "--", *argv]
    try:
        proc = _Runner(
            argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=fds + ours, start_new_session=True, **keywords)
    except BaseException:
        if info_r is not None:
            os.close(info_r)
        raise
    finally:
        for fd in ours:
            os.close(fd)
    proc.info_fd = info_r
    return proc


def watch_pid1(proc: _Runner, wait_s: float) -> None:
    """Opens a pidfd of the sandbox's PID 1 (bwrap's `child-pid`), so that `_kill` kills it itself:
    a program that reaches PID 1 (the audit ptraced it and cleared its parent-death signal) must not
    keep it, and with it a daemon, alive past the kill of bwrap. Waits up to `wait_s` for bwrap to say."""
    fd, proc.info_fd = proc.info_fd, None
    if fd is None:
        return
    data, until = b"", time.monotonic() + wait_s
    try:  # to EOF (bwrap closes it right after): closed earlier, its next write would kill bwrap (SIGPIPE)
        while select.select([fd], [], [], max(0.0, until - time.monotonic()))[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    match = re.search(rb'"child-pid":\s*(\d+)', data)
    if match is None:  # bwrap failed before it made a sandbox (its stderr says why)
        return
    pid = int(match[1])
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # gone already, and every process of its namespace with it
        return
    if _parent(pid) == proc.pid:  # bwrap (not reaped yet) forks once: this is its PID 1, not a reused pid
        proc.pid1 = pidfd
    else:
        os.close(pidfd)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _status(data: bytes) -> dict:
    out: dict = {}
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            out.update(ast.literal_eval(line))
        except (ValueError, SyntaxError, TypeError):
            pass
    return out


def _run(program: Program, limits: SandboxLimits, slot: Slot) -> RunResult:
    start = time.monotonic()
    out, err, status, verdict = (_Capped(limits.output_bytes), _Capped(limits.output_bytes), _Capped(4096),
                                 _Frames(64 * len(program.cases) + (1 << 20)))
    request_r, request_w = os.pipe()
    reply_r, reply_w = os.pipe()
    status_r, status_w = os.pipe()
    setup = {"limits": asdict(limits), "request_fd": request_r, "reply_fd": reply_w, "status_fd": status_w,
             "max_message": 1 << 30, "tmp_mb": 4 * limits.file_size_mb}  # argv: nothing secret in it
    judge = _judges.acquire()
    try:
        proc = _spawn(setup, limits.mode, slot, (request_r, reply_w, status_w))
    except BaseException:
        _judges.release(judge)
        for fd in (request_w, reply_r, status_r):
            os.close(fd)
        raise
    finally:
        for fd in (request_r, reply_w, status_w):
            os.close(fd)  # only the candidate holds these ends now: EOF once it is gone
    job = {"code": program.code, "preamble": program.preamble, "cases": list(program.cases),
           "entry_point": program.entry_point, "names": _function_names(program.code, program.entry_point),
           "timeout_s": limits.timeout_s, "max_message": limits.reply_mb << 20, "memory_mb": limits.memory_mb}
    try:
        judge.send(job, [request_w, reply_r])
    finally:
        os.close(request_w)
        os.close(reply_r)
    watch_pid1(proc, limits.timeout_s)
    try:
        pidfd = os.pidfd_open(proc.pid)  # readable when the runner exits (Linux >= 5.3)
    except (AttributeError, OSError):
        pidfd = None
    judge_ok = False
    with proc, selectors.DefaultSelector() as sel:
        try:
            for fileobj, sink in ((proc.stdout.fileno(), out), (proc.stderr.fileno(), err), (status_r, status),
                                  (judge.sock, verdict)):
                sel.register(fileobj, selectors.EVENT_READ, sink)
            message = None
            _pump(sel, start + limits.timeout_s + JUDGE_GRACE_S, lambda: verdict.message() is not None)
            message = verdict.message()
            judge_ok = message is not None and "cases" in message
            crashed = judge_ok and any(kind == "crashed" for _, _, kind in message["cases"])
            if crashed and pidfd is not None:  # its exit status names the crash: give it a moment
                sel.register(pidfd, selectors.EVENT_READ, None)
                _pump(sel, min(time.monotonic() + DRAIN_S, start + limits.timeout_s), lambda: proc.poll() is not None)
        finally:
            returncode = proc.poll()
            facts = _status(_drain_status(sel, status_r, status))
            _kill(proc)
            if pidfd is not None:
                os.close(pidfd)
            sel.unregister(judge.sock)
            _pump(sel, time.monotonic() + DRAIN_S, lambda: False)  # output still in flight
            os.close(status_r)
            if judge_ok:
                _judges.release(judge)
            else:
                judge.kill()
    check_started(facts, returncode, bytes(err.data))
    if not judge_ok:  # no verdict in time (or a judge that failed: its message says why)
        error = str(message["error"]) if message is not None and "error" in message else "timeout"
        cases = [CaseResult(False, error)] * len(program.cases)
        kinds = ["timeout" if error == "timeout" else ""] * len(program.cases)
    else:
        reason = _exit_reason(_signalled(returncode) if limits.mode == "bwrap" else returncode)
        cases = [CaseResult(bool(ok), None if ok else (reason if kind == "crashed" else error))
                 for ok, error, kind in message["cases"]]
        kinds = [kind for _, _, kind in message["cases"]]
    return RunResult(cases=cases, timed_out="timeout" in kinds, crashed="crashed" in kinds,
                     stdout=out.data.decode("utf-8", "replace"), stderr=err.data.decode("utf-8", "replace"),
                     duration_s=time.monotonic() - start, isolation=limits.mode)


def check_started(facts: dict, returncode: int | None, stderr: bytes) -> None:
    """RuntimeError when the sandbox never ran the program: the candidate's own setup failed, or bwrap
    (or the cgroup join before it) did, e.g. out of user namespaces: the machine's fault, never a score of 0."""
    if "setup_error" in facts:
        raise RuntimeError(f"sandbox setup failed, nothing was run: {facts['setup_error']}")
    if "ready" not in facts and returncode is not None and stderr.startswith(SETUP_FAILED):
        reason = stderr.decode("utf-8", "replace").splitlines()[0]
        raise RuntimeError(f"sandbox setup failed, nothing was run: {reason}")


def _drain_status(sel: selectors.BaseSelector, status_r: int, sink: _Capped) -> bytes:
    """The runner writes its status first thing; read what has come, without waiting for EOF."""
    os.set_blocking(status_r, False)
    while True:
        try:
            chunk = os.read(status_r, 4096)
        except BlockingIOError:
            break
        if not chunk:
            break
        sink.add(chunk)
    if status_r in sel.get_map():
        sel.unregister(status_r)
    return bytes(sink.data)


def _kill(proc: _Runner) -> None:
    """SIGKILL the sandbox's PID 1 through its pidfd (with PID 1 every process of its PID namespace dies,
    whatever the program did to PID 1's parent-death signal), then the candidate's process group (bwrap
    itself; unsafe: the program and the children it did not move out)."""
    pidfd, proc.pid1 = proc.pid1, None
    if pidfd is not None:
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            os.close(pidfd)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _signalled(returncode: int | None) -> int | None:
    """bwrap exits 128+n when its child was killed by signal n: say which signal."""
    return 128 - returncode if returncode is not None and 128 < returncode < 160 else returncode


def _function_names(code: str, entry_point: str) -> list[str]:
    """Top-level functions of the program, which the judge binds to proxies (the entry point first)."""
    names = [entry_point]
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return names
    names += [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
              and n.name != entry_point]
    return names


def run_program(program: Program, limits: SandboxLimits = SandboxLimits()) -> RunResult:
    """Runs `program` in a confined child process and has a judge process score each of its cases."""
    if limits.mode not in MODES:
        raise ValueError(f"sandbox mode {limits.mode!r}; choose one of: {', '.join(MODES)}")
    with confinement(limits) as slot:
        return _run(program, limits, slot)


@contextlib.contextmanager
def confinement(limits: SandboxLimits) -> Iterator[Slot]:
    """The Slot of one sandboxed process, given back afterwards: bwrap as root, a uid of its own
    (RLIMIT_NPROC then holds); unsafe, a fresh working folder, removed; a cgroup where there can be one,
    whose processes are all killed at the end, whatever session or process group they moved to."""
    if limits.mode == "bwrap":
        workdir, uid = None, isolation.acquire_uid() if os.geteuid() == 0 else None
    else:
        workdir, uid = tempfile.mkdtemp(prefix="magrpo-sandbox-"), None
    group = None
    try:
        # pids: the program's max_processes, and bwrap's own two (itself and the sandbox's PID 1)
        group = cgroups.create(limits.memory_mb, limits.max_processes + 2)
        yield Slot(workdir, uid, group)
    finally:
        if group is not None:
            group.kill()
            group.remove()
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
        if uid is not None:
            isolation.release_uid(uid)


def run_many(programs: Sequence[Program], limits: SandboxLimits = SandboxLimits(),
             workers: int | None = None) -> list[RunResult]:
    """Runs `programs` in parallel (threads suffice: the work is in the child processes), in order."""
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda program: run_program(program, limits), programs))


def main() -> None:  # python -m envs.code.sandbox [N] [bwrap|unsafe]: sandbox runs per second
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    limits = SandboxLimits(mode=sys.argv[2] if len(sys.argv) > 2 else "bwrap")
    isolation.check(limits.mode)
    cases = [f"assert candidate({i}, 1) == {i + 1}" for i in range(4)]
    add = Program("def add(a, b):\n    return a + b\n", "", cases, "add")
    run_many([add] * (os.cpu_count() or 1), limits)  # warm judges
    began = time.monotonic()
    results = run_many([add] * count, limits)
    elapsed = time.monotonic() - began
    assert all(r.fraction == 1.0 for r in results), results[0]
    print(f"{len(results) / elapsed:.1f} sandbox runs/s ({os.cpu_count()} workers, 4 asserts each, "
          f"isolation: {results[0].isolation})")


if __name__ == "__main__":
    main()
