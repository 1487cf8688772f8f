"""The hostile corpus: programs written against the sandbox's design, each the right answer only if its
attack worked (or a wrong one where the attack itself is the point: forging, escaping, flooding). Every
route an audit found stays here as a regression case. The unprivileged run in test_sandbox.py runs it
as `nobody` (`python -m tests.hostile FOLDER`, through tests/nobody.py: the venv's own Python and the
checkout); it prints the violations as JSON.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from magrpo.envs.code import isolation
from magrpo.envs.code.sandbox import Program, SandboxLimits, run_many, run_program

FAST = SandboxLimits(timeout_s=2.0, cpu_s=2, memory_mb=512, max_processes=32, output_bytes=10_000)
CASES = ["assert candidate(1) == 2", "assert candidate(2) == 3"]
SECRET = "magrpo-hostile-secret-7f3a"  # in a host process's argv during the run: never readable inside
SYSV_KEY = 0x6D616772  # "magr"


def prog(code: str, cases: list[str] = CASES, preamble: str = "", entry_point: str = "f") -> Program:
    return Program(code=code, preamble=preamble, cases=cases, entry_point=entry_point)


# Walks the frames up from `frame`: where the grader keeps its token and report fd, writes a pass
# line for every case and a done line (what the old in-process runner read as its verdict).
FORGE_FROM_FRAME = ("    loc = frame.f_locals\n    if 'token' in loc and 'fd' in loc:\n"
                    "        tok, fd = loc['token'], loc['fd']\n        for i in range(len(loc['cases'])):\n"
                    "            os.write(fd, tok + b' case %d 1 \\n' % i)\n        os.write(fd, tok + b' done \\n')\n"
                    "        break\n    frame = frame.f_back\n")


def hostile_corpus(target: Path) -> dict[str, str]:
    """name -> code. Each `f` returns the right answer only if its attack did not stop it,
    or a wrong one where the attack itself is the point (forging, escaping, flooding)."""
    ok = "    return x + 1\n"
    forged = '{"cases": [{"passed": true}, {"passed": true}], "done": true}'
    return {
        "infinite_loop": "def f(x):\n    while True:\n        pass\n",
        "fork_bomb": "import os\ndef f(x):\n    while True:\n        os.fork()\n" + ok,
        "fork_bomb_spinning": "import os\ndef f(x):\n    while True:\n        try:\n            os.fork()\n"
                               "        except OSError:\n            pass\n",
        "memory_bomb_bytes": "def f(x):\n    blob = bytearray(10 * 1024 ** 3)\n" + ok,
        "memory_bomb_list": "def f(x):\n    big = [0] * (10 ** 10)\n" + ok,
        "deep_recursion": "import sys\nsys.setrecursionlimit(10 ** 6)\ndef g(n):\n    return g(n + 1) + 1\n"
                           "def f(x):\n    return g(0)\n",
        "c_stack_overflow": "import sys\nsys.setrecursionlimit(10 ** 6)\ndef g(n):\n    return list(map(g, [n]))\n"
                             "def f(x):\n    return g(0)\n",
        "os_system": "import os\ndef f(x):\n    os.system('echo hi')\n    return None\n",
        "subprocess_sleep": "import subprocess\ndef f(x):\n    subprocess.run(['sleep', '100'])\n" + ok,
        "background_sleep": "import subprocess\ndef f(x):\n    subprocess.Popen(['sleep', '100'])\n    return None\n",
        "setsid_escape": "import os, time\ndef f(x):\n    if os.fork() == 0:\n        os.setsid()\n"
                          "        time.sleep(100)\n    return None\n",
        "setsid_escape_then_crash": "import os, time\ndef f(x):\n    if os.fork() == 0:\n        os.setsid()\n"
                                     "        time.sleep(100)\n    os._exit(0)\n",
        "daemon_ignoring_sigterm": "import os, signal, time\ndef f(x):\n    if os.fork() == 0:\n"
                                    "        os.setsid()\n        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                    "        if os.fork() == 0:\n"
                                    "            time.sleep(100)\n        os._exit(0)\n    return None\n",
        "sys_exit_at_import": "import sys\nsys.exit(0)\ndef f(x):\n" + ok,
        "os_exit_at_import": "import os\nos._exit(0)\ndef f(x):\n" + ok,
        "sys_exit_in_function": "import sys\ndef f(x):\n    sys.exit(0)\n",
        "os_exit_in_function": "import os\ndef f(x):\n    os._exit(0)\n",
        "raise_system_exit": "def f(x):\n    raise SystemExit\n",
        "raise_keyboard_interrupt": "def f(x):\n    raise KeyboardInterrupt\n",
        "write_outside_workdir": f"def f(x):\n    open({str(target)!r}, 'w').write('escaped')\n" + ok,
        # bwrap's own / and /dev are tmpfs without a size: 100 MB there was memory past every cap
        "fill_root": "def f(x):\n    open('/fill.bin', 'wb').write(b'0' * (100 * 1024 ** 2))\n" + ok,
        "fill_dev": "def f(x):\n    open('/dev/fill.bin', 'wb').write(b'0' * (100 * 1024 ** 2))\n" + ok,
        "fill_disk": "def f(x):\n    open('big.bin', 'wb').write(b'0' * (64 * 1024 ** 2))\n" + ok,
        "socket_to_localhost": "import socket\ndef f(x):\n    s = socket.socket()\n    s.connect(('127.0.0.1', 22))\n"
                                "    s.recv(1)\n    return None\n",
        "print_50mb": "def f(x):\n    print('x' * 50_000_000)\n    return None\n",
        "kill_parent": "import os, signal\ndef f(x):\n    os.kill(os.getppid(), signal.SIGKILL)\n    return None\n",
        "kill_everything": "import os, signal\ndef f(x):\n    os.kill(-1, signal.SIGKILL)\n    return None\n",
        "forge_report": "import os\ndef f(x):\n    print(%r)\n    for fd in range(0, 64):\n        try:\n"
                         "            os.write(fd, b'case 0 1\\ncase 1 1\\ndone\\n' + %r.encode() + b'\\n')\n"
                         "        except OSError:\n            pass\n    return None\n" % (forged, forged),
        "patch_builtins": "import builtins\nbuiltins.exec = lambda *a, **k: None\n"
                           "builtins.compile = lambda *a, **k: None\n"
                           "builtins.enumerate = lambda xs, start=0: [(i, 'pass') for i in range(len(xs))]\n"
                           "def f(x):\n    return None\n",
        "close_all_fds": "import os\ndef f(x):\n    os.closerange(3, 1024)\n" + ok,
        # --- the grader's own channel, state and code, reached from inside the graded process
        "forge_via_frames": "import os, sys\nframe = sys._getframe()\nwhile frame is not None:\n" + FORGE_FROM_FRAME
                             + "def f(x):\n    return None\n",
        "forge_via_gc": "import gc, os\nfor o in gc.get_objects():\n    if isinstance(o, dict) and 'report_fd' in o:\n"
                         "        tok, fd = o['token'].encode(), o['report_fd']\n"
                         "        for i in range(len(o['cases'])):\n"
                         "            os.write(fd, tok + b' case %d 1 \\n' % i)\n"
                         "        os.write(fd, tok + b' done \\n')\ndef f(x):\n    return None\n",
        "forge_via_sys_current_frames": "import os, sys\nframe = list(sys._current_frames().values())[0]\n"
                                         "while frame is not None:\n" + FORGE_FROM_FRAME
                                         + "def f(x):\n    return None\n",
        "forge_into_every_fd": "import gc, os\ntok = [o['token'] for o in gc.get_objects() if isinstance(o, dict) and "
                                "'token' in o][:1]\nline = ((tok[0] if tok else 'x') + ' case 0 1 \\n').encode()\n"
                                "for fd in range(3, 256):\n    try:\n        os.write(fd, line * 2)\n"
                                "    except OSError:\n        pass\ndef f(x):\n    return None\n",
        "mutate_cases_default_arg": "import sys\ndef f(x, _=sys._getframe(1).f_locals['cases'].__setitem__(\n"
                                     "        slice(None), ['pass'] * len(sys._getframe(1).f_locals['cases']))):\n"
                                     "    return None\n",
        "bytecode_peek": "import sys\ndef f(x):\n    consts = sys._getframe(1).f_code.co_consts\n"
                          "    ints = [c for c in consts if type(c) is int and c != x]\n"
                          "    return ints[-1] if ints else None\n",
        "always_equal": "class Yes:\n    def __eq__(self, other):\n        return True\n"
                         "    def __ne__(self, other):\n        return False\n    __hash__ = object.__hash__\n"
                         "def f(x):\n    return Yes()\n",
        "truthy_comparison": "class T:\n    def __eq__(self, other):\n        return [1]\n"
                              "def f(x):\n    return T()\n",
        "int_subclass": "class I(int):\n    def __eq__(self, other):\n        return True\n"
                         "    __hash__ = int.__hash__\ndef f(x):\n    return I(0)\n",
        "raising_repr": "class R:\n    def __eq__(self, other):\n        return True\n"
                         "    def __repr__(self):\n        raise RuntimeError('no repr')\n"
                         "def f(x):\n    return R()\n",
        "generator_return": "def f(x):\n    yield x + 1\n",
        "function_return": "def f(x):\n    return lambda *a: x + 1\n",
        "huge_return": "def f(x):\n    return 'x' * (40 * 2 ** 20)\n",
        "garbage_on_reply_channel": "import os, sys\ndef f(x):\n    fd = sys._getframe(1).f_locals.get('reply_fd')\n"
                                     "    if fd is not None:\n"
                                     "        os.write(fd, b'\\xff\\xff\\xff\\xff' + b'x' * 64)\n"
                                     "    return None\n",
        "tmp_leftovers": "import os\ndef f(x):\n    open('/tmp/magrpo-hostile-leftover', 'w').write('x')\n"
                          "    os.makedirs('/dev/shm/magrpo-hostile-leftover', exist_ok=True)\n"
                          "    return None\n",
    }




# Programs that answer right only where the sandbox lets them see or change what it hides: the dataset,
# the checkout, the trainer's packages, the judge's source, the host's processes, its own modules.
def readers(checkout: Path) -> dict[str, str]:
    site = [p for p in sys.path if p.endswith("site-packages")][:1] or [str(checkout)]
    found = ("    (os.listdir(p) if os.path.isdir(p) else open(p, 'rb').read(1))\n    return x + 1\n")
    out = {name: f"import os\ndef f(x):\n    p = {str(path)!r}\n" + found
           for name, path in (("read_dataset", checkout / "envs" / "code" / "data" / "HumanEval.jsonl.gz"),
                              ("read_checkout", checkout / "envs" / "code" / "judge.py"),
                              ("read_site_packages", Path(site[0])))}
    out["find_judge_source"] = (  # anywhere it can reach: the judge's private folder must not be there
        "import glob, os\ndef f(x):\n    if glob.glob('/tmp/*/judge.py'):\n        return x + 1\n"
        "    for root, dirs, files in os.walk('/'):\n"
        "        dirs[:] = [d for d in dirs if root != '/' or d not in ('proc', 'sys', 'dev')]\n"
        "        if 'judge.py' in files:\n            return x + 1\n")
    out["read_host_processes"] = (  # a host process's argv or environment (run_corpus puts the secret there)
        f"import os\ndef f(x):\n    for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        f"        for name in ('cmdline', 'environ'):\n            try:\n"
        f"                if {SECRET!r}.encode() in open(f'/proc/{{pid}}/{{name}}', 'rb').read():\n"
        f"                    return x + 1\n            except OSError:\n                pass\n")
    out["write_own_modules"] = (  # the candidate's wire.py, shared by every later run
        "import os, sys\ndef f(x):\n    folder = os.path.dirname(sys.modules['wire'].__file__)\n"
        "    open(os.path.join(folder, 'wire.py'), 'a').write('#')\n    return x + 1\n")
    out["nested_user_namespace"] = (  # a new user namespace: root inside, more of the kernel in reach
        "import ctypes\ndef f(x):\n    libc = ctypes.CDLL(None, use_errno=True)\n"
        "    return x + 1 if libc.unshare(0x10000000) == 0 else None\n")
    out["network_namespace_escape"] = (  # any socket to the host's loopback (an abstract unix one too)
        "import socket\ndef f(x):\n    s = socket.socket(socket.AF_UNIX)\n"
        "    try:\n        s.connect('\\0magrpo-hostile')\n        return x + 1\n"
        "    except OSError:\n        return None\n")
    return out


# Two runs of one program, as an oracle would need: the second answers right only if the first left
# state behind for it (a SysV segment, a key in the user's keyring, a file in a shared /tmp or /dev/shm).
ORACLE = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
          "def remembered():\n"
          f"    seen = libc.shmget({SYSV_KEY}, 4096, 0o600) >= 0\n"
          f"    libc.shmget({SYSV_KEY}, 4096, 0o1000 | 0o600)\n"
          "    key = -1\n    if os.uname().machine == 'x86_64':  # keyctl(SEARCH) and add_key, the user keyring\n"
          "        key = libc.syscall(250, 10, -4, b'user', b'magrpo-hostile', 0)\n"
          "        libc.syscall(248, b'user', b'magrpo-hostile', b'x', 1, -4)\n"
          "    for path in ('/tmp/magrpo-hostile-oracle', '/dev/shm/magrpo-hostile-oracle'):\n"
          "        seen = seen or os.path.exists(path)\n"
          "        try:\n            open(path, 'w').write('x')\n        except OSError:\n            pass\n"
          "    return seen or key >= 0\n"
          "SEEN = remembered()  # at load: state from an earlier run, not from this run's own calls\n"
          "def f(x):\n    return x + 1 if SEEN else None\n")
STOP_ITERATION = ("def f(x):\n    raise StopIteration\n", ["assert all(map(candidate, [1, 2]))"])


# The audit's escape: ptrace the sandbox's PID 1 (bwrap's init: same uid, dumpable), make it run
# prctl(PR_SET_PDEATHSIG, 0) and setsid() (x86_64: two injected system calls), so that neither the
# kill of bwrap's process group nor bwrap's death reaches it; then start a daemon. Right answers only
# if PID 1 let itself be attached; the daemon (`sleep 100`) must not outlive the run either way.
PID1_HIJACK = """import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
Regs = ctypes.c_ulong * 27  # struct user_regs_struct: rax 10, rsi 13, rdi 14, orig_rax 15, rip 16
def inject(saved, number, *args):
    regs = Regs(*saved)
    regs[10], regs[15], regs[16] = number, 2 ** 64 - 1, saved[16] - 2  # PID 1 sits after wait4's `syscall`
    for index, value in zip((14, 13), args):
        regs[index] = value
    libc.ptrace(13, 1, None, ctypes.byref(regs))  # PTRACE_SETREGS
    libc.ptrace(9, 1, None, None)  # PTRACE_SINGLESTEP over the syscall instruction
    os.waitpid(1, 0x40000000)
