"""`python -m tests.kill_at POINT STEP key=value ...`: train.py that kills itself with SIGKILL at a
given point of step STEP, so kill -9 lands deterministically where a crash hurts most:
    rollouts    after the metrics line, mid-write of the step's first rollouts.jsonl record
    checkpoint  mid-write of the step's checkpoint (tensors written; no config, COMPLETE or rename)
    prune       right after the checkpoint's rename, before older ones are pruned"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from magrpo import checkpoint, run_io
from magrpo.cli import main


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def torn(file, line: str) -> None:
    file.write(line[: len(line) // 2])
    file.flush()
    die()


def install(point: str, step: int) -> None:
    if point == "rollouts":
        trees = run_io.RunWriter.log_trees

        def log_trees(self, records):
            if records and records[0]["step"] == step:
                torn(self.rollouts, run_io.json.dumps(records[0], default=str) + "\n")
            trees(self, records)
        run_io.RunWriter.log_trees = log_trees
    elif point == "checkpoint":
        save = checkpoint.torch.save

        def torch_save(obj, path, *args, **kwargs):
            save(obj, path, *args, **kwargs)
            if Path(path).name == "trainer.pt" and Path(path).parent.name.startswith(f".tmp-step_{step:06d}"):
                die()
        checkpoint.torch.save = torch_save
    elif point == "prune":
        prune = checkpoint._prune

        def _prune(folder, keep):
            if (folder / f"{checkpoint.PREFIX}{step:06d}").is_dir():
                die()
            prune(folder, keep)
        checkpoint._prune = _prune
    else:
        raise SystemExit(f"unknown kill point {point}")


if __name__ == "__main__":
    install(sys.argv[1], int(sys.argv[2]))
    sys.exit(main(sys.argv[3:]))
