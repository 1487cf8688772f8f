"""What the code env's sandbox costs: each bubblewrap flag, and whole programs per second.

    .venv/bin/python bench/bench_sandbox.py                 # ~2 min on 2 idle cores
    .venv/bin/python bench/bench_sandbox.py --launches 50 --programs 100

Part 1 starts `python -I -S -c pass` in the sandbox one at a time: with every flag magrpo uses, with each
flag left out in turn, and with no bwrap at all; the variants take turns (round robin), so drift in the
machine's speed spreads over all of them. It prints the median ms per launch, min-max, and the cost of
each flag (the default's median minus the median without it). Part 2 runs whole programs (4 asserts
each, the judge included) through `run_many` in both modes, `--repeats` times, and prints programs/s.
It reports numbers and asserts nothing: run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from envs.code import isolation, syscalls
from envs.code.sandbox import Program, SandboxLimits, run_many

TMP_MB = SandboxLimits().file_size_mb * 4


def variants() -> dict[str, list[str]]:
    """label -> argv of one sandboxed `python -c pass`."""
    lib = isolation.candidate_lib("bwrap")
    python = [isolation.interpreter().executable, "-I", "-S", "-c", "pass"]
    size = f"--size {TMP_MB << 20}"
    hidden = frozenset(f"--tmpfs {p} --remount-ro {p}" for p in isolation.interpreter().hidden)
    drops = {"--unshare-net": {"--unshare-net"}, "--unshare-ipc": {"--unshare-ipc"}, "--unshare-pid": {"--unshare-pid"},
             "--unshare-uts": {"--unshare-uts"}, "--unshare-cgroup-try": {"--unshare-cgroup-try"},
             "--disable-userns": {"--disable-userns"}, "--die-with-parent": {"--die-with-parent"},
             "--new-session": {"--new-session"}, "--proc /proc": {"--proc /proc"}, "--dev /dev": {"--dev /dev"},
             "private /dev/shm": {f"{size} --tmpfs /dev/shm"}, "hidden site-packages": hidden,
             "--seccomp (the syscall filter)": {"--seccomp -1"}}
    out = {"all flags (the default)": isolation.bwrap_command(lib, TMP_MB, seccomp_fd=-1) + python}
    out.update({f"without {name}": isolation.bwrap_command(lib, TMP_MB, frozenset(drop), seccomp_fd=-1) + python
                for name, drop in drops.items()})
    out["no bwrap: python -I -S alone"] = python
    return out


def _with_filter(argv: list[str]) -> tuple[list[str], tuple[int, ...]]:
    """argv with a fresh filter pipe after --seccomp (bwrap reads it to EOF: one per launch, as the
    sandbox makes one per program; its cost is timed), and that fd to pass."""
    if "--seccomp" not in argv:
        return argv, ()
    fd, at = syscalls.pipe(), argv.index("--seccomp") + 1
    return [*argv[:at], str(fd), *argv[at + 1:]], (fd,)


def launch_costs(launches: int) -> None:
    argvs = variants()
    times: dict[str, list[float]] = {label: [] for label in argvs}
    for _ in range(launches):
        for label, argv in argvs.items():
            sandboxed = argv[0] == isolation.bwrap()[0]
            uid = isolation.acquire_uid() if os.geteuid() == 0 and sandboxed else None
            began = time.perf_counter()
            command, fds = _with_filter(argv)
            command, keywords = isolation.as_user(uid, command)
            subprocess.run(command, check=True, stdin=subprocess.DEVNULL, pass_fds=fds, **keywords)
            times[label].append((time.perf_counter() - began) * 1000)
            for fd in fds:
                os.close(fd)
            if uid is not None:
                isolation.release_uid(uid)
    default = statistics.median(times["all flags (the default)"])
    print(f"\nPart 1: one sandboxed `python -I -S -c pass` at a time, {launches} launches per variant")
    print(f"{'variant':40s} {'median ms':>9s} {'min-max':>13s} {'launches/s':>10s} {'flag costs ms':>13s}")
    for label, values in times.items():
        median = statistics.median(values)
        cost = f"{default - median:+.1f}" if label.startswith("without") else ""
        print(f"{label:40s} {median:9.1f} {min(values):6.1f}-{max(values):<6.1f} {1000 / median:10.1f} {cost:>13s}")


def programs_per_second(count: int, repeats: int) -> None:
    cases = [f"assert candidate({i}, 1) == {i + 1}" for i in range(4)]
    add = Program("def add(a, b):\n    return a + b\n", "", cases, "add")
    workers = os.cpu_count() or 1
    rates: dict[str, list[float]] = {mode: [] for mode in isolation.MODES}
    for mode in isolation.MODES:
        run_many([add] * workers, SandboxLimits(mode=mode))  # warm judges and folders
    for _ in range(repeats):
        for mode in isolation.MODES:
            began = time.monotonic()
            results = run_many([add] * count, SandboxLimits(mode=mode))
            rates[mode].append(count / (time.monotonic() - began))
            assert all(r.fraction == 1.0 for r in results), results[0]
    print(f"\nPart 2: {count} programs x {repeats} through run_many, {workers} workers, 4 asserts each")
    for mode, values in rates.items():
        print(f"{mode:8s} programs/s: median {statistics.median(values):.1f}  (runs: "
              f"{', '.join(f'{v:.1f}' for v in values)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=40, help="launches per variant in part 1")
    parser.add_argument("--programs", type=int, default=200, help="programs per measurement in part 2")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per mode in part 2")
    args = parser.parse_args()
    isolation.check("bwrap")
    print(f"bwrap {'.'.join(map(str, isolation.bwrap()[1]))}, sandbox Python {isolation.interpreter().executable}, "
          f"uid {os.geteuid()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    launch_costs(args.launches)
    programs_per_second(args.programs, args.repeats)


if __name__ == "__main__":
    main()
