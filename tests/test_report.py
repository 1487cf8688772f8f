"""The run report (`python -m magrpo.report`): plots and report.md from a real tiny-model run, from a
moved copy of it, and from hand-written metrics; only plots with data; bad input exits with 2."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from PIL import Image

from magrpo import report
from tests.conftest import ROOT

PLOTS = ["reward.png", "agents.png", "eval.png", "speed.png"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 3-step run on the toy env, with an eval before training and after every step."""
    run = tmp_path_factory.mktemp("report") / "run"
    subprocess.run([sys.executable, "train.py", "env=length_ratio", "model=tiny", "external=length_ratio",
                    "logging.progress=false", "trainer.steps=3", "trainer.batch_size=2", "trainer.num_generations=2",
                    "generation.max_new_tokens=6", "eval.every=1", "eval.max_problems=2", "eval.num_samples=2",
                    "eval.at_start=true", "logging.wandb.mode=disabled", f"logging.run_dir={run}"],
                   cwd=ROOT, check=True)
    return run


def cli(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "magrpo.report", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def assert_png(path):
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), path
    assert len(data) > 10_000, f"{path} is only {len(data)} bytes"
    with Image.open(path) as image:
        width, height = image.size
    assert width >= 600 and height >= 300, (path, image.size)


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def report_md(run_dir, records: list[dict]) -> str:
    """report.md of a run dir whose metrics.jsonl holds `records`."""
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report.write_report(run_dir, run_dir / "out")
    return (run_dir / "out" / "report.md").read_text()


def table_row(markdown: str, label: str) -> str:
    rows = [line for line in markdown.splitlines() if line.startswith(f"| {label} |")]
    assert rows, f"no row {label!r} in\n{markdown}"
    return rows[0]


def embedded_images(md_path) -> list[str]:
    """The image links of report.md; each must be relative and resolve next to report.md."""
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md_path.read_text())
    for link in links:
        assert not os.path.isabs(link) and (md_path.parent / link).is_file(), link
    return links


@pytest.mark.slow
def test_cli_writes_all_plots_and_summary(run):
    result = cli(run)
    assert result.returncode == 0, result.stderr
    out = run / "report"
    assert result.stdout.split() == [str(out / name) for name in [*PLOTS, "tree.html", "tree.png", "report.md"]]
    for name in PLOTS:
        assert_png(out / name)
    assert (out / "tree.png").read_bytes().startswith(PNG_SIGNATURE)
    # the last step's first tree: root + K children
    assert (out / "tree.html").read_text().count('class="node"') == 1 + 2
    md = (out / "report.md").read_text()
    assert "env: length_ratio" in md and "model: tiny" in md and "agents: 2" in md
    assert "steps done: 3 of 3" in md
    assert "T (turns): 2" in md and "joint mode: align" in md
    assert embedded_images(out / "report.md") == [*PLOTS, "tree.png"]
    assert "mean tokens/s" in md and "time split: gen " in md and "eval " in md


@pytest.mark.slow
def test_summary_and_plot_values_match_metrics(run, tmp_path):
    records = report.load_metrics(run)
    assert records == read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    report.write_report(run, tmp_path)
    md = (tmp_path / "report.md").read_text()
    for turn in (0, 1):
        first, last = records[1][f"train/turn_{turn}/reward_mean"], records[-1][f"train/turn_{turn}/reward_mean"]
        assert table_row(md, f"turn {turn + 1}").startswith(
            f"| turn {turn + 1} | {first:.3f} (step 1) | {last:.3f} (step 3) | {last - first:+.3f} |")
    # The toy env has no pass@k: the eval table shows the reward at step 0 and step 3 (greedy, sampled).
    eval_rows = [line for line in md.split("## Eval reward")[1].splitlines() if line.startswith("| turn 2 |")]
    expected = [records[i][f"eval/turn_1/{k}"] for k in ("greedy_reward_mean", "reward_mean") for i in (0, -1)]
    assert eval_rows == ["| turn 2 | " + " | ".join(f"{v:.3f}" for v in expected) + " |"]
    gain = records[-1]["eval/turn_1/greedy_reward_mean"] - records[-1]["eval/turn_0/greedy_reward_mean"]
    assert table_row(md, "turn 1 → 2").split(" | ")[2] == f"{gain:+.3f}"
    # The plotted reward line holds the metrics' values at their steps.
    fig = report._plot_reward(records)
    (line,) = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == "turn 2 reward"]
    assert list(line.get_xdata()) == [1, 2, 3]
    assert list(line.get_ydata()) == [r["train/turn_1/reward_mean"] for r in records[1:]]


@pytest.mark.slow
def test_report_on_a_moved_copy(run, tmp_path):
    moved = tmp_path / "elsewhere" / "copied_run"
    shutil.copytree(run, moved, ignore=shutil.ignore_patterns("report", "adapters"))
    config = json.loads((moved / "config.json").read_text())
    config["logging"]["run_dir"] = "/home/someone/runs/on-another-machine"  # as if trained elsewhere
    (moved / "config.json").write_text(json.dumps(config))
    result = cli("elsewhere/copied_run", cwd=tmp_path)  # a relative RUN_DIR from another working dir
    assert result.returncode == 0, result.stderr
    for name in PLOTS:
        assert_png(moved / "report" / name)
    md = (moved / "report" / "report.md").read_text()
    assert "# Run report: copied_run" in md and "env: length_ratio" in md
    assert str(run) not in md  # nothing read from the original location
    final = tmp_path / "moved_again"
    shutil.move(moved, final)  # the report itself moves with its run dir
    assert embedded_images(final / "report" / "report.md") == [*PLOTS, "tree.png"]


