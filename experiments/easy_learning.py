"""Issue 32's experiment: does MAGRPO-MT raise held-out pass@1 of SmolLM2-135M on `env.dataset=easy`?

    python experiments/easy_learning.py all              # run every variant x seed, then report
    python experiments/easy_learning.py all --smoke      # the same pipeline on the tiny model, seconds
    python experiments/easy_learning.py report           # tables, plot and headline of what finished
    python experiments/easy_learning.py all --select 80 --out experiments/out/easy_selected
                                                         # train on the problems the untrained team sometimes passes

Variants (each one `train.py` run per seed, in-process through magrpo.cli, in out/runs/<variant>/seed<s>):
the method (2 agents, 2 turns, level_feedback), one agent with the same turns and feedback, and 2
agents in one turn. The untrained agents are each run's evaluation at step 0. Every variant samples
at least the method's completions per step (its batch is scaled; code_learning.batch_size). The
held-out split (`heldout`: other templates and other instances, never trained on) is evaluated
before the first step, every `eval_every` steps and after the last, greedy and sampled, per turn.

With `--select N`, the runs train only on the problems among the first N of the train split that
the untrained team (2 agents, one turn, the runs' generation settings) passes on some but not all of
`--select-samples` sampled paths (`select`, kept in OUT/selection.json): on the whole split about half
the GRPO groups had no reward spread, and the rest mostly differed in formatting. The held-out split
is never sampled for this and never narrowed.

A run that is stopped resumes from its last checkpoint when the same command is run again
(`resume=auto`, a checkpoint every `checkpoint_every` steps); finished runs are kept and checked to
have the same settings. docs/results/easy_learning.md holds the results and how they were made.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "experiments"):  # this checkout's magrpo, and code_learning beside this file
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import code_learning as shared  # noqa: E402  (the HumanEval experiment: variants, run checks, report tables)

METHOD = shared.REFERENCE  # "level_feedback": 2 agents, 2 turns
GRID = (METHOD, "single_agent", "one_turn")  # what `all` runs
# Opt-in (--variants early_stop): the method with early termination at the reward of a program that passes every
# test (2.1 = main 0.6 + syntax 0.5 + tests 1.0; a defined helper adds 0.4, so there 60% of the tests reach it)
# and a stopped branch's reward counted again at the turn it skipped: turn 2 spent only where turn 1 failed.
EARLY_STOP = "early_stop"
VARIANTS = {**shared.VARIANTS, EARLY_STOP: replace(shared.VARIANTS[METHOD], extra=(
    "trainer.early_termination_threshold=2.1", "trainer.early_termination_return=repeat"))}
VARIANT_NAMES = (*GRID, EARLY_STOP)


@dataclass(frozen=True)
class Sizes:
    model: str
    steps: int
    batch_size: int  # problems per step of the method; other variants sample at least as many completions
    k: int  # trainer.num_generations
    max_new_tokens: int
    lr: float
    eval_problems: int  # first this many held-out problems (0 = all 104)
    eval_samples: int  # sampled eval paths per problem (pass@1 sampled); a greedy path always runs
    eval_every: int  # also evaluate after every this many steps (0 = before the first and after the last)
    seeds: dict[str, tuple[int, ...]]  # variant -> seeds
    stop: tuple[str, ...] = ()  # generation.stop: end a completion after its first code block or function
    device: str = "auto"
    checkpoint_every: int = 5
    temperature: float = 0.7
    top_p: float = 0.9
    micro_batch_size: int = 0  # trainer.micro_batch_size (0: the trainer's default); less memory, the same update
    select_candidates: int = 0  # train on the problems among the first this many train ones that the untrained
    #                             team sometimes passes and sometimes fails (0: train on the whole train split)
    select_samples: int = 4  # sampled paths per candidate when selecting
    train_split: str = "train"  # the easy dataset's training split: train | train_reach (envs/code/easy.py, REACH)

    @property
    def runs(self) -> list[tuple[str, int]]:
        """(variant, seed), seed-major: an interrupted experiment has whole seeds."""
        order = [(seed, i, name) for i, (name, seeds) in enumerate(self.seeds.items()) for seed in seeds]
        return [(name, seed) for seed, _, name in sorted(order)]


# The closing fence of the first code block ends a reply (the opening ```python line does not match):
# without it SmolLM2 writes prose after its code until max_new_tokens (docs/backends.md, Stop strings).
# A top-level def after a blank line ends it too: the helper wrote one function after another, unfenced,
# until the limit (69% of replies cut at step 8 of the first runs); the env drops the kept "def".
# Sized for about 95 minutes of the 2-core CPU as two 1-thread queues side by side (the method's 3 seeds in
# one, the baselines' in the other; docs/results/easy_learning.md): 12 steps, held-out evaluation greedy
# and 1 sampled path on 30 problems before training, after step 6 and after step 12. The first runs
# (8 steps at lr 3e-4) moved only the reward's formatting levels: lr 5e-4 and 12 steps give the LoRA more room.
FULL = Sizes("smollm2-135m", steps=12, batch_size=1, k=4, max_new_tokens=128, lr=5e-4, eval_problems=30,
             eval_samples=1, eval_every=6,
             seeds={METHOD: (0, 1, 2), "single_agent": (0, 1, 2), "one_turn": (0, 1, 2), EARLY_STOP: (0, 1, 2)},
             stop=("\n```\n", "\n\ndef"), micro_batch_size=8)
SMOKE = Sizes("tiny", steps=1, batch_size=1, k=2, max_new_tokens=16, lr=1e-4, eval_problems=2, eval_samples=2,
              eval_every=0, seeds={METHOD: (0,), "single_agent": (0,), "one_turn": (0,), EARLY_STOP: (0,)},
              temperature=1.0, top_p=1.0)


def stop_setting(sizes: Sizes) -> list[str]:
    """`generation.stop` as the runs and the selection both pass it (none without stop strings)."""
    return [f"generation.stop={json.dumps(list(sizes.stop))}"] if sizes.stop else []


def overrides(name: str, seed: int, sizes: Sizes, run_dir: Path, train_split: str = "train") -> list[str]:
    """The `train.py` settings of one run: the results page prints them, so every variant's exact config is there."""
    v = VARIANTS[name]
    optional = stop_setting(sizes) + list(v.extra)
    optional += [f"trainer.micro_batch_size={sizes.micro_batch_size}"] if sizes.micro_batch_size else []
    return [
        f"model={sizes.model}", f"model.device={sizes.device}", f"external={v.feedback}", "env=code",
        "env.dataset=easy", f"env.train_split='{train_split}'", "env.eval_split=heldout", f"env.num_agents={v.agents}",
        f"trainer.num_turns={v.turns}", f"trainer.num_generations={sizes.k}",
        f"trainer.batch_size={shared.batch_size(v, sizes)}", f"trainer.steps={sizes.steps}", f"trainer.lr={sizes.lr}",
        f"trainer.seed={seed}", f"generation.max_new_tokens={sizes.max_new_tokens}",
        f"generation.temperature={sizes.temperature}", f"generation.top_p={sizes.top_p}", *optional,
        "eval.at_start=true", "eval.at_end=true", f"eval.every={sizes.eval_every}",
        f"eval.max_problems={sizes.eval_problems}", f"eval.num_samples={sizes.eval_samples}",
        f"logging.run_dir='{run_dir}'", "logging.wandb.mode=disabled", "logging.samples_every=0", "resume=auto",
        f"checkpoint.every={sizes.checkpoint_every}",
    ]


