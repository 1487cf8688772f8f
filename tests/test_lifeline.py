"""magrpo/lifeline.py: a program run under the supervisor, and every daemon it starts (`setsid`, a double
fork, ignoring SIGTERM: tests/daemons.py), ends when the program exits, when the trainer is killed with
SIGKILL (as root and as an unprivileged user), and a grace after a SIGTERM; where the supervisor makes a
PID namespace (root), also when the program SIGKILLs or SIGSTOPs its supervisor, or the supervisor is
killed while a fork chain runs. Each test looks only at the processes it started (their pids: a
supervised program's own, translated by tests/daemons.py's `host_pids`), so none runs `alone`."""
from __future__ import annotations

import functools
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from magrpo import lifeline, pinned
from tests import nobody
from tests.daemons import after_sigkill, alive, host_pids, survivors

ROOT = Path(__file__).resolve().parent.parent
DAEMONS = str(ROOT / "tests" / "daemons.py")

# A trainer that starts `daemons.py` under a supervisor, passes the daemons' pids on and waits to be
# killed. stdlib only (lifeline.py imported from its file).
TRAINER = """
import subprocess, sys, time
sys.path.insert(0, sys.argv[1])
import lifeline
child = subprocess.Popen(lifeline.command([sys.executable, sys.argv[2], "0", "3600"]), stdout=subprocess.PIPE)
for _ in range(2):
    sys.stdout.write(child.stdout.readline().decode())
print(child.pid, flush=True)
time.sleep(3600)
"""


