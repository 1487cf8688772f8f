"""The code sandbox: scoring, definition failures, parallelism, and a corpus of hostile programs that
must all be contained (no case passes, no process left behind, the test process survives)."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from magrpo import lifeline
from magrpo.envs.code import cgroups, isolation, syscalls
from magrpo.envs.code.sandbox import run_many, run_program
from magrpo.envs.code.script import run_script
from tests import hostile, nobody
from tests.daemons import after_sigkill
from tests.hostile import CASES, FAST, prog

# It counts the host's processes, /tmp entries or SysV objects: it runs alone (.ci/run, docs/testing.md).
pytestmark = pytest.mark.alone

ROOT = os.geteuid() == 0
CHECKOUT = Path(__file__).resolve().parent.parent


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


@pytest.mark.parametrize("mode", isolation.MODES)
def test_environment_and_workdir_are_private(monkeypatch, mode):
    monkeypatch.setenv("MAGRPO_SANDBOX_SECRET", "hunter2")
    code = ("import os\ndef f(x):\n    print(os.getcwd())\n    open('magrpo-scratch.txt', 'w').write('ok')\n"
            "    return 'MAGRPO_SANDBOX_SECRET' not in os.environ\n")
    result = run_program(prog(code, ["assert candidate(0)"]), dataclasses.replace(FAST, mode=mode))
    assert result.passed == 1 and result.isolation == mode, result
    workdir = Path(result.stdout.split()[0])
    if mode == "bwrap":  # its own tmpfs /tmp, gone with it
        assert workdir == Path("/tmp") and not (workdir / "magrpo-scratch.txt").exists()
    else:
        assert workdir.name.startswith("magrpo-sandbox-") and not workdir.exists()


@pytest.mark.skipif(not ROOT, reason="bwrap runs under a uid of its own only when the trainer is root")
def test_root_runs_bwrap_under_a_uid_of_its_own_and_can_still_import():
    code = "import os, decimal, fractions, collections.abc, json\ndef f(x):\n    return os.getuid()\n"
    result = run_program(prog(code, [f"assert candidate(0) >= {isolation.UID_BASE}"]), FAST)
    assert result.passed == 1, result


@pytest.mark.skipif(not ROOT, reason="bwrap runs under a uid of its own only when the trainer is root")
def test_refuses_to_run_as_root_when_the_uid_switch_fails(monkeypatch, tmp_path):
    monkeypatch.setattr(isolation, "acquire_uid", lambda: 2 ** 32 - 1)  # (uid_t)-1: setresuid changes nothing
    target = tmp_path / "ran.txt"
    with pytest.raises(ValueError, match="uid"):
        run_program(prog(f"open({str(target)!r}, 'w').write('as root')\ndef f(x):\n    return x + 1\n"), FAST)
    assert not target.exists()


def test_a_sandbox_that_cannot_start_is_the_trainers_fault_not_a_score_of_zero(monkeypatch):
    """bwrap failing before the program exists (here a flag it does not know; on a machine, e.g. out of
    user namespaces) raised nothing before: every case 'crashed' and the program scored as wrong."""
    command = isolation.bwrap_command
    monkeypatch.setattr(isolation, "bwrap_command", lambda *a, **k: [*command(*a, **k)[:-1], "--no-such-flag", "--"])
    with pytest.raises(RuntimeError, match="sandbox setup failed, nothing was run: bwrap: Unknown option"):
        run_program(prog("def f(x):\n    return x + 1\n"), FAST)


def test_run_many_keeps_order_and_runs_in_parallel():
    sleepy = "import time\ndef f(x):\n    time.sleep(1)\n    return x + {}\n"
    programs = [prog(sleepy.format(i), [f"assert candidate(1) == {1 + i}"]) for i in range(4)]
    programs.append(prog("def f(x):\n    return 0\n", ["assert candidate(1) == 1"]))
    began = time.monotonic()
    results = run_many(programs, FAST, workers=2)
    assert time.monotonic() - began < 3.5
    assert [r.passed for r in results] == [1, 1, 1, 1, 0]


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


def test_a_sysv_segment_dies_with_the_run():
    """SysV IPC objects outlive processes: without an IPC namespace a program kept state across runs (an
    oracle over the judge's calls) and pinned memory no process owned. In bwrap's IPC namespace the
    segment is made, and dies with the run."""
    made = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"def f(x):\n    return x + 1 if libc.shmget({hostile.SYSV_KEY}, 4096, 0o1000 | 0o600) >= 0 else None\n")
    before = hostile.host_state()["shm"]
    result = run_program(prog(made), FAST)
    assert result.isolation == "bwrap" and result.passed == 2  # the segment was made, inside
    assert hostile.host_state()["shm"] == before


@pytest.mark.slow  # ~75 programs, each run to its limits
def test_hostile_programs_are_contained(tmp_path):
    """The whole corpus in the default mode, as this process's user: tests/hostile.py lists what must hold."""
    assert hostile.run_corpus("bwrap", tmp_path / "escaped.txt", CHECKOUT) == []
    os.kill(os.getpid(), 0)  # still here


def test_without_libseccomp_bwrap_mode_is_refused_at_start_up_with_what_to_install(monkeypatch):
    """No filter, no sandbox: the policy is the attacker (it ptraced PID 1 when there was none)."""
    monkeypatch.setitem(sys.modules, "pyseccomp", None)  # `import pyseccomp` raises ImportError
    syscalls.program.cache_clear()
    isolation.check.cache_clear()
    try:
        with pytest.raises(isolation.SandboxUnavailable, match="needs libseccomp .*; pip install pyseccomp"):
            isolation.check("bwrap")
        isolation.check("unsafe")  # the explicit opt-out still starts
    finally:
        syscalls.program.cache_clear()
        isolation.check.cache_clear()


def _without_the_filter(monkeypatch) -> None:
    """bwrap as before the syscall filter (it gets no --seccomp): for the tests that show a hole."""
    command = isolation.bwrap_command
    monkeypatch.setattr(isolation, "bwrap_command", lambda *a, seccomp_fd=None, **k: command(*a, **k))


def _wait_for_no_leftovers(seconds: float) -> list[str]:
    uids = range(isolation.UID_BASE, isolation.UID_BASE + isolation.UID_SPAN)
    deadline = time.monotonic() + seconds  # SIGKILLed processes may take a moment to go
    while hostile.leftovers(uids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return hostile.leftovers(uids)


# The deny list's calls as the sandbox sees them: (name, number, argument 1) called with -1 first (a bad
# fd, pid, flag or pointer: nothing happens where the call is allowed), the rest 0.
def _surface() -> list[tuple[str, int, int]]:
    import pyseccomp

    calls = [(name, number, 0) for name in syscalls.DENIED
             if (number := syscalls._number(pyseccomp, name)) is not None]
    fcntl = syscalls._number(pyseccomp, "fcntl")
    calls += [(f"fcntl {name}", fcntl, command) for name, command in syscalls.FCNTL_DENIED.items()]
    calls += [(f"fcntl {name} with high bits", fcntl, (1 << 32) | command)
              for name, command in syscalls.FCNTL_DENIED.items()]
    return calls


SURFACE_PROBE = """import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}
for name, number, second in CALLS:
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(number), ctypes.c_long(-1), ctypes.c_ulong(second), *[ctypes.c_long(0)] * 4)
    out[name] = ctypes.get_errno() if result == -1 else 0
ctypes.set_errno(0)
out["prctl PR_SET_PDEATHSIG"] = ctypes.get_errno() if libc.prctl(1, 0, 0, 0, 0) == -1 else 0
out["allowed: fcntl F_GETFD"] = ctypes.get_errno() if libc.fcntl(1, 1) == -1 else 0
out["allowed: prctl PR_GET_PDEATHSIG"] = ctypes.get_errno() if libc.prctl(2, ctypes.byref(ctypes.c_int())) == -1 else 0
print(json.dumps(out))
"""


def _probe_surface() -> dict[str, int]:
    result = run_script(f"CALLS = {_surface()!r}\n{SURFACE_PROBE}", FAST)
    assert result.returncode == 0, result
    return json.loads(result.stdout)


def test_every_call_of_the_deny_list_is_refused_inside_the_sandbox():
    """Each call of syscalls.DENIED that this architecture has, fcntl's lock commands (with high bits
    set too: the kernel reads a 32-bit command) and prctl(PR_SET_PDEATHSIG) fail with EPERM inside;
    the rest of fcntl and prctl works. Without the filter most of them fail otherwise (EBADF, EINVAL,
    EFAULT) or succeed: test_the_surface_probe_sees_the_calls_without_the_filter."""
    errors = _probe_surface()
    assert {name: error for name, error in errors.items() if not name.startswith("allowed")} == \
        dict.fromkeys([name for name in errors if not name.startswith("allowed")], 1)
    assert errors["allowed: fcntl F_GETFD"] == 0 and errors["allowed: prctl PR_GET_PDEATHSIG"] == 0
    assert len(errors) > 60


def test_the_surface_probe_sees_the_calls_without_the_filter(monkeypatch):
    """The probe above is no tautology: without --seccomp, the calls that need no privilege answer
    something other than EPERM."""
    _without_the_filter(monkeypatch)
    errors = _probe_surface()
    for name in ("ptrace", "process_vm_readv", "keyctl", "flock", "fadvise64", "mincore", "preadv2",
                 "io_uring_setup", "fcntl F_SETLK", "fcntl F_OFD_SETLK with high bits", "prctl PR_SET_PDEATHSIG"):
        assert errors[name] != 1, (name, errors)


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the hijack injects x86_64 system calls")
@pytest.mark.parametrize("via", ["run_program", "run_python"])
def test_a_pid1_that_ignores_its_parents_death_is_killed_from_outside(monkeypatch, via):
    """The audit's program ptraced the sandbox's PID 1, cleared its parent-death signal and moved it to
    a session of its own: killing bwrap's process group then left PID 1 and a daemon running past the
    run. The filter now refuses ptrace; here it is left out, so the hijack works, and the driver's own
    kill of PID 1 (a pidfd of bwrap's --info-fd child-pid) must still take the daemon with it."""
    _without_the_filter(monkeypatch)
    if via == "run_program":  # score() and run_tests
        result = run_program(prog(hostile.PID1_HIJACK), FAST)
        assert result.passed == 2, result  # PID 1 was attached: the attack ran
    else:  # the run_python tool
        result = run_script(hostile.PID1_HIJACK + "print(HIJACKED)\n", FAST)
        assert result.stdout == "True\n", result
    assert _wait_for_no_leftovers(3) == []


TRAINER = """import sys, time
from magrpo.envs.code.sandbox import run_program
from tests.hostile import FAST, PID1_HIJACK, prog
if sys.argv[1] == "unfiltered":
    from magrpo.envs.code import isolation
    command = isolation.bwrap_command
    isolation.bwrap_command = lambda *a, seccomp_fd=None, **k: command(*a, **k)
run_program(prog(PID1_HIJACK + "__import__('time').sleep(100)\\n", ["assert candidate(1)"]),
            FAST.__class__(timeout_s=100, cpu_s=100))
"""


def test_nothing_of_a_sandbox_outlives_a_killed_trainer():
    """The trainer dies (SIGKILL) while a program that tried the PID 1 hijack and started a daemon is
    still loading: bwrap, its PID 1 and so every process inside die with it (--die-with-parent), since
    the filter refuses the ptrace. (Without the filter the hijacked PID 1 and the daemon outlived the
    trainer: checked by hand when the filter came, see the commit.)"""
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, "filtered"], cwd=CHECKOUT, stdin=subprocess.DEVNULL)
    uids = range(isolation.UID_BASE, isolation.UID_BASE + isolation.UID_SPAN)
    try:
        deadline = time.monotonic() + 30
        while not any("sleep" in line for line in hostile.leftovers(uids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert trainer.poll() is None, "the trainer ended before its sandbox started the daemon"
    finally:
        trainer.kill()
        trainer.wait()
    left = _wait_for_no_leftovers(3)
    for line in left:  # never leave them for the next test
        os.kill(int(line.split()[0]), 9)
    assert left == []
    cgroups.sweep()  # what the next trainer does at start-up: the killed one's groups go
    assert not list(Path(cgroups.CGROUP_ROOT).glob(f"*/**/{cgroups.PREFIX}{trainer.pid}-*"))


# A trainer whose judge is busy in a slow test preamble (the candidate only defines `f`) when it dies.
SLOW_JUDGE = """from magrpo.envs.code.sandbox import run_program
from tests.hostile import FAST, prog
run_program(prog("def f(x):\\n    return x\\n", ["assert candidate(1) == 1"], "import time\\ntime.sleep(100)\\n"),
            FAST.__class__(timeout_s=100, cpu_s=100))
"""


def test_a_busy_judge_dies_with_a_trainer_killed_by_sigkill():
    """A judge ends at EOF on its socket, but one busy in a slow preamble or case outlived a trainer killed
    by SIGKILL for up to the program's timeout (issue 44). Under its lifeline supervisor it dies at once."""
    # Its own TMPDIR: the private copies a SIGKILLed trainer cannot remove at exit are removed here.
    tmp = tempfile.mkdtemp(prefix="magrpo-killed-trainer-")
    os.chmod(tmp, 0o755)  # the sandbox's uid reads the candidate's copy in it
    trainer = subprocess.Popen([sys.executable, "-c", SLOW_JUDGE], cwd=CHECKOUT, stdin=subprocess.DEVNULL,
                               env={**os.environ, "TMPDIR": tmp})
    judges: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while len(judges) < 2 and time.monotonic() < deadline:  # the warm judge and its child for the program
            time.sleep(0.05)
            # (not its supervisor, whose argv holds the judge's: counting it passed or failed by timing)
            judges = [p for p in lifeline.descendants(trainer.pid)
                      if b"import judge" in (line := _cmdline(p)) and b"lifeline.py" not in line]
        assert len(judges) == 2 and trainer.poll() is None, "the judge did not start on the program"
    finally:
        left = after_sigkill(trainer, judges, 3)
        isolation.remove(tmp)
    assert left == []


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def private_copies(uid: int) -> list[Path]:
    """The judge's and the candidate's private module folders in /tmp that `uid` owns."""
    return [p for p in Path(tempfile.gettempdir()).glob("magrpo-*")
            if p.name.startswith(("magrpo-judge-", "magrpo-candidate-")) and p.stat().st_uid == uid]


@pytest.mark.slow
def test_hostile_programs_are_contained_for_an_unprivileged_trainer():
    """The same corpus with the trainer as `nobody`: bwrap unprivileged, in user namespaces it makes itself.
    The real code path (the checkout, the venv's Python and packages) as `nobody`, through tests/nobody.py.
    Then, with no bwrap on its PATH, `nobody` is refused at the start-up check."""
    if reason := nobody.unavailable():
        pytest.skip(reason)
    for stale in private_copies(nobody.NOBODY):  # left by runs before the fix: they would hide nothing, but count
        shutil.rmtree(stale)
    folder = Path(tempfile.mkdtemp(prefix="magrpo-unprivileged-"))  # the corpus's target file is written (or not) here
    os.chown(folder, nobody.NOBODY, nobody.NOBODY)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(folder), "TMPDIR": "/tmp"}
    try:
        done = subprocess.run(nobody.command([sys.executable, "-m", "tests.hostile", str(folder)], [str(CHECKOUT)]),
                              cwd=CHECKOUT, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout.splitlines()[-1]) == []
        assert hostile.leftovers(range(nobody.NOBODY, nobody.NOBODY + 1)) == []
        assert private_copies(nobody.NOBODY) == []  # the judge's and candidate's read-only copies are removed at exit
        # Without bubblewrap, the same user gets the start-up refusal (the env turns it into env.sandbox's line)
        check = "from magrpo.envs.code import isolation; isolation.check('bwrap')"
        refused = subprocess.run(nobody.command([sys.executable, "-c", check], [str(CHECKOUT)]), cwd=CHECKOUT,
                                 capture_output=True, text=True, timeout=60, env={**env, "PATH": str(folder)})
        assert refused.returncode == 1
        assert "SandboxUnavailable: bubblewrap (bwrap) is not installed" in refused.stderr, refused.stderr
        assert "env.sandbox=unsafe" in refused.stderr
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_an_older_bwrap_gets_only_the_flags_it_knows(monkeypatch):
    """--size and --disable-userns came with bwrap 0.8; Ubuntu 22.04 ships 0.6.1, which would refuse
    every sandbox if given them."""
    path, version = isolation.bwrap()
    full = isolation.bwrap_command("/lib", 40)
    assert "--disable-userns" in full and "--size" in full
    monkeypatch.setattr(isolation, "bwrap", lambda: (path, (0, 6, 1)))
    old = isolation.bwrap_command("/lib", 40)
    assert "--disable-userns" not in old and "--size" not in old
    assert [a for a in full if a not in ("--disable-userns", "--size", str(40 << 20))] == old


# ---- resources the kernel accounts for the whole sandbox (cgroups.py) ------------------------------

HAS_GROUP = cgroups.hierarchy() is not None
needs_group = pytest.mark.skipif(not HAS_GROUP, reason="no cgroup for sandboxes here (not root, no delegated v2)")
# Three children of 150 MB each: each under RLIMIT_AS, together past the sandbox's 256 MB
FORK_HUNGRY = """import os, time
kids = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        block = bytearray(150 * 2 ** 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        time.sleep(1)
        os._exit(0)
    kids.append(pid)
print(sorted(os.waitstatus_to_exitcode(os.waitpid(kid, 0)[1]) for kid in kids))
"""


@needs_group
@pytest.mark.parametrize("mode", ["bwrap", "unsafe"])
def test_memory_is_capped_for_the_sandbox_as_a_whole(mode):
    """RLIMIT_AS is per process: three children of 150 MB each all ran under a 256 MB limit. The
    sandbox's cgroup counts them together, and its OOM killer takes one or more."""
    limits = dataclasses.replace(FAST, memory_mb=256, timeout_s=10, mode=mode)
    result = run_script(FORK_HUNGRY, limits)
    assert result.returncode == 0, result
    assert -9 in json.loads(result.stdout), result.stdout


def test_root_and_dev_of_the_sandbox_are_read_only():
    """bwrap's / and /dev are tmpfs of no size: 160 MB went there against a documented 40 MB."""
    result = run_script("import os\nfor path in ('/fill', '/dev/fill', '/tmp/fill'):\n"
                        "    try:\n        open(path, 'wb').write(b'0' * 1000)\n        print(path, 'written')\n"
                        "    except OSError as e:\n        print(path, e.strerror)\n", FAST)
    assert result.stdout.splitlines() == ["/fill Read-only file system", "/dev/fill Read-only file system",
                                          "/tmp/fill written"], result


DAEMON = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
          "        print(os.getpid(), flush=True)\n        time.sleep(100)\n    os._exit(0)\ntime.sleep(0.5)\n")


