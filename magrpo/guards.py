"""What keeps a run going through trouble it can survive: an out-of-memory halves a batch setting
once and retries; updates with a NaN/inf loss or gradient are skipped, counted, and stop the run
only when they repeat."""
from __future__ import annotations

import sys
from typing import Callable, TypeVar

import torch

from .errors import TrainingError

T = TypeVar("T")


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error)


class Halvable:
    """A batch setting that an out-of-memory halves for the rest of the run."""

    def __init__(self, setting: str, value: int):
        self.setting, self.value = setting, value

    def halve(self) -> int:
        self.value = max(1, self.value // 2)
        return self.value


def oom_retry(run: Callable[[], T], shrink: Callable[[], int | None], setting: str) -> T:
    """run(); on out-of-memory, shrink() (halves `setting`, returns the new size) and run once more.
    A second out-of-memory (or a first one where shrink() returns None: nothing to shrink) stops
    training with a line naming the setting; the last checkpoint stays."""
    try:
        return run()
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    size = shrink()
    if size is None:
        raise TrainingError(f"out of memory; lower {setting}; the last checkpoint is intact")
    from tqdm import (
        tqdm,  # a warning even in quiet mode; tqdm.write keeps a progress bar intact
    )

    tqdm.write(f"magrpo: out of memory; retrying with {setting}={size} (kept for the rest of the run)", file=sys.stderr)
    try:
        return run()
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
        raise TrainingError(f"out of memory again with {setting}={size}; lower {setting} (or the batch size, "
                            f"K, max_new_tokens); the last checkpoint is intact") from None


class BadSteps:
    """Counts steps in a row where some agent's update was skipped (NaN/inf loss or gradient)."""

    def __init__(self, limit: int):
        self.limit, self.in_row = limit, 0

    def check(self, step: int, agent_stats: list[dict[str, float]]) -> None:
        """Raises TrainingError after more than `limit` such steps in a row."""
        bad = [a for a, stats in enumerate(agent_stats) if stats["skipped_updates"]]
        self.in_row = self.in_row + 1 if bad else 0
        if self.in_row > self.limit:
            raise TrainingError(f"{self.in_row} steps in a row had a NaN/inf loss or gradient (agents {bad}; last at "
                                f"step {step}); stopping (trainer.max_bad_steps={self.limit}). Lower trainer.lr "
                                f"or check the rewards; the last checkpoint is intact")
