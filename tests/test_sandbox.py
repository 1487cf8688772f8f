"""The code sandbox: scoring, definition failures, parallelism, and a corpus of hostile programs that
must all be contained (no case passes, no process left behind, the test process survives)."""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from magrpo.envs.code import sandbox
from magrpo.envs.code.sandbox import Program, SandboxLimits, run_many, run_program

ROOT = os.geteuid() == 0
FAST = SandboxLimits(timeout_s=2.0, cpu_s=2, memory_mb=512, max_processes=32, output_bytes=10_000)
CASES = ["assert candidate(1) == 2", "assert candidate(2) == 3"]
PROBE = Program("def f():\n    return 1\n", "", ["assert candidate() == 1"], "f")
NAMESPACES = run_program(PROBE).isolation == "namespaces"


def prog(code: str, cases: list[str] = CASES, preamble: str = "", entry_point: str = "f") -> Program:
    return Program(code=code, preamble=preamble, cases=cases, entry_point=entry_point)


def test_correct_program_passes_every_case():
    result = run_program(prog("def f(x):\n    return x + 1\n"), FAST)
    assert [c.passed for c in result.cases] == [True, True] and result.passed == 2 and result.fraction == 1.0
    assert not result.timed_out and not result.crashed


def test_wrong_program_fails_exactly_the_failing_cases():
    cases = ["assert candidate(1) == 2", "assert candidate(5) == 6, 'five'", "assert candidate(2) == 3"]
    result = run_program(prog("def f(x):\n    return 0 if x == 5 else x + 1\n", cases), FAST)
    assert [c.passed for c in result.cases] == [True, False, True]
    assert result.cases[1].error == "AssertionError: five" and result.fraction == pytest.approx(2 / 3)


def test_multiline_cases_preamble_and_candidate_binding():
    preamble = "import math\nTOL = 1e-9\ndef close(a, b):\n    return math.isclose(a, b, abs_tol=TOL)\n"
    cases = [
        "assert close(\n    candidate(2.0),\n    math.sqrt(2.0),\n)",
        "for x in (1, 4, 9):\n    assert close(candidate(x), x ** 0.5)",
        "assert list(map(candidate, [4.0])) == [2.0]",  # a proxy can be passed to a call
        "assert candidate is root",  # not through a proxy: refused, never guessed
    ]
    code = "from math import sqrt\ndef root(x):\n    print('computing', x)\n    return sqrt(x)\n"
    result = run_program(prog(code, cases, preamble, entry_point="root"), FAST)
    assert [c.passed for c in result.cases] == [True, True, True, False], result
    assert result.cases[3].error.startswith("unsupported case: `candidate` used other than by calling it")
    assert "computing 2.0" in result.stdout


@pytest.mark.parametrize("code, error", [
    ("def f(x)\n    return x + 1\n", "SyntaxError"),
    ("undefined_name + 1\ndef f(x):\n    return x + 1\n", "NameError"),
    ("def g(x):\n    return x + 1\n", "entry point 'f'"),
])
def test_definition_failure_fails_every_case(code, error):
    result = run_program(prog(code), FAST)
    assert result.passed == 0 and not result.crashed and not result.timed_out
    assert all(error in c.error for c in result.cases), result.cases


def test_cases_reported_before_a_crash_keep_their_result():
    code = "import os\ndef f(x):\n    if x == 2:\n        os._exit(1)\n    return x + 1\n"
    result = run_program(prog(code, CASES + ["assert candidate(3) == 4"]), FAST)
    assert result.crashed and [c.passed for c in result.cases] == [True, False, False]
    assert result.cases[1].error == "crashed: exit status 1"


