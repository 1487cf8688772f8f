"""Data parallelism over torch.distributed, as launched by torchrun (one process per rank).

Every rank holds all agents and expands its own contiguous share of the step's trees; the LoRA
gradients are summed over ranks (the loss is normalised by global token and sequence counts, so the
sum is the single-process gradient); rank 0 gathers the trees and per-rank numbers, logs them and
writes checkpoints. A single process is a World of size 1 where every collective is the identity.
"""
from __future__ import annotations

import datetime
import importlib
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, count: int) -> tuple[int, int]:
        """[start, stop) of this rank's share of `count` items: contiguous, sizes differ by at most one."""
        base, extra = divmod(count, self.size)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (self.rank < extra)

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) in place; the tensor must live on this rank's device."""
        if self.size > 1:
            torch.distributed.all_reduce(tensor)
        return tensor

    def sum_floats(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum of a list of numbers over ranks (float64, one collective)."""
        if self.size == 1:
            return [float(v) for v in values]
        return self.sum_(torch.tensor(values, dtype=torch.float64, device=_collective_device())).tolist()

    def sum_dict(self, values: dict[str, float]) -> dict[str, float]:
        """The same keys, each value summed over ranks (one collective)."""
        return dict(zip(values, self.sum_floats(list(values.values()))))

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size if self.is_main else None
        torch.distributed.gather_object(obj, out, dst=0)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.size == 1:
            return obj
        box = [obj if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on any rank (e.g. a signal that reached one process)."""
        return self.sum_floats([float(bool(flag))])[0] > 0

    def close(self) -> None:
        if self.size > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def is_main_process() -> bool:
    """Rank 0, or no torchrun; usable before the process group exists (start-up messages)."""
    return os.environ.get("RANK", "0") == "0"


def _collective_device() -> torch.device:
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def world_from_env(device_setting: str, timeout_min: float) -> World:
    """The World torchrun describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*);
    without WORLD_SIZE > 1, a single process. Process group: nccl when the model runs on CUDA, else gloo."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device_setting.startswith("cuda") or (device_setting == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(local_rank)
    if not torch.distributed.is_initialized():
        # torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when it is
        # first imported. Imported after init_process_group (transformers and peft import it while
        # loading the model), those defaults keep the process group alive past World.close(): gloo's
        # threads then die in interpreter shutdown, which can abort the process at exit ("terminate
        # called without an active exception", SIGABRT). Imported first, the defaults are None.
        importlib.import_module("torch.distributed.nn")
        torch.distributed.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=size,
                                             timeout=datetime.timedelta(minutes=timeout_min))
    return World(rank, size, local_rank)
