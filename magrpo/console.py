"""What a run prints: the progress bar, the compact metrics line, and stop signals (SIGTERM/SIGINT
finish the current step and write a checkpoint)."""
from __future__ import annotations

import signal
import sys
import threading
import time


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


class StopSignals:
    """SIGTERM/SIGINT end the run after the current step, with a checkpoint (a second one stops now)."""

    REPEAT_S = 2.0  # Ctrl-C under torchrun arrives twice at once: from the terminal and forwarded by torchrun

    def __init__(self):
        self.signal: signal.Signals | None = None
        self.since = 0.0
        self.previous = {}
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:
            if time.monotonic() - self.since < self.REPEAT_S:
                return
            raise KeyboardInterrupt
        self.signal, self.since = signal.Signals(signum), time.monotonic()
        print(f"\nmagrpo: {self.signal.name}: finishing this step, then writing a checkpoint", file=sys.stderr)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