def run(sizes: Sizes, out: Path, variants: Sequence[str]) -> list[Path]:
    """Every (variant, seed) run not finished yet; finished runs are kept (same settings checked)."""
    import torch

    from magrpo.models import device_facts, pick_device, resolve_dtype
    from magrpo.tree import tree_size

    # model.dtype=auto differs by CPU (bfloat16 with AMX, else float32): each record says what it was
    dtype = resolve_dtype("auto", device_facts(pick_device(sizes.device)))[0]
    train_split = sizes.train_split
    if sizes.select_candidates:
        path = out / "selection.json"
        selection = json.loads(path.read_text()) if path.is_file() else select(sizes, out)
        check_same_selection_settings(selection, sizes)
        train_split = split_of(selection["selected"], sizes.train_split)
    dirs = []
    for name, seed in sizes.runs:
        if name not in variants:
            continue
        v = VARIANTS[name]
        run_dir = out / "runs" / name / f"seed{seed}"
        dirs.append(run_dir)
        argv = overrides(name, seed, sizes, run_dir, train_split)
        per_step = tree_size("align", sizes.k, v.agents, v.turns)[1] * shared.batch_size(v, sizes)
        info = {"variant": name, "seed": seed, **asdict(v), "completions_per_step": per_step,
                "torch_threads": torch.get_num_threads(), "dtype": dtype,
                "sizes": asdict(sizes), "overrides": argv}
        train_or_keep(run_dir, argv, info, sizes.steps)
    return dirs


