"""Step time of one process against `torchrun --nproc_per_node=P` on the same run.

Runs `train.py` once per process count with identical settings (the effective batch is the same:
each process expands batch_size / P trees), reads `metrics.jsonl` and prints, per process count,
the mean step time and its parts (generation, reward, update) over the steps after the first, the
generated tokens per second, and the speed-up over one process. It asserts nothing.

    python bench/bench_dp.py                         # tiny model, 1 and 2 processes, ~1.5 min on 2 cores
    python bench/bench_dp.py --procs 1 2 4 --batch-size 16 --extra model=smollm2-135m

Threads: torchrun gives each process OMP_NUM_THREADS=1; the single process keeps torch's default
(all cores) unless --threads is given, which then applies to every process (OMP_NUM_THREADS).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(procs: int, args, run_dir: Path) -> tuple[list[dict], float]:
    settings = ["env=length_ratio", "model=tiny", "external=length_ratio", "logging.progress=false",
                "logging.wandb.mode=disabled", "logging.rollouts=false", "eval.at_end=false", "checkpoint.every=0",
                f"trainer.steps={args.steps}", f"trainer.batch_size={args.batch_size}",
                f"trainer.num_generations={args.k}", f"generation.max_new_tokens={args.max_new_tokens}",
                f"trainer.joint_mode={args.mode}", f"logging.run_dir={run_dir}", *args.extra]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"] \
        if procs > 1 else [sys.executable]
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    start = time.perf_counter()
    proc = subprocess.run([*launcher, "train.py", *settings], cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{procs} process(es) failed:\n{proc.stderr[-2000:]}")
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--mode", default="align")
    parser.add_argument("--threads", type=int, default=0,
                        help="OMP_NUM_THREADS for every process (0: launcher default)")
    parser.add_argument("--extra", nargs="*", default=[], help="more key=value overrides")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs; batch {args.batch_size} trees, K={args.k}, {args.mode}, "
          f"{args.max_new_tokens} new tokens, {args.steps} steps (the first is not timed)")
    print(f"{'procs':>5} {'step_s':>8} {'gen_s':>8} {'reward_s':>8} {'update_s':>8} "
          f"{'tok/s':>8} {'wall_s':>8} {'speed-up':>8}")
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for procs in args.procs:
            rows, wall = run(procs, args, Path(tmp) / f"p{procs}")
            timed = [r for r in rows if r["step"] > 1] or rows
            keys = ("perf/step_s", "perf/gen_s", "perf/reward_s", "perf/update_s", "perf/tokens_per_s")
            mean = {key: sum(r[key] for r in timed) / len(timed) for key in keys}
            step_s = mean["perf/step_s"]
            base = base or step_s
            print(f"{procs:>5} {step_s:>8.2f} {mean['perf/gen_s']:>8.2f} {mean['perf/reward_s']:>8.2f} "
                  f"{mean['perf/update_s']:>8.2f} {mean['perf/tokens_per_s']:>8.0f} {wall:>8.1f} {base / step_s:>8.2f}")


if __name__ == "__main__":
    main()
