"""Resources the kernel accounts for a whole sandbox: one cgroup per sandboxed program, where the machine
lets the trainer make one.

rlimits are per process: RLIMIT_AS does not see tmpfs pages, memfds or the sum over a program's
children, and nothing per process can kill a tree that left its process group. A cgroup can: its memory
limit counts every page its processes charge (anonymous memory, tmpfs and shared memory, page cache),
its pids limit counts every task, and it lists every process it holds, so the driver kills them all
itself. Each group is made before its sandbox starts (the sandbox's first process joins it before it
execs bwrap: nothing runs outside it), killed with everything in it when the program is done, and
removed.

Three cases, found once per trainer (`hierarchy()`):
* cgroup v1 (these CI machines): the `memory` and `pids` controllers' folders of the trainer's own
  groups are writable (root). The `freezer`, where there is one, stops a tree before it is killed.
* cgroup v2 (most laptops and newer servers): the trainer's own group is writable and offers `memory`
  and `pids` (root, or a delegated subtree such as `systemd-run --user --scope -p Delegate=yes`).
  `cgroup.kill` kills a tree at once.
* none (an unprivileged user without delegation): limits stay per process, and `describe()` gives the
  warning the trainer says at start-up (docs/environments.md, "Resources the kernel accounts").
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_ROOT = "/sys/fs/cgroup"
PREFIX = "magrpo-"  # the trainer's own folder in each controller: magrpo-PID-STARTTIME
# Swap accounting is off on some kernels (v1 without swapaccount=1, v2 without swap): then no swap limit
OPTIONAL = frozenset({"memory.memsw.limit_in_bytes", "memory.swap.max"})
_counter = itertools.count()
_lock = threading.Lock()


@dataclass
class Hierarchy:
    """Where this trainer makes its sandboxes' groups: one folder per controller (v1: memory, pids and,
    where there is one, the freezer, which stops a tree before it is killed) or one (v2, under "")."""

    version: int  # 1 or 2
    folders: dict[str, Path]  # controller -> this trainer's folder
    stale: list[Path] = field(default_factory=list)  # groups whose processes were killed, not yet empty


@dataclass
class Group:
    """One sandbox's group: join its `procs` files first thing, `kill()` and `remove()` when done."""

    hierarchy: Hierarchy
    folders: dict[str, Path]  # controller -> this group's folder (as the hierarchy's)

    @property
    def procs(self) -> list[str]:
        return [str(folder / "cgroup.procs") for folder in self.folders.values()]

    def pids(self) -> set[int]:
        """Its processes: every controller's folder lists the same ones (the join adds each to all)."""
        with contextlib.suppress(OSError, ValueError):
            return {int(line) for line in (next(iter(self.folders.values())) / "cgroup.procs").read_text().split()}
        return set()

    def kill(self) -> None:
        """SIGKILL every process in the group, those that left their session and process group too."""
        if self.hierarchy.version == 2 and _write(self.folders[""] / "cgroup.kill", "1"):
            return
        frozen = self._freeze("FROZEN")  # no fork between the listing and the kill
        try:
            for _ in range(100):  # without a freezer, a fork bomb adds processes while we kill
                pids = self.pids()
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                if frozen:
                    break
        finally:
            if frozen:
                self._freeze("THAWED")  # SIGKILL takes effect once thawed

    def _freeze(self, state: str) -> bool:
        if self.hierarchy.version == 2:
            return _write(self.folders[""] / "cgroup.freeze", "1" if state == "FROZEN" else "0")
        folder = self.folders.get("freezer")
        if folder is None or not _write(folder / "freezer.state", state):
            return False
        for _ in range(200):  # freezing is asynchronous: FREEZING until every task has stopped
            if state != "FROZEN" or _read(folder / "freezer.state") == "FROZEN":
                return True
            time.sleep(0.001)
        return True

    def remove(self) -> None:
        """rmdir the group's folders; those still holding dying processes are retried later."""
        for folder in self.folders.values():
            if not _rmdir(folder):
                with _lock:
                    self.hierarchy.stale.append(folder)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _write(path: Path, value: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(value)
        return True
    except OSError:
        return False


def _rmdir(folder: Path) -> bool:
    try:
        folder.rmdir()
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _start_time(pid: int) -> str | None:
    """A process's start time (clock ticks since boot): with its pid, it names one process for good."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _own_name() -> str:
    return f"{PREFIX}{os.getpid()}-{_start_time(os.getpid())}"


def _owner_alive(name: str) -> bool:
    try:
        pid, start = name.removeprefix(PREFIX).split("-", 1)
        return _start_time(int(pid)) == start
    except ValueError:
        return True  # not ours to judge


def _mounts(root: str) -> dict[str, Path]:
    """controller -> mount point, from /proc/self/mountinfo (v2's unified mount under "")."""
    found: dict[str, Path] = {}
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or not fields[4].startswith(root):
            continue
        if tail[0] == "cgroup2":
            found.setdefault("", Path(fields[4]))
        elif tail[0] == "cgroup":
            for option in tail[2].split(","):
                found.setdefault(option, Path(fields[4]))
    return found


def _own_groups() -> dict[str, str]:
    """controller -> this process's group path ("" for v2's unified hierarchy)."""
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                out[controller] = path
    return out


def _sweep(parent: Path) -> None:
    """Kill and remove what a trainer that died without cleaning up (kill -9) left in `parent`."""
    with contextlib.suppress(OSError):
        for folder in parent.glob(f"{PREFIX}*"):
            if folder.is_dir() and not _owner_alive(folder.name):
                for child in [*folder.iterdir()]:
                    if child.is_dir():
                        for pid in _read(child / "cgroup.procs").split():
                            with contextlib.suppress(OSError, ValueError):
                                os.kill(int(pid), signal.SIGKILL)
                        _rmdir_soon(child)
                _rmdir(folder)


def _rmdir_soon(folder: Path, seconds: float = 1.0) -> bool:
    """rmdir once the group's killed processes have left it (SIGKILL takes effect asynchronously)."""
    deadline = time.monotonic() + seconds
    while not _rmdir(folder):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _make(parent: Path, name: str) -> Path | None:
    _sweep(parent)
    folder = parent / name
    try:
        folder.mkdir(exist_ok=True)
    except OSError:
        return None
    return folder


def _v1(mounts: dict[str, Path], own: dict[str, str], name: str) -> Hierarchy | None:
    folders: dict[str, Path] = {}
    for controller in ("memory", "pids", "freezer"):
        if controller not in mounts or controller not in own:
            continue
        folder = _make(mounts[controller] / own[controller].lstrip("/"), name)
        if folder is not None:
            folders[controller] = folder
    if "memory" in folders and "pids" in folders:
        return Hierarchy(1, folders)
    for folder in folders.values():
        _rmdir(folder)
    return None


def _v2(mounts: dict[str, Path], own: dict[str, str], name: str) -> Hierarchy | None:
    if "" not in mounts or "" not in own:
        return None
    base = mounts[""] / own[""].lstrip("/")
    if not {"memory", "pids"} <= set(_read(base / "cgroup.controllers").split()):
        return None
    folder = _make(base, name)
    if folder is None:
        return None
    # Our folder hands memory and pids down to the sandboxes' groups; it holds no process itself
    if not _write(folder / "cgroup.subtree_control", "+memory +pids"):
        _rmdir(folder)
        return None
    return Hierarchy(2, {"": folder})


@functools.lru_cache(maxsize=1)
def hierarchy(root: str = CGROUP_ROOT) -> Hierarchy | None:
    """This trainer's place for sandbox groups, made once (and removed at exit); None where the machine
    gives it none. Groups left by trainers that were killed are killed and removed on the way."""
    mounts, own = _mounts(root), _own_groups()
    found = _v2(mounts, own, _own_name()) or _v1(mounts, own, _own_name())
    if found is not None:
        atexit.register(_close, found)
    return found


def sweep() -> None:
    """Kill and remove what trainers killed with -9 left beside this one's folders (done at start-up)."""
    found = hierarchy()
    for folder in found.folders.values() if found else ():
        _sweep(folder.parent)


def _close(found: Hierarchy) -> None:
    deadline = time.monotonic() + 2  # killed processes may take a moment to leave their groups
    for folder in [*found.stale, *found.folders.values()]:
        _rmdir_soon(folder, max(0.0, deadline - time.monotonic()))


def create(memory_mb: int, max_processes: int) -> Group | None:
    """A fresh group that holds at most `memory_mb` of memory (swap included) and `max_processes` tasks;
    None where the machine has no place for one (describe() says so at start-up)."""
    found = hierarchy()
    if found is None:
        return None
    with _lock:
        stale, found.stale = found.stale, []
    found.stale.extend(folder for folder in stale if not _rmdir(folder))
    name = f"sandbox-{next(_counter)}"
    folders: dict[str, Path] = {}
    for controller, parent in found.folders.items():
        folder = parent / name
        try:
            folder.mkdir()
        except OSError as e:
            for made in folders.values():
                _rmdir(made)
            raise RuntimeError(f"could not make the sandbox's cgroup {folder}: {e}") from None
        folders[controller] = folder
    group = Group(found, folders)
    limit, tasks = str(memory_mb << 20), str(max_processes)
    if found.version == 2:
        by_controller = {"": [("memory.max", limit), ("memory.swap.max", "0"), ("pids.max", tasks)]}
    else:
        by_controller = {"memory": [("memory.limit_in_bytes", limit), ("memory.memsw.limit_in_bytes", limit)],
                         "pids": [("pids.max", tasks)]}
    for controller, settings in by_controller.items():
        folder = folders[controller]
        for key, value in settings:
            if key in OPTIONAL and not (folder / key).exists():
                continue
            if not _write(folder / key, value):
                group.remove()
                raise RuntimeError(f"could not set {key} of the sandbox's cgroup {folder}")
    return group


def pins_oom_score() -> bool:
    """Whether the sandbox's oom_score_adj of 1000 is a floor its program cannot lower: only a writer
    with CAP_SYS_RESOURCE sets that floor (root, but not in every container: this one lacks it)."""
    try:
        status = Path("/proc/self/status").read_text()
        effective = int(status.split("\nCapEff:\t", 1)[1].split()[0], 16)
    except (OSError, IndexError, ValueError):
        return False
    return bool(effective >> 24 & 1)  # CAP_SYS_RESOURCE


def describe(memory_mb: int, max_processes: int) -> tuple[str, bool]:
    """One line for start-up, which limits hold for a whole sandbox here and which do not; and whether
    they all hold."""
    found, pinned = hierarchy(), pins_oom_score()
    oom = ("oom_score_adj pinned at 1000" if pinned else
           "oom_score_adj set to 1000 but not pinned (no CAP_SYS_RESOURCE): a program can lower it")
    if found is None:
        return ("sandbox limits: no cgroup here (not root, and no delegated cgroup v2 subtree with memory and "
                f"pids): memory is capped per process ({memory_mb} MB of address space) and in /tmp, not for "
                f"a sandbox as a whole; processes are capped per uid, and killed by their PID namespace; "
                f"{oom}"), False
    return (f"sandbox limits: a cgroup v{found.version} per sandbox: {memory_mb} MB of memory for all its "
            f"processes, tmpfs included, at most {max_processes} tasks, every process killed at the end; "
            f"{oom}"), pinned
