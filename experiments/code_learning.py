"""Issue 17's CPU learning experiment on the code env: does MAGRPO-MT move SmolLM2-135M on HumanEval?

    python experiments/code_learning.py all              # select -> run -> report (hours on a CPU)
    python experiments/code_learning.py all --smoke      # the same pipeline on the tiny model, seconds

1. `select`: the untrained model samples `select_samples` paths (2 agents, one turn) on the first
   `candidates` problems of the code env's train split (HumanEval test[:132]) only; the problems whose
   sampled rewards differ are the training set (a GRPO group there can have differing rewards: a
   gradient is possible). Pass rates are recorded too: strictly between 0 and 1 would be the stricter
   rule, but SmolLM2-135M passes almost nothing, so almost no problem would be left. Held-out
   problems (test[132:]) are never sampled here.
2. `run`: every variant x seed is one `train.py` run (in-process, through magrpo.cli) in its own run
   dir (seed by seed, so an interrupted experiment has whole seeds), evaluated on the held-out
   problems before the first step and after every step (`eval_every`). Baselines get
   the generation budget of the reference: their batch is scaled so each step samples at least as
   many completions. The "before" evaluation is the untrained-agents baseline.
3. `report`: mean and spread over seeds, before/after, per variant: a Markdown table and a plot.

Everything goes through magrpo's own config, env, backend and evaluation code; docs/benchmarks.md
says how to read the results.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass, replace
from itertools import zip_longest
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python experiments/code_learning.py` from a clean clone: this checkout's magrpo
    sys.path.insert(0, str(ROOT))

TRAIN_SPLIT, HELD_OUT_SPLIT = "test[:132]", "test[132:]"  # the code env's own defaults
SELECT_STREAM = 7  # sampling stream of the selection paths (training uses 0, evaluation 1)
SELECT_CHUNK = 8  # candidates sampled per batch


@dataclass(frozen=True)
class Sizes:
    model: str
    candidates: int  # first this many train problems are candidates (0 = all 132)
    select_samples: int  # sampled paths per candidate
    steps: int
    batch_size: int  # problems per step of the reference variant
    k: int  # trainer.num_generations
    max_new_tokens: int
    eval_problems: int  # first this many held-out problems (0 = all 32)
    eval_samples: int  # sampled eval paths per problem (pass@1 and pass@k); a greedy path always runs
    seeds: tuple[int, ...]
    lr: float
    strict: bool = True  # keep only problems whose sampled rewards differ; the smoke run keeps all
    eval_every: int = 1  # also evaluate after every this many steps (0 = before the first and after the last)


# Sized to run in about 3 hours on 2 CPU cores (a step of the reference variant, 40 completions of
# up to 96 tokens, takes ~75 s there, a held-out evaluation ~100 s): 12 runs of 5 steps, evaluated
# before the first step and after every step. The learning rate is 3x the model
# default so that 5 steps can move anything; docs/results/code_learning.md says what this scale can show.
FULL = Sizes("smollm2-135m", 24, 4, 5, 1, 4, 96, 8, 1, (0, 1, 2), 3e-4)
SMOKE = Sizes("tiny", 2, 2, 1, 1, 2, 16, 2, 2, (0,), 1e-4, strict=False, eval_every=0)


@dataclass(frozen=True)
class Variant:
    agents: int
    turns: int
    feedback: str
    extra: tuple[str, ...] = ()  # more train.py settings of this variant (key=value)


VARIANTS = {
    "level_feedback": Variant(2, 2, "level_feedback"),  # the reference
    "plain": Variant(2, 2, "plain"),
    "single_agent": Variant(1, 2, "level_feedback"),
    "one_turn": Variant(2, 1, "plain"),  # one turn: no feedback is ever shown
}
REFERENCE = "level_feedback"


# ------------------------------------------------------------------------------------------ select


def sampled(paths: Sequence[tuple[int, dict]], task_ids: Sequence[str], samples: int,
            field: str) -> dict[str, list[float]]:
    """Per task id, the `field` outcome of each of its `samples` sampled paths, in path order; `paths` are
    (index into the repeated problem list, outcomes), the list repeating each problem `samples` times."""
    values: list[list[float]] = [[] for _ in task_ids]
    for index, outcome in paths:
        values[index // samples].append(round(float(outcome[field]), 6))
    return {task_id: values[i] for i, task_id in enumerate(task_ids)}


def pass_rates(paths: Sequence[tuple[int, dict]], task_ids: Sequence[str], samples: int) -> dict[str, float]:
    """Per task id, the share of its sampled paths that pass."""
    return {task_id: sum(v > 0 for v in passed) / samples
            for task_id, passed in sampled(paths, task_ids, samples, "passed").items()}


def reward_sets(paths: Sequence[tuple[int, dict]], task_ids: Sequence[str], samples: int) -> dict[str, list[float]]:
    """Per task id, the sorted rewards of its sampled paths."""
    return {task_id: sorted(rewards) for task_id, rewards in sampled(paths, task_ids, samples, "reward").items()}


def choose(rewards: dict[str, list[float]], strict: bool = True) -> list[str]:
    """The task ids to train on, in dataset order: sampled rewards not all equal (strict=False: all)."""
    return [task_id for task_id, values in rewards.items() if not strict or len(set(values)) > 1]


def select(sizes: Sizes, out: Path, seed: int = 0) -> dict[str, Any]:
    """Sample the untrained model on the train candidates; write and return the selection."""
    from magrpo.cli import compose

    cfg = compose([f"model={sizes.model}", "env.num_agents=2", "trainer.num_turns=1",
                   f"env.train_split='{TRAIN_SPLIT}'", f"generation.max_new_tokens={sizes.max_new_tokens}",
                   "eval.at_end=false"])
    start = time.perf_counter()
    rates, rewards = sample_candidates(cfg, sizes.candidates, sizes.select_samples, seed,
                                       lambda _, rewards: len(choose(rewards, sizes.strict)))
    g = cfg.generation
    selection = {
        "selected": choose(rewards, sizes.strict), "rates": rates, "rewards": rewards, "strict": sizes.strict,
        "model": sizes.model,
        "samples": sizes.select_samples, "temperature": g.temperature, "top_p": g.top_p,
        "max_new_tokens": g.max_new_tokens, "split": TRAIN_SPLIT, "seed": seed, **_provenance(start),
    }
    save_selection(selection, out)
    print(f"select: {len(selection['selected'])} of {len(rates)} train problems kept -> {out}", file=sys.stderr)
    return selection


Rates, Rewards = dict[str, float], dict[str, list[float]]  # per task id: pass rate; sorted sampled rewards


def sample_candidates(cfg, candidates: int, samples: int, seed: int,
                      kept: Callable[[Rates, Rewards], int]) -> tuple[Rates, Rewards]:
    """The untrained agents of `cfg` (its env, generation settings and turns) sample `samples` paths on
    each of the first `candidates` problems of the train split (0 = all): per task id, the pass rate
    and the sorted rewards. `kept(rates, rewards)` (so far) is the progress line's count of problems kept."""
    from magrpo.backends import make_backend
    from magrpo.evaluation import run_paths
    from magrpo.generation import SamplingParams
    from magrpo.models import load_agents
    from magrpo.sampling import stream_key
    from magrpo.trainer import prepare

    env, feedback = prepare(cfg)
    problems = list(env.problems("train"))[: candidates or None]
    ids = [p["task_id"] for p in problems]
    g = cfg.generation
    sampling = SamplingParams(g.max_new_tokens, g.temperature, g.top_p, g.top_k)
    start = time.perf_counter()
    backend = make_backend(cfg, load_agents(cfg, env.num_agents))
    rates: dict[str, float] = {}
    rewards: dict[str, list[float]] = {}
    try:
        for first in range(0, len(problems), SELECT_CHUNK):  # chunks: a progress line, bounded batches
            chunk = problems[first:first + SELECT_CHUNK]
            repeated = [p for p in chunk for _ in range(samples)]
            key = stream_key(seed, SELECT_STREAM, first)  # every chunk its own sampling stream
            paths = run_paths(repeated, env, backend, feedback, cfg.trainer.num_turns, sampling, seed=key)[0]
            rates.update(pass_rates(paths, ids[first:first + SELECT_CHUNK], samples))
            rewards.update(reward_sets(paths, ids[first:first + SELECT_CHUNK], samples))
            print(f"select: {len(rates)}/{len(ids)} problems sampled, {kept(rates, rewards)} kept "
                  f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    finally:
        backend.close()
    return rates, rewards


def save_selection(selection: dict[str, Any], path: Path) -> Path:
    """Write the selection to `path`, unless runs beside it trained on another one (`all` twice with
    other --candidates): those would be kept and reported as if trained on this one. Then it goes to
    selection.rejected.json and the command stops."""
    runs = path.parent / "runs"
    if path.is_file() and any(runs.glob("*/seed*")):
        old = json.loads(path.read_text()).get("selected")
        if old != selection["selected"]:
            rejected = path.with_name("selection.rejected.json")
            rejected.write_text(json.dumps(selection, indent=1) + "\n")
            raise SystemExit(f"select: {runs} holds runs trained on the {len(old or [])} problems of {path}; "
                             f"this selection keeps {len(selection['selected'])} others (saved in {rejected}): "
                             f"pass another --out, or remove {runs} to train on it")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(selection, indent=1) + "\n")
    return path