def test_environment_and_workdir_are_private(monkeypatch):
    monkeypatch.setenv("MAGRPO_SANDBOX_SECRET", "hunter2")
    code = ("import os\ndef f(x):\n    print(os.getcwd())\n    open('magrpo-scratch.txt', 'w').write('ok')\n"
            "    return 'MAGRPO_SANDBOX_SECRET' not in os.environ\n")
    result = run_program(prog(code, ["assert candidate(0)"]), FAST)
    assert result.passed == 1, result
    workdir = Path(result.stdout.split()[0])
    if NAMESPACES:  # its own tmpfs /tmp, gone with it
        assert workdir == Path("/tmp") and not (workdir / "magrpo-scratch.txt").exists()
    else:
        assert workdir.name.startswith("magrpo-sandbox-") and not workdir.exists()


@pytest.mark.skipif(not ROOT, reason="the uid switch happens only when the trainer runs as root")
def test_root_runs_switch_uid_and_can_still_import():
    code = "import os, decimal, fractions, collections.abc, json\ndef f(x):\n    return os.getuid()\n"
    result = run_program(prog(code, ["assert candidate(0) >= 2_000_000_000"]), FAST)
    assert result.passed == 1, result


@pytest.mark.skipif(not ROOT, reason="the uid switch happens only when the trainer runs as root")
def test_refuses_to_run_as_root_when_the_uid_switch_fails(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox, "_acquire_uid", lambda: 2 ** 32 - 1)  # (uid_t)-1: setresuid changes nothing
    target = tmp_path / "ran.txt"
    with pytest.raises(RuntimeError, match="sandbox setup failed"):
        run_program(prog(f"open({str(target)!r}, 'w').write('as root')\ndef f(x):\n    return x + 1\n"), FAST)
    assert not target.exists()


def test_run_many_keeps_order_and_runs_in_parallel():
    sleepy = "import time\ndef f(x):\n    time.sleep(1)\n    return x + {}\n"
    programs = [prog(sleepy.format(i), [f"assert candidate(1) == {1 + i}"]) for i in range(4)]
    programs.append(prog("def f(x):\n    return 0\n", ["assert candidate(1) == 1"]))
    began = time.monotonic()
    results = run_many(programs, FAST, workers=2)
    assert time.monotonic() - began < 3.5
    assert [r.passed for r in results] == [1, 1, 1, 1, 0]


# Walks the frames up from `frame`: where the grader keeps its token and report fd, writes a pass
# line for every case and a done line (what the old in-process runner read as its verdict).
FORGE_FROM_FRAME = ("    loc = frame.f_locals\n    if 'token' in loc and 'fd' in loc:\n"
                    "        tok, fd = loc['token'], loc['fd']\n        for i in range(len(loc['cases'])):\n"
                    "            os.write(fd, tok + b' case %d 1 \\n' % i)\n        os.write(fd, tok + b' done \\n')\n"
                    "        break\n    frame = frame.f_back\n")


