"""The sandbox's system-call filter: a seccomp program, built with libseccomp (PyPI `pyseccomp`), that
bwrap installs (`--seccomp FD`) on its PID 1 and on the candidate before the candidate's Python starts.

It denies (EPERM) calls a graded program never needs and that an audit used against the sandbox or
against other runs: reaching into another process (PID 1 included), keeping or passing state across
runs and between concurrent sandboxes (the shared page cache of the read-only mounts, keyrings, file
locks and change notifications on files every sandbox sees), and kernel subsystems out of all
proportion to running a Python function. Everything else is allowed: CPython, subprocess,
multiprocessing and the OS's programs run as before. docs/environments.md lists each entry and why.
Calls of another ABI (x86's `int 0x80`, x32) kill the process: libseccomp's default for a foreign
architecture.
"""
from __future__ import annotations

import errno
import functools
import os

INSTALL = ("pip install pyseccomp (a ctypes binding; it needs libseccomp: Debian/Ubuntu apt-get install "
           "libseccomp2, Fedora dnf install libseccomp)")

# name -> why it is denied (the docs' table says the same)
DENIED = {
    "ptrace": "another process's memory and registers: PID 1's parent-death signal was cleared through it",
    "process_vm_readv": "another process's memory",
    "process_vm_writev": "another process's memory",
    "pidfd_getfd": "another process's open files",
    "kcmp": "compares other processes' kernel objects",
    "process_madvise": "another process's memory",
    "fadvise64": "evicts shared page cache (DONTNEED): a channel across runs through the stdlib's pages",
    "fadvise64_64": "the same on 32-bit ABIs",
    "arm_fadvise64_64": "the same on 32-bit ARM",
    "readahead": "loads shared page cache on demand",
    "mincore": "reads which pages of a shared file are cached",
    "cachestat": "reads the page-cache state of a shared file",
    "preadv2": "RWF_NOWAIT reads tell cached pages from the rest",
    "pwritev2": "the flags of preadv2, for writes",
    "memfd_create": "memory no rlimit counts (not RLIMIT_AS, not /dev/shm's size); without a cgroup, unbounded",
    "memfd_secret": "the same",
    "keyctl": "kernel keyrings: state that outlived a run",
    "add_key": "kernel keyrings",
    "request_key": "kernel keyrings",
    "flock": "locks on files every sandbox sees: a channel between concurrent runs",
    "inotify_init": "change and access notifications on shared files: a channel between runs",
    "inotify_init1": "the same",
    "inotify_add_watch": "the same",
    "fanotify_init": "the same, and more",
    "fanotify_mark": "the same",
    "io_uring_setup": "a second system-call interface that this filter does not see",
    "io_uring_enter": "the same",
    "io_uring_register": "the same",
    "perf_event_open": "hardware counters and kernel events: side channels, a large kernel surface",
    "bpf": "kernel programs",
    "userfaultfd": "stalls the kernel mid-copy: a tool of kernel exploits",
    "setns": "namespaces: the sandbox's are fixed",
    "unshare": "the same",
    "mount": "mounts (no capability for them inside; the kernel code stays out of reach)",
    "umount2": "the same",
    "pivot_root": "the same",
    "chroot": "the same",
    "open_tree": "the same",
    "move_mount": "the same",
    "fsopen": "the same",
    "fsconfig": "the same",
    "fsmount": "the same",
    "fspick": "the same",
    "mount_setattr": "the same",
    "name_to_handle_at": "file handles: opening files by handle escaped containers before",
    "open_by_handle_at": "the same",
    "init_module": "kernel modules, reboot, swap, clocks, accounting: the host's, never a program's",
    "finit_module": "the same",
    "delete_module": "the same",
    "kexec_load": "the same",
    "kexec_file_load": "the same",
    "reboot": "the same",
    "swapon": "the same",
    "swapoff": "the same",
    "acct": "the same",
    "quotactl": "the same",
    "syslog": "the kernel's log",
    "settimeofday": "the host's clock",
    "clock_settime": "the host's clock",
    "clock_adjtime": "the host's clock",
    "adjtimex": "the host's clock",
    "iopl": "I/O ports",
    "ioperm": "I/O ports",
    "lookup_dcookie": "kernel profiling",
}
# Newer than some libseccomp releases (cachestat came with Linux 6.5, libseccomp 2.5.5): denied by
# number where libseccomp does not know the name (one number on every architecture since Linux 5.1).
UNIFIED_NUMBERS = {"cachestat": 451}
# fcntl's lock, lease and notification commands (F_GETLK F_SETLK F_SETLKW, the F_OFD_ ones, F_SETLEASE
# F_GETLEASE F_NOTIFY): locks on shared files are a channel, as flock is; the rest of fcntl is needed.
FCNTL_DENIED = {"F_GETLK": 5, "F_SETLK": 6, "F_SETLKW": 7, "F_OFD_GETLK": 36, "F_OFD_SETLK": 37,
                "F_OFD_SETLKW": 38, "F_SETLEASE": 1024, "F_GETLEASE": 1025, "F_NOTIFY": 1026}
