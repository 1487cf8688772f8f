"""Does batching pay? Seconds per prompt of a magrpo training run at several batch sizes, per model and
joint mode, all in one process (issue 49, part 3).

    python bench/bench_batching.py                                          # tiny model and SmolLM2, ~30 min
    python bench/bench_batching.py --models tiny --batches 1 2 4 8          # ~2 min
    python bench/bench_batching.py --models smollm2-135m --modes align --pairs 2

The task is bench_vs_comlrl.py's (the length-ratio env and its between-turn feedback, N=2 agents, K=4,
T=2, 32 new tokens, temperature 1.0; `model.dtype=auto`, no evaluation), on the same `--prompts` problems at
every batch size: batch B trains them in prompts / B steps. Time per prompt is the sum of the trainer's own
`perf/step_s` over the steps (rollout and update, model loading excluded) over the prompts, with its parts:
generation, the update and the rest (scoring, feedback, bookkeeping). The batch sizes of one model and mode
run in turn, `--pairs` rounds, so a drift of the machine's load hits each alike. For each model and mode the
table ends with the factor by which time per prompt falls from the smallest batch to the largest (issue 49's
target: SmolLM2's factor at least the tiny model's). A benchmark that prints numbers: nothing here asserts on
speed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_comlrl import TASKS, T, cpu_state, log, machine_facts, run_magrpo

MODELS = {"tiny": None, "smollm2-135m": "smollm2-135m"}  # None: the task's own tiny model
# Training only (the env's default evaluation would be timed with the steps), in the dtype magrpo picks.
EXTRA = ("model.dtype=auto", "eval.at_start=false", "eval.at_end=false", "eval.every=0")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "smollm2-135m"])
    p.add_argument("--modes", nargs="+", choices=["align", "cross"], default=["align", "cross"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8], help="trees per step (default 1 8)")
    p.add_argument("--prompts", type=int, default=8, help="problems trained at every batch size (default 8)")
    p.add_argument("--pairs", type=int, default=1, help="rounds of the batch sizes in turn (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", action="store_true", help="skip each model's untimed warm-up run")
    p.add_argument("--verbose", action="store_true", help="show magrpo's own stderr lines")
    a = p.parse_args(argv)
    bad = [b for b in a.batches if b < 1 or a.prompts % b]
    if bad:
        p.error(f"--batches {bad}: each must divide --prompts ({a.prompts})")

    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    task = TASKS["length_ratio"]
    print(f"batching: N=2 agents, K=4, T={T}, 32 new tokens, {a.prompts} prompts per run, length-ratio env")
    for line in machine_facts(torch.get_num_threads(), torch.get_num_threads()):
        print("  " + line)
    print("  " + cpu_state())
    start = time.perf_counter()
    table = []
    for model in a.models:
        if not a.no_warmup:  # one-off first-call costs (lazy imports, the first forward) charged to no batch size
            log(f"{model}: warm-up (1 prompt, T=1) ...")
            run_magrpo(task, "align", 1, 1, 1, a.seed, quiet=not a.verbose, model=MODELS[model],
                       extra=EXTRA)
        for mode in a.modes:
            runs: dict[int, list[dict]] = {b: [] for b in a.batches}
            for _ in range(a.pairs):
                for b in a.batches:
                    r = run_magrpo(task, mode, a.prompts, b, T, a.seed, quiet=not a.verbose, model=MODELS[model],
                                   extra=EXTRA)
                    runs[b].append(r)
                    log(f"{model} {mode} batch {b}: {r['time_s'] / a.prompts:.2f} s/prompt "
                        f"(generation {r['gen_s'] / a.prompts:.2f}, update {r['update_s'] / a.prompts:.2f})")
            table.append((model, mode, runs))

    print(f"\nseconds per prompt (sum of perf/step_s / prompts; each round's figure, then the median)"
          f"  [{(time.perf_counter() - start) / 60:.1f} min]")
    head = (f"{'model':<13} {'mode':<6} {'batch':>5} {'s/prompt':>22} {'generation':>10} {'update':>7} {'rest':>6} "
            f"{'tokens/s':>8}")
    print(head)
    print("-" * len(head))
    for model, mode, runs in table:
        medians = {}
        for b, rs in runs.items():
            per = [r["time_s"] / a.prompts for r in rs]
            medians[b] = statistics.median(per)
            gen, upd = (statistics.median(r[k] / a.prompts for r in rs) for k in ("gen_s", "update_s"))
            tok = statistics.median(r["tokens"] / r["gen_s"] for r in rs)
            each = ", ".join(f"{x:.2f}" for x in per)
            print(f"{model:<13} {mode:<6} {b:>5} {each + ' -> ' + format(medians[b], '.2f'):>22} {gen:>10.2f} "
                  f"{upd:>7.2f} {medians[b] - gen - upd:>6.2f} {tok:>8.0f}")
        lo, hi = min(a.batches), max(a.batches)
        print(f"{model:<13} {mode:<6} batch {lo} -> {hi}: per-prompt time falls {medians[lo] / medians[hi]:.2f}x")
    print("  " + cpu_state())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