def test_the_programs_daemons_die_when_it_exits_and_its_status_comes_back():
    proc = subprocess.Popen(lifeline.command([sys.executable, DAEMONS, "3", "stdin"]), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    pids = host_pids(proc.pid, [int(proc.stdout.readline()) for _ in range(2)])
    assert all(alive(p) for p in pids)
    proc.stdin.close()  # the program exits
    assert proc.wait(timeout=60) == 3
    assert survivors(pids, 0) == []  # reaped before the supervisor exited


@pytest.mark.parametrize("user", ["own", "nobody"])
def test_everything_dies_with_a_trainer_killed_by_sigkill(user):
    argv = [sys.executable, "-c", TRAINER, str(ROOT / "magrpo"), DAEMONS]
    if user == "nobody":  # the venv's own Python as `nobody`, where it may not read the venv: tests/nobody.py
        if reason := nobody.unavailable():
            pytest.skip(reason)
        argv = nobody.command(argv, [str(ROOT)])
    trainer = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        *said, supervisor = [int(trainer.stdout.readline()) for _ in range(3)]  # two daemons, the supervisor
        pids += [*host_pids(trainer.pid, said), supervisor]
        assert all(alive(p) for p in pids)
    finally:
        left = after_sigkill(trainer, pids)
    assert left == []


# A program that takes root through its setuid binary where it can, says its pid and real uid, and waits.
SETUID_PROGRAM = """
import os, time
try:
    os.setresuid(0, 0, 0)
except PermissionError:  # the setuid bit did not take
    pass
print(os.getpid(), os.getuid(), flush=True)
time.sleep(3600)
"""
# A trainer that runs argv[1:] under a supervisor, passes its one line on and waits to be killed.
RELAY = """
import subprocess, sys, time
from magrpo import lifeline
child = subprocess.Popen(lifeline.command(sys.argv[1:]), stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), flush=True)  # an empty line if it could not start
time.sleep(3600)
"""


@pytest.fixture
def setuid_python(tmp_path):
    """A setuid-root copy of the system's Python, in a folder only root and `nobody`'s group can enter
    (a setuid-root Python is root for whoever runs it); skipped where such a copy would not take root."""
    python = os.path.realpath("/usr/bin/python3")
    if nobody.unavailable() or not os.path.isfile(python):
        pytest.skip(nobody.unavailable() or "no /usr/bin/python3 to make a setuid copy of")
    folder = tmp_path / "setuid"
    folder.mkdir()
    os.chown(folder, 0, nobody.NOBODY)
    folder.chmod(0o750)
    copy = folder / "python3"
    shutil.copy(python, copy)
    copy.chmod(0o4755)
    probe = subprocess.run([*nobody.as_nobody(), str(copy), "-I", "-S", "-c", "import os; print(os.geteuid())"],
                           capture_output=True, text=True, timeout=60)
    if probe.stdout.strip() != "0":
        pytest.skip(f"a setuid-root binary does not take root here (a nosuid mount?): {probe.stderr.strip()[-200:]}")
    yield str(copy)
    copy.unlink()


def test_a_setuid_program_under_an_unprivileged_trainer_gets_no_root_and_dies_with_it(setuid_python):
    """A process that changed its user could not be killed by the supervisor (EPERM): it outlived the
    trainer. The supervisor starts its program with no_new_privs, so a setuid bit never takes."""
    argv = [sys.executable, "-c", RELAY, setuid_python, "-I", "-S", "-c", SETUID_PROGRAM]
    trainer = subprocess.Popen(nobody.command(argv, [str(ROOT), setuid_python]), cwd=ROOT, stdout=subprocess.PIPE,
                               text=True)
    pids: list[int] = []
    try:
        said = trainer.stdout.readline().split()
        assert len(said) == 2, "the program did not start (the supervisor's error went to the test's stderr)"
        pid, uid = map(int, said)
        pids += host_pids(trainer.pid, [pid])
        assert uid == nobody.NOBODY
    finally:
        left = after_sigkill(trainer, pids)
    assert left == []


def test_a_sigterm_reaches_the_program_and_one_that_ignores_it_is_killed_after_the_grace():
    def started(code: str, grace_s: float) -> subprocess.Popen:
        proc = subprocess.Popen(lifeline.command([sys.executable, "-c", f"{code}print(flush=True); "
                                                  f"import time; time.sleep(60)"], grace_s), stdout=subprocess.PIPE)
        proc.stdout.readline()  # the program runs: the supervisor's handlers are in place
        return proc

    polite = started("", 30)
    deaf = started("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); ", 0.2)
    try:
        for proc in (polite, deaf):
            proc.terminate()
        assert polite.wait(timeout=30) == 128 + signal.SIGTERM  # passed on; it ended by it
        assert deaf.wait(timeout=30) == 128 + signal.SIGKILL  # 0.2 s later, killed
    finally:
        for proc in (polite, deaf):
            proc.kill()
            proc.wait()


def test_a_program_that_cannot_start_says_why_and_one_whose_supervisor_is_killed_dies_too():
    missing = subprocess.run(lifeline.command(["/nonexistent/program"]), capture_output=True, text=True, timeout=60)
    assert missing.returncode == 127
    assert missing.stderr == "FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent/program'\n"
    # subprocess.run's timeout kills the supervisor with SIGKILL: the program must not run on
    proc = subprocess.Popen(lifeline.command([sys.executable, "-c", "import os, time; print(os.getpid(), "
                                              "flush=True); time.sleep(60)"]), stdout=subprocess.PIPE)
    pids = host_pids(proc.pid, [int(proc.stdout.readline())])
    assert after_sigkill(proc, pids) == []


# A trainer that runs a program under a supervisor, passes on the supervisor's pid and the program's
# line, then, on a line from the test, has the program act and passes its next line on; then waits.
ATTACKED = """
import subprocess, sys, time
sys.path.insert(0, sys.argv[1])
import lifeline
child = subprocess.Popen(lifeline.command([sys.executable, "-c", *sys.argv[2:]]), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
sys.stdin.readline()
child.stdin.write("go\\n")
child.stdin.flush()
print(child.stdout.readline().strip(), flush=True)  # an empty line where the program is gone
time.sleep(3600)
"""
# The program: says its pid and those of a daemon of each kind (tests/daemons.py), then sends its
# parent (the supervisor, as it sees it) SIGNAL, and exits or stays.
ATTACKER = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
import daemons
print(os.getpid(), *map(daemons.start, daemons.KINDS), flush=True)
sys.stdin.readline()
os.kill(os.getppid(), getattr(signal, sys.argv[2]))
print("sent", flush=True)
if sys.argv[3] == "stay":
    time.sleep(3600)
"""
# Whether this user may make a PID namespace (what lifeline.py tries): 0, else -1
PROBE = "import ctypes; print(ctypes.CDLL(None).unshare(0x20000000))"


@functools.lru_cache(maxsize=None)
def no_namespace(user: str) -> str | None:
    """Why a supervisor started by `user` (own, nobody) can make no PID namespace here, or None."""
    argv = [sys.executable, "-c", PROBE]
    if user == "nobody":
        if reason := nobody.unavailable():
            return reason
        argv = nobody.command(argv, [])
    if subprocess.run(argv, capture_output=True, text=True, timeout=120).stdout.strip() != "0":
        return (f"{user} (uid {os.geteuid() if user == 'own' else nobody.NOBODY}) may not unshare(CLONE_NEWPID) "
                f"here, and lifeline.py makes no user namespace for one (docs/tools.md, Sessions)")
    return None


@pytest.mark.parametrize("user", ["own", "nobody"])
@pytest.mark.parametrize("then", ["exit", "stay"])
@pytest.mark.parametrize("attack", ["SIGKILL", "SIGSTOP"])
def test_a_program_that_kills_or_stops_its_supervisor_still_ends_and_its_daemons_with_it(attack, then, user):
    """Issue 44: a program (or a tool's code, run as the server's user) that SIGKILLed its supervisor ended
    itself (its parent-death signal) but left its daemons to init; one that SIGSTOPped it left them all
    running when it exited or the trainer died. The supervisor now is the init of a PID namespace, which
    no process inside can SIGKILL or SIGSTOP: everything ends when the program exits (`exit`), or when
    the trainer is killed with SIGKILL (`stay`)."""
    if reason := no_namespace(user):
        pytest.skip(reason)
    argv = [sys.executable, "-c", ATTACKED, str(ROOT / "magrpo"), ATTACKER, str(ROOT / "tests"), attack, then]
    if user == "nobody":
        argv = nobody.command(argv, [str(ROOT)])
    trainer = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        supervisor, *said = map(int, trainer.stdout.readline().split())
        pids += [supervisor, *host_pids(trainer.pid, said)]  # the supervisor, the program, two daemons
        assert len(pids) == 4 and all(alive(p) for p in pids)
        trainer.stdin.write("\n")
        trainer.stdin.flush()
        trainer.stdout.readline()  # "sent" (or nothing: the supervisor's death took the program along)
        if then == "stay":
            trainer.kill()
        left = survivors(pids, 5)
    finally:
        after_sigkill(trainer, pids, 0)  # a failed run's leftovers, and the trainer
    assert left == []


# A program that starts two chains that fork and exit in a loop (a new pid every few ms: faster than a
# scan of /proc finds them), each in a session of its own (out of reach of a kill of the supervisor's
# group) and writing its pid on the supervisor's stdout at each step; says it started; waits. Every line
# is one write (os.write, not print: under PYTHONUNBUFFERED print writes a line's text and its newline
# apart, and a chain's line once landed between them: "started3\n\n", never seen as started).
CHAINS = """
import os, time
for _ in range(2):
    if os.fork() == 0:
        os.setsid()
        while True:
            os.write(1, b"%d\\n" % os.getpid())
            time.sleep(0.005)
            if os.fork():
                os._exit(0)
os.write(1, b"started\\n")
time.sleep(3600)
"""


def writers_after(fd: int, seconds: float) -> list[int]:
    """Reads `fd` until EOF (no writer left: []) or `seconds` pass; then the pids written next."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if select.select([fd], [], [], 0.1)[0] and not os.read(fd, 1 << 16):
            return []
    time.sleep(0.2)
    return sorted({int(line) for line in os.read(fd, 1 << 16).split(b"\n")[1:-1]})  # whole lines only


def test_fork_chains_in_sessions_of_their_own_die_with_a_supervisor_killed_by_a_group_sigkill():
    """The MCP SDK ends a close with a SIGKILL of the supervisor's process group two seconds after its
    SIGTERM: a chain that left the group and forks and exits in a loop ran on (parent 1) when that kill
    came before or during the supervisor's chase. The kernel kills a PID namespace with its init."""
    if reason := no_namespace("own"):
        pytest.skip(reason)
    proc = subprocess.Popen(lifeline.command([sys.executable, "-c", CHAINS], grace_s=1.0), stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        seen, until = b"", time.monotonic() + 60
        while b"\nstarted\n" not in b"\n" + seen:  # a whole line
            if time.monotonic() > until or not (select.select([proc.stdout], [], [], 1)[0]
                                                 and (chunk := os.read(proc.stdout.fileno(), 1 << 16))):
                pytest.fail(f"the program did not say it started: {seen[-200:]!r}")
            seen += chunk
        time.sleep(0.2)  # the chains run
        proc.terminate()  # the SDK's SIGTERM, then its group kill before the grace is over
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        left = writers_after(proc.stdout.fileno(), 5)  # pids (as the chains see them) still writing
    finally:
        proc.stdout.close()  # a chain still running dies at its next line (EPIPE)
    assert left == []


# A program that leaves 20 orphans that end at once (each the child of a child that exited), then waits.
ORPHANS = """
import os, time
for _ in range(20):
    if os.fork() == 0:
        if os.fork() == 0:
            os._exit(0)
        os._exit(0)
    os.wait()
print(flush=True)
time.sleep(3600)
"""


def test_orphans_that_end_are_reaped_at_once_not_kept_as_zombies_until_the_end():
    """The supervisor (or its namespace's init) reaped orphans only at the end: a fork chain's zombies,
    one per step, filled the machine's pid table within minutes."""
    proc = subprocess.Popen(lifeline.command([sys.executable, "-c", ORPHANS]), stdout=subprocess.PIPE)
    try:
        proc.stdout.readline()
        deadline = time.monotonic() + 5
        while (zombies := [p for p in lifeline.descendants(proc.pid) if not alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    assert zombies == []


class ForkChain:
    """A stand-in for the process table under a supervisor: a chain that forks and exits in a loop, so
    each scan finds a new pid, caught only after `rounds` scans (the kernel refuses a fork to a process
    with a SIGKILL pending, so a real chase ends at some round: which one is chance); then one process
    that refuses SIGKILL (another uid). A fake clock: each scan takes a second."""

    def __init__(self, rounds: int):
        self.rounds, self.now, self.killed, self.refusing = rounds, 0.0, [], False

    def descendants(self, _root: int) -> list[int]:
        self.now += 1.0
        if self.rounds:
            self.rounds -= 1
            return [1000 + self.rounds]
        self.refusing = True
        return [999]

    def kill(self, pid: int, _signal: int) -> None:
        if pid == 999:
            raise PermissionError(1, "Operation not permitted")
        self.killed.append(pid)

    def waitpid(self, _pid: int, _options: int) -> tuple[int, int]:
        return 0, 0  # live children left, none to reap yet


def test_the_supervisor_chases_a_fork_chain_as_long_as_it_takes_and_gives_up_only_on_refusals(monkeypatch):
    """A chain of 16 such processes ran past the supervisor's 5 s give-up in one of three runs (and on,
    with parent 1): the give-up now counts only the time every descendant left has refused the kill."""
    chain = ForkChain(rounds=20)
    monkeypatch.setattr(lifeline, "descendants", chain.descendants)
    monkeypatch.setattr(lifeline.os, "kill", chain.kill)
    monkeypatch.setattr(lifeline.os, "waitpid", chain.waitpid)
    monkeypatch.setattr(lifeline.time, "monotonic", lambda: chain.now)
    monkeypatch.setattr(lifeline.time, "sleep", lambda _s: None)
    lifeline.kill_all()
    assert chain.killed == [1000 + r for r in range(19, -1, -1)]  # every pid the chase found, 20 s of it
    assert chain.refusing and chain.now <= 20 + lifeline.KILL_GIVE_UP_S + 2  # then the refusal, 5 s


# A trainer with two children of its own (as a library starts them: not through `command`), one of
# which ignores SIGTERM, under `watch`; it passes their pids on and waits to be killed.
WATCHED = """
import subprocess, sys, time
sys.path.insert(0, sys.argv[1])
import lifeline
polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
deaf = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                         "print(flush=True); time.sleep(3600)"], stdout=subprocess.PIPE)
deaf.stdout.readline()
lifeline.watch([polite.pid, deaf.pid], grace_s=0.5)
print(polite.pid, deaf.pid, flush=True)
time.sleep(3600)
"""


def test_watched_children_of_a_trainer_killed_by_sigkill_end_after_it():
    trainer = subprocess.Popen([sys.executable, "-c", WATCHED, str(ROOT / "magrpo")], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids += map(int, trainer.stdout.readline().split())
        assert len(pids) == 2 and all(alive(p) for p in pids)
    finally:
        left = after_sigkill(trainer, pids)  # SIGTERM at once, SIGKILL 0.5 s later for the deaf one
    assert left == []


BUILDER = """from pathlib import Path
import sys
from magrpo import sft
sft.build_pinned("tests.daemons:hanging_build", {"seconds": 3600}, Path(sys.argv[1]), "test")
"""


@pytest.mark.slow  # the pinned child imports torch
@pytest.mark.skipif(not pinned.supported(), reason="no pinned child on this CPU: the build runs in the trainer")
def test_a_pinned_build_and_its_daemons_die_with_a_trainer_killed_by_sigkill(tmp_path):
    trainer = subprocess.Popen([sys.executable, "-c", BUILDER, str(tmp_path / "out")], cwd=ROOT,
                               stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        while len(pids) < 3:  # the build, then its two daemons
            line = trainer.stderr.readline()
            assert line, "the trainer ended before the build said its pids"
            if line.startswith("pid "):
                pids += host_pids(trainer.pid, [int(line.split()[1])])
    finally:
        left = after_sigkill(trainer, pids)
    assert left == []


def test_a_trainer_under_a_supervisor_sees_the_hosts_processes(monkeypatch):
    """magrpo.pinned runs a whole trainer under a supervisor with own_pids=False: no PID namespace, so its
    start-up sweeps that judge other trainers' leftovers by their pids see those trainers alive. In a
    namespace this process (its parent trainer) is not in /proc, and a pinned run removed a live test
    process's sandbox cgroups. A program that asks for its own pids still gets them where root may."""
    from magrpo import pinned

    probe = f"import os; print(os.path.exists('/proc/{os.getpid()}'), os.getpid() > 3)"
    shared = subprocess.run(lifeline.command([sys.executable, "-c", probe], own_pids=False), capture_output=True,
                            text=True, timeout=60)
    assert shared.stdout.split() == ["True", "True"]
    ran = []
    monkeypatch.setattr(pinned.subprocess, "run", lambda argv, **kwargs: ran.append(argv))
    pinned.run(["trainer.steps=1"])
    assert ran[0][ran[0].index("--") - 1] == lifeline.SHARED_PIDS  # pinned trainers ask for the host's pids
    monkeypatch.undo()
    if reason := no_namespace("own"):
        pytest.skip(reason)
    own = subprocess.run(lifeline.command([sys.executable, "-c", probe]), capture_output=True, text=True, timeout=60)
    assert own.stdout.split() == ["False", "False"]  # the namespace's pids: the program is 2