def hijack():
    if libc.ptrace(16, 1, None, None) != 0:  # PTRACE_ATTACH
        return False
    os.waitpid(1, 0x40000000)  # __WALL
    if os.uname().machine == 'x86_64':
        saved = Regs()
        libc.ptrace(12, 1, None, ctypes.byref(saved))  # PTRACE_GETREGS
        inject(saved, 157, 1, 0)  # prctl(PR_SET_PDEATHSIG, 0)
        inject(saved, 112)  # setsid()
        libc.ptrace(13, 1, None, ctypes.byref(saved))
    libc.ptrace(17, 1, None, None)  # PTRACE_DETACH
    return True
HIJACKED = hijack()
subprocess.Popen(['sleep', '100'], start_new_session=True)
def f(x):
    return x + 1 if HIJACKED else None
"""


def denied(call: str) -> str:
    """A program whose answers are right only if `call` (ctypes, libc as `libc`) did not fail with EPERM."""
    return ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"def attempt():\n    {call}\n    return ctypes.get_errno()\n"
            "ERRNO = attempt()\ndef f(x):\n    return x + 1 if ERRNO != 1 else None\n")


LOCK = ("import fcntl, struct\n    fd = os.open(os.__file__, os.O_RDONLY)\n"
        "    lock = ctypes.create_string_buffer(struct.pack('hhqqi', fcntl.F_RDLCK, 0, 0, 0, 0), 32)\n")
# The system calls the filter denies, used as an attacker would (x86_64 numbers where libc has no
# wrapper); each program's answers are right only if its call was not refused with EPERM.
SYSCALL_PROBES = {
    "page_cache_fadvise": "fd = os.open('/usr/lib', os.O_RDONLY)\n    libc.posix_fadvise(fd, 0, 0, 4)\n"
                          "    return libc.posix_fadvise(fd, 0, 0, 4)  # DONTNEED; returns the error",
    "page_cache_preadv2": "fd = os.open(os.__file__, os.O_RDONLY)\n    buf = ctypes.create_string_buffer(4096)\n"
                          "    iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 4096)\n"
                          "    libc.syscall(327, fd, iov, 1, 0, 0, 8)  # preadv2(RWF_NOWAIT)",
    "page_cache_mincore": "fd = os.open(os.__file__, os.O_RDONLY)\n    libc.mmap.restype = ctypes.c_void_p\n"
                          "    address = libc.mmap(None, 4096, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED\n"
                          "    libc.mincore(ctypes.c_void_p(address), 4096, ctypes.create_string_buffer(1))",
    "page_cache_readahead": "fd = os.open(os.__file__, os.O_RDONLY)\n    libc.readahead(fd, 0, 4096)",
    "memfd": "libc.memfd_create(b'magrpo-hostile', 0)  # memory RLIMIT_AS does not count",
    "keyring": "libc.syscall(248, b'user', b'magrpo-hostile', b'x', 1, -4)  # add_key, the user keyring",
    "keyctl": "libc.syscall(250, 0, -3, 0)  # keyctl(GET_KEYRING_ID, the session keyring)",
    "flock_shared_file": "import fcntl\n    fd = os.open(os.__file__, os.O_RDONLY)\n"
                         "    libc.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)",
    "fcntl_lock_shared_file": LOCK + "    libc.fcntl(fd, fcntl.F_SETLK, lock)",
    "fcntl_ofd_lock_high_bits": LOCK + "    libc.syscall(72, fd, ctypes.c_ulong((1 << 32) | 37), lock)  # F_OFD_SETLK",
    "inotify_shared_file": "fd = libc.inotify_init1(0)\n    libc.inotify_add_watch(fd, os.__file__.encode(), 1)",
    "process_vm_readv": "buf = ctypes.create_string_buffer(8)\n"
                        "    iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)\n"
                        "    libc.process_vm_readv(1, iov, 1, iov, 1, 0)  # PID 1's memory",
    "io_uring": "params = ctypes.create_string_buffer(120)\n    libc.syscall(425, 4, params)  # io_uring_setup",
    "perf_event_open": "attr = ctypes.create_string_buffer(128)\n    libc.syscall(298, attr, 0, -1, -1, 0)",
    "bpf": "attr = ctypes.create_string_buffer(128)\n    libc.syscall(321, 0, attr, 128)",
    "userfaultfd": "libc.syscall(323, 1)  # UFFD_USER_MODE_ONLY: allowed unprivileged without the filter",
    "clear_own_parent_death_signal": "libc.prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG",
}


def corpus(target: Path, checkout: Path) -> dict[str, Program]:
    programs = {name: prog(code) for name, code in {**hostile_corpus(target), **readers(checkout)}.items()}
    programs["stop_iteration_through_map"] = prog(*STOP_ITERATION)
    programs["ptrace_pid1_then_daemon"] = prog(PID1_HIJACK)
    if os.uname().machine == "x86_64":  # the probes name x86_64 system call numbers
        programs.update({name: prog(denied(call)) for name, call in SYSCALL_PROBES.items()})
    return programs


def host_state() -> dict[str, set]:
    """What a run could leave on the host: SysV IPC objects, and named leftovers in /tmp and /dev/shm."""
    state: dict[str, set] = {}
    for kind in ("shm", "msg", "sem"):
        rows = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
        state[kind] = {tuple(row.split()[:2]) for row in rows}
    state["files"] = {str(p) for folder in ("/tmp", "/dev/shm", "/var/tmp") for p in Path(folder).glob("magrpo-*")
                      if not p.name.startswith(("magrpo-candidate-", "magrpo-judge-"))}
    return state


def leftovers(uids: range) -> list[str]:
    """Live processes a sandbox could have left: a candidate, `sleep 100`, anything of a sandbox uid."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        uid = int(status.split("\nUid:\t", 1)[1].split("\t", 1)[0])
        if "\nState:\tZ" not in status and (b"import candidate" in cmdline or cmdline == b"sleep\x00100\x00"
                                            or uid in uids) and int(pid) != os.getpid():
            found.append(f"{pid} uid={uid} {cmdline[:80]!r}")
    return found


