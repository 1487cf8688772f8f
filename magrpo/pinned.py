"""Kernels that compute alike on every x86 CPU this project runs on, and a child process pinned to them.

Why: a float sum's last bit depends on the instructions that compute it. torch's vectorized kernels
differ between its AVX2 and AVX-512 builds, MKL picks its matrix-product path by instruction set and
by CPU vendor, oneDNN by ISA (bf16 and AMX paths on newer CPUs), and numpy's loops too. Training
amplifies a last-bit difference: AdamW's first steps move each weight by about lr x sign(gradient), so
a near-zero gradient of another sign moves a weight by 2 x lr, and the runs part ways. A recipe that
converges on one CPU kind may then never converge on another (the tool_arith warm start did on an AMX
Xeon and on AVX2, and never in 6000 steps on an AMD EPYC with AVX512-BF16), and a golden file written
on one kind fails on the others.

Pinned, a run no longer depends on the kernels a machine's features pick: on one machine, imitating
AVX2 or AVX-512 changes nothing, and an AMD EPYC (AVX512-BF16) built the tool_arith warm start to the
same weights under each. Across CPU vendors it is not bit-exact: that pinned 500-step build wrote sha256
06d4244a... there and 1242e54f... on an Intel Xeon with AMX (2026-11-29; under the pins the only library
calls are MKL's SGEMM in CNR mode and torch's AVX2 kernels, and which one parts is not found). Short runs
agree (the golden rollouts pass on both), long ones part ways: a test that asserts a trained outcome
needs a margin that holds on any trajectory, not only on the one it was tuned on. The
pins must be in the environment before torch is imported, hence a child process:

    python -m magrpo.pinned train.py-ARGS...                    # a training run
    python -m magrpo.pinned --call module:function JSON         # function(**JSON); a MagrpoError: `error: ...`

Started without the pins, `python -m magrpo.pinned` starts itself again with them; the child checks
that they took effect before it does any work.
"""
from __future__ import annotations

import importlib
import json
import os
import platform
import subprocess
import sys
from typing import Any, Mapping, Sequence

from . import lifeline

PORTABLE_KERNELS = {
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's own vectorized kernels: the AVX2 build, not AVX-512's
    "MKL_CBWR": "COMPATIBLE,STRICT",  # MKL's one code path for Intel and AMD alike (its AVX2 branch is Intel-only)
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # no AVX-512, bf16 or AMX paths in oneDNN
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",  # numpy's AVX-512 loops (silently absent on AVX2)
    "OMP_NUM_THREADS": "1",  # sums split over threads add up in another order
    "MKL_NUM_THREADS": "1",
}


def supported() -> bool:
    """Pinning needs an x86-64 CPU with AVX2 (every machine this project's CI runs on)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def pinned_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    return {**(os.environ if base is None else base), **PORTABLE_KERNELS}


def missing() -> dict[str, str]:
    """The pins this process's environment lacks."""
    return {k: v for k, v in PORTABLE_KERNELS.items() if os.environ.get(k) != v}


def active() -> bool:
    """Whether this process runs pinned (its environment holds the pins and torch took them)."""
    import torch

    return not missing() and torch.backends.cpu.get_cpu_capability() == "AVX2"


def check() -> None:
    """Raise unless this process runs the pinned kernels (the child calls this before any work)."""
    import torch

    if missing():
        raise RuntimeError(f"pinned kernels: not set in this process: {missing()}")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2":
        raise RuntimeError(f"pinned kernels: torch runs {capability} kernels, not AVX2 (a CPU without AVX2?)")
    torch.set_num_threads(1)


def command(args: Sequence[str]) -> list[str]:
    """The argv of a pinned child running `python -m magrpo.pinned ARGS`."""
    return [sys.executable, "-m", "magrpo.pinned", *args]


def run(args: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """`python -m magrpo.pinned ARGS` in a child with the pins in its environment (`env=` adds to it),
    under a lifeline supervisor (magrpo.lifeline): it dies with this process, even by SIGKILL."""
    env = pinned_env({**os.environ, **kwargs.pop("env", {})})
    return subprocess.run(lifeline.command(command(args), own_pids=False), env=env, **kwargs)


def main(argv: Sequence[str]) -> int:
    check()
    if argv[:1] == ["--call"]:
        from .errors import MagrpoError

        module, function = argv[1].split(":")
        try:
            getattr(importlib.import_module(module), function)(**json.loads(argv[2]))
        except MagrpoError as e:  # one line for the parent (magrpo.sft.build_pinned reads it), no traceback
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    from magrpo.cli import main as train_main

    return train_main(list(argv))


if __name__ == "__main__":
    if missing():  # before torch loads: pin, start again
        os.execve(sys.executable, command(sys.argv[1:]), pinned_env())
    sys.exit(main(sys.argv[1:]))