def hostile_corpus(target: Path) -> dict[str, tuple[str, bool]]:
    """name -> (code, needs root). Each `f` returns the right answer only if its attack did not stop it,
    or a wrong one where the attack itself is the point (forging, escaping, flooding)."""
    ok = "    return x + 1\n"
    forged = '{"cases": [{"passed": true}, {"passed": true}], "done": true}'
    return {
        "infinite_loop": ("def f(x):\n    while True:\n        pass\n", False),
        "fork_bomb": ("import os\ndef f(x):\n    while True:\n        os.fork()\n" + ok, False),
        "fork_bomb_spinning": ("import os\ndef f(x):\n    while True:\n        try:\n            os.fork()\n"
                               "        except OSError:\n            pass\n", False),
        "memory_bomb_bytes": ("def f(x):\n    blob = bytearray(10 * 1024 ** 3)\n" + ok, False),
        "memory_bomb_list": ("def f(x):\n    big = [0] * (10 ** 10)\n" + ok, False),
        "deep_recursion": ("import sys\nsys.setrecursionlimit(10 ** 6)\ndef g(n):\n    return g(n + 1) + 1\n"
                           "def f(x):\n    return g(0)\n", False),
        "c_stack_overflow": ("import sys\nsys.setrecursionlimit(10 ** 6)\ndef g(n):\n    return list(map(g, [n]))\n"
                             "def f(x):\n    return g(0)\n", False),
        "os_system": ("import os\ndef f(x):\n    os.system('echo hi')\n    return None\n", False),
        "subprocess_sleep": ("import subprocess\ndef f(x):\n    subprocess.run(['sleep', '100'])\n" + ok, False),
        "background_sleep": ("import subprocess\ndef f(x):\n    subprocess.Popen(['sleep', '100'])\n    return None\n",
                             False),
        "setsid_escape": ("import os, time\ndef f(x):\n    if os.fork() == 0:\n        os.setsid()\n"
                          "        time.sleep(100)\n    return None\n", True),
        "setsid_escape_then_crash": ("import os, time\ndef f(x):\n    if os.fork() == 0:\n        os.setsid()\n"
                                     "        time.sleep(100)\n    os._exit(0)\n", True),
        "daemon_ignoring_sigterm": ("import os, signal, time\ndef f(x):\n    if os.fork() == 0:\n"
                                    "        os.setsid()\n        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                    "        if os.fork() == 0:\n"
                                    "            time.sleep(100)\n        os._exit(0)\n    return None\n", True),
        "sys_exit_at_import": ("import sys\nsys.exit(0)\ndef f(x):\n" + ok, False),
        "os_exit_at_import": ("import os\nos._exit(0)\ndef f(x):\n" + ok, False),
        "sys_exit_in_function": ("import sys\ndef f(x):\n    sys.exit(0)\n", False),
        "os_exit_in_function": ("import os\ndef f(x):\n    os._exit(0)\n", False),
        "raise_system_exit": ("def f(x):\n    raise SystemExit\n", False),
        "raise_keyboard_interrupt": ("def f(x):\n    raise KeyboardInterrupt\n", False),
        "write_outside_workdir": (f"def f(x):\n    open({str(target)!r}, 'w').write('escaped')\n" + ok, True),
        "fill_disk": ("def f(x):\n    open('big.bin', 'wb').write(b'0' * (64 * 1024 ** 2))\n" + ok, False),
        "socket_to_localhost": ("import socket\ndef f(x):\n    s = socket.socket()\n    s.connect(('127.0.0.1', 22))\n"
                                "    s.recv(1)\n    return None\n", False),
        "print_50mb": ("def f(x):\n    print('x' * 50_000_000)\n    return None\n", False),
        "kill_parent": ("import os, signal\ndef f(x):\n    os.kill(os.getppid(), signal.SIGKILL)\n    return None\n",
                        True),
        "kill_everything": ("import os, signal\ndef f(x):\n    os.kill(-1, signal.SIGKILL)\n    return None\n", True),
        "forge_report": ("import os\ndef f(x):\n    print(%r)\n    for fd in range(0, 64):\n        try:\n"
                         "            os.write(fd, b'case 0 1\\ncase 1 1\\ndone\\n' + %r.encode() + b'\\n')\n"
                         "        except OSError:\n            pass\n    return None\n" % (forged, forged), False),
        "patch_builtins": ("import builtins\nbuiltins.exec = lambda *a, **k: None\n"
                           "builtins.compile = lambda *a, **k: None\n"
                           "builtins.enumerate = lambda xs, start=0: [(i, 'pass') for i in range(len(xs))]\n"
                           "def f(x):\n    return None\n", False),
        "close_all_fds": ("import os\ndef f(x):\n    os.closerange(3, 1024)\n" + ok, False),
        # --- the grader's own channel, state and code, reached from inside the graded process
        "forge_via_frames": ("import os, sys\nframe = sys._getframe()\nwhile frame is not None:\n" + FORGE_FROM_FRAME
                             + "def f(x):\n    return None\n", False),
        "forge_via_gc": ("import gc, os\nfor o in gc.get_objects():\n    if isinstance(o, dict) and 'report_fd' in o:\n"
                         "        tok, fd = o['token'].encode(), o['report_fd']\n"
                         "        for i in range(len(o['cases'])):\n"
                         "            os.write(fd, tok + b' case %d 1 \\n' % i)\n"
                         "        os.write(fd, tok + b' done \\n')\ndef f(x):\n    return None\n", False),
        "forge_via_sys_current_frames": ("import os, sys\nframe = list(sys._current_frames().values())[0]\n"
                                         "while frame is not None:\n" + FORGE_FROM_FRAME
                                         + "def f(x):\n    return None\n", False),
        "forge_into_every_fd": ("import gc, os\ntok = [o['token'] for o in gc.get_objects() if isinstance(o, dict) and "
                                "'token' in o][:1]\nline = ((tok[0] if tok else 'x') + ' case 0 1 \\n').encode()\n"
                                "for fd in range(3, 256):\n    try:\n        os.write(fd, line * 2)\n"
                                "    except OSError:\n        pass\ndef f(x):\n    return None\n", False),
        "mutate_cases_default_arg": ("import sys\ndef f(x, _=sys._getframe(1).f_locals['cases'].__setitem__(\n"
                                     "        slice(None), ['pass'] * len(sys._getframe(1).f_locals['cases']))):\n"
                                     "    return None\n", False),
        "bytecode_peek": ("import sys\ndef f(x):\n    consts = sys._getframe(1).f_code.co_consts\n"
                          "    ints = [c for c in consts if type(c) is int and c != x]\n"
                          "    return ints[-1] if ints else None\n", False),
        "always_equal": ("class Yes:\n    def __eq__(self, other):\n        return True\n"
                         "    def __ne__(self, other):\n        return False\n    __hash__ = object.__hash__\n"
                         "def f(x):\n    return Yes()\n", False),
        "truthy_comparison": ("class T:\n    def __eq__(self, other):\n        return [1]\n"
                              "def f(x):\n    return T()\n", False),
        "int_subclass": ("class I(int):\n    def __eq__(self, other):\n        return True\n"
                         "    __hash__ = int.__hash__\ndef f(x):\n    return I(0)\n", False),
        "raising_repr": ("class R:\n    def __eq__(self, other):\n        return True\n"
                         "    def __repr__(self):\n        raise RuntimeError('no repr')\n"
                         "def f(x):\n    return R()\n", False),
        "generator_return": ("def f(x):\n    yield x + 1\n", False),
        "function_return": ("def f(x):\n    return lambda *a: x + 1\n", False),
        "huge_return": ("def f(x):\n    return 'x' * (40 * 2 ** 20)\n", False),
        "garbage_on_reply_channel": ("import os, sys\ndef f(x):\n    fd = sys._getframe(1).f_locals.get('reply_fd')\n"
                                     "    if fd is not None:\n"
                                     "        os.write(fd, b'\\xff\\xff\\xff\\xff' + b'x' * 64)\n"
                                     "    return None\n", False),
        "tmp_leftovers": ("import os\ndef f(x):\n    open('/tmp/magrpo-hostile-leftover', 'w').write('x')\n"
                          "    os.makedirs('/dev/shm/magrpo-hostile-leftover', exist_ok=True)\n"
                          "    return None\n", True),
    }