def violations(results: dict, target: Path, mode: str) -> list[str]:
    """Every way the results break the sandbox's promises; [] when all held."""
    out = []

    def expect(ok: bool, what: str) -> None:
        if not ok:
            out.append(what)

    for name, r in results.items():
        expect(r.passed == 0, f"{name}: {r.passed} case(s) passed ({r.cases})")
        expect(r.duration_s < FAST.timeout_s + 2, f"{name}: took {r.duration_s:.1f} s")
        expect(len(r.stdout) <= FAST.output_bytes and len(r.stderr) <= FAST.output_bytes, f"{name}: output uncapped")
        expect(r.isolation == mode, f"{name}: isolation {r.isolation!r}")

    def error(name: str) -> str:
        return results[name].cases[0].error or ""

    expect(results["infinite_loop"].timed_out, "infinite_loop: not timed out")
    for name in ("os_exit_at_import", "os_exit_in_function", "c_stack_overflow"):
        expect(results[name].crashed, f"{name}: not reported as a crash")
    for name in ("fork_bomb", "setsid_escape", "kill_everything", "forge_report"):
        expect(not results[name].crashed, f"{name}: reported as a crash")
    for name in ("sys_exit_at_import", "sys_exit_in_function", "raise_system_exit", "raise_keyboard_interrupt"):
        kind = error(name).removeprefix("CandidateError: ").split(":")[0]
        expect(not results[name].crashed and kind in ("SystemExit", "KeyboardInterrupt"), f"{name}: {error(name)!r}")
    expect("BlockingIOError" in error("fork_bomb"), f"fork_bomb: RLIMIT_NPROC did not hold ({error('fork_bomb')!r})")
    for name in ("memory_bomb_bytes", "memory_bomb_list"):
        expect(all("MemoryError" in (c.error or "") for c in results[name].cases), f"{name}: {results[name].cases}")
    expect(results["print_50mb"].stdout.startswith("xxx") and not results["print_50mb"].timed_out, "print_50mb")
    expect("File too large" in error("fill_disk"), f"fill_disk: {error('fill_disk')!r}")
    if mode == "bwrap":  # unsafe: the program writes where its user may
        for name in ("fill_root", "fill_dev"):
            expect("Read-only file system" in error(name), f"{name}: {error(name)!r}")
    for name, kind in (("always_equal", "Yes"), ("truthy_comparison", "T"), ("raising_repr", "R"),
                       ("int_subclass", "I (a subclass of int)"), ("generator_return", "generator"),
                       ("function_return", "function")):
        expect(error(name) == f"f returned a value of type {kind}, which is not plain data", f"{name}: {error(name)!r}")
    expect("bytes (more than" in error("huge_return"), f"huge_return: {error('huge_return')!r}")
    expect(error("garbage_on_reply_channel").startswith("bad reply from the candidate"), "garbage_on_reply_channel")
    expect(error("stop_iteration_through_map") == "CandidateError: StopIteration", "stop_iteration_through_map")
    for name in ("read_dataset", "read_checkout", "read_site_packages"):
        expect("FileNotFoundError" in error(name), f"{name}: {error(name)!r}")
    expect(results["subprocess_sleep"].timed_out, "subprocess_sleep: not timed out")
    expect("hi" in results["os_system"].stdout, "os_system: no shell inside (the OS's programs are meant to work)")
    expect(not target.exists(), f"write_outside_workdir: {target} was written")
    return out


