"""Does magrpo learn what the reference learns? Reward curves of CoMLRL 1.4.3's MAGRPOTrainer and of
magrpo with full-weight agents on one task, per prompt, over seeds (issue 47, part 2).

    bash scripts/setup_comlrl.sh                        # once: CoMLRL's own venv (~/.cache/magrpo/comlrl-venv)
    .venv/bin/python experiments/parity.py              # align + cross, 9 seeds, 48 prompts: experiments/out/parity/
    .venv/bin/python experiments/parity.py --quick      # the whole pipeline in seconds (1 seed, 2 prompts, tiny tree)
    .venv/bin/python experiments/parity.py --modes align --seeds 1 --prompts 20   # a small real comparison

Both sides train the length_ratio task (bench/comlrl_pair.py: prompts, reward, feedback, tiny model)
with the same tree (N=2 agents, K, T turns, no early termination), tokens, sampling, learning rate,
AdamW, one prompt per step, and for each seed the same problems in the same order (the order magrpo's
sampler draws for that seed, handed to CoMLRL as its dataset). `--updates turn` (the default) gives
both one optimizer step per turn of each prompt's tree (magrpo `trainer.update_every=turn`; CoMLRL a
rollout buffer of one tree's nodes, drained by turn); `--updates buffer` keeps CoMLRL's default
buffer of 2 (3.5 steps per prompt aligned, 9.5 crossed) against magrpo's one step per prompt.
CoMLRL runs in its own venv as a subprocess (experiments/parity_comlrl.py, its trainer built as its docs
show); magrpo runs through its CLI (`train.py` with the overrides of `magrpo_overrides` below). The runs
go one at a time (each library in turn, first one then the other by seed), with the same torch thread
count (--threads). docs/results/parity.md says what CoMLRL does per step, which magrpo settings match
it, and what cannot be matched (`MAGRPO_SETTINGS` holds the latter's choices).

A run whose record is already in --out/runs with the same inputs (`run_inputs`) is kept, not run
again: a stopped comparison resumes, and more seeds add to the ones made.

Output (--out): runs/<library>_<mode>_seed<s>.json as each run ends (per prompt: rewards of each turn,
seconds, problem id), parity.json (settings, every record, the summary), parity.png (per-turn
reward curves, mean over seeds with the min-max band; matplotlib), and the summary table on stdout:
reward over the first and the last --window prompts (mean +- sd over seeds) and seconds per prompt.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "bench"):  # this checkout's magrpo, and bench/comlrl_pair.py (the shared task)
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from comlrl_pair import TASKS, Tree, magrpo_overrides  # noqa: E402

LIBRARIES = ("comlrl", "magrpo")
COMLRL_VENV = Path(os.environ.get("MAGRPO_COMLRL_VENV", Path.home() / ".cache" / "magrpo" / "comlrl-venv"))
# magrpo settings that make its update CoMLRL's (docs/results/parity.md, "Matching magrpo to CoMLRL").
MAGRPO_SETTINGS = (
    "model.dtype=float32",  # CoMLRL loads the float32 folder as it is
    "trainer.weight_decay=0.01",  # torch.optim.AdamW's default, which CoMLRL keeps
    "trainer.max_grad_norm=0",  # CoMLRL clips no gradient
    "trainer.warmup_steps=0",  # nor schedules the learning rate
    "trainer.baseline=mean",  # advantage_mode=mean
    "trainer.advantage_scale=std",  # advantage_normalization=True (its re-centring is a no-op after the mean)
    "trainer.cross_credit=sum",  # a cross completion's value is the sum over its joint actions
    "trainer.discount=1.0",  # CoMLRL's training returns are undiscounted whatever its `discount`
    "trainer.group_by=node",
    "trainer.loss_agg=dr_grpo",  # a summed log-prob per sequence with a constant normaliser, as CoMLRL's
    "trainer.kl_coef=0",
    "trainer.ppo_epochs=1",  # one plain policy-gradient step per batch, no ratio
    "trainer.entropy_coef=0",
)
# CoMLRL's MAGRPOConfig, its defaults written out so the record shows them.
COMLRL_SETTINGS = {"rollout_buffer_size": 2, "advantage_mode": "mean", "advantage_normalization": True,
                   "reference_kl_enabled": False, "discount": 1.0}


@dataclass(frozen=True)
class Settings:
    """What one comparison runs: the same for both libraries."""

    task: str = "length_ratio"
    modes: tuple[str, ...] = ("align", "cross")
    seeds: tuple[int, ...] = tuple(range(9))  # a 3-seed band is too narrow to hold a curve (parity.md)
    prompts: int = 48  # prompts per run = steps (one prompt per step), one epoch over a split of this size
    tree: Tree = field(default_factory=Tree)
    lr: float = 3e-3  # both sides, every agent: both learn visibly within 24 prompts (docs/results/parity.md)
    threads: int = 1  # torch intra-op threads of every run (OMP_NUM_THREADS)
    window: int = 8  # prompts averaged for the "first" and "last" rewards of the table
    updates: str = "turn"  # optimizer steps: one per turn on both sides, or each library's own ("buffer")
    magrpo_extra: tuple[str, ...] = ()  # more train.py overrides (after MAGRPO_SETTINGS: they win)
    comlrl_extra: tuple[tuple[str, object], ...] = ()  # more MAGRPOConfig fields (over COMLRL_SETTINGS)


QUICK = Settings(seeds=(0,), prompts=2, tree=Tree(k=2, turns=2, max_new_tokens=6), window=1)
UPDATES = ("turn", "buffer")


def tree_nodes(tree: Tree, mode: str) -> int:
    """Nodes of one tree without early termination: each node below the last turn has one child per
    joint action."""
    return sum(tree.joint_actions(mode) ** t for t in range(tree.turns))


def problem_order(prompts: int, seed: int) -> list[int]:
    """Indices of the train problems magrpo trains on, in its order, for this seed and one prompt per
    step (its own sampler, so the CoMLRL side gets exactly these)."""
    from magrpo.trainer import ProblemSampler

    sampler = ProblemSampler(list(range(prompts)), seed)
    return [sampler.next(1)[0] for _ in range(prompts)]


def magrpo_command(s: Settings, mode: str, seed: int, run_dir: Path) -> list[str]:
    full = ", ".join(["{finetune: full}"] * s.tree.num_agents)
    return [sys.executable, str(ROOT / "train.py"),
            *magrpo_overrides(TASKS[s.task], s.tree, mode, s.prompts, 1, seed),
            f"agents=[{full}]", f"trainer.lr={s.lr}", *MAGRPO_SETTINGS,
            *(["trainer.update_every=turn"] if s.updates == "turn" else []), *s.magrpo_extra,
            "eval.at_end=false", "eval.every=0", "logging.progress=false", "logging.rollouts=true",
            "logging.samples_every=0", "logging.wandb.mode=disabled", f"logging.run_dir={run_dir}"]


def comlrl_spec(s: Settings, mode: str, seed: int) -> dict:
    # per turn: a buffer holding one tree's node samples is drained by turn, one batch (step) per turn
    per_turn = {"rollout_buffer_size": tree_nodes(s.tree, mode), "train_batch_size": tree_nodes(s.tree, mode)}
    return {"task": s.task, "mode": mode, "seed": seed, "tree": asdict(s.tree),
            "problems": problem_order(s.prompts, seed),
            "config": {"agent_learning_rate": s.lr, **COMLRL_SETTINGS, **(per_turn if s.updates == "turn" else {}),
                       **dict(s.comlrl_extra)}}


def run_inputs(s: Settings, library: str, mode: str, seed: int) -> dict:
    """Everything a run's record depends on: magrpo's overrides (as key -> value, the last one winning,
    as Hydra reads them; the run folder aside) or CoMLRL's spec, and the thread count. A record made
    with the same inputs is reused (by an older commit too: its record names the commit)."""
    if library == "comlrl":
        return {"spec": comlrl_spec(s, mode, seed), "threads": s.threads}
    overrides = dict(item.partition("=")[::2] for item in magrpo_command(s, mode, seed, Path("RUN"))[2:])
    overrides.pop("logging.run_dir")
    return {"overrides": overrides, "threads": s.threads}


def child_env(threads: int) -> dict[str, str]:
    """The same thread count and offline switches for both libraries' processes."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "WANDB_MODE": "disabled",
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def run_child(command: list[str], threads: int, log: Path) -> None:
    with log.open("w") as out:
        done = subprocess.run(command, cwd=ROOT, env=child_env(threads), stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise SystemExit(f"parity: {command[1]} failed (exit {done.returncode}); last lines of {log}:\n{tail}")


def run_magrpo(s: Settings, mode: str, seed: int, work: Path) -> dict:
    run_dir = work / f"magrpo_{mode}_seed{seed}"
    run_child(magrpo_command(s, mode, seed, run_dir), s.threads, work / f"magrpo_{mode}_seed{seed}.log")
    return magrpo_record(run_dir, s, mode, seed)


def magrpo_record(run_dir: Path, s: Settings, mode: str, seed: int) -> dict:
    """The run's steps in the CoMLRL side's shape: problem, seconds (perf/step_s: rollout + update), the
    rewards of each turn (from rollouts.jsonl: every joint action of the step's one tree) and the texts
    of the root's first joint action."""
    metrics = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    config = json.loads((run_dir / "config.json").read_text())
    per_turn = config["trainer"]["update_every"] == "turn"  # one optimizer step per turn the tree reached
    steps = []
    for tree in map(json.loads, (run_dir / "rollouts.jsonl").read_text().splitlines()):
        turns = [[] for _ in range(s.tree.turns)]
        for node in tree["nodes"]:
            turns[node["turn"]].extend(j["reward"] for j in node["joint_actions"])
        m, root = metrics[tree["step"]], tree["nodes"][0]
        sample = [root["completions"][agent][k] for agent, k in enumerate(root["joint_actions"][0]["agents"])]
        steps.append({"step": tree["step"], "problem": tree["problem"]["id"], "seconds": m["perf/step_s"],
                      "turn_rewards": turns, "sample": sample, "gen_s": m["perf/gen_s"], "update_s": m["perf/update_s"],
                      "optimizer_steps": [sum(map(bool, turns)) if per_turn else 1] * s.tree.num_agents})
    return {"library": "magrpo", "task": s.task, "mode": mode, "seed": seed, "tree": asdict(s.tree),
            "config": {"trainer": config["trainer"], "agents": config["agents"]}, "steps": steps}


def run_comlrl(s: Settings, mode: str, seed: int, work: Path, python: Path) -> dict:
    spec, out = work / f"comlrl_{mode}_seed{seed}.spec.json", work / f"comlrl_{mode}_seed{seed}.json"
    spec.write_text(json.dumps(comlrl_spec(s, mode, seed)))
    run_child([str(python), str(ROOT / "experiments" / "parity_comlrl.py"), str(spec), str(out)], s.threads,
              work / f"comlrl_{mode}_seed{seed}.log")
    return json.loads(out.read_text())


def check_same_problems(records: list[dict]) -> None:
    """Both libraries of one mode and seed trained the same problems in the same order."""
    runs: dict[tuple, dict[str, list]] = {}
    for r in records:
        runs.setdefault((r["mode"], r["seed"]), {})[r["library"]] = [step["problem"] for step in r["steps"]]
    for key, by in runs.items():
        if len(set(map(tuple, by.values()))) > 1:
            raise SystemExit(f"parity: {key}: the libraries trained different problems: {by}")


# ---------------------------------------------------------------- summary

def curve(record: dict, turn: int) -> list[float]:
    """Mean reward of `turn`'s joint actions at each prompt."""
    return [statistics.fmean(step["turn_rewards"][turn]) for step in record["steps"]]


def mean_sd(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def summarise(records: list[dict], s: Settings) -> list[dict]:
    """One row per mode, library and turn: reward over the first and last `window` prompts and seconds
    per prompt, each a mean +- sd over seeds."""
    rows = []
    for mode in s.modes:
        for library in LIBRARIES:
            runs = [r for r in records if r["mode"] == mode and r["library"] == library]
            if not runs:
                continue
            seconds = mean_sd([statistics.fmean(step["seconds"] for step in r["steps"]) for r in runs])
            for turn in range(s.tree.turns):
                curves = [curve(r, turn) for r in runs]
                rows.append({"mode": mode, "library": library, "turn": turn, "seeds": [r["seed"] for r in runs],
                             "first": mean_sd([statistics.fmean(c[:s.window]) for c in curves]),
                             "last": mean_sd([statistics.fmean(c[-s.window:]) for c in curves]),
                             "seconds_per_prompt": seconds,
                             "optimizer_steps_per_prompt": statistics.fmean(map(steps_per_prompt, runs))})
    return rows


def steps_per_prompt(record: dict) -> float:
    """Agent 0's optimizer steps per prompt (CoMLRL: its buffer updates; magrpo: 1, or the turns its tree
    reached with trainer.update_every=turn)."""
    return sum(step["optimizer_steps"][0] for step in record["steps"]) / len(record["steps"])


def band_agreement(records: list[dict], s: Settings) -> list[dict]:
    """Per mode and turn, what issue 47 asks: at each prompt, is magrpo's smoothed curve (the mean over its
    seeds, as plotted) within CoMLRL's band (its seeds' lowest to highest)? Counts, and the largest gap
    below and above the band."""
    return [dict(row, compared="magrpo, all seeds vs CoMLRL, all seeds")
            for row in agreement(records, s, lambda r: r["library"] == "magrpo", lambda r: r["library"] == "comlrl")]


def calibration(records: list[dict], s: Settings) -> list[dict]:
    """The same test of CoMLRL against itself: the mean of half its seeds against the band of the other
    half, both ways round. How often one library's curve leaves its own band with that many seeds is
    what a difference between the libraries has to be read against."""
    seeds = sorted({r["seed"] for r in records if r["library"] == "comlrl"})
    halves = (seeds[:len(seeds) // 2], seeds[len(seeds) // 2:])
    if not halves[0]:
        return []
    rows = []
    for ours, theirs in (halves, halves[::-1]):
        rows += [dict(row, compared=f"CoMLRL seeds {ours} vs CoMLRL seeds {theirs}")
                 for row in agreement(records, s, lambda r, o=ours: r["library"] == "comlrl" and r["seed"] in o,
                                      lambda r, o=theirs: r["library"] == "comlrl" and r["seed"] in o)]
    return rows


def agreement(records: list[dict], s: Settings, ours, theirs) -> list[dict]:
    """Prompt by prompt, the mean of the `ours` records' smoothed curves against the lowest-to-highest
    band of the `theirs` records' (each a predicate on a record), per mode and turn."""
    out = []
    for mode in s.modes:
        for turn in range(s.tree.turns):
            sides = [[smooth(curve(r, turn), s.window) for r in records if r["mode"] == mode and pick(r)]
                     for pick in (ours, theirs)]
            if not all(sides):
                continue
            gaps = []
            for at, values in enumerate(zip(*sides[0])):
                band = [c[at] for c in sides[1]]
                mean = statistics.fmean(values)
                gaps.append(min(0.0, mean - min(band)) + max(0.0, mean - max(band)))
            out.append({"mode": mode, "turn": turn, "prompts": len(gaps), "within": sum(g == 0 for g in gaps),
                        "largest_below": min(gaps), "largest_above": max(gaps)})
    return out


def agreement_table(rows: list[dict]) -> str:
    lines = ["| compared | mode | turn | prompts within the band | largest gap below | largest gap above |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['compared']} | {r['mode']} | {r['turn'] + 1} | {r['within']} of {r['prompts']} | "
              f"{r['largest_below']:.3f} | {r['largest_above']:.3f} |" for r in rows]
    return "\n".join(lines)


def table(rows: list[dict], s: Settings) -> str:
    def cell(x: dict) -> str:
        return f"{x['mean']:.3f} ± {x['sd']:.3f}"

    head = (f"| mode | library | turn | seeds | reward, first {s.window} prompts | reward, last {s.window} prompts | "
            "s / prompt | optimizer steps / prompt (agent 0) |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        sec, steps = r["seconds_per_prompt"], r["optimizer_steps_per_prompt"]
        lines.append(f"| {r['mode']} | {r['library']} | {r['turn'] + 1} | {len(r['seeds'])} | {cell(r['first'])} | "
                     f"{cell(r['last'])} | {sec['mean']:.2f} ± {sec['sd']:.2f} | {steps:.2f} |")
    return "\n".join(lines)


def smooth(values: list[float], width: int) -> list[float]:
    """Trailing moving average over up to `width` prompts (the plot only; the JSON keeps every prompt)."""
    return [statistics.fmean(values[max(0, i + 1 - width): i + 1]) for i in range(len(values))]


def plot(records: list[dict], s: Settings, path: Path) -> Path | None:
    """Rows: joint modes; columns: turns. Per library the mean over seeds of the smoothed per-prompt
    curve, with the band between the seeds' lowest and highest. None when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no global backend or display
    except ImportError:
        return None
    fig = Figure(figsize=(5 * s.tree.turns, 3.4 * len(s.modes)), layout="constrained")
    axes = fig.subplots(len(s.modes), s.tree.turns, squeeze=False, sharey=True)
    for row, mode in enumerate(s.modes):
        for turn in range(s.tree.turns):
            ax = axes[row][turn]
            for library, colour in zip(LIBRARIES, ("tab:orange", "tab:blue")):
                curves = [smooth(curve(r, turn), s.window) for r in records
                          if r["mode"] == mode and r["library"] == library]
                if not curves:
                    continue
                x = range(1, len(curves[0]) + 1)
                ax.plot(x, [statistics.fmean(v) for v in zip(*curves)], color=colour,
                        label=f"{library} ({len(curves)} seed{'s' * (len(curves) > 1)})")
                if len(curves) > 1:
                    ax.fill_between(x, [min(v) for v in zip(*curves)], [max(v) for v in zip(*curves)],
                                    color=colour, alpha=0.2, linewidth=0)
            ax.set_title(f"{mode}, turn {turn + 1}")
            ax.set_xlabel("prompt (= magrpo step)")
            ax.set_ylabel(f"reward (mean of last {s.window} prompts)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    return path


# ---------------------------------------------------------------- main

def machine() -> dict:
    """Where and with what the runs were made: CPU, load, this checkout's commit, magrpo side's versions."""
    from importlib.metadata import version

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?") if Path("/proc/cpuinfo").exists() else "?"
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout.strip())
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
            "commit": commit + (" (with uncommitted changes)" if dirty else ""),
            "versions": {name: version(name) for name in ("torch", "transformers", "peft")}}


def settings_from(a: argparse.Namespace) -> Settings:
    base = QUICK if a.quick else Settings()
    sizes = {"k": a.k, "turns": a.turns, "max_new_tokens": a.max_new_tokens}
    tree = replace(base.tree, **{k: v for k, v in sizes.items() if v is not None})
    given = {"modes": tuple(a.modes) if a.modes else None, "prompts": a.prompts, "lr": a.lr, "threads": a.threads,
             "window": a.window, "updates": a.updates, "seeds": tuple(range(a.seeds)) if a.seeds else None,
             "magrpo_extra": tuple(a.magrpo) or None, "comlrl_extra": tuple(map(config_item, a.comlrl)) or None}
    return replace(base, tree=tree, **{k: v for k, v in given.items() if v is not None})


def config_item(text: str) -> tuple[str, object]:
    """'key=value' -> (key, value), the value read as JSON when it is JSON (2, 0.5, true, null), else a string."""
    key, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"parity: --comlrl {text!r} is not key=value")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="seconds-long smoke: 1 seed, 2 prompts, K=2, 6 tokens")
    p.add_argument("--modes", nargs="+", choices=["align", "cross"], help="joint modes (default both)")
    p.add_argument("--seeds", type=int, help="seeds 0..N-1 (default 9)")
    p.add_argument("--prompts", type=int, help="prompts per run, one per step (default 48)")
    p.add_argument("--lr", type=float, help="learning rate of every agent, both libraries (default 3e-3)")
    p.add_argument("--k", type=int, help="completions per agent and node (default 4)")
    p.add_argument("--turns", type=int, help="turns per tree (default 2)")
    p.add_argument("--max-new-tokens", type=int, help="tokens per completion (default 32)")
    p.add_argument("--threads", type=int, help="torch threads of every run (default 1)")
    p.add_argument("--window", type=int, help="prompts per table average and plot smoothing (default 8)")
    p.add_argument("--updates", choices=UPDATES, help="turn (default): both one optimizer step per turn of a "
                   "prompt's tree; buffer: CoMLRL's default buffer of 2 against magrpo's one step per prompt")
    p.add_argument("--magrpo", action="append", default=[], metavar="OVERRIDE",
                   help="one more train.py override for the magrpo side (repeatable)")
    p.add_argument("--comlrl", action="append", default=[], metavar="KEY=VALUE",
                   help="one more MAGRPOConfig field for the CoMLRL side, e.g. rollout_buffer_size=5 (repeatable)")
    p.add_argument("--sides", nargs="+", choices=LIBRARIES, default=list(LIBRARIES), help="libraries to run")
    p.add_argument("--comlrl-python", type=Path, default=COMLRL_VENV / "bin" / "python",
                   help="CoMLRL's venv python (default $MAGRPO_COMLRL_VENV or ~/.cache/magrpo/comlrl-venv)")
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "out" / "parity", help="results folder")
    return p.parse_args(argv)


def ensure_comlrl(python: Path) -> None:
    """One command from a clean clone: CoMLRL's own venv (the default one) is made first when missing
    (scripts/setup_comlrl.sh, a few minutes, once); a --comlrl-python that does not exist is an error."""
    if python.exists():
        return
    if python != COMLRL_VENV / "bin" / "python":
        raise SystemExit(f"parity: --comlrl-python {python} does not exist")
    print(f"parity: no CoMLRL venv at {COMLRL_VENV}: making it with scripts/setup_comlrl.sh", file=sys.stderr)
    subprocess.run(["bash", str(ROOT / "scripts" / "setup_comlrl.sh")], check=True,
                   env={**os.environ, "MAGRPO_COMLRL_VENV": str(COMLRL_VENV)})


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    s = settings_from(a)
    if "comlrl" in a.sides:
        ensure_comlrl(a.comlrl_python)
    runs_dir = a.out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    records, started, before = [], time.time(), machine()
    with tempfile.TemporaryDirectory(prefix="magrpo-parity-") as tmp:
        for mode in s.modes:
            for seed in s.seeds:
                # each library first on every other seed: a slow drift of the machine's load hits both
                for library in (a.sides if seed % 2 == 0 else a.sides[::-1]):
                    saved, inputs = runs_dir / f"{library}_{mode}_seed{seed}.json", run_inputs(s, library, mode, seed)
                    record = json.loads(saved.read_text()) if saved.exists() else {}
                    if record.get("inputs") == inputs:
                        print(f"[{time.strftime('%H:%M:%S')}] {library} {mode} seed {seed}: kept from {saved}",
                              file=sys.stderr)
                    else:
                        why = " (its saved record had other inputs)" if record else ""
                        print(f"[{time.strftime('%H:%M:%S')}] {library} {mode} seed {seed}{why} ...", file=sys.stderr)
                        record = (run_magrpo(s, mode, seed, Path(tmp)) if library == "magrpo"
                                  else run_comlrl(s, mode, seed, Path(tmp), a.comlrl_python))
                        record.update(inputs=inputs, commit=before["commit"])
                        saved.write_text(json.dumps(record, indent=1))
                    records.append(record)
    check_same_problems(records)
    rows = summarise(records, s)
    result = {"settings": asdict(s), "magrpo_settings": list(MAGRPO_SETTINGS), "comlrl_settings": COMLRL_SETTINGS,
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
              "wall_s": time.time() - started, "machine": before, "load_average_after": os.getloadavg(),
              "summary": rows, "agreement": band_agreement(records, s),
              "calibration": calibration(records, s), "records": records}
    (a.out / "parity.json").write_text(json.dumps(result, indent=1))
    picture = plot(records, s, a.out / "parity.png")
    print(table(rows, s))
    if result["agreement"]:
        print(agreement_table(result["agreement"] + result["calibration"]))
    print(f"results: {a.out / 'parity.json'}" + (f"; plot: {picture}" if picture else " (no matplotlib: no plot)"))
    return result


if __name__ == "__main__":
    main()
