"""What a run prints: the progress bar, the compact metrics line, and stop signals (SIGTERM/SIGINT
stop a run that is starting at once, and finish the current step and write a checkpoint once it runs)."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """transformers' own bars (loading and writing weights) off: the run's progress lines say what runs."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def startup_line(cfg, num_agents: int, processes: int, step_size: tuple[int, int], run_dir,
                 dtype: tuple[str, str]) -> str:
    """What the run will do, before the first step: the tree's shape and its size per step, and the
    weights dtype with why (`dtype`: models.model_dtype's (name, reason))."""
    trainer = cfg.trainer
    procs = f", {processes} processes" if processes > 1 else ""
    nodes, completions = step_size
    name, why = dtype
    return (
        f"magrpo: {num_agents} agent(s), K={trainer.num_generations}, T={trainer.num_turns}, "
        f"{trainer.joint_mode}{procs}; dtype {name} ({why}); "
        f"up to {nodes:,} nodes and {completions:,} completions per step; run dir {run_dir}"
    )


def summary_line(step: int, steps: int, m: dict[str, float], num_agents: int, num_turns: int) -> str:
    """The compact console line: rewards per turn, loss per agent, speed, eval when it ran."""
    turns = " ".join(f"t{t} {m[f'train/turn_{t}/reward_mean']:.3f}" for t in range(num_turns)
                     if f"train/turn_{t}/reward_mean" in m)
    losses = " ".join(f"a{a} {m[f'train/agent_{a}/loss']:+.3g}" for a in range(num_agents))
    line = (f"step {step}/{steps} | reward {m['train/reward_mean']:.3f} ({turns}) | loss {losses} | "
            f"{m['perf/tokens_per_s']:.0f} tok/s | {m['perf/step_s']:.1f} s/step")
    last = f"eval/turn_{num_turns - 1}/pass@1_greedy"
    return line + (f" | eval pass@1 {m[last]:.3f}" if last in m else "")


class NoBar:
    """The progress bar's interface, printing nothing (quiet mode, ranks other than 0)."""

    def write(self, s, file=None): ...
    def update(self, n): ...
    def set_postfix(self, **kw): ...
    def close(self): ...


def progress_bar(total: int, enabled: bool, initial: int = 0):
    if not enabled:
        return NoBar()
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="magrpo", unit="step", dynamic_ncols=True)


def phase_lines(bar, enabled: bool, head: str, quiet_s: float = 0.0):
    """say(done): one line per phase of a task that can take minutes, `magrpo: HEAD: DONE (N s)` with the
    seconds since this call, through the progress bar; said only once the task has run quiet_s seconds
    (a quick one says nothing) and where `enabled` (rank 0)."""
    start = time.perf_counter()

    def say(done: str) -> None:
        elapsed = time.perf_counter() - start
        if enabled and elapsed >= quiet_s:
            bar.write(f"magrpo: {head}: {done} ({elapsed:.0f} s)", file=sys.stderr)

    return say


class Interrupted(KeyboardInterrupt):
    """A stop signal while the run starts (before its first step): raised at once in the main thread. A
    KeyboardInterrupt, so that no `except Exception` of a library that is loading a model swallows it."""

    def __init__(self, signum: int, message: str = ""):
        self.signum, self.exit_code = int(signum), 128 + int(signum)
        super().__init__(message or f"{signal.Signals(signum).name} during start-up, before the first step")


class StopSignals:
    """SIGTERM/SIGINT from the first line of start-up to the run's end. While the run starts (models
    load or build, the resume is decided) a signal stops it at once: `Interrupted` is raised in the
    main thread, and what the run made is cleaned up on the way out. Once the run is `ready()`, a
    signal ends it after the current step, with a checkpoint. Either way a second signal (more than
    REPEAT_S later) ends the process at once, whatever user code is doing (a hung feedback function
    included): one line and 128 + its number, as a shell reports a process that signal ended."""

    REPEAT_S = 2.0  # Ctrl-C under torchrun arrives twice at once: from the terminal and forwarded by torchrun

    def __init__(self):
        self.signal: signal.Signals | None = None
        self.since = 0.0
        self.starting = True
        self.previous = {}
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)

    def ready(self) -> None:
        """Start-up is over: from now on a signal finishes the step first."""
        self.starting = False

    def _handle(self, signum, frame) -> None:
        sig = signal.Signals(signum)
        if self.signal is not None:
            if time.monotonic() - self.since < self.REPEAT_S:
                return
            # os.write and os._exit: no buffered stream that the interrupted code may be writing, no
            # thread to join (a feedback pool's workers stuck in user code), no atexit hook that waits
            line = (f"\nstopped: {sig.name} again: stopped at once, without a checkpoint; resume=auto continues from "
                    f"the last complete checkpoint, if any\n")
            os.write(sys.stderr.fileno(), line.encode())
            os._exit(128 + signum)
        self.signal, self.since = sig, time.monotonic()
        if self.starting:
            raise Interrupted(sig)
        print(f"\nmagrpo: {sig.name}: finishing this step, then writing a checkpoint", file=sys.stderr)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def __enter__(self) -> "StopSignals":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