@needs_group
def test_a_daemon_that_left_its_session_dies_with_an_unsafe_sandbox_too():
    """Unsafe mode has no PID namespace: the driver's kill of the process group missed a double-forked,
    setsid daemon. The sandbox's cgroup lists it, and the driver kills it."""
    result = run_script(DAEMON, dataclasses.replace(FAST, mode="unsafe"))
    pid = int(result.stdout.split()[0])
    gone = _wait_gone(pid, 3)
    if not gone:
        os.kill(pid, 9)
    assert gone


def _wait_gone(pid: int, seconds: float) -> bool:
    """Whether `pid` is gone (or a zombie) within `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text():
                return True
        except OSError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


@pytest.mark.skipif(not ROOT or not cgroups.pins_oom_score(), reason="needs root with CAP_SYS_RESOURCE "
                    "(some containers' root lacks it: then describe() says the score is not pinned)")
def test_the_program_cannot_lower_its_oom_score():
    """The candidate set oom_score_adj 1000 itself, and could set it back to 0 (the OOM killer then takes
    the trainer first). Set from outside, by root, 1000 is a floor."""
    result = run_script("open('/proc/self/oom_score_adj', 'w').write('0')", FAST)
    assert result.returncode == 1 and "PermissionError" in result.stderr, result


@needs_group
def test_groups_left_by_a_killed_trainer_are_killed_and_removed_at_the_next_start(tmp_path):
    """A trainer killed with -9 removes nothing: the next one (here: a fresh look at the hierarchy)
    kills what is left in the dead trainer's groups and removes them."""
    found = cgroups.hierarchy()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = found.folders["memory"].parent / f"{cgroups.PREFIX}{dead.stdout.strip()}-1"
    (stale / "sandbox-0").mkdir(parents=True)
    # an orphan, as a dead trainer's would be (init reaps it), in the dead trainer's group
    procs = stale / "sandbox-0" / "cgroup.procs"
    orphan = int(subprocess.run(["sh", "-c", f"sh -c 'echo $$ > {procs} && exec sleep 100' >/dev/null 2>&1 & echo $!"],
                                capture_output=True, text=True).stdout)
    try:
        deadline = time.monotonic() + 5
        while procs.read_text().split() != [str(orphan)] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert procs.read_text().split() == [str(orphan)]
        cgroups._sweep(stale.parent)
        assert not stale.exists()
        assert _wait_gone(orphan, 3)
    finally:
        if not _wait_gone(orphan, 0):
            os.kill(orphan, 9)
        for folder in (stale / "sandbox-0", stale):
            if folder.exists():
                folder.rmdir()