# prctl(PR_SET_PDEATHSIG, ...): a process that clears its parent-death signal outlives the trainer.
PR_SET_PDEATHSIG = 1


class FilterUnavailable(RuntimeError):
    """libseccomp or its binding is missing: the message says what to install."""


def _library():
    try:
        import pyseccomp
    except (ImportError, OSError, RuntimeError) as e:  # the binding raises RuntimeError without libseccomp
        raise FilterUnavailable(f"the sandbox's system-call filter needs libseccomp ({e}); {INSTALL}") from None
    return pyseccomp


def _number(seccomp, name: str) -> int | None:
    """The native number of `name`, or None where this architecture has no such call."""
    number = seccomp.resolve_syscall(seccomp.Arch.NATIVE, name)
    if number >= 0:
        return number
    if number == -1:  # libseccomp does not know the name at all (a call newer than it)
        return UNIFIED_NUMBERS.get(name)
    return None  # known, but not on this architecture (a pseudo number)


def _int_arg(seccomp, index: int, value: int):
    """Argument `index` equals `value` in its low 32 bits: the kernel reads fcntl's command and prctl's
    option as 32-bit ints, so a value with high bits set must not slip past the filter."""
    return seccomp.Arg(index, seccomp.MASKED_EQ, 0xFFFF_FFFF, value)


@functools.lru_cache(maxsize=1)
def program() -> bytes:
    """The compiled filter (classic BPF, what `bwrap --seccomp FD` reads); FilterUnavailable without
    libseccomp."""
    seccomp = _library()
    deny = seccomp.ERRNO(errno.EPERM)
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in DENIED:
        number = _number(seccomp, name)
        if number is not None:
            rules.add_rule(deny, number)
    for name in ("fcntl", "fcntl64"):
        number = _number(seccomp, name)
        for command in FCNTL_DENIED.values() if number is not None else ():
            rules.add_rule(deny, number, _int_arg(seccomp, 1, command))
    rules.add_rule(deny, "prctl", _int_arg(seccomp, 0, PR_SET_PDEATHSIG))
    fd = os.memfd_create("magrpo-seccomp", os.MFD_CLOEXEC)
    with os.fdopen(fd, "w+b") as file:
        rules.export_bpf(file)
        file.seek(0)
        return file.read()


def pipe() -> int:
    """A fresh read end holding the program, for one bwrap (it reads to EOF); the caller closes it."""
    read, write = os.pipe()
    data = program()
    try:
        if len(data) > 60_000:  # a pipe holds 64 KiB: never block the driver on its own write
            raise RuntimeError(f"the seccomp program has {len(data)} bytes, more than a pipe holds")
        os.write(write, data)
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)
    return read