def train_or_keep(run_dir: Path, argv: list[str], info: dict, steps: int) -> None:
    """Train one run (`train.py argv`, resuming a stopped one) and write its experiment.json (`info`
    plus date, time and machine); a run finished before is kept, once checked to have had `argv`."""
    from magrpo.cli import main as train_main

    label = f"{info['variant']} seed {info['seed']}"
    if shared.finished(run_dir, steps):
        check_same_overrides(run_dir, argv)
        print(f"run: {label} already finished in {run_dir}", file=sys.stderr)
        if not (run_dir / "experiment.json").is_file():  # stopped between training and this record
            shared.write_info(run_dir, {**info, **shared._provenance(time.perf_counter()),
                                        **shared.timed_by_metrics(run_dir)})
        return
    print(f"run: {label} -> {run_dir}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    code = train_main(argv)
    if code > 128:  # stopped by a signal (a job's time limit), after a checkpoint: not a failure
        raise SystemExit(f"run: {label} stopped (exit {code}); the same command resumes it from its last checkpoint")
    if code:
        raise SystemExit(f"run: {label} failed (exit {code}); see {run_dir}")
    shared.write_info(run_dir, {**info, **shared._provenance(start)})


# ------------------------------------------------------------------------------------------ select


def select_settings(sizes: Sizes) -> list[str]:
    """The untrained team as the method samples it (2 agents, the same generation settings), one turn."""
    stop = stop_setting(sizes)
    return [f"model={sizes.model}", f"model.device={sizes.device}", "env=code", "env.dataset=easy",
            f"env.train_split={sizes.train_split}", "env.eval_split=heldout", "env.num_agents=2", "trainer.num_turns=1",
            f"generation.max_new_tokens={sizes.max_new_tokens}", f"generation.temperature={sizes.temperature}",
            f"generation.top_p={sizes.top_p}", *stop, "eval.at_start=false", "eval.every=0", "eval.at_end=false",
            "logging.wandb.mode=disabled"]


def keep(rates: dict[str, float]) -> list[str]:
    """Task ids, in dataset order, that some sampled paths pass and some fail: every GRPO group on them
    can be told apart by passing, where most groups of the whole split differ only in formatting."""
    return [task_id for task_id, rate in rates.items() if 0 < rate < 1]


def select(sizes: Sizes, out: Path, seed: int = 0) -> dict:
    """Sample the untrained team `select_samples` times on each of the first `select_candidates` train
    problems; write out/selection.json with the kept task ids and every candidate's pass rate."""
    from magrpo.cli import compose

    settings = select_settings(sizes)
    start = time.perf_counter()
    rates, rewards = shared.sample_candidates(compose(settings), sizes.select_candidates, sizes.select_samples,
                                              seed, lambda rates, _: len(keep(rates)))
    selection = {"selected": keep(rates), "rates": rates, "rewards": rewards, "samples": sizes.select_samples,
                 "candidates": sizes.select_candidates, "settings": settings, "seed": seed,
                 **shared._provenance(start)}
    shared.save_selection(selection, out / "selection.json")
    print(f"select: {len(selection['selected'])} of {len(rates)} train problems kept -> {out / 'selection.json'}",
          file=sys.stderr)
    return selection


def check_same_selection_settings(selection: dict, sizes: Sizes) -> None:
    """A selection.json kept from an earlier call must come from these sizes' sampling."""
    want = (select_settings(sizes), sizes.select_samples, sizes.select_candidates)
    if (selection.get("settings"), selection.get("samples"), selection.get("candidates")) != want:
        raise SystemExit("select: the selection.json kept in the output folder was sampled with other settings; "
                         "pass another --out, or remove it (and the runs beside it) to select again")


def split_of(task_ids: Sequence[str], split: str = "train") -> str:
    """An HF split spec of the easy training split `split` that picks these task ids, in dataset order,
    with neighbouring rows merged: `train[3:5]+train[9:10]`."""
    from magrpo.envs.code.problems import load_problems

    order = {r["task_id"]: i for i, r in enumerate(load_problems("easy", split))}
    unknown = [t for t in task_ids if t not in order]
    if unknown or not task_ids:
        raise SystemExit(f"selection: {unknown[:3] or 'no problems'} not in the easy {split} split")
    rows = sorted(order[t] for t in task_ids)
    spans: list[list[int]] = []
    for row in rows:
        if spans and spans[-1][1] == row:
            spans[-1][1] = row + 1
        else:
            spans.append([row, row + 1])
    return "+".join(f"{split}[{a}:{b}]" for a, b in spans)


# Settings that change memory and speed but not the update (micro-batches accumulate one gradient):
# a run kept from a call with another value still counts.
SAME_UPDATE = ("trainer.micro_batch_size=",)


def check_same_overrides(run_dir: Path, argv: Sequence[str]) -> None:
    """A finished run kept from an earlier call must have had these settings: the ones its
    experiment.json recorded, else (stopped before writing it) those config.json shows."""
    record = run_dir / "experiment.json"
    kept = json.loads(record.read_text()).get("overrides") if record.is_file() else None
    argv = [a for a in argv if not a.startswith(SAME_UPDATE)]
    if kept is None:  # the config check decodes JSON values, and config.json keeps stop strings as typed
        shared.check_same_settings(run_dir, [a for a in argv if not a.startswith("generation.stop=")])
        return
    differ = sorted(set(a for a in kept if not a.startswith(SAME_UPDATE)) ^ set(argv))
    if differ:
        raise SystemExit(f"run: {run_dir} finished with other settings ({', '.join(differ[:4])}); "
                         f"pass another --out (or the options that run had)")


# ------------------------------------------------------------------------------------------ report

PASS_KEY = "pass@1_greedy"


def last_turn_pass(records: list[dict], turns: int, step: str) -> float | None:
    """Held-out greedy pass@1 at the variant's last turn, before training (step="before") or after."""
    before, after = shared.before_after(records)
    return (before if step == "before" else after).get(f"eval/turn_{turns - 1}/{PASS_KEY}")


def headline(runs: dict[str, dict[int, tuple[list[dict], dict]]]) -> str:
    """One sentence for the README: the method's held-out pass@1 before -> after (mean ± sd over seeds),
    whether the rise beats its seed spread, and the best baseline's after-training pass@1."""
    def scores(name: str, step: str) -> list[float]:
        seeds = runs.get(name, {})
        values = [last_turn_pass(records, info["turns"], step) for records, info in seeds.values()]
        return [v for v in values if v is not None]

    before, after = scores(METHOD, "before"), scores(METHOD, "after")
    if not before or not after:
        return f"No finished run of the method ({METHOD}) yet."
    changes = [a - b for a, b in zip(after, before)]
    # a rise "beyond the seed spread": the mean change exceeds the sd of the changes (needs 2+ seeds)
    beats = len(changes) > 1 and statistics.mean(changes) > statistics.stdev(changes)
    baselines = {name: sum(s) / len(s) for name in runs if name in GRID[1:] and (s := scores(name, "after"))}
    problems = next(iter(runs[METHOD].values()))[1].get("sizes", {}).get("eval_problems")
    on = f" on {problems} held-out problems" if problems else ""  # 0.05 is one problem of 20: say so
    # in problems too: with few problems and seeds, "larger than the spread" can be one problem each
    solved = f"; {statistics.mean(changes) * problems:+.1f} of {problems} problems" if problems else ""
    text = (f"Held-out greedy pass@1 of SmolLM2-135M with MAGRPO-MT (2 agents, 2 turns, level_feedback) on "
            f"env.dataset=easy{on}: {shared.mean_sd(before)} before -> {shared.mean_sd(after)} after "
            f"({len(after)} seed(s); change {shared.mean_sd(changes)}, "
            f"{'larger' if beats else 'not larger'} than its seed spread{solved})")
    if baselines:
        best = max(baselines, key=baselines.get)
        text += (f"; the best baseline, {best}, reaches {shared.mean_sd(scores(best, 'after'))} "
                 f"({len(scores(best, 'after'))} seed(s))")
    return text + "."


def configs(runs: dict[str, dict[int, tuple[list[dict], dict]]]) -> str:
    """Markdown: the exact `train.py` settings of every variant (seed 0's; the seeds differ in trainer.seed)."""
    lines = ["**Exact settings per variant** (`python train.py <these>`; the seeds differ only in trainer.seed "
             "and logging.run_dir)", ""]
    for name, seeds in runs.items():
        info = next(iter(seeds.values()))[1]
        settings = [a for a in info.get("overrides", []) if not a.startswith("logging.run_dir")]
        lines.append(f"- {name}: `{' '.join(settings)}`")
    return "\n".join(lines) + "\n"


def selection_line(out: Path) -> list[str]:
    """What the runs trained on, when a selection chose it: one sentence, else nothing."""
    path = out / "selection.json"
    if not path.is_file():
        return []
    sel = json.loads(path.read_text())
    rates = sel["rates"]
    kept = [rates[t] for t in sel["selected"]]
    return [f"Training problems: {len(kept)} of the first {len(rates)} train problems, those whose untrained "
            f"pass rate ({sel['samples']} sampled paths, 2 agents, 1 turn) was strictly between 0 and 1 "
            f"(mean {sum(kept) / max(len(kept), 1):.2f}; all {len(rates)} candidates: "
            f"{sum(rates.values()) / len(rates):.2f}); selected on {sel['date']} in {sel['seconds'] / 60:.0f} min."]


def report(out: Path, doc: Path, image: Path) -> str:
    """Write the Markdown results (headline, provenance, tables, settings) to `doc` and the plot to `image`."""
    runs = shared.load_runs(out)
    if not runs:
        raise SystemExit(f"report: no finished runs under {out / 'runs'} (run `run` first)")
    shared.plot(runs, image)
    infos = [i for seeds in runs.values() for _, i in seeds.values()]
    dates = sorted(i["date"] for i in infos)
    machines = sorted({i["machine"] for i in infos})
    minutes = sum(i["seconds"] for i in infos) / 60
    head = [f"**Headline:** {headline(runs)}", "",
            f"Runs finished between {dates[0]} and {dates[-1]} on {'; '.join(machines)}. "
            f"Time: {len(infos)} runs, {minutes:.0f} min in all ({minutes / 60:.2f} h).",
            f"Sizes: {json.dumps(infos[0].get('sizes', 'not recorded'))}.", *selection_line(out),
            "", f"![results]({os.path.relpath(image, doc.parent)})", ""]
    missing = shared.unfinished(out)
    if missing:  # a partial report must say so
        head[-2:-2] = [f"**Not in these tables** (no experiment.json: running, stopped or failed): "
                       f"{', '.join(missing)}.", ""]
    text = ("\n".join(head) + "\n" + shared.comparison(runs) + "\n" + shared.table(runs) + shared.per_step(runs)
            + "\n**Training diagnostics** (mean ± sd over seeds)\n\n" + shared.diagnostics(runs) + "\n"
            + configs(runs))
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    return text


# ------------------------------------------------------------------------------------------ CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["select", "run", "report", "all"])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model, 1 step, 1 seed per variant (tests/test_easy_learning_experiment.py "
                             "trains this way)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default experiments/out/easy_learning, or ..._smoke)")
    parser.add_argument("--variants", nargs="+", choices=VARIANT_NAMES, default=list(GRID),
                        help=f"default: {' '.join(GRID)}; {EARLY_STOP}: the method with early termination "
                             "(opt-in)")
    parser.add_argument("--steps", type=int, default=None, help=f"training steps (default {FULL.steps})")
    parser.add_argument("--eval-every", type=int, default=None, help=f"default {FULL.eval_every}")
    parser.add_argument("--lr", type=float, default=None, help=f"default {FULL.lr}")
    parser.add_argument("--eval-problems", type=int, default=None,
                        help=f"first this many held-out problems (default {FULL.eval_problems}; 0 = all)")
    parser.add_argument("--eval-samples", type=int, default=None,
                        help=f"sampled eval paths per problem beside the greedy one (default {FULL.eval_samples})")
    parser.add_argument("--seeds", type=int, default=None, help="run seeds 0..N-1 of every variant (default: "
                        + ", ".join(f"{n} {len(s)}" for n, s in FULL.seeds.items()) + ")")
    parser.add_argument("--seed", type=int, action="append", default=None,
                        help="run only this seed of each variant's seeds (repeatable): e.g. a third process "
                             "on a third core")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="trainer.micro_batch_size (default: the trainer's, 32): smaller needs less memory "
                             "for the same update (SmolLM2's update at 32 rows peaks at ~10-15 GB)")
    parser.add_argument("--select", type=int, default=None, dest="select_candidates",
                        help="train only on the problems among the first N train ones whose untrained pass rate "
                             "(--select-samples sampled paths, 2 agents, 1 turn) is strictly between 0 and 1; "
                             "`select` samples them into OUT/selection.json, `run` trains on it "
                             f"(default {FULL.select_candidates}: the whole train split)")
    parser.add_argument("--select-samples", type=int, default=None, help=f"default {FULL.select_samples}")
    parser.add_argument("--train-split", default=None, choices=["train", "train_reach"],
                        help="the easy dataset's training split: train_reach keeps the templates the untrained "
                             f"model passes at all (envs/code/easy.py, REACH; default {FULL.train_split})")
    parser.add_argument("--device", default=None, help="model.device (default auto)")
    parser.add_argument("--doc", type=Path, default=None, help="results Markdown (default OUT/results.md)")
    parser.add_argument("--image", type=Path, default=None, help="plot PNG (default OUT/results.png)")
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    for field, value in (("steps", args.steps), ("eval_every", args.eval_every), ("lr", args.lr),
                         ("device", args.device), ("eval_problems", args.eval_problems),
                         ("eval_samples", args.eval_samples), ("micro_batch_size", args.micro_batch_size),
                         ("select_candidates", args.select_candidates), ("select_samples", args.select_samples),
                         ("train_split", args.train_split)):
        if value is not None:
            sizes = replace(sizes, **{field: value})
    if args.seeds is not None:
        sizes = replace(sizes, seeds={name: tuple(range(args.seeds)) for name in sizes.seeds})
    if args.seed is not None:
        sizes = replace(sizes, seeds={name: tuple(x for x in seeds if x in args.seed)
                                      for name, seeds in sizes.seeds.items()})
    out = args.out or ROOT / "experiments" / "out" / ("easy_learning_smoke" if args.smoke else "easy_learning")
    from magrpo import envs, external  # noqa: F401  (fills the env and feedback registries)

    if args.command == "select":
        if not sizes.select_candidates:
            parser.error("select needs --select N (how many train problems are candidates)")
        select(sizes, out)
    if args.command in ("run", "all"):
        run(sizes, out, args.variants)
    if args.command in ("report", "all"):
        print(report(out, args.doc or out / "results.md", args.image or out / "results.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
