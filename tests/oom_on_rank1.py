"""train.py for torchrun tests, where rank 1 alone runs out of memory in its update forward once it
gets a micro-batch of more than 4 rows (the out-of-memory guard must retry without desynchronising
the gradient all-reduce)."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import magrpo.update as update
from magrpo.cli import main

real = update.forward_logprobs


def forward_logprobs(model, batch, *args, **kwargs):
    if os.environ.get("RANK") == "1" and batch.targets.shape[0] > 4:
        raise torch.OutOfMemoryError("CUDA out of memory (raised by the test on rank 1)")
    return real(model, batch, *args, **kwargs)


update.forward_logprobs = forward_logprobs

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
