"""Run report: PNG plots and a Markdown summary of a run directory's metrics.jsonl and config.json.

`python -m magrpo.report RUN_DIR [--out DIR]` (default DIR: RUN_DIR/report/). Which metrics exist
depends on the env, the number of agents and turns and the settings, so every plot and every
summary line is written only when its data is there. Turns are shown 1-based (the metric keys are
0-based: `train/turn_0/...` is turn 1). Only the run directory itself is read: the absolute paths
inside config.json (from the machine that trained) are never used, so a copied run works too.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from matplotlib.axes import Axes
from matplotlib.figure import Figure  # no pyplot: no global backend or display, Agg renders savefig
from matplotlib.ticker import MaxNLocator

from .errors import MagrpoError

Records = list[dict[str, Any]]
DPI = 120
AGENT_STATS = ("loss", "kl", "grad_norm", "clip_frac", "entropy", "completion_len")
PHASES = ("gen", "reward", "feedback", "update", "other", "eval")  # "other": step time outside the four


class ReportError(MagrpoError):
    """Bad input (no run dir, no metrics); the CLI prints it as one line and exits with 2."""

    exit_code = 2


def load_metrics(run_dir: Path | str) -> Records:
    """The records of RUN_DIR/metrics.jsonl in file order. A last line that is not valid JSON is
    what a run killed mid-write leaves, so it is skipped; a bad line elsewhere is an error."""
    path = Path(run_dir) / "metrics.jsonl"
    if not Path(run_dir).is_dir():
        raise ReportError(f"{run_dir} is not a directory")
    if not path.is_file():
        raise ReportError(f"{path} not found (is {run_dir} a run directory?)")
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    records: Records = []
    for i, (n, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ReportError(f"{path}:{n} is not valid JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ReportError(f"{path}:{n} has no integer 'step'")
        records.append(record)
    return records


def write_report(run_dir: Path | str, out_dir: Path | str | None = None) -> list[Path]:
    """Write the plots that have data and report.md into out_dir (default run_dir/report/);
    returns the written paths, report.md last."""
    run_dir = Path(run_dir)
    records = _last_run(load_metrics(run_dir))
    if not records:
        raise ReportError(f"{run_dir / 'metrics.jsonl'} holds no metrics")
    config = _load_config(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots: list[Path] = []
    for name, plot in (("reward", _plot_reward), ("agents", _plot_agents), ("eval", _plot_eval),
                       ("speed", _plot_speed)):
        fig = plot(records)
        if fig is not None:
            fig.savefig(out / f"{name}.png", dpi=DPI)
            plots.append(out / f"{name}.png")
    plots += _last_tree(run_dir, out)
    summary = out / "report.md"
    summary.write_text(_markdown(run_dir, records, config, [p.name for p in plots if p.suffix == ".png"]))
    return [*plots, summary]


def _last_tree(run_dir: Path, out: Path) -> list[Path]:
    """The tree viewer's page and picture of the last step's first tree, when rollouts were written."""
    from .viz import load_tree, render_tree_html, render_tree_png

    try:
        record = load_tree(run_dir)
    except (FileNotFoundError, LookupError):
        return []
    html = out / "tree.html"
    html.write_text(render_tree_html(record))
    return [html, render_tree_png(record, out / "tree.png")]


def _last_run(records: Records) -> Records:
    # RunWriter appends, so a run dir reused by a second run holds both; report the latest one.
    start = 0
    for i in range(1, len(records)):
        if records[i]["step"] <= records[i - 1]["step"]:
            start = i
    return records[start:]


def _load_config(run_dir: Path) -> dict[str, Any]:
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}  # the summary then shows what the metrics alone tell
    return config if isinstance(config, dict) else {}


# ---- reading series -------------------------------------------------------------------------


def _series(records: Records, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records holding key as a number."""
    pairs = [(r["step"], float(r[key])) for r in records
             if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _indices(records: Records, pattern: str) -> list[int]:
    """Sorted distinct integers captured by pattern's group over all keys, e.g. turn or agent ids."""
    regex = re.compile(pattern)
    return sorted({int(m.group(1)) for r in records for k in r if (m := regex.fullmatch(k))})


def _turns(records: Records, prefix: str) -> list[int]:
    return _indices(records, re.escape(prefix) + r"/turn_(\d+)/.*")


def _has(records: Records, key: str) -> bool:
    return any(key in r for r in records)


# ---- plots ----------------------------------------------------------------------------------


def _figure(panels: int, title: str) -> tuple[Figure, list[Axes]]:
    cols = min(panels, 2)
    rows = math.ceil(panels / cols)
    fig = Figure(figsize=(6 * cols, 3.8 * rows), dpi=DPI, layout="tight")
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(panels)]
    fig.suptitle(title)
    return fig, axes