def _provenance(start: float) -> dict[str, Any]:
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "seconds": round(time.perf_counter() - start, 1),
            "machine": f"{_cpu_name()}{_cpu_kind()}, {os.cpu_count()} core(s), "
                       f"{platform.system()} {platform.machine()}"}


# The instruction sets that change a CPU's float results (the CPU kinds of CI's machines): a model name such as
# "Intel(R) Xeon(R) Processor" does not say which, and runs on two kinds differ in bfloat16 rounding.
CPU_KINDS = (("amx_tile", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def _cpu_kind(flags: set[str] | None = None) -> str:
    """" (AMX, AVX512-BF16, AVX-512)": the CPU_KINDS this CPU has, from /proc/cpuinfo ("" where unknown)."""
    if flags is None:
        flags = set((_cpuinfo("flags") or "").split())
    kinds = [name for flag, name in CPU_KINDS if flag in flags]
    return f" ({', '.join(kinds)})" if kinds else ""


def _cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor() or "unknown CPU"


def _cpuinfo(key: str) -> str | None:
    """The value of /proc/cpuinfo's first `key` line; None without that file or line (not Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(key)), None)


# ------------------------------------------------------------------------------------------ run


def write_dataset(selected: Sequence[str], folder: Path) -> tuple[Path, int]:
    """A .jsonl of the selected train problems followed by every held-out problem; returns (path,
    number of train records): env.train_split=test[:n] and env.eval_split=test[n:] pick them."""
    from magrpo.envs.code.problems import load_problems

    train = {r["task_id"]: r for r in load_problems("humaneval", TRAIN_SPLIT)}
    held_out = load_problems("humaneval", HELD_OUT_SPLIT)
    unknown = [t for t in selected if t not in train]
    if unknown or not selected:
        raise SystemExit(f"selection: {unknown[:3] or 'no problems'} not in the train split {TRAIN_SPLIT}")
    assert not set(selected) & {r["task_id"] for r in held_out}  # held-out problems never train
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "problems.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*(train[t] for t in selected), *held_out]))
    return path, len(selected)


def batch_size(variant: Variant, sizes: Sizes) -> int:
    """The variant's problems per step: at least the reference's completions per step."""
    from magrpo.tree import tree_size

    ref = VARIANTS[REFERENCE]
    target = tree_size("align", sizes.k, ref.agents, ref.turns)[1] * sizes.batch_size
    return math.ceil(target / tree_size("align", sizes.k, variant.agents, variant.turns)[1])


def overrides(name: str, seed: int, sizes: Sizes, dataset: Path, n_train: int, run_dir: Path) -> list[str]:
    v = VARIANTS[name]
    return [
        f"model={sizes.model}", f"external={v.feedback}", f"env.dataset='{dataset}'",
        f"env.train_split='test[:{n_train}]'", f"env.eval_split='test[{n_train}:]'", f"env.num_agents={v.agents}",
        f"trainer.num_turns={v.turns}",
        f"trainer.num_generations={sizes.k}", f"trainer.batch_size={batch_size(v, sizes)}",
        f"trainer.steps={sizes.steps}", f"trainer.lr={sizes.lr}",
        f"trainer.seed={seed}", f"generation.max_new_tokens={sizes.max_new_tokens}", "eval.at_start=true",
        "eval.at_end=true", f"eval.every={sizes.eval_every}", f"eval.max_problems={sizes.eval_problems}",
        f"eval.num_samples={sizes.eval_samples}", f"logging.run_dir='{run_dir}'", "logging.wandb.mode=disabled",
        "logging.samples_every=0", "resume=auto", "checkpoint.every=5",  # a killed run loses at most 5 steps
    ]


def finished(run_dir: Path, steps: int) -> bool:
    """The run dir holds the evaluation after the last step (an interrupted run resumes instead)."""
    from magrpo.report import ReportError, load_metrics

    try:
        return steps in evaluations(load_metrics(run_dir))
    except ReportError:
        return False


def check_same_settings(run_dir: Path, wanted: Sequence[str]) -> None:
    """A finished run kept from an earlier call must have been run with these `key=value` settings
    (say --eval-every 1 over an out dir evaluated before/after only: its per-step numbers would be
    silently missing); exits naming the first that differs."""
    config = json.loads((run_dir / "config.json").read_text())
    for item in wanted:
        key, text = item.split("=", 1)
        if key.split(".")[0] not in ("trainer", "eval", "generation"):
            continue  # the model, data paths and logging say where the run was, not what it computed
        try:
            value = json.loads(text)  # numbers and true/false as the config holds them
        except json.JSONDecodeError:
            value = text.strip("'")
        node = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node != value:
            raise SystemExit(f"run: {run_dir} finished with {key}={node}, this call wants {key}={text}; "
                             f"pass another --out (or the options that run had)")


def check_same_problems(run_dir: Path, selected: Sequence[str], selection: Path) -> None:
    """A finished run kept from an earlier call must have trained on these problems (the data file
    is rewritten from the selection, and its path says nothing of what it held); exits otherwise.
    Records written before train_ids was recorded are not checked."""
    record = run_dir / "experiment.json"
    trained = json.loads(record.read_text()).get("train_ids") if record.is_file() else None
    if trained is not None and list(trained) != list(selected):
        raise SystemExit(f"run: {run_dir} trained on other problems ({len(trained)}) than the {len(selected)} "
                         f"of {selection} (first difference, kept vs selected: "
                         f"{next((a, b) for a, b in zip_longest(trained, selected) if a != b)}); pass another --out")


def run(sizes: Sizes, selection: Path, out: Path, variants: Sequence[str]) -> list[Path]:
    """One training run per variant and seed, each in out/runs/<variant>/seed<seed>; finished runs are kept."""
    from magrpo.cli import main as train_main
    from magrpo.tree import tree_size

    selected = json.loads(selection.read_text())["selected"]
    dataset, n_train = write_dataset(selected, out / "data")
    dirs = []
    for seed in sizes.seeds:
        for name in variants:
            v = VARIANTS[name]
            run_dir = out / "runs" / name / f"seed{seed}"
            dirs.append(run_dir)
            per_step = tree_size("align", sizes.k, v.agents, v.turns)[1] * batch_size(v, sizes)
            info = {"variant": name, "seed": seed, **asdict(v), "completions_per_step": per_step,
                    "train_problems": n_train, "train_ids": selected, "sizes": asdict(sizes)}
            if finished(run_dir, sizes.steps):
                check_same_settings(run_dir, overrides(name, seed, sizes, dataset, n_train, run_dir))
                check_same_problems(run_dir, selected, selection)
                print(f"run: {name} seed {seed} already finished in {run_dir}", file=sys.stderr)
                if not (run_dir / "experiment.json").is_file():  # stopped between training and this record
                    write_info(run_dir, {**info, **_provenance(time.perf_counter()), **timed_by_metrics(run_dir)})
                continue
            start = time.perf_counter()
            code = train_main(overrides(name, seed, sizes, dataset, n_train, run_dir))
            if code:
                raise SystemExit(f"run: {name} seed {seed} failed (exit {code}); see {run_dir}")
            write_info(run_dir, {**info, **_provenance(start)})
    return dirs


def write_info(run_dir: Path, info: dict[str, Any]) -> None:
    """experiment.json: what `report` reads of a finished run (a run dir without one is not reported)."""
    (run_dir / "experiment.json").write_text(json.dumps(info, indent=1) + "\n")


def timed_by_metrics(run_dir: Path) -> dict[str, Any]:
    """A finished run whose wall time was never recorded: its logged step and evaluation seconds."""
    from magrpo.report import load_metrics

    records = load_metrics(run_dir)
    seconds = sum(r.get("perf/step_s", 0.0) + r.get("perf/eval_s", 0.0) for r in records)
    return {"seconds": round(seconds, 1), "seconds_from": "metrics.jsonl (perf/step_s + perf/eval_s)"}


# ------------------------------------------------------------------------------------------ report

# (label, metric key suffix under eval/turn_{t}/) in table order; rows whose key no run logged are left out
LEVELS = [("reward (greedy)", "greedy_reward_mean"), ("aux defined", "greedy_aux_defined_mean"),
          ("main defined", "greedy_main_defined_mean"), ("syntax ok", "greedy_syntax_ok_mean"),
          ("tests passed = pass@1 greedy", "pass@1_greedy"), ("aux used", "greedy_aux_used_mean"),
          ("reward (sampled)", "reward_mean"), ("pass@1 sampled", "pass@1")]


def before_after(records: list[dict]) -> tuple[dict, dict]:
    """The evaluation before the first step (step 0) and the last one after it."""
    evals = evaluations(records)
    later = [step for step in evals if step > 0]
    return evals.get(0, {}), (evals[max(later)] if later else {})


def mean_sd(values: Sequence[float]) -> str:
    """`mean ± sd` over seeds (sample sd; one seed: the mean alone)."""
    if not values:
        return "–"
    m = sum(values) / len(values)
    if len(values) == 1:
        return f"{m:.3f}"
    sd = math.sqrt(sum((x - m) ** 2 for x in values) / (len(values) - 1))
    return f"{m:.3f} ± {sd:.3f}"


def load_runs(out: Path) -> dict[str, dict[int, tuple[list[dict], dict]]]:
    """variant -> seed -> (metrics records, experiment.json) of every finished run under out/runs."""
    from magrpo.report import load_metrics

    runs: dict[str, dict[int, tuple[list[dict], dict]]] = {}
    for info_path in sorted((out / "runs").glob("*/seed*/experiment.json")):
        info = json.loads(info_path.read_text())
        runs.setdefault(info["variant"], {})[info["seed"]] = (load_metrics(info_path.parent), info)
    order = [*VARIANTS, *sorted(set(runs) - set(VARIANTS))]  # the reference first
    return {name: dict(sorted(runs[name].items())) for name in order if name in runs}


def unfinished(out: Path) -> list[str]:
    """Run dirs under out/runs that have no experiment.json (running, stopped or failed): not reported."""
    return [str(d.relative_to(out)) for d in sorted((out / "runs").glob("*/seed*"))
            if d.is_dir() and not (d / "experiment.json").is_file()]


def table(runs: dict[str, dict[int, tuple[list[dict], dict]]]) -> str:
    """Markdown: one overview table, then per variant the held-out metrics per turn before and after."""
    lines = ["| variant | agents | turns | feedback | seeds | completions/step | minutes per run, by seed |",
             "|---|---|---|---|---|---|---|"]
    for name, seeds in runs.items():
        info = next(iter(seeds.values()))[1]
        # each seed's own time, not mean ± sd: one run slowed by a job beside it must stay visible
        minutes = ", ".join(f"{seeds[s][1]['seconds'] / 60:.1f}" for s in sorted(seeds))
        lines.append(f"| {name} | {info['agents']} | {info['turns']} | {info['feedback']} | "
                     f"{', '.join(map(str, sorted(seeds)))} | {info['completions_per_step']} | {minutes} |")
    for name, seeds in runs.items():
        pairs = [before_after(records) for records, _ in seeds.values()]
        lines += ["", f"**{name}** (held-out, mean ± sd over {len(pairs)} seed(s); turns 1-based)", "",
                  "| metric | turn | before | after | change |", "|---|---|---|---|---|"]
        for label, turn, key in metric_rows([b for b, _ in pairs], seeds):
            both = [(b[key], a[key]) for b, a in pairs if key in b and key in a]
            if both:
                lines.append(f"| {label} | {turn} | {mean_sd([x for x, _ in both])} | "
                             f"{mean_sd([y for _, y in both])} | {mean_sd([y - x for x, y in both])} |")
    return "\n".join(lines) + "\n"


# (label, metric suffix) compared across variants at each one's last turn: the reward shaping and the task itself
COMPARED = [("greedy reward", "greedy_reward_mean"), ("pass@1 greedy", "pass@1_greedy")]


def comparison(runs: dict[str, dict[int, tuple[list[dict], dict]]]) -> str:
    """Markdown: which variant wins on the held-out problems, and by how much. Per variant, at its last
    turn, each compared metric after training and its change (after - before), and that change minus
    the reference's (the first variant) on the same seeds, so the seed's shared problems cancel; then
    one generated sentence per metric naming the largest change, or the tie."""
    reference = next(iter(runs))
    # metric -> variant -> seed -> (before, after); each seed's evaluations are read once
    pairs: dict[str, dict[str, dict[int, tuple[float, float]]]] = {label: {} for label, _ in COMPARED}
    for name, seeds in runs.items():
        last = next(iter(seeds.values()))[1]["turns"] - 1
        for seed, (records, _) in seeds.items():
            before, after = before_after(records)
            for label, suffix in COMPARED:
                key = f"eval/turn_{last}/{suffix}"
                if key in before and key in after:
                    pairs[label].setdefault(name, {})[seed] = (before[key], after[key])

    def changes(label: str, name: str) -> dict[int, float]:
        return {seed: a - b for seed, (b, a) in pairs[label].get(name, {}).items()}

    header = "| variant | last turn |" + "".join(f" {label} after | {label} change | change vs {reference} |"
                                                   for label, _ in COMPARED)
    lines = [f"**Which wins** (held-out, each variant's last turn; change = after - before; vs {reference}: "
             "the change minus the reference's on the same seed; mean ± sd over seeds)", "", header,
             "|---|---|" + "---|---|---|" * len(COMPARED)]
    for name, seeds in runs.items():
        row = f"| {name} | {next(iter(seeds.values()))[1]['turns']} |"
        for label, _ in COMPARED:
            mine, ref = changes(label, name), changes(label, reference)
            paired = [mine[s] - ref[s] for s in sorted(mine) if s in ref]
            afters = [a for _, a in pairs[label].get(name, {}).values()]
            row += (f" {mean_sd(afters)} | {mean_sd(list(mine.values()))} | "
                    f"{'–' if name == reference else mean_sd(paired)} |")
        lines.append(row)
    lines.append("")
    for label, _ in COMPARED:
        spreads = {name: mean_sd(list(changes(label, name).values())) for name in pairs[label]}
        means = {name: sum(c.values()) / len(c) for name in pairs[label] if (c := changes(label, name))}
        if not means:
            continue
        ranked = sorted(means, key=means.get, reverse=True)
        if max(means.values()) - min(means.values()) < 1e-9:
            lines.append(f"- {label}: a tie, change {means[ranked[0]]:.3f} in every variant.")
        else:
            lines.append(f"- {label}: the largest change is {ranked[0]}'s, {spreads[ranked[0]]}"
                         + (f"; next {ranked[1]}, {spreads[ranked[1]]}." if len(ranked) > 1 else "."))
    return "\n".join(lines) + "\n"


GAINS = [("turn-1 -> last-turn gain, pass@1 greedy", "eval/improvement/pass@1_greedy"),
         ("turn-1 -> last-turn gain, pass@1 sampled", "eval/improvement/pass@1")]


def metric_rows(evals: list[dict], seeds: dict[int, tuple[list[dict], dict]]) -> list[tuple[str, str, str]]:
    """(label, turn column, metric key) of every held-out row, in table order, for the turns these
    evaluation records hold; a one-agent variant has no aux rows, a one-turn one no gain rows."""
    turns = sorted({t for record in evals for t in map(_turn, record) if t is not None})
    single = next(iter(seeds.values()))[1]["agents"] == 1  # no helper: the aux rates mean nothing
    k = _k(evals)
    rows = [(label, str(t + 1), f"eval/turn_{t}/{suffix}") for t in turns
            for label, suffix in [*LEVELS, (f"pass@{k} sampled", f"pass@{k}")]
            if not (single and label.startswith("aux"))]
    return rows + ([(label, "–", key) for label, key in GAINS] if len(turns) > 1 else [])


def evaluations(records: list[dict]) -> dict[int, dict]:
    """step -> the held-out evaluation logged at that step (step 0: before training)."""
    return {r["step"]: r for r in records if "perf/eval_s" in r}


def per_step(runs: dict[str, dict[int, tuple[list[dict], dict]]]) -> str:
    """Markdown: per variant evaluated between its first and last step too (--eval-every), every
    held-out metric at each evaluation step that all its seeds logged (mean ± sd over seeds)."""
    lines: list[str] = []
    for name, seeds in runs.items():
        evals = [evaluations(records) for records, _ in seeds.values()]
        steps = sorted(set.intersection(*(set(e) for e in evals)))
        if len(steps) <= 2:  # before and after only: the before/after table says it all
            continue
        lines += ["", f"**{name}** per evaluation step (held-out, mean ± sd over {len(evals)} seed(s); "
                  "step 0 is before training)", "",
                  "| metric | turn | " + " | ".join(f"step {s}" for s in steps) + " |",
                  "|---|---|" + "---|" * len(steps)]
        for label, turn, key in metric_rows([e[s] for e in evals for s in steps], seeds):
            if all(key in e[s] for e in evals for s in steps):
                lines.append(f"| {label} | {turn} | " + " | ".join(mean_sd([e[s][key] for e in evals]) for s in steps)
                             + " |")
    return "\n".join(lines) + "\n" if lines else ""


# (label, metric key) of the training diagnostics: why a run can or cannot learn (agent keys: mean over agents)
DIAGNOSTICS = [("training reward, turn 1", "train/turn_0/reward_mean"),
               ("training reward, turn 2", "train/turn_1/reward_mean"),
               ("groups with zero reward spread (no gradient)", "frac_zero_std"),
               ("completions cut at max_new_tokens", "truncated_frac"),
               ("completion length (tokens)", "completion_len"),
               ("gradient norm", "grad_norm"),
               ("seconds per step", "perf/step_s")]


def diagnostics(runs: dict[str, dict[int, tuple[list[dict], dict]]]) -> str:
    """Markdown: per variant, each training diagnostic at the first step, the mean over all steps and
    at the last step (mean ± sd over seeds)."""
    lines = ["| variant | diagnostic | first step | all steps | last step |", "|---|---|---|---|---|"]
    for name, seeds in runs.items():
        for label, key in DIAGNOSTICS:
            per_seed = [[v for v in (_value(r, key) for r in records) if v is not None]
                        for records, _ in seeds.values()]
            per_seed = [values for values in per_seed if values]
            if per_seed:
                lines.append(f"| {name} | {label} | {mean_sd([v[0] for v in per_seed])} | "
                             f"{mean_sd([sum(v) / len(v) for v in per_seed])} | {mean_sd([v[-1] for v in per_seed])} |")
    return "\n".join(lines) + "\n"


def _value(record: dict, key: str) -> float | None:
    """A training record's value of `key`; a bare name is the mean of train/agent_*/<name>."""
    if "step" not in record or record["step"] == 0 or "perf/step_s" not in record:
        return None  # not a training step (the evaluation before training)
    if "/" in key:
        return record.get(key)
    values = [v for k, v in record.items() if k.startswith("train/agent_") and k.endswith("/" + key)]
    return sum(values) / len(values) if values else None


def _turn(key: str) -> int | None:
    """t of an `eval/turn_{t}/...` key (0-based), else None."""
    m = re.match(r"eval/turn_(\d+)/", key)
    return int(m.group(1)) if m else None


def _k(evals: list[dict]) -> str:
    """The k of pass@k (eval.num_samples) when above 1, else a key that matches nothing."""
    ks = {k.rsplit("@", 1)[1] for record in evals for k in record if "/pass@" in k and k[-1].isdigit()} - {"1"}
    return ks.pop() if ks else "none"


def plot(runs: dict[str, dict[int, tuple[list[dict], dict]]], path: Path) -> Path:
    """Per variant, mean over seeds with the min-max band: the training reward (turn 1) per step, and
    on the held-out problems the greedy reward and pass@1 at the last turn per evaluation step (step 0:
    before training; more points with --eval-every)."""
    from matplotlib.figure import Figure  # no pyplot: no global state
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(15, 4), dpi=120)
    axes = fig.subplots(1, 3)
    panels = [("training reward, turn 1", "reward", lambda r, last: "train/turn_0/reward_mean"),
              ("held-out greedy reward, last turn", "reward", lambda r, last: f"eval/turn_{last}/greedy_reward_mean"),
              ("held-out pass@1 greedy, last turn", "pass@1", lambda r, last: f"eval/turn_{last}/pass@1_greedy")]
    for name, seeds in runs.items():
        last = next(iter(seeds.values()))[1]["turns"] - 1
        for ax, (_, _, key_of) in zip(axes, panels):
            curves = [{r["step"]: r[key_of(r, last)] for r in records if key_of(r, last) in r}
                      for records, _ in seeds.values()]
            steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if steps:
                values = [[c[s] for c in curves] for s in steps]
                ax.plot(steps, [sum(v) / len(v) for v in values], marker="o", label=name)
                ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], alpha=0.2)
    for ax, (title, ylabel, _) in zip(axes, panels):
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        if ax.lines:
            ax.legend(fontsize=8)
        else:  # say so rather than draw an empty frame
            ax.text(0.5, 0.5, "no data in these runs", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle("mean over seeds; band: min-max", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def report(out: Path, doc: Path, image: Path) -> str:
    """Write the Markdown results (table, selection, provenance) to `doc` and the plot to `image`."""
    runs = load_runs(out)
    if not runs:
        raise SystemExit(f"report: no finished runs under {out / 'runs'} (run `run` first)")
    selection = json.loads((out / "selection.json").read_text()) if (out / "selection.json").is_file() else {}
    plot(runs, image)
    dates = sorted(i["date"] for seeds in runs.values() for _, i in seeds.values())
    machines = sorted({i["machine"] for seeds in runs.values() for _, i in seeds.values()})
    run_minutes = sum(i["seconds"] for seeds in runs.values() for _, i in seeds.values()) / 60
    select_minutes = float(selection.get("seconds", 0.0)) / 60
    head = [f"Runs finished between {dates[0]} and {dates[-1]} on {'; '.join(machines)}. "
            f"Time: selection {select_minutes:.0f} min + {sum(map(len, runs.values()))} runs {run_minutes:.0f} min "
            f"= {(select_minutes + run_minutes) / 60:.2f} h.",
            f"Training problems: {len(selection.get('selected', []))} of {len(selection.get('rates', {}))} "
            f"candidates, those whose sampled rewards differ ({_strictly_between(selection)} of them with a "
            f"pass rate strictly between 0 and 1; selection {selection.get('date', '?')}, "
            f"{selection.get('seconds', '?')} s, {selection.get('samples', '?')} samples each); "
            f"held-out: HumanEval {HELD_OUT_SPLIT}.",
            f"Sizes: {json.dumps(next(iter(next(iter(runs.values())).values()))[1].get('sizes', 'not recorded'))}.",
            "", f"![results]({os.path.relpath(image, doc.parent)})", ""]
    missing = unfinished(out)
    if missing:  # a partial report must say so
        head[-2:-2] = [f"**Not in these tables** (no experiment.json: running, stopped or failed): "
                       f"{', '.join(missing)}.", ""]
    text = ("\n".join(head) + "\n" + comparison(runs) + "\n" + table(runs) + per_step(runs)
            + "\n**Training diagnostics** (mean ± sd over seeds)\n\n" + diagnostics(runs))
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    return text


def _strictly_between(selection: dict) -> int:
    return sum(0.0 < selection.get("rates", {}).get(t, 0.0) < 1.0 for t in selection.get("selected", []))


# ------------------------------------------------------------------------------------------ CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["select", "run", "report", "all"])
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 problems, 1 step, 1 seed (the CI test)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default experiments/out/code_learning, or ..._smoke)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="default: 0 1 2 (smoke: 0)")
    parser.add_argument("--steps", type=int, default=None, help=f"training steps (default {FULL.steps})")
    parser.add_argument("--candidates", type=int, default=None, help="first N train problems to select from (0 = all)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help=f"also evaluate every N steps (0 = before and after only; "
                             f"default {FULL.eval_every}, smoke 0)")
    parser.add_argument("--doc", type=Path, default=None, help="results Markdown (default OUT/results.md)")
    parser.add_argument("--image", type=Path, default=None, help="plot PNG (default OUT/results.png)")
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    for field, value in (("seeds", tuple(args.seeds) if args.seeds else None), ("steps", args.steps),
                         ("candidates", args.candidates), ("eval_every", args.eval_every)):
        if value is not None:
            sizes = replace(sizes, **{field: value})
    out = args.out or ROOT / "experiments" / "out" / ("code_learning_smoke" if args.smoke else "code_learning")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # HumanEval: the copy shipped with magrpo, never the hub
    from magrpo import envs, external  # noqa: F401  (fills the env and feedback registries)

    if args.command in ("select", "all"):
        select(sizes, out / "selection.json")
    if args.command in ("run", "all"):
        run(sizes, out / "selection.json", out, args.variants)
    if args.command in ("report", "all"):
        print(report(out, args.doc or out / "results.md", args.image or out / "results.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
