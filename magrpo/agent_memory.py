"""What full-weight agents (`agents[i].finetune=full`) need in memory, said and checked before their
copies load: a run that cannot fit stops with one line instead of swapping or being OOM-killed an hour
in. Counted: the weights, their gradients, AdamW's two moments (all in the weights' dtype) and, with
trainer.kl_coef > 0, a frozen reference copy; activations come on top (trainer.micro_batch_size)."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Sequence

import torch

from .errors import ConfigError

GB = 1e9


def parameter_count(folder: Path) -> int | None:
    """Weights in a local model folder, read from its safetensors headers (no tensor is loaded); None
    when it is not a local folder of safetensors files."""
    files = sorted(Path(folder).glob("*.safetensors")) if Path(folder).is_dir() else []
    if not files:
        return None
    total = 0
    for path in files:
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
    return total


def full_agent_bytes(params: int, dtype: torch.dtype, reference: bool) -> dict[str, float]:
    """Bytes one full agent holds, by part."""
    each = params * torch.finfo(dtype).bits // 8
    parts = {"weights": each, "gradients": each, "AdamW": 2 * each}
    if reference:
        parts["reference"] = each
    return parts


def available_bytes(device: torch.device) -> tuple[float, str]:
    """Memory free for new tensors on `device`, and where the figure comes from."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0]), f"free on {device}"
    free = _meminfo_available()
    limit = _cgroup_room()
    if limit is not None and (free is None or limit < free):
        return limit, "left under this process's cgroup memory limit"
    return (free, "MemAvailable") if free is not None else (float("inf"), "unknown")


def _meminfo_available() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_room() -> float | None:
    """The process's cgroup memory limit less its usage (v2, then v1); None without a limit."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = float(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or float(limit) >= 2**60:  # v1 writes "no limit" as a huge number
            return None
        return float(limit) - usage
    return None


def check_full_agents(agents: Sequence[tuple[int, str, str]], dtype: tuple[str, str], reference: bool,
                      device: torch.device) -> None:
    """Say what each full agent (index, model name, its folder or hub id) needs in `dtype` (name, why),
    with a `reference` copy or not, and stop with one line (ConfigError on its `agents[i].finetune`)
    when they all need more than `device` has free. A model that is not a local folder of safetensors
    (a hub id) is sized once it loads: unknown here, said so."""
    from .distributed import is_main_process

    dtype_name, why = dtype
    free, source = available_bytes(device)
    total, lines = 0.0, []
    for index, name, path in agents:
        params = parameter_count(Path(path))
        if params is None:
            lines.append(f"magrpo: agent {index} trains all weights of {name} ({dtype_name}, {why}); its size is "
                         f"known once it loads")
            continue
        parts = full_agent_bytes(params, getattr(torch, dtype_name), reference)
        need = sum(parts.values())
        total += need
        lines.append(f"magrpo: agent {index} trains all {params / 1e6:.1f}M weights of {name} ({dtype_name}, {why}): "
                     f"at least {need / GB:.2f} GB (" + " + ".join(f"{k} {v / GB:.2f}" for k, v in parts.items()) + ")")
        if total > free:
            raise ConfigError(f"agents[{index}].finetune",
                              f"full: the full agents up to this one need at least {total / GB:.2f} GB for weights, "
                              f"gradients and AdamW state, and {device} has {free / GB:.2f} GB ({source}); use "
                              f"finetune=lora, a smaller model, or fewer full agents")
    if is_main_process():
        for line in lines:
            print(line, file=sys.stderr)
        print(f"magrpo: full agents need at least {total / GB:.2f} GB of the {free / GB:.2f} GB available "
              f"({source}); activations come on top (trainer.micro_batch_size)", file=sys.stderr)