def _style(ax: Axes, title: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole; no 1.25 ticks on short runs
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _plot_reward(records: Records) -> Figure | None:
    turns = _turns(records, "train")
    if not turns and not _has(records, "train/reward_mean"):
        return None
    fig, (ax,) = _figure(1, "Training reward")
    for t in turns:
        color = f"C{t % 10}"
        ax.plot(*_series(records, f"train/turn_{t}/reward_mean"), color=color, marker=".",
                label=f"turn {t + 1} reward")
        ax.plot(*_series(records, f"train/turn_{t}/return_mean"), color=color, linestyle="--",
                label=f"turn {t + 1} return")
    # train/reward_mean is the turn-1 reward again: thin and dotted so the turn-1 line stays visible
    ax.plot(*_series(records, "train/reward_mean"), color="black", linestyle=":", linewidth=1,
            label="train/reward_mean")
    _style(ax, "Reward (solid) and return (dashed) per turn", "mean over joint actions")
    return fig


def _plot_agents(records: Records) -> Figure | None:
    agents = _indices(records, r"train/agent_(\d+)/.*")
    stats = [s for s in AGENT_STATS if any(_has(records, f"train/agent_{a}/{s}") for a in agents)]
    if not stats:
        return None
    fig, axes = _figure(len(stats), "Per-agent update")
    for ax, stat in zip(axes, stats):
        for a in agents:
            ax.plot(*_series(records, f"train/agent_{a}/{stat}"), marker=".", label=f"agent {a}")
        _style(ax, stat, stat)
    return fig


def _plot_eval(records: Records) -> Figure | None:
    turns = _turns(records, "eval")
    panels = []  # (title, ylabel, sampled key, greedy key)
    if any(_has(records, f"eval/turn_{t}/pass@1") or _has(records, f"eval/turn_{t}/pass@1_greedy") for t in turns):
        panels.append(("pass@1", "pass@1", "eval/turn_{t}/pass@1", "eval/turn_{t}/pass@1_greedy"))
    if any(_has(records, f"eval/turn_{t}/reward_mean") or _has(records, f"eval/turn_{t}/greedy_reward_mean")
           for t in turns):
        panels.append(("reward", "mean reward", "eval/turn_{t}/reward_mean", "eval/turn_{t}/greedy_reward_mean"))
    if not panels:
        return None
    fig, axes = _figure(len(panels), "Evaluation per turn (step 0 = before training)")
    for ax, (title, ylabel, sampled, greedy) in zip(axes, panels):
        for t in turns:
            color = f"C{t % 10}"
            # markers: there are only a few eval points, a bare line would hide where they are
            ax.plot(*_series(records, sampled.format(t=t)), color=color, marker="o", label=f"turn {t + 1} sampled")
            ax.plot(*_series(records, greedy.format(t=t)), color=color, marker="s", linestyle="--",
                    label=f"turn {t + 1} greedy")
        _style(ax, f"Eval {title}: sampled (solid), greedy (dashed)", ylabel)
    return fig


def _phase_times(record: dict[str, Any]) -> dict[str, float]:
    """Seconds per phase of one record; 'other' is the step time the four timed phases leave."""
    times = {p: float(record[f"perf/{p}_s"]) for p in PHASES if isinstance(record.get(f"perf/{p}_s"), (int, float))}
    if isinstance(record.get("perf/step_s"), (int, float)):
        timed = sum(times.get(p, 0.0) for p in ("gen", "reward", "feedback", "update"))
        times["other"] = max(float(record["perf/step_s"]) - timed, 0.0)
    return times


def _plot_speed(records: Records) -> Figure | None:
    has_tokens = _has(records, "perf/tokens_per_s")
    timed = [(r["step"], times) for r in records if (times := _phase_times(r))]
    if not has_tokens and not timed:
        return None
    fig, axes = _figure(int(has_tokens) + int(bool(timed)), "Speed")
    if has_tokens:
        axes[0].plot(*_series(records, "perf/tokens_per_s"), marker=".", label="training generation")
        _style(axes[0], "Generated tokens per second", "tokens/s")
    if timed:
        ax = axes[-1]
        steps = [s for s, _ in timed]
        bottom = [0.0] * len(timed)
        for i, phase in enumerate(PHASES):
            heights = [times.get(phase, 0.0) for _, times in timed]
            if any(heights):
                ax.bar(steps, heights, bottom=bottom, width=0.8, linewidth=0, color=f"C{i}", label=phase)
                bottom = [b + h for b, h in zip(bottom, heights)]
        _style(ax, "Time per phase", "seconds")
    return fig


# ---- summary --------------------------------------------------------------------------------


def _get(config: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if not isinstance(config, dict) or key not in config:
            return None
        config = config[key]
    return config


def _fmt(value: float | None, sign: bool = False) -> str:
    if value is None:
        return "–"
    return f"{value:+.3f}" if sign else f"{value:.3f}"


def _at(record: dict[str, Any], key: str) -> float | None:
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _markdown(run_dir: Path, records: Records, config: dict[str, Any], images: Sequence[str]) -> str:
    t = _get(config, "trainer") or {}
    agents = _indices(records, r"train/agent_(\d+)/.*")
    steps = max(r["step"] for r in records)
    planned = t.get("steps")
    lines = [
        f"# Run report: {run_dir.resolve().name}",
        "",
        f"- run dir: `{run_dir}`",
        f"- env: {_get(config, 'env', 'name') or '?'}",
        f"- model: {_get(config, 'model', 'name') or '?'}",
        f"- agents: {len(agents) if agents else _get(config, 'env', 'num_agents') or '?'}",
        f"- K (generations per agent): {t.get('num_generations', '?')}; T (turns): {t.get('num_turns', '?')}; "
        f"joint mode: {t.get('joint_mode', '?')}",
        f"- steps done: {steps}" + (f" of {planned}" if planned is not None else ""),
    ]
    lines += _train_section(records) + _tools_section(records) + _eval_section(records) + _speed_section(records)
    if images:
        lines += ["", "## Plots", ""] + [f"![{Path(name).stem}]({name})" for name in images]
    return "\n".join(lines) + "\n"


def _train_section(records: Records) -> list[str]:
    rows = [(f"turn {t + 1}", f"train/turn_{t}/reward_mean") for t in _turns(records, "train")]
    if not rows and _has(records, "train/reward_mean"):
        rows = [("mean", "train/reward_mean")]
    out = []
    for label, key in rows:
        steps, values = _series(records, key)
        if values:
            out.append(f"| {label} | {_fmt(values[0])} (step {steps[0]}) | {_fmt(values[-1])} (step {steps[-1]}) "
                       f"| {_fmt(values[-1] - values[0], sign=True)} |")
    if not out:
        return []
    return ["", "## Train reward (first → last step)", "", "| turn | first | last | change |",
            "|---|---|---|---|", *out]


def _tools_section(records: Records) -> list[str]:
    """Tool use in training (a run with tools): calls, call rate, errors by kind and seconds per step, and
    each turn's call rate, first and last step."""
    kinds = sorted({k.removeprefix("tools/errors/") for r in records for k in r if k.startswith("tools/errors/")})
    rows = [("calls per step", "tools/calls"), ("call rate", "tools/call_rate"),
            *[(f"errors: {kind}", f"tools/errors/{kind}") for kind in kinds],
            ("tool seconds per step", "tools/seconds"),
            *[(f"turn {t + 1} call rate", f"tools/turn_{t}/call_rate") for t in _turns(records, "tools")]]
    out = []
    for label, key in rows:
        steps, values = _series(records, key)
        if values:
            out.append(f"| {label} | {_fmt(values[0])} (step {steps[0]}) | {_fmt(values[-1])} (step {steps[-1]}) |")
    if not out:
        return []
    return ["", "## Tools (first → last step)", "", "| | first | last |", "|---|---|---|", *out]


def _eval_section(records: Records) -> list[str]:
    turns = _turns(records, "eval")
    evals = [r for r in records if any(k.startswith("eval/turn_") for k in r)]
    if not evals:
        return []
    # pass@1 when the env reports "passed", else the reward: the one eval number every env has
    if any(f"eval/turn_{t}/pass@1{s}" in r for r in evals for t in turns for s in ("", "_greedy")):
        title, greedy, sampled = "pass@1", "eval/turn_{t}/pass@1_greedy", "eval/turn_{t}/pass@1"
    else:
        title, greedy, sampled = "reward", "eval/turn_{t}/greedy_reward_mean", "eval/turn_{t}/reward_mean"
    first, last = evals[0], evals[-1]
    cols = [(first, greedy), (last, greedy), (first, sampled), (last, sampled)]
    rows = [f"| turn {t + 1} | " + " | ".join(_fmt(_at(r, key.format(t=t))) for r, key in cols) + " |"
            for t in turns]
    gains = []
    for r, key in cols:
        a, b = _at(r, key.format(t=turns[0])), _at(r, key.format(t=turns[-1]))
        gains.append(_fmt(b - a, sign=True) if a is not None and b is not None else "–")
    rows.append(f"| turn {turns[0] + 1} → {turns[-1] + 1} | " + " | ".join(gains) + " |")
    return [
        "", f"## Eval {title} (first and last eval, {len(evals)} in all)", "",
        f"| turn | greedy @ step {first['step']} | greedy @ step {last['step']} "
        f"| sampled @ step {first['step']} | sampled @ step {last['step']} |",
        "|---|---|---|---|---|", *rows,
    ]


def _speed_section(records: Records) -> list[str]:
    out = []
    _, rates = _series(records, "perf/tokens_per_s")
    if rates:
        out.append(f"- mean tokens/s (training generation): {sum(rates) / len(rates):.1f}")
    totals = {p: 0.0 for p in PHASES}
    train_steps = 0  # records timing a training step, not only an evaluation (step 0)
    for r in records:
        times = _phase_times(r)
        train_steps += any(p != "eval" for p in times)
        for phase, seconds in times.items():
            totals[phase] += seconds
    total = sum(totals.values())
    if total > 0:
        split = ", ".join(f"{p} {100 * s / total:.1f}%" for p, s in totals.items() if s > 0)
        out.append(f"- time split: {split}")
        out.append(f"- total time: {total:.1f} s (training steps and evaluation; "
                   f"{sum(totals[p] for p in PHASES if p != 'eval') / max(train_steps, 1):.2f} s per training step)")
    return ["", "## Speed", "", *out] if out else []


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m magrpo.report",
        description="Plots (reward.png, agents.png, eval.png, speed.png; each when its metrics exist) and a "
                    "Markdown summary (report.md) of a run directory's metrics.jsonl and config.json.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory (holds metrics.jsonl)")
    parser.add_argument("--out", type=Path, metavar="DIR", help="where to write (default: RUN_DIR/report/)")
    args = parser.parse_args(argv)
    try:
        paths = write_report(args.run_dir, args.out)
    except (ReportError, OSError) as e:  # OSError: e.g. an unwritable --out
        print(f"report error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
