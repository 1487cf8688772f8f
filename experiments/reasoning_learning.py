"""Issue 48's experiment: does MAGRPO-MT raise SmolLM2-135M's held-out accuracy on a reasoning-gym task?

    python experiments/reasoning_learning.py untrained   # each arm's held-out accuracy before training (first)
    python experiments/reasoning_learning.py run --arms method --seeds 0   # one run: one ~2.5-hour job
    python experiments/reasoning_learning.py report      # tables, plot and headline of what finished
    python experiments/reasoning_learning.py all --smoke  # the whole pipeline on the tiny model, a minute

The task is part 2's choice (docs/results/reasoning_sizing.md): `chain_sum` with two terms of 1-2
digits, answers read as the tag or else the last number (`env.answer_reading=tag_or_last_number`).
Arms (each one `train.py` run per seed, in-process through magrpo.cli, in OUT/runs/<arm>/seed<s>):
the method (2 agents, 2 turns, the env's verifier feedback), one agent with the same turns and
feedback, and 2 agents in one turn. Every arm samples the method's completions per step (its batch
is scaled); the report shows the tokens each actually sampled. The held-out split (`env.eval_size`
problems from `env.eval_seed`, none of them a train question) is evaluated per turn, greedy and
with `eval_samples` sampled paths: untrained once per arm (`untrained`: greedy paths do not depend on
the seed, so the runs skip their own step-0 evaluation), every `eval_every` steps and after the last.

A run that is stopped resumes from its last checkpoint when the same command is run again
(`resume=auto`, a checkpoint every `checkpoint_every` steps); finished runs and untrained evaluations
are kept and checked to have the same settings. docs/results/reasoning_learning.md holds the plan,
the measured sizing and the commands.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "experiments"):  # this checkout's magrpo, and the experiments beside this file
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import code_learning as shared  # noqa: E402  (run records, before/after, mean ± sd, diagnostics)
from easy_learning import train_or_keep  # noqa: E402  (trains a run, or keeps it once it finished with these settings)


@dataclass(frozen=True)
class Arm:
    agents: int
    turns: int


METHOD = "method"
ARMS = {METHOD: Arm(2, 2), "single_agent": Arm(1, 2), "one_turn": Arm(2, 1)}  # the method first: the reference
TASK = "chain_sum"
TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}  # part 2: untrained at 0.28


@dataclass(frozen=True)
class Sizes:
    model: str
    steps: int
    batch_size: int  # trees per step of the method; the other arms sample as many completions
    k: int  # trainer.num_generations
    max_new_tokens: int
    lr: float
    train_size: int  # env.train_size: the most any arm draws in its steps (one_turn: 10 x 12 = 120); a larger
    #                  split takes more of the task's 200 one-digit questions away from the held-out split
    eval_size: int  # env.eval_size: held-out problems (part 2's power computation: >= 216 at 3 seeds)
    eval_samples: int  # sampled held-out paths per problem beside the greedy one
    eval_every: int  # also evaluate after every this many steps (0: before the first and after the last)
    seeds: dict[str, tuple[int, ...]] = field(default_factory=dict)  # arm -> seeds
    dtype: str = "auto"  # model.dtype: bfloat16 on CPUs with a bf16 fast path, else float32
    device: str = "auto"
    checkpoint_every: int = 2
    temperature: float = 0.7
    top_p: float = 0.9
    # reward.team_weight of the arms with 2 agents: each solver is paid half its own score. At 1 (the team
    # reward alone) nothing the solver writes at turn 1 reaches the reward (the checker answers alone
    # there), and method seed 0 (2026-11-28) trained it into replies of a lone random number: its own
    # held-out score fell from 0.40 to 0.04 (docs/results/reasoning_learning.md, "Run 1").
    team_weight: float = 0.5

    @property
    def runs(self) -> list[tuple[str, int]]:
        """(arm, seed), seed-major: an interrupted experiment has whole seeds."""
        order = [(seed, i, name) for i, (name, seeds) in enumerate(self.seeds.items()) for seed in seeds]
        return [(name, seed) for seed, _, name in sorted(order)]


# Sized from the measurement in docs/results/reasoning_learning.md ("Sizing"): on the loaded 2-core machine a
# method step of 2 trees took ~15 min and a greedy held-out evaluation of its team on 216 problems ~1.5 h (a
# sampled pass costs ~5x a greedy one: none by default). 12 steps, evaluated after step 6 and step 12: a method
# run is ~6 h there, so it spans three ~2.5-hour jobs; a checkpoint after every step loses at most one.
# lr 1e-4 for every arm: at 5e-4 (easy_learning's) the method's two agents shrank their replies and lost most of
# their entropy within 12 steps (method seed 0, 2026-11-28); at 1e-4 the same run kept both
# (docs/results/reasoning_learning.md, "Runs 2 and 3"). The single agent had learned at 5e-4; all arms move.
FULL = Sizes("smollm2-135m", steps=12, batch_size=2, k=4, max_new_tokens=128, lr=1e-4, train_size=128,
             eval_size=216, eval_samples=0, eval_every=6, checkpoint_every=1,
             seeds={METHOD: (0, 1, 2), "single_agent": (0, 1, 2), "one_turn": (0, 1, 2)})
SMOKE = Sizes("tiny", steps=2, batch_size=1, k=2, max_new_tokens=8, lr=1e-4, train_size=8, eval_size=3,
              eval_samples=1, eval_every=1, seeds={name: (0,) for name in ARMS}, dtype="float32",
              checkpoint_every=1, temperature=1.0, top_p=1.0)


def completions_per_tree(arm: Arm, k: int) -> int:
    from magrpo.tree import tree_size

    return tree_size("align", k, arm.agents, arm.turns)[1]


def batch_size(arm: Arm, sizes: Sizes) -> int:
    """The arm's trees per step: at least the method's completions per step (equal at K=2 and K=4)."""
    target = completions_per_tree(ARMS[METHOD], sizes.k) * sizes.batch_size
    return math.ceil(target / completions_per_tree(arm, sizes.k))


def overrides(name: str, seed: int, sizes: Sizes, run_dir: Path) -> list[str]:
    """The `train.py` settings of one run: the results page prints them, so every arm's exact config is there."""
    arm = ARMS[name]
    task = [f"+env.task_config.{key}={value}" for key, value in TASK_CONFIG.items()]
    return [
        f"model={sizes.model}", f"model.device={sizes.device}", f"model.dtype={sizes.dtype}", "env=reasoning_gym",
        f"env.task={TASK}", *task, "env.answer_reading=tag_or_last_number", f"env.num_agents={arm.agents}",
        f"env.train_size={sizes.train_size}", f"env.eval_size={sizes.eval_size}", "env.train_seed=0",
        "env.eval_seed=1000000", f"trainer.num_turns={arm.turns}", f"trainer.num_generations={sizes.k}",
        f"trainer.batch_size={batch_size(arm, sizes)}", f"trainer.steps={sizes.steps}", f"trainer.lr={sizes.lr}",
        f"trainer.seed={seed}", f"generation.max_new_tokens={sizes.max_new_tokens}",
        f"generation.temperature={sizes.temperature}", f"generation.top_p={sizes.top_p}",
        "eval.at_start=false", "eval.at_end=true", f"eval.every={sizes.eval_every}", "eval.max_problems=0",
        f"eval.num_samples={sizes.eval_samples}", f"logging.run_dir='{run_dir}'", "logging.wandb.mode=disabled",
        "logging.samples_every=0", "resume=auto", f"checkpoint.every={sizes.checkpoint_every}",
        *([f"reward.team_weight={sizes.team_weight}"] if arm.agents > 1 else []),
    ]