@pytest.mark.parametrize("keys,plots", [
    (["train/reward_mean"], ["reward.png"]),
    (["train/agent_0/kl"], ["agents.png"]),
    (["eval/turn_0/reward_mean", "eval/turn_1/greedy_reward_mean"], ["eval.png"]),
    (["perf/tokens_per_s"], ["speed.png"]),
    (["perf/gen_s", "perf/update_s"], ["speed.png"]),
    (["env_step"], []),
])
def test_only_plots_with_data(tmp_path, keys, plots):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in (1, 2, 3):
            f.write(json.dumps({"step": step, **{k: 0.1 * step for k in keys}}) + "\n")
    written = report.write_report(tmp_path)  # no config.json
    assert [p.name for p in written] == [*plots, "report.md"]
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == sorted([*plots, "report.md"])
    md = (tmp_path / "report" / "report.md").read_text()
    assert "steps done: 3" in md and "env: ?" in md
    assert embedded_images(tmp_path / "report" / "report.md") == plots


def test_pass_at_1_is_plotted_and_summarised(tmp_path):
    records = [{"step": 0, "eval/turn_0/pass@1": 0.25, "eval/turn_0/pass@1_greedy": 0.0,
                "eval/turn_1/pass@1": 0.5, "eval/turn_1/pass@1_greedy": 0.5, "eval/turn_0/reward_mean": 0.3},
               {"step": 5, "eval/turn_0/pass@1": 0.5, "eval/turn_0/pass@1_greedy": 0.5,
                "eval/turn_1/pass@1": 1.0, "eval/turn_1/pass@1_greedy": 0.75, "eval/turn_0/reward_mean": 0.6}]
    md = report_md(tmp_path, records)
    assert "## Eval pass@1 (first and last eval, 2 in all)" in md
    assert table_row(md, "turn 1") == "| turn 1 | 0.000 | 0.500 | 0.250 | 0.500 |"
    assert table_row(md, "turn 1 → 2") == "| turn 1 → 2 | +0.500 | +0.250 | +0.250 | +0.500 |"
    assert [ax.get_ylabel() for ax in report._plot_eval(records).axes] == ["pass@1", "mean reward"]


def test_truncated_last_line_is_skipped(tmp_path):
    lines = [json.dumps({"step": s, "train/reward_mean": s / 10}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "train/rew')
    assert [r["step"] for r in report.load_metrics(tmp_path)] == [1, 2, 3]
    result = cli(tmp_path)
    assert result.returncode == 0, result.stderr
    assert "steps done: 3" in (tmp_path / "report" / "report.md").read_text()


def test_a_reused_run_dir_reports_the_latest_run(tmp_path):
    steps = [1, 2, 3, 1, 2]  # RunWriter appends: a second run into the same dir starts again at 1
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "train/reward_mean": i}) + "\n" for i, s in enumerate(steps)))
    report.write_report(tmp_path)
    md = (tmp_path / "report" / "report.md").read_text()
    assert "steps done: 2" in md and table_row(md, "mean").startswith("| mean | 3.000 (step 1) | 4.000 (step 2) |")


@pytest.mark.parametrize("case,words", [
    ("missing_dir", "not a directory"),
    ("no_metrics", "metrics.jsonl not found"),
    ("empty", "holds no metrics"),
    ("only_truncated", "holds no metrics"),
    ("bad_middle_line", "metrics.jsonl:1 is not valid JSON"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, case, words):
    run = tmp_path / "run"
    if case != "missing_dir":
        run.mkdir()
    content = {"empty": "\n", "only_truncated": '{"step": 1, "train', "bad_middle_line": '{"st\n{"step": 1}\n'}
    if case in content:
        (run / "metrics.jsonl").write_text(content[case])
    assert report.main([str(run)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1 and captured.err.startswith("report error: ")
    assert words in captured.err
    assert not (run / "report").exists()


def test_cli_error_is_one_line_without_traceback(tmp_path):
    result = cli(tmp_path / "nope")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"report error: {tmp_path / 'nope'} is not a directory"]


def test_a_run_with_tools_gets_a_tools_section(tmp_path):
    records = [{"step": s, "train/reward_mean": 0.1 * s, "tools/calls": calls, "tools/call_rate": rate,
                "tools/seconds": 0.5 * s, "tools/turn_0/call_rate": rate, "tools/turn_1/call_rate": rate / 2,
                **({"tools/errors/bad_json": 3} if s == 1 else {})}
               for s, calls, rate in ((1, 4, 0.25), (2, 12, 0.75))]
    md = report_md(tmp_path, records)
    assert "## Tools (first → last step)" in md
    assert table_row(md, "calls per step") == "| calls per step | 4.000 (step 1) | 12.000 (step 2) |"
    assert table_row(md, "errors: bad_json") == "| errors: bad_json | 3.000 (step 1) | 3.000 (step 1) |"
    assert table_row(md, "turn 2 call rate") == "| turn 2 call rate | 0.125 (step 1) | 0.375 (step 2) |"
    assert "## Tools" not in report_md(tmp_path, [{"step": 1, "train/reward_mean": 0.1}])  # no tools, no section
