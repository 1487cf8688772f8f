"""Large CPU tensors from reused memory instead of fresh pages.

glibc's malloc serves a block above its mmap threshold (128 KiB, rising to at most 32 MiB as such blocks
are freed) with a fresh mapping and unmaps it on free, and frees memory at the heap's top back to the
system past 128 KiB. A fresh page costs a page fault and a zeroing on first touch, and on a CPU every
large tensor of a run is such a block, made and freed again at every decode step and micro-batch: the
KV cache's growth, the float32 copy of the keys, activations and logits. Measured 2026-11-28 (2-core AMD
EPYC VM, torch 2.13, idle): one `torch.cat` growing a 66 MB bfloat16 key cache by a position took 27 ms
with glibc's defaults and 4 ms with the settings below; the update pass of SmolLM2-135M over 256
completions of 8 tokens after a 300-token prompt 32.3 s and 15.2 s (bench/bench_roofline.py; more in
docs/benchmarks.md). `keep()` raises both thresholds, so such blocks come from the heap and freed
memory stays there for the next one: the process keeps up to `TRIM` bytes it no longer uses.
Numbers are unchanged: torch aligns every CPU tensor to 64 bytes whichever way the memory came.

Opt-in (`model.cpu_memory=keep`), not the default: a freed block does not serve the next aligned request
of the same size (torch's 64-byte `posix_memalign` asks for a little more), and a decode's tensors grow
by a position every step, so in a long decode the heap fragments and grows. Measured: a 432-row, 128-token
greedy evaluation of SmolLM2-135M grew past the machine's 24 GB and was killed, where glibc's settings ran it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt(3) parameters, from glibc's malloc.h
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP = 1 << 30  # blocks below 1 GiB come from the heap
TRIM = (1 << 31) - 1  # freed memory at the heap's top goes back to the system past 2 GiB (mallopt takes an int)
TOP_PAD = 64 << 20  # the heap grows by at least 64 MiB at a time: fewer system calls while it fills


def keep() -> bool:
    """Apply the settings above to this process's glibc malloc; False (nothing changed) where there is no
    glibc (macOS, musl) or it refuses one of them."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all([mallopt(M_MMAP_THRESHOLD, MMAP) == 1, mallopt(M_TRIM_THRESHOLD, TRIM) == 1,
                mallopt(M_TOP_PAD, TOP_PAD) == 1])