# Settings that change training but not an untrained evaluation (its greedy paths and the team's score)
TRAINING_ONLY = ("reward.team_weight=", "trainer.lr=")


def run(sizes: Sizes, out: Path, arms: Sequence[str]) -> list[Path]:
    """Every (arm, seed) run not finished yet; finished runs are kept (same settings checked)."""
    import torch

    from magrpo.models import device_facts, pick_device, resolve_dtype

    dtype = resolve_dtype(sizes.dtype, device_facts(pick_device(sizes.device)))[0]  # differs by CPU: recorded
    dirs = []
    for name, seed in sizes.runs:
        if name not in arms:
            continue
        arm, run_dir = ARMS[name], out / "runs" / name / f"seed{seed}"
        dirs.append(run_dir)
        argv = overrides(name, seed, sizes, run_dir)
        info = {"variant": name, "seed": seed, **asdict(arm), "feedback": "reasoning_gym",
                "completions_per_step": completions_per_tree(arm, sizes.k) * batch_size(arm, sizes),
                "torch_threads": torch.get_num_threads(), "dtype": dtype, "load_average": os.getloadavg(),
                "sizes": asdict(sizes), "overrides": argv}
        train_or_keep(run_dir, argv, info, sizes.steps)
    return dirs


def evaluate_untrained(sizes: Sizes, out: Path, arms: Sequence[str]) -> list[Path]:
    """The untrained agents' held-out evaluation, once per arm, in OUT/untrained/<arm>.json: its greedy paths
    are the same for every seed, so the runs skip it (eval.at_start=false) and the report reads it as the
    "before" of each. The settings are the arm's run's; the sampled paths use seed 0's evaluation stream."""
    from magrpo.backends import make_backend
    from magrpo.cli import compose
    from magrpo.conversation import conversation_of
    from magrpo.evaluation import evaluate, path_options
    from magrpo.generation import SamplingParams
    from magrpo.models import load_agents
    from magrpo.rollout import TreeSettings
    from magrpo.sampling import stream_key
    from magrpo.trainer import EVAL_STREAM, prepare

    paths = []
    for name in arms:
        path = out / "untrained" / f"{name}.json"
        paths.append(path)
        argv = overrides(name, 0, sizes, out / "untrained" / name)
        if path.is_file():
            check_same_untrained(path, argv)
            print(f"untrained: {name} already evaluated in {path}", file=sys.stderr)
            continue
        print(f"untrained: {name} -> {path}", file=sys.stderr, flush=True)
        cfg = compose(argv)
        env, feedback = prepare(cfg)
        agents, tree, g = load_agents(cfg, env.num_agents), TreeSettings.of(cfg), cfg.generation
        backend = make_backend(cfg, agents)
        start = time.perf_counter()
        try:
            metrics = evaluate(env, backend, feedback, env.problems("eval"), cfg.trainer.num_turns,
                               SamplingParams(g.max_new_tokens, g.temperature, g.top_p, g.top_k), cfg.eval.num_samples,
                               seed=stream_key(cfg.trainer.seed, 0, EVAL_STREAM),
                               progress=turn_lines(name, cfg.trainer.num_turns, start),
                               **path_options(tree, conversation_of(cfg.external, agents)))
        finally:
            backend.close()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"variant": name, **asdict(ARMS[name]), "metrics": metrics, "overrides": argv,
                                    "load_average": os.getloadavg(), **shared._provenance(start)}, indent=1) + "\n")
    return paths