def run_corpus(mode: str, target: Path, checkout: Path) -> list[str]:
    """Runs the corpus (and the oracle, twice) in `mode`; the violations, host leftovers included."""
    limits = dataclasses.replace(FAST, mode=mode)
    isolation.check(mode)
    before = host_state()
    programs = corpus(target, checkout)
    # Bait on the host: a process with the secret in its argv, a listening abstract unix socket.
    bait = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", SECRET])
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind("\0magrpo-hostile")
        listener.listen()
        results = dict(zip(programs, run_many(list(programs.values()), limits, workers=2)))
    finally:
        bait.kill()
        bait.wait()
        listener.close()
    problems = violations(results, target, mode)
    for attempt in (1, 2):
        oracle = run_program(prog(ORACLE), limits)
        if oracle.passed:
            problems.append(f"oracle: run {attempt} found state an earlier run left ({oracle.cases})")
    deadline = time.monotonic() + 3  # SIGKILLed processes may take a moment to go
    uids = range(isolation.UID_BASE, isolation.UID_BASE + isolation.UID_SPAN)
    while leftovers(uids) and time.monotonic() < deadline:
        time.sleep(0.05)
    problems += [f"left running: {p}" for p in leftovers(uids)]
    after = host_state()
    problems += [f"left on the host ({kind}): {sorted(after[kind] - before[kind])}" for kind in after
                 if after[kind] - before[kind]]
    return problems


if __name__ == "__main__":  # python -m tests.hostile FOLDER [MODE]: the run as `nobody` (see test_sandbox.py)
    checkout = Path(__file__).resolve().parent.parent
    print(json.dumps(run_corpus(sys.argv[2] if len(sys.argv) > 2 else "bwrap", Path(sys.argv[1]) / "escaped.txt",
                                checkout)))