def test_cgroup_v2_groups_are_made_with_their_limits_and_killed_with_cgroup_kill(tmp_path, monkeypatch):
    """The v2 path on a stand-in folder (these machines have v1): the trainer's folder hands memory and
    pids down, each sandbox's group gets memory.max (no swap) and pids.max, and is killed by cgroup.kill."""
    own = tmp_path / "user.slice" / "scope"
    own.mkdir(parents=True)
    (own / "cgroup.controllers").write_text("cpu memory pids\n")
    monkeypatch.setattr(cgroups, "_mounts", lambda root: {"": tmp_path})
    monkeypatch.setattr(cgroups, "_own_groups", lambda: {"": "/user.slice/scope"})
    monkeypatch.setattr(cgroups, "OPTIONAL", frozenset())  # a stand-in has no files: write them all
    monkeypatch.setattr(cgroups.atexit, "register", lambda *args: None)  # nothing of it to remove at exit
    found = cgroups.hierarchy.__wrapped__()
    assert found.version == 2 and found.folders[""].parent == own
    assert (found.folders[""] / "cgroup.subtree_control").read_text() == "+memory +pids"
    monkeypatch.setattr(cgroups, "hierarchy", lambda: found)
    group = cgroups.create(300, 66)
    folder = group.folders[""]
    assert group.procs == [str(folder / "cgroup.procs")]
    assert [(folder / key).read_text() for key in ("memory.max", "memory.swap.max", "pids.max")] == \
        [str(300 << 20), "0", "66"]
    group.kill()
    assert (folder / "cgroup.kill").read_text() == "1"


def test_start_up_says_which_limits_hold_where_there_is_no_cgroup(monkeypatch):
    monkeypatch.setattr(cgroups, "hierarchy", lambda: None)
    line, all_hold = cgroups.describe(1024, 64)
    assert not all_hold and line.startswith("sandbox limits: no cgroup here") and "not for a sandbox as a whole" in line
