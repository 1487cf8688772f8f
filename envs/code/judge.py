"""The judge: runs a problem's test cases against a candidate it never executes.

A warm process started by the sandbox driver (`python -I -S -c BOOT FOLDER SOCKET_FD`). For each program
the driver sends the job (test preamble, cases, the candidate's function names) and two pipe ends to
the candidate process over a Unix socket; the judge forks a child that runs the preamble and every
case here, in its own interpreter, with `candidate` (and the program's other functions) bound to
proxies. A proxy call sends its arguments to the candidate process as plain data and turns the
plain-data answer back into a value (`wire.py`); the assert is evaluated on that value, here. The
verdict goes back to the driver on the socket, which the candidate cannot reach.

A case fails, never passes, when a call in it cannot be answered honestly: the candidate crashed,
ran out of time, returned something that is not plain data, or an argument is not plain data
(a case that catches such a failure still fails). Exceptions the candidate raises come back as the
same builtin exception type, so tests that expect one keep their meaning; StopIteration and
non-builtin types come back as CandidateError, which no iteration protocol swallows.
"""
from __future__ import annotations

import ast
import builtins
import os

if __package__:
    from . import wire
else:  # started by the driver: its boot line puts this folder first on sys.path
    import wire

CRASHED, TIMEOUT = "crashed", "timeout"
_NOT_REPLAYED = (StopIteration, StopAsyncIteration)  # iteration protocols would read them as "done"


class CandidateError(Exception):
    """The candidate raised an exception that is not re-raised as its own type."""


class CallFailed(BaseException):
    """A call with no honest answer (crash, timeout, not plain data). BaseException, and the case
    fails even if the test catches it."""

    def __init__(self, message: str, kind: str = ""):
        super().__init__(message)
        self.kind = kind


class JudgeTimeout(BaseException):
    pass


def unsupported_reason(case: str, names: set[str]) -> str | None:
    """Why a case cannot be judged through proxies, or None. A proxy can be called and passed to a
    call (`map(candidate, xs)`); identity checks, attribute access or storing it are refused."""
    try:
        tree = ast.parse(case)
    except SyntaxError as e:
        return f"the case does not parse: {e.msg}"
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in names and isinstance(node.ctx, ast.Load):
            parent = parents.get(node)
            if isinstance(parent, ast.Call) and (parent.func is node or node in parent.args):
                continue
            if isinstance(parent, ast.Assign) and all(isinstance(t, ast.Name) for t in parent.targets):
                continue  # `f = candidate` (a check whose parameter has another name): f is the proxy
            return f"`{node.id}` used other than by calling it (line {node.lineno})"
    return None


class Channel:
    """The judge's end of the pipes to one candidate process."""

    def __init__(self, request_fd: int, reply_fd: int, deadline: float, max_message: int):
        self.request_fd, self.reply_fd, self.deadline, self.max_message = request_fd, reply_fd, deadline, max_message
        os.set_blocking(request_fd, False)
        os.set_blocking(reply_fd, False)
        self.next_id, self.gone, self.failed = 0, None, None  # failed: the current case had a failed call

    def ask(self, message: dict) -> dict:
        if self.gone is not None:
            raise self.gone
        self.next_id += 1
        message["id"] = self.next_id
        try:
            wire.send(self.request_fd, message, self.deadline)
            reply = wire.receive(self.reply_fd, self.max_message, self.deadline)
        except wire.ChannelTimeout:
            self.gone = CallFailed("timeout", TIMEOUT)
        except (wire.ChannelClosed, BrokenPipeError):
            self.gone = CallFailed("crashed", CRASHED)
        except wire.PlainDataError as e:  # the stream is out of step from here on
            self.gone = CallFailed(f"bad reply from the candidate: {e}")
        except Exception as e:  # noqa: BLE001  (fail closed: no error of the channel may reach the test's `except`)
            self.gone = CallFailed(f"bad reply from the candidate: {type(e).__name__}")
        else:
            if type(reply) is dict and reply.get("id") == self.next_id:
                return reply
            self.gone = CallFailed("bad reply from the candidate")
        raise self.gone

    def call(self, name: str, args: tuple, kwargs: dict):
        try:
            encoded = {"args": wire.encode(list(args)), "kwargs": wire.encode(dict(kwargs))}
        except wire.PlainDataError as e:
            raise self._fail(f"unsupported case: an argument to {name} cannot be sent ({e})") from None
        try:
            reply = self.ask({"op": "call", "fn": name, **encoded})
        except CallFailed as e:
            self.failed = self.failed or e
            raise
        if "value" in reply:
            try:
                return wire.decode(reply["value"])
            except wire.PlainDataError as e:
                raise self._fail(f"{name} returned {e}") from None
        if "unplain" in reply:
            raise self._fail(f"{name} returned {str(reply['unplain'])[:wire.ERROR_CHARS]}")
        raise _as_exception(reply.get("raised"))

    def _fail(self, message: str) -> CallFailed:
        self.failed = self.failed or CallFailed(message)
        return self.failed


def _as_exception(raised) -> BaseException:
    """The candidate's exception as the judge raises it: the builtin type itself where that is safe."""
    if not (type(raised) is list and len(raised) == 2 and all(type(x) is str for x in raised)):
        return CallFailed("bad reply from the candidate")
    name, text = raised
    kind = getattr(builtins, name, None) if name.isidentifier() else None
    if isinstance(kind, type) and issubclass(kind, Exception) and not issubclass(kind, _NOT_REPLAYED):
        message = text.split(": ", 1)[1] if ": " in text else ""
        try:
            return kind(message) if message else kind()
        except Exception:  # noqa: BLE001  types with other constructors (UnicodeDecodeError)
            pass
    return CandidateError(text[:wire.ERROR_CHARS])