def turn_lines(name: str, turns: int, start: float):
    """A line after each turn of an evaluation: a greedy turn on 216 problems takes minutes on a CPU."""
    return lambda paths, turn: print(f"untrained: {name}: {paths} paths, turn {turn + 1}/{turns} done at "
                                     f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def check_same_untrained(record: Path, argv: Sequence[str]) -> None:
    """A kept untrained evaluation must have had these settings."""
    differ = sorted(key for key in set(json.loads(record.read_text())["overrides"]) ^ set(argv)
                    if not key.startswith(TRAINING_ONLY))
    if differ:
        raise SystemExit(f"untrained: {record} was evaluated with other settings ({', '.join(differ[:4])}); "
                         f"pass another --out (or the options it had)")


# ------------------------------------------------------------------------------------------ report

Runs = dict[str, dict[int, tuple[list[dict], dict]]]  # arm -> seed -> (metrics records, experiment.json)


def load_runs(out: Path) -> Runs:
    """Every finished run, the method first; each run's records start with its arm's untrained evaluation
    (OUT/untrained/<arm>.json) as step 0, as eval.at_start would have logged it."""
    runs, untrained_runs = shared.load_runs(out), load_untrained(out)
    for name, seeds in runs.items():
        before = untrained_runs.get(name)
        for records, _ in seeds.values():
            if before and 0 not in shared.evaluations(records):
                records.insert(0, {"step": 0, **before["metrics"]})
    return {name: runs[name] for name in [*ARMS, *sorted(set(runs) - set(ARMS))] if name in runs}


def load_untrained(out: Path) -> dict[str, dict]:
    """arm -> its untrained evaluation record (evaluate_untrained)."""
    return {path.stem: json.loads(path.read_text()) for path in sorted((out / "untrained").glob("*.json"))}


def accuracy_key(turns: int, sampled: bool = True, turn: int | None = None) -> str:
    """Held-out accuracy at a turn (default: the arm's last): the sampled paths' pass@1, or the greedy one."""
    return f"eval/turn_{turns - 1 if turn is None else turn}/{'pass@1' if sampled else 'pass@1_greedy'}"


def before_after(runs: Runs, name: str, sampled: bool = True) -> list[tuple[float, float]]:
    """Per seed of `name`, the held-out accuracy at its last turn before training and after the last step."""
    out = []
    for records, info in runs.get(name, {}).values():
        before, after = shared.before_after(records)
        key = accuracy_key(info["turns"], sampled)
        if key in before and key in after:
            out.append((before[key], after[key]))
    return out


def gain_line(changes: Sequence[float]) -> tuple[float, float | None, str]:
    """Mean change, its standard error over seeds (None with one seed) and whether it exceeds 2 SE."""
    mean = statistics.mean(changes)
    if len(changes) < 2:
        return mean, None, "one seed: no SE"
    se = statistics.stdev(changes) / math.sqrt(len(changes))
    return mean, se, "yes" if abs(mean) > 2 * se else "no"


def accuracy_table(runs: Runs, sampled: bool = True) -> str:
    """Markdown: per arm, held-out accuracy at its last turn before -> after (mean ± sd over seeds), the
    gain with its SE over seeds and whether it exceeds 2 SE."""
    label = "sampled pass@1 (1 path per problem)" if sampled else "greedy pass@1"
    lines = [f"**Held-out accuracy, {label}, each arm's last turn** (mean ± sd over seeds; SE = sd / sqrt(seeds))",
             "", "| arm | agents | turns | seeds | before (untrained) | after | gain | SE | gain > 2 SE |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, seeds in runs.items():
        pairs = before_after(runs, name, sampled)
        if not pairs:
            continue
        info = next(iter(seeds.values()))[1]
        mean, se, beats = gain_line([a - b for b, a in pairs])
        lines.append(f"| {name} | {info['agents']} | {info['turns']} | {len(pairs)} | "
                     f"{shared.mean_sd([b for b, _ in pairs])} | {shared.mean_sd([a for _, a in pairs])} | "
                     f"{mean:+.3f} | {'–' if se is None else f'{se:.3f}'} | {beats} |")
    return "\n".join(lines) + "\n" if len(lines) > 4 else ""  # no sampled held-out paths (eval_samples=0): none


def sampled_headline(runs: Runs) -> bool:
    """The headline's accuracy: the sampled paths' where every run of the method sampled held-out paths
    (eval_samples > 0), else the greedy paths' (the full size's: a greedy pass costs a fraction of a sampled one)."""
    return bool(runs.get(METHOD)) and all(info["sizes"].get("eval_samples", 0) > 0 for _, info in runs[METHOD].values())


def best_baseline(runs: Runs, sampled: bool = True) -> str:
    """One sentence: the method's held-out accuracy after training against the best baseline's (by mean),
    the difference with its SE (unpaired: the arms' seeds are independent runs) and whether it exceeds 2 SE."""
    after = {name: [a for _, a in before_after(runs, name, sampled)] for name in runs}
    baselines = {name: values for name, values in after.items() if name != METHOD and values}
    if not after.get(METHOD) or not baselines:
        return "Best baseline: not yet (needs the method and at least one baseline finished)."
    best = max(baselines, key=lambda name: statistics.mean(baselines[name]))
    diff = statistics.mean(after[METHOD]) - statistics.mean(baselines[best])
    if min(len(after[METHOD]), len(baselines[best])) < 2:
        return (f"Best baseline: {best}, {shared.mean_sd(baselines[best])} after training; the method minus it: "
                f"{diff:+.3f} (one seed on a side: no SE).")
    se = math.sqrt(sum(statistics.variance(v) / len(v) for v in (after[METHOD], baselines[best])))
    return (f"Best baseline: {best}, {shared.mean_sd(baselines[best])} after training; the method minus it: "
            f"{diff:+.3f} (SE {se:.3f}), {'beyond' if abs(diff) > 2 * se else 'within'} 2 SE.")


def headline(runs: Runs) -> str:
    """One sentence for the README: the method's held-out accuracy before -> after and whether its gain
    exceeds 2 SE over seeds; the best baseline's comparison."""
    sampled = sampled_headline(runs)
    pairs = before_after(runs, METHOD, sampled)
    if not pairs:
        return (f"No finished run of the method ({METHOD}) yet." if not runs.get(METHOD) else
                f"The method's runs have no untrained evaluation to start from: run `untrained --arms {METHOD}`.")
    mean, se, beats = gain_line([a - b for b, a in pairs])
    problems = next(iter(runs[METHOD].values()))[1]["sizes"]["eval_size"]
    verdict = {"yes": "exceeds 2 SE", "no": "does not exceed 2 SE"}.get(beats, beats)
    return (f"Held-out {'sampled' if sampled else 'greedy'} accuracy of SmolLM2-135M with MAGRPO-MT "
            f"(2 agents, 2 turns, verifier feedback) on "
            f"{TASK} ({problems} problems): {shared.mean_sd([b for b, _ in pairs])} before -> "
            f"{shared.mean_sd([a for _, a in pairs])} after ({len(pairs)} seed(s); gain {mean:+.3f}, {verdict}). "
            + best_baseline(runs, sampled))


def per_turn(runs: Runs) -> str:
    """Markdown: per arm and turn, held-out accuracy (sampled, greedy) and the solvers' own score, before -> after."""
    lines = ["**Per turn** (held-out, before -> after, mean over seeds; solver score: the solvers' own answers)", "",
             "| arm | turn | sampled pass@1 | greedy pass@1 | solver score (greedy) |", "|---|---|---|---|---|"]
    for name, seeds in runs.items():
        turns = next(iter(seeds.values()))[1]["turns"]
        pairs = [shared.before_after(records) for records, _ in seeds.values()]
        for turn in range(turns):
            cells = []
            for key in (accuracy_key(turns, True, turn), accuracy_key(turns, False, turn),
                        f"eval/turn_{turn}/greedy_solver_score_mean"):
                both = [(b[key], a[key]) for b, a in pairs if key in b and key in a]
                cells.append(f"{statistics.mean(x for x, _ in both):.3f} -> {statistics.mean(y for _, y in both):.3f}"
                             if both else "–")
            lines.append(f"| {name} | {turn + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def untrained(out: Path) -> str:
    """Markdown: each arm's untrained held-out evaluation, per turn, with its date, minutes and machine load."""
    rows = []
    for name, record in load_untrained(out).items():
        m = record["metrics"]
        accuracy = ", ".join(f"turn {t + 1}: greedy {m[f'eval/turn_{t}/pass@1_greedy']:.3f}"
                             + (f", sampled {m[f'eval/turn_{t}/pass@1']:.3f}" if f"eval/turn_{t}/pass@1" in m else "")
                             for t in range(record["turns"]))
        load = ", ".join(f"{x:.1f}" for x in record["load_average"])
        rows.append(f"| {name} | {accuracy} | {record['seconds'] / 60:.1f} | {record['date']} | {load} |")
    return "\n".join(["**Untrained** (held-out, OUT/untrained/<arm>.json: each arm's \"before\")", "",
                      "| arm | held-out accuracy | minutes | date | load average at the end |", "|---|---|---|---|---|",
                      *rows]) + "\n"


def sampled_tokens(record: dict) -> int:
    """Tokens a training step sampled: the trainer logs its generation rate and time, not the count."""
    return round(record["perf/tokens_per_s"] * record["perf/gen_s"])


def budget(runs: Runs) -> str:
    """Markdown: per arm, the completions and the tokens actually sampled per step, against the method's."""
    per_arm = {name: [sampled_tokens(r) for records, _ in seeds.values() for r in records if "perf/gen_s" in r]
               for name, seeds in runs.items()}
    reference = statistics.mean(per_arm[METHOD]) if per_arm.get(METHOD) else None
    lines = ["**Sampling budget per training step** (tokens: mean ± sd over steps and seeds)", "",
             "| arm | trees per step | completions per step | sampled tokens per step | vs the method |",
             "|---|---|---|---|---|"]
    for name, seeds in runs.items():
        info, tokens = next(iter(seeds.values()))[1], per_arm[name]
        trees = next((a.split("=", 1)[1] for a in info["overrides"] if a.startswith("trainer.batch_size=")), "?")
        ratio = f"{statistics.mean(tokens) / reference:.2f}x" if tokens and reference else "–"
        spread = f"{statistics.mean(tokens):.0f} ± {statistics.stdev(tokens):.0f}" if len(tokens) > 1 else (
            f"{tokens[0]:.0f}" if tokens else "–")
        lines.append(f"| {name} | {trees} | {info['completions_per_step']} | {spread} | {ratio} |")
    return "\n".join(lines) + "\n"


def plot(runs: Runs, path: Path) -> Path:
    """Per arm, mean over seeds with the min-max band: training reward at the last turn, the zero-spread
    share per step, and held-out greedy accuracy at the last turn per evaluation step."""
    from matplotlib.figure import Figure  # no pyplot: no global state

    fig = Figure(figsize=(15, 4), dpi=120)
    panels = [("training reward, last turn", lambda r, t: r.get(f"train/turn_{t - 1}/reward_mean")),
              ("groups with zero reward spread", lambda r, t: shared._value(r, "frac_zero_std")),
              ("held-out greedy accuracy, last turn", lambda r, t: r.get(accuracy_key(t, sampled=False)))]
    for ax, (title, value) in zip(fig.subplots(1, 3), panels):
        for name, seeds in runs.items():
            turns = next(iter(seeds.values()))[1]["turns"]
            curves = [{r["step"]: v for r in records if (v := value(r, turns)) is not None}
                      for records, _ in seeds.values()]
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            if steps:
                values = [[c[s] for c in curves] for s in steps]
                ax.plot(steps, [statistics.mean(v) for v in values], marker="o", label=name)
                ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], alpha=0.2)
        ax.set(title=title, xlabel="step")
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle("mean over seeds; band: min-max", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def configs(runs: Runs) -> str:
    """Markdown: the exact `train.py` settings of every arm (its first seed's; the seeds differ in trainer.seed)."""
    lines = ["**Exact settings per arm** (`python train.py <these>`; the seeds differ only in trainer.seed "
             "and logging.run_dir)", ""]
    for name, seeds in runs.items():
        info = next(iter(seeds.values()))[1]
        lines.append(f"- {name}: `{' '.join(a for a in info['overrides'] if not a.startswith('logging.run_dir'))}`")
    return "\n".join(lines) + "\n"


def durations(runs: Runs) -> str:
    """Markdown: per arm, each seed's minutes, seconds per step and per evaluation, dtype, threads, load."""
    lines = ["| arm | seed | minutes | s per step | s per evaluation | dtype | torch threads | load at start |",
             "|---|---|---|---|---|---|---|---|"]
    for name, seeds in runs.items():
        for seed, (records, info) in seeds.items():
            steps = [r["perf/step_s"] for r in records if "perf/step_s" in r]
            # step 0's evaluation is the arm's untrained one (load_runs), a job of its own: not this run's time
            evals = [r["perf/eval_s"] for r in records if "perf/eval_s" in r and r.get("step", 0) >= 1]
            load = ", ".join(f"{x:.1f}" for x in info.get("load_average", ()))
            minutes = run_seconds(records, info) / 60
            lines.append(f"| {name} | {seed} | {minutes:.1f} | {_mean(steps)} | {_mean(evals)} | "
                         f"{info.get('dtype', '?')} | {info.get('torch_threads', '?')} | {load or '?'} |")
    return "\n".join(lines) + "\n"


def run_seconds(records: list[dict], info: dict) -> float:
    """A run's time: experiment.json's wall time of the job that finished it or, for a run resumed across jobs
    (that job's time is only its last part), the seconds its metrics logged for every step and evaluation."""
    logged = sum(r.get("perf/step_s", 0.0) + r.get("perf/eval_s", 0.0) for r in records if r.get("step", 0) >= 1)
    return max(info["seconds"], logged)


def _mean(values: Sequence[float]) -> str:
    return f"{statistics.mean(values):.0f}" if values else "–"


def reported_sizes(runs: dict, infos: list[dict]) -> dict:
    """The runs' sizes, with the seeds these tables hold: each run records the seeds of the command that
    started it (`run --seeds 0` says {"method": [0]}), not those of the experiment."""
    return {**infos[0]["sizes"], "seeds": {arm: sorted(seeds) for arm, seeds in runs.items()}}


def report(out: Path, doc: Path, image: Path) -> str:
    """Write the Markdown results (headline, provenance, tables, settings) to `doc` and the plot to `image`."""
    runs = load_runs(out)
    if not runs:
        raise SystemExit(f"report: no finished runs under {out / 'runs'} (run `run` first)\n\n{untrained(out)}")
    plot(runs, image)
    infos = [i for seeds in runs.values() for _, i in seeds.values()]
    dates = sorted(i["date"] for i in infos)
    hours = sum(run_seconds(records, i) for seeds in runs.values() for records, i in seeds.values()) / 3600
    head = [f"**Headline:** {headline(runs)}", "",
            f"Runs finished between {dates[0]} and {dates[-1]} on {'; '.join(sorted({i['machine'] for i in infos}))}. "
            f"Time: {len(infos)} runs, {hours:.2f} h in all.", f"Sizes: {json.dumps(reported_sizes(runs, infos))}.", "",
            f"![results]({os.path.relpath(image, doc.parent)})", ""]
    missing = shared.unfinished(out)
    if missing:  # a partial report must say so
        head[-2:-2] = [f"**Not in these tables** (no experiment.json: running, stopped or failed): "
                       f"{', '.join(missing)}.", ""]
    text = "\n".join(head) + "\n" + "\n".join([
        accuracy_table(runs, sampled=False), accuracy_table(runs), best_baseline(runs, sampled_headline(runs)) + "\n",
        per_turn(runs),
        untrained(out), budget(runs), "**Durations**\n\n" + durations(runs),
        "**Training diagnostics** (mean ± sd over seeds; the share of GRPO groups with zero reward spread is "
        "train/agent_*/frac_zero_std, mean over agents)\n\n" + shared.diagnostics(runs), configs(runs)])
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    return text


# ------------------------------------------------------------------------------------------ CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["untrained", "run", "report", "all"],
                        help="untrained: each arm's held-out evaluation before training (first: is the task in its "
                             "band?); run: the training runs; report; all: the three in turn")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 steps, 3 held-out problems, seed 0 "
                        "(tests/test_reasoning_learning_experiment.py runs it)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default experiments/out/reasoning_learning, or ..._smoke)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS),
                        help="arms to run (default all; the intended order is in docs/results/reasoning_learning.md)")
    parser.add_argument("--seeds", nargs="+", type=int, default=None,
                        help="seeds of each arm (default " + ", ".join(f"{n} {s}" for n, s in FULL.seeds.items())
                             + ")")
    parser.add_argument("--steps", type=int, default=None, help=f"training steps (default {FULL.steps})")
    parser.add_argument("--eval-every", type=int, default=None, help=f"default {FULL.eval_every}")
    parser.add_argument("--eval-size", type=int, default=None, help=f"held-out problems (default {FULL.eval_size})")
    parser.add_argument("--eval-samples", type=int, default=None, help=f"default {FULL.eval_samples}")
    parser.add_argument("--batch-size", type=int, default=None, help=f"the method's trees per step "
                        f"(default {FULL.batch_size}; the other arms are scaled to its completions)")
    parser.add_argument("--lr", type=float, default=None, help=f"trainer.lr of every arm (default {FULL.lr})")
    parser.add_argument("--device", default=None, help="model.device (default auto)")
    parser.add_argument("--doc", type=Path, default=None, help="results Markdown (default OUT/results.md)")
    parser.add_argument("--image", type=Path, default=None, help="plot PNG (default OUT/results.png)")
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    for name, value in (("steps", args.steps), ("eval_every", args.eval_every), ("eval_size", args.eval_size),
                        ("eval_samples", args.eval_samples), ("batch_size", args.batch_size), ("lr", args.lr),
                        ("device", args.device)):
        if value is not None:
            sizes = replace(sizes, **{name: value})
    if args.seeds is not None:
        sizes = replace(sizes, seeds={name: tuple(args.seeds) for name in sizes.seeds})
    out = args.out or ROOT / "experiments" / "out" / f"reasoning_learning{'_smoke' if args.smoke else ''}"
    from magrpo import envs, external  # noqa: F401  (fills the env and feedback registries)

    if args.command in ("untrained", "all"):
        evaluate_untrained(sizes, out, args.arms)
    if args.command in ("run", "all"):
        run(sizes, out, args.arms)
    if args.command in ("report", "all"):
        print(report(out, args.doc or out / "results.md", args.image or out / "results.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