def test_a_reply_that_is_not_utf8_fails_the_case_even_under_except_valueerror():
    """The candidate writes one well-framed message of bytes that are not UTF-8 on its reply channel.
    Its decode error was a UnicodeDecodeError, a ValueError: the test's own `except ValueError` caught
    it and the case passed. Now the call fails, whatever the test catches."""
    code = ("import os, sys\ndef f(x):\n    fd = sys._getframe(1).f_locals['reply_fd']\n"
            "    os.write(fd, (2).to_bytes(4, 'big') + b'\\xff\\xfe')\n    return x + 1\n")
    cases = ["try:\n    candidate(1)\nexcept ValueError:\n    pass", "assert candidate(2) == 3"]
    result = run_program(prog(code, cases), FAST)
    assert [c.passed for c in result.cases] == [False, False]
    assert "bad reply from the candidate" in (result.cases[0].error or "")


def test_a_reply_just_under_the_size_cap_cannot_take_the_judges_memory():
    """A 14 MB list literal (under the 16 MB reply cap) becomes millions of objects when the judge decodes
    it: the audit saw 1.9 GB in the judge's child. The child now has the candidate's memory limit, so the
    decode fails with MemoryError and the call fails. (Without it the judge was still decoding at the
    20 s timeout.) The program writes the frame itself: cheap for it, whatever its own memory limit."""
    code = ("import os, sys\ndef f(x):\n    fd = sys._getframe(1).f_locals['reply_fd']\n"
            "    body = b'[' + b'0,' * 7_000_000 + b']'\n"
            "    view = memoryview(len(body).to_bytes(4, 'big') + body)\n"
            "    while view:\n        view = view[os.write(fd, view):]\n    return x + 1\n")
    result = run_program(prog(code), dataclasses.replace(FAST, timeout_s=20))
    assert result.passed == 0
    assert "MemoryError" in (result.cases[0].error or ""), result.cases[0]


