"""Checkpoints that resume exactly: written atomically, found again by `resume=auto`.

A checkpoint is RUN_DIR/checkpoints/step_NNNNNN/ with
    agent_{i}/            the adapter in peft format (usable on its own)
    agent_{i}/train.pt    the exact trainable tensors, optimizer and scheduler state
    trainer.pt            step counters, data order, and per process: RNG states and env counters
    COMPLETE              written last
It is built in a temporary folder and renamed into place, so a crash mid-write leaves no folder
that `resume=auto` would pick; a folder whose files do not load is skipped with a warning.
With data parallelism only rank 0 reads and writes checkpoints; the others get their part from it.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

PREFIX = "step_"


def folder_of(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"{PREFIX}{step:06d}"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run_dir: Path, step: int, agents: Sequence[Any], updaters: Sequence[Any], trainer_state: dict[str, Any],
         keep: int) -> Path:
    final = folder_of(run_dir, step)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for agent, updater in zip(agents, updaters):
        folder = agent.save(tmp)
        torch.save({
            "params": [p.detach().cpu().clone() for p in updater.params],
            "optimizer": updater.optimizer.state_dict(),
            "scheduler": updater.scheduler.state_dict(),
        }, folder / "train.pt")
    torch.save(trainer_state, tmp / "trainer.pt")
    (tmp / "COMPLETE").write_text(json.dumps({"step": step}))
    shutil.rmtree(final, ignore_errors=True)  # a checkpoint of the same step from an earlier attempt
    os.replace(tmp, final)
    _prune(final.parent, keep)
    return final


def _prune(folder: Path, keep: int) -> None:
    done = sorted(p for p in folder.glob(f"{PREFIX}*") if (p / "COMPLETE").is_file())
    for old in done[: max(0, len(done) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


def candidates(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, newest first."""
    folder = run_dir / "checkpoints"
    return sorted((p for p in folder.glob(f"{PREFIX}*") if (p / "COMPLETE").is_file()), reverse=True) \
        if folder.is_dir() else []


def read(path: Path, agents: Sequence[Any], updaters: Sequence[Any]) -> dict[str, Any]:
    """A checkpoint's contents (tensors on the CPU), checked against the agents; changes nothing."""
    trainer_state = torch.load(path / "trainer.pt", weights_only=False, map_location="cpu")
    parts = [torch.load(path / agent.adapter / "train.pt", weights_only=False, map_location="cpu") for agent in agents]
    for part, updater in zip(parts, updaters):
        if len(part["params"]) != len(updater.params):
            raise ValueError(f"{path}: {len(part['params'])} adapter tensors, the model has {len(updater.params)}")
    return {"trainer": trainer_state, "agents": parts}


def apply(contents: dict[str, Any], updaters: Sequence[Any]) -> dict[str, Any]:
    """Restore adapters and optimizers in place from `read`'s contents; returns the trainer state."""
    with torch.no_grad():
        for part, updater in zip(contents["agents"], updaters):
            for target, value in zip(updater.params, part["params"]):
                target.copy_(value)
            updater.optimizer.load_state_dict(part["optimizer"])
            updater.scheduler.load_state_dict(part["scheduler"])
    return contents["trainer"]


def find(setting: str, run_dir: Path, agents: Sequence[Any], updaters: Sequence[Any]) -> dict[str, Any] | None:
    """`auto`: the newest checkpoint of run_dir that loads (None: start fresh); else a checkpoint path."""
    if setting != "auto":
        return read(Path(setting), agents, updaters)
    for path in candidates(run_dir):
        try:
            contents = read(path, agents, updaters)
        except Exception as e:  # truncated or corrupt: fall back to the one before
            print(f"magrpo: skipping checkpoint {path} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
                  file=sys.stderr)
            continue
        print(f"magrpo: resuming from {path}", file=sys.stderr)
        return contents
    return None


def truncate_log(path: Path, last_step: int) -> None:
    """Drop lines written after `last_step` (the interrupted run got further than its checkpoint)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError):
            break  # a half-written last line
    path.write_text("".join(kept))
