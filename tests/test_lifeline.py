"""magrpo/lifeline.py: a program run under the supervisor, and every daemon it starts (`setsid`, a double
fork, ignoring SIGTERM: tests/daemons.py), ends when the program exits, when the trainer is killed with
SIGKILL (as root and as an unprivileged user), and a grace after a SIGTERM. Each test looks only at the
processes it started (their pids), so none runs `alone`."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from magrpo import lifeline, pinned
from tests import nobody
from tests.daemons import after_sigkill, alive, survivors

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
    done = subprocess.run(lifeline.command([sys.executable, DAEMONS, "3"]), capture_output=True, text=True,
                          timeout=60)
    pids = [int(line) for line in done.stdout.split()]
    assert survivors(pids, 0) == []  # reaped before the supervisor exited
    assert len(pids) == 2 and done.returncode == 3


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
        pids += [int(trainer.stdout.readline()) for _ in range(3)]  # two daemons, then the supervisor
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
        pids.append(pid)
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
    pid = int(proc.stdout.readline())
    assert after_sigkill(proc, [pid]) == []


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
                pids.append(int(line.split()[1]))
    finally:
        left = after_sigkill(trainer, pids)
    assert left == []
