"""What `generation.overlap_chunks` saves when scoring and feedback wait on remote services.

Runs the same short training once per chunk count (in this process, through magrpo's CLI) on the
toy task with latency of `bench/latency_task.py` (scoring waits --score-ms per joint action,
feedback --feedback-ms per branch, as a sandbox or an expert behind HTTP would), and prints per chunk
count the mean step time and its parts over the steps after the first, the time the turn barrier
still waited for the last part's scoring (`overlap_wait_s`), the speed-up over one chunk, and
whether the rollouts (rollouts.jsonl) and training rewards are byte-identical to one chunk's. It
asserts nothing.

    python bench/bench_overlap.py                              # tiny model, chunks 1 2 4, ~1 min on 2 cores
    python bench/bench_overlap.py --score-ms 0 --feedback-ms 0 # no latency: what the smaller decodes cost
    python bench/bench_overlap.py --chunks 1 2 --extra trainer.batch_size=4

With one chunk a turn generates all its nodes, then scores, then asks for feedback; with C chunks it
generates 1/C of the nodes at a time and scores (and gives feedback to) each part in a second thread
while the next part generates (one part at a time: a single scoring thread). At best this hides
the generation of all parts but the first behind scoring, or the scoring of all parts but the last
behind generation, whichever is shorter; each decode batch is C times smaller.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")

ROOT = Path(__file__).resolve().parent.parent
for folder in (ROOT, ROOT / "bench"):  # envs/ lives at the repo root, latency_task here
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

PHASES = ("step", "gen", "reward", "feedback", "overlap_wait", "update")


def settings(args, chunks: int, run_dir: Path) -> list[str]:
    return ["plugins=[latency_task]", "env=slow_length_ratio", "external.mode=slow_length_ratio", "model=tiny",
            f"env.score_ms={args.score_ms}", f"env.feedback_ms={args.feedback_ms}",
            f"generation.overlap_chunks={chunks}", f"trainer.steps={args.steps}",
            f"trainer.batch_size={args.batch_size}", f"trainer.num_generations={args.k}",
            f"trainer.joint_mode={args.mode}", f"generation.max_new_tokens={args.max_new_tokens}",
            "logging.progress=false", "logging.wandb.mode=disabled", "eval.at_end=false", "checkpoint.every=0",
            f"logging.run_dir={run_dir}", *args.extra]


def run(args, chunks: int, run_dir: Path) -> tuple[dict[str, float], str, list[float]]:
    """Mean seconds per phase over the timed steps, the rollouts' md5 and the training reward per step."""
    from magrpo.cli import main as train_main

    with contextlib.redirect_stderr(io.StringIO()) as err:
        code = train_main(settings(args, chunks, run_dir))
    if code:
        sys.exit(f"overlap_chunks={chunks} failed (exit {code}):\n{err.getvalue()[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["step"] > 1] or records  # the first step warms up
    mean = {p: sum(r.get(f"perf/{p}_s", 0.0) for r in timed) / len(timed) for p in PHASES}
    digest = hashlib.md5((run_dir / "rollouts.jsonl").read_bytes()).hexdigest()
    return mean, digest, [r["train/reward_mean"] for r in records]


def main(argv=None) -> int:
    from bench_vs_comlrl import cpu_state

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4], help="overlap_chunks values (default 1 2 4)")
    p.add_argument("--score-ms", type=float, default=5.0, help="wait per scored joint action (default 5)")
    p.add_argument("--feedback-ms", type=float, default=100.0,
                   help="wait per feedback branch (default 100; external.max_concurrency at once)")
    p.add_argument("--steps", type=int, default=3, help="training steps; the first is not timed (default 3)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--mode", choices=["align", "cross"], default="align")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--extra", nargs="*", default=[], help="more key=value overrides for every run")
    args = p.parse_args(argv)
    if 1 not in args.chunks:
        args.chunks = [1, *args.chunks]  # the sequential schedule is the baseline of every comparison
    print(cpu_state())
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} CPUs; batch {args.batch_size} "
          f"trees, K={args.k}, {args.mode}, {args.max_new_tokens} new tokens, {args.steps} steps (the first not "
          f"timed); scoring waits {args.score_ms:g} ms per joint action, feedback {args.feedback_ms:g} ms per branch")
    print(f"{'chunks':>6} " + " ".join(f"{p + '_s':>15}" for p in PHASES) + f" {'speed-up':>8}  same rollouts")
    base: tuple[dict, str, list] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        for chunks in sorted(set(args.chunks)):
            mean, digest, rewards = run(args, chunks, Path(tmp) / f"c{chunks}")
            base = base or (mean, digest, rewards)
            same = "yes" if (digest, rewards) == base[1:] else "NO: rollouts differ from one chunk's"
            print(f"{chunks:>6} " + " ".join(f"{mean[p]:>15.3f}" for p in PHASES)
                  + f" {base[0]['step'] / mean['step']:>8.2f}  {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