SYSV_KEY = 0x6D616772  # "magr"
# Returns the right answer only when it could create a SysV segment that outlives it (IPC_CREAT | 0600).
SYSV_SEGMENT = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                f"def f(x):\n    shmid = libc.shmget({SYSV_KEY}, 4096, 0o1000 | 0o600)\n"
                "    return x + 1 if shmid >= 0 else None\n")


def sysv_segments(key: int) -> list[int]:
    """The host's SysV shared-memory ids with `key` (/proc/sysvipc/shm: key, shmid, ...)."""
    rows = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return [int(row.split()[1]) for row in rows if int(row.split()[0]) == key]


def remove_segments(key: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for shmid in sysv_segments(key):
        libc.shmctl(shmid, 0, None)  # IPC_RMID


def test_a_sysv_segment_dies_with_the_namespaces_run():
    """SysV IPC objects outlive processes: without an IPC namespace a program kept state across runs (an
    oracle over the judge's calls) and pinned memory no process owned. In the namespaces mode the
    segment now dies with the run. (uid and rlimits modes cannot make an IPC namespace: issue 29's
    bubblewrap engine is what closes it there.)"""
    if not NAMESPACES:
        pytest.skip("the namespaces mode is not available here (needs root with CAP_SYS_ADMIN)")
    remove_segments(SYSV_KEY)
    try:
        result = run_program(prog(SYSV_SEGMENT), FAST)
        assert result.isolation == "namespaces" and result.passed == 2  # the segment was made, inside
        assert sysv_segments(SYSV_KEY) == []
    finally:
        remove_segments(SYSV_KEY)


STOP_ITERATION = ("def f(x):\n    raise StopIteration\n", ["assert all(map(candidate, [1, 2]))"])


def _readers() -> dict[str, str]:
    """Programs that can answer only if they can read what must be hidden: the dataset, the checkout,
    the trainer's site-packages."""
    here = Path(__file__).resolve().parent.parent
    site = next(p for p in __import__("sys").path if p.endswith("site-packages"))
    paths = {"read_dataset": here / "envs" / "code" / "data" / "HumanEval.jsonl.gz",
             "read_checkout": here / "magrpo" / "trainer.py", "read_site_packages": Path(site)}
    return {name: (f"import os\ndef f(x):\n    p = {str(path)!r}\n"
                   f"    (os.listdir(p) if os.path.isdir(p) else open(p, 'rb').read(1))\n" + "    return x + 1\n")
            for name, path in paths.items()}


def leftovers() -> list[str]:
    """Live processes a sandbox could have left: runner copies, `sleep 100`, anything of a sandbox uid."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        uid = int(status.split("\nUid:\t", 1)[1].split("\t", 1)[0])
        if "\nState:\tZ" not in status and (b"--run-job" in cmdline or cmdline == b"sleep\x00100\x00"
                                            or uid >= sandbox.UID_BASE):
            found.append(f"{pid} uid={uid} {cmdline!r}")
    return found


@pytest.mark.slow  # 47 programs, each run to its limits
@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "no-namespaces"])
def test_hostile_programs_are_contained(tmp_path, namespaces):
    if not namespaces and not (ROOT and NAMESPACES):
        pytest.skip("the fallback differs from the default only where namespaces can be made")
    limits = dataclasses.replace(FAST, namespaces=namespaces)
    hidden = NAMESPACES and namespaces
    target = tmp_path / "escaped.txt"
    corpus = {name: prog(code) for name, (code, needs_root) in hostile_corpus(target).items() if ROOT or not needs_root}
    if hidden:  # only where the sandbox makes its own mount namespace
        corpus.update({name: prog(code) for name, code in _readers().items()})
    corpus["stop_iteration_through_map"] = prog(*STOP_ITERATION)
    assert len(corpus) >= (30 if ROOT else 14)
    began = time.monotonic()
    results = dict(zip(corpus, run_many(list(corpus.values()), limits, workers=2)))
    assert {r.isolation for r in results.values()} == {"namespaces" if hidden else "uid" if ROOT else "rlimits"}
    for name, result in results.items():
        assert result.passed == 0, (name, result)
        assert result.duration_s < FAST.timeout_s + 2, (name, result.duration_s)
        assert len(result.stdout) <= FAST.output_bytes and len(result.stderr) <= FAST.output_bytes, name
    assert results["infinite_loop"].timed_out
    assert all(results[n].crashed for n in ("os_exit_at_import", "os_exit_in_function", "c_stack_overflow"))
    assert not any(results[n].crashed for n in ("fork_bomb", "setsid_escape", "kill_everything", "forge_report")
                   if n in results)
    for name in ("sys_exit_at_import", "sys_exit_in_function", "raise_system_exit", "raise_keyboard_interrupt"):
        assert not results[name].crashed
        error = results[name].cases[0].error  # in a call: re-raised in the judge as CandidateError
        assert error.removeprefix("CandidateError: ").split(":")[0] in ("SystemExit", "KeyboardInterrupt"), name
    assert "BlockingIOError" in results["fork_bomb"].cases[0].error  # RLIMIT_NPROC held, even as root
    assert all("MemoryError" in c.error for n in ("memory_bomb_bytes", "memory_bomb_list") for c in results[n].cases)
    assert results["print_50mb"].stdout.startswith("xxx") and not results["print_50mb"].timed_out
    assert "File too large" in results["fill_disk"].cases[0].error
    # Values that are not plain data fail with a message saying so; they never reach a comparison.
    for name, kind in (("always_equal", "Yes"), ("truthy_comparison", "T"), ("raising_repr", "R"),
                       ("int_subclass", "I (a subclass of int)"), ("generator_return", "generator"),
                       ("function_return", "function")):
        assert results[name].cases[0].error == f"f returned a value of type {kind}, which is not plain data", name
    assert "bytes (more than" in results["huge_return"].cases[0].error
    assert results["garbage_on_reply_channel"].cases[0].error.startswith("bad reply from the candidate")
    assert results["stop_iteration_through_map"].cases[0].error == "CandidateError: StopIteration"
    if hidden:
        for name in _readers():
            assert "FileNotFoundError" in results[name].cases[0].error, (name, results[name].cases[0])
    if ROOT:  # not root, all runs share the trainer's uid and its process budget: they cannot fork here
        assert results["subprocess_sleep"].timed_out and "hi" in results["os_system"].stdout
        assert not target.exists()
        assert not Path("/tmp/magrpo-hostile-leftover").exists()
        assert not Path("/dev/shm/magrpo-hostile-leftover").exists()
    deadline = time.monotonic() + 3  # SIGKILLed processes may take a moment to go
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftovers() == []
    os.kill(os.getpid(), 0)  # still here
    assert time.monotonic() - began < 40
