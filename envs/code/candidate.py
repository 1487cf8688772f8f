"""The candidate process: sets its limits, loads the model-written program, and answers calls.

Started by the sandbox driver as `python -I -S -c BOOT FOLDER SETUP`, BOOT importing this file and
`wire.py` from their folder (cached bytecode), stdlib only: a fast start-up, and nothing of the
trainer's packages. In the default mode the whole process runs inside a bubblewrap sandbox the driver
set up (isolation.py); this file adds only what a process sets for itself, the rlimits. It never sees
a test case: the judge process sends `load` (the program) and then `call` messages (function name and
plain-data arguments) on one pipe and reads the plain-data results on another. Whatever this process
writes there is a return value, never a verdict: it cannot make a case pass that its values do not pass.

With `script_fd` in its setup (the code env's `run_python` tool, script.py) it serves no calls: it
runs the snippet it reads there as a script, under the same limits, and exits as `python script.py` would.
"""
import os
import sys

if __package__:
    from . import wire
else:  # started by the driver: its boot line puts this folder first on sys.path
    import wire


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


def _say(status_fd: int, facts: dict) -> None:
    """A line for the driver (a Python literal): written before any of the program runs."""
    os.write(status_fd, repr(facts).encode() + b"\n")


def confine(setup: dict) -> None:
    _set_limits(setup["limits"])
    _say(setup["status_fd"], {"ready": True})  # the sandbox started: a later failure is the program's
    os.close(setup["status_fd"])


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


def run_script(script_fd: int) -> None:
    """The snippet (read whole from its pipe) as `__main__`. An exception prints the snippet's own
    traceback to stderr and exits with status 1; SystemExit is the snippet's exit status."""
    chunks = []
    while chunk := os.read(script_fd, 1 << 16):
        chunks.append(chunk)
    os.close(script_fd)
    source = b"".join(chunks).decode("utf-8", "replace")
    sys.argv = ["<snippet>"]
    try:
        exec(compile(source, "<snippet>", "exec", dont_inherit=True), {"__name__": "__main__"})
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001  (printed as Python would, without this function's frame)
        import linecache
        import traceback

        linecache.cache["<snippet>"] = (len(source), None, source.splitlines(True), "<snippet>")
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        raise SystemExit(1) from None


def main(setup_text: str) -> None:
    setup = eval(setup_text, {"__builtins__": {}})  # a literal from the driver
    try:
        confine(setup)
    except Exception as e:  # noqa: BLE001  never run the program with fewer restrictions than asked for
        _say(setup["status_fd"], {"setup_error": wire.describe(e)})
        os._exit(3)
    if "script_fd" in setup:
        run_script(setup["script_fd"])
    else:
        serve(setup["request_fd"], setup["reply_fd"], setup["max_message"])


