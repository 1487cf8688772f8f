"""torchrun target that reports, on every rank, the gloo threads still alive after World.close().

With train.py overrides as arguments it trains (magrpo.cli.main, which closes the World); without,
it opens a World, makes the import that transformers and peft make while loading a model
(torch.distributed.nn, after init_process_group), runs a few collectives and closes it. Threads
that outlive close() are torn down in interpreter shutdown, where they can abort the process.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from magrpo.distributed import world_from_env


def gloo_threads() -> list[str]:
    names = (Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))
    return sorted(name for name in names if "gloo" in name)


def collectives() -> int:
    world = world_from_env("cpu", 1)
    import torch.distributed.nn  # noqa: F401

    for _ in range(20):
        world.sum_floats([1.0])
        world.gather({"numbers": list(range(100))})
        world.broadcast({"x": 1})
    world.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1:
        from magrpo.cli import main

        code = main(sys.argv[1:])
    else:
        code = collectives()
    print(f"rank {os.environ.get('RANK')}: gloo threads after close: {gloo_threads()}", file=sys.stderr)
    sys.exit(code)