class _Proxy:
    def __init__(self, channel: Channel, name: str):
        self._channel, self._name = channel, name

    def __call__(self, *args, **kwargs):
        return self._channel.call(self._name, args, kwargs)

    def __repr__(self) -> str:
        return f"<candidate function {self._name}>"


def judge(job: dict, compiled: dict, channel: Channel) -> list[list]:
    """[passed, error, kind] per case; kind is CRASHED or TIMEOUT when that ended the case."""
    cases = job["cases"]
    try:
        loaded = channel.ask({"op": "load", "code": job["code"], "entry_point": job["entry_point"]})
    except CallFailed as e:
        return [[False, str(e), e.kind]] * len(cases)
    if "loaded" not in loaded:
        return [[False, str(loaded.get("error", "definition failed"))[:wire.ERROR_CHARS], ""]] * len(cases)
    namespace: dict = {"__name__": "__judge__"}
    try:
        exec(compiled[job["preamble"]], namespace)
    except BaseException as e:  # noqa: BLE001  (whatever the preamble raises fails every case)
        return [[False, f"preamble: {wire.describe(e)}", ""]] * len(cases)
    for name in job["names"]:
        namespace.setdefault(name, _Proxy(channel, name))
    namespace.setdefault("candidate", _Proxy(channel, job["entry_point"]))
    out = []
    for case in cases:
        reason = compiled[("unsupported", case, job["entry_point"])]
        if reason is not None:
            out.append([False, f"unsupported case: {reason}", ""])
            continue
        channel.failed = None
        try:
            exec(compiled[case], namespace)
            verdict = [True, None, ""] if channel.failed is None else [False, str(channel.failed), channel.failed.kind]
        except CallFailed as e:
            verdict = [False, str(e), e.kind]
        except JudgeTimeout:
            verdict = [False, TIMEOUT, TIMEOUT]
        except BaseException as e:  # noqa: BLE001  (whatever a case raises fails it)
            failed = channel.failed
            verdict = [False, wire.describe(e), ""] if failed is None else [False, str(failed), failed.kind]
        out.append(verdict)
        if verdict[2] == TIMEOUT:
            out.extend([[False, TIMEOUT, TIMEOUT]] * (len(cases) - len(out)))
            break
    return out


# ---- the warm process ---------------------------------------------------------------------------

def _compile_all(job: dict, cache: dict) -> dict:
    if len(cache) > 4096:
        cache.clear()
    for source in (job["preamble"], *job["cases"]):
        if source not in cache:
            try:
                cache[source] = compile(source, "<test>", "exec", dont_inherit=True)
            except SyntaxError as e:
                cache[source] = compile(f"raise SyntaxError({str(e)!r})", "<test>", "exec")
    for case in job["cases"]:  # the K samples of a problem share its cases: parse them once
        key = ("unsupported", case, job["entry_point"])
        if key not in cache:
            cache[key] = unsupported_reason(case, {"candidate", job["entry_point"]})
    return cache


def _run_child(job: dict, compiled: dict, fds: list[int], sock) -> None:
    import random
    import resource
    import signal
    import time

    # The candidate's memory limit holds here too: decoding a reply just under the size cap could
    # otherwise take gigabytes (a 12 MB list literal put 1.9 GB in the judge); now a MemoryError
    # there fails the call.
    limit = job["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    random.seed(0)  # tests that draw random inputs draw the same ones for every candidate

    def on_alarm(signum, frame):
        raise JudgeTimeout()

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, job["timeout_s"])
    channel = Channel(fds[0], fds[1], time.monotonic() + job["timeout_s"], job["max_message"])
    try:
        verdict = judge(job, compiled, channel)
    except JudgeTimeout:
        verdict = [[False, TIMEOUT, TIMEOUT]] * len(job["cases"])
    signal.setitimer(signal.ITIMER_REAL, 0)
    _send_message(sock, {"cases": verdict})


def _send_message(sock, message) -> None:
    import json

    data = json.dumps(message).encode()
    sock.sendall(len(data).to_bytes(wire.HEADER_SIZE, "big") + data)


def _receive_job(sock):
    import json
    import socket

    header, fds, _, _ = socket.recv_fds(sock, wire.HEADER_SIZE, 2)
    if not header:
        return None, []
    size = int.from_bytes(header, "big")
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None, fds
        data += chunk
    return json.loads(data), fds


def main(sock_fd: str) -> None:
    import ctypes
    import socket

    # No PR_SET_PDEATHSIG: it fires when the spawning *thread* ends. We end at EOF on the socket.
    ctypes.CDLL(None).prctl(4, 0)  # PR_SET_DUMPABLE 0: a same-uid candidate cannot ptrace or read our memory
    sock = socket.socket(fileno=int(sock_fd))
    cache: dict = {}
    while True:
        job, fds = _receive_job(sock)
        if job is None:
            return
        compiled = _compile_all(job, cache)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _run_child(job, compiled, fds, sock)
                code = 0
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            _send_message(sock, {"error": f"judge child failed (wait status {status})"})

