"""experiments/reasoning_queue.sh keeps issue 48's finished records where a lost machine cannot take them:
after each job it copies the records the report reads (never checkpoints) to KEEP, which is committed,
and at its start it copies back what an earlier machine finished, so that work is not run again.

The harness itself is tested in tests/test_reasoning_learning_experiment.py; here a stand-in interpreter
(MAGRPO_VENV/bin/python) writes what the harness would and logs each call."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Writes OUT/untrained/<arm>.json, or a run folder with a checkpoint; a run is finished (experiment.json) unless
# its arm is "stopped". Skips what OUT already holds, as the harness does.
STAND_IN = r"""#!/usr/bin/env bash
set -eu
cmd=$2; shift 2; out=; arm=; seed=
while [ $# -gt 0 ]; do
    case $1 in --out) out=$2; shift 2;; --arms) arm=$2; shift 2;; --seeds) seed=$2; shift 2;; *) shift;; esac
done
if [ "$cmd" = untrained ]; then
    mkdir -p "$out/untrained"
    for a in method single_agent; do
        [ -f "$out/untrained/$a.json" ] || echo "{\"variant\": \"$a\"}" > "$out/untrained/$a.json"
    done
    exit 0
fi
dir=$out/runs/$arm/seed$seed
if [ -f "$dir/experiment.json" ]; then echo "kept $arm $seed" >> "$CALLS"; exit 0; fi
echo "trained $arm $seed" >> "$CALLS"
mkdir -p "$dir/checkpoint"
echo '{}' > "$dir/config.json"; echo '{"step": 1}' > "$dir/metrics.jsonl"; echo weights > "$dir/checkpoint/state.pt"
[ "$arm" = stopped ] && exit 143
echo "{\"variant\": \"$arm\"}" > "$dir/experiment.json"
"""


def run_queue(tmp_path: Path, out: Path, keep: Path, jobs: str, pin: str = "", code: int = 0) -> list[str]:
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    calls = tmp_path / "calls.txt"
    calls.unlink(missing_ok=True)
    env = {**os.environ, "MAGRPO_VENV": str(venv), "OUT": str(out), "KEEP": str(keep), "JOBS": jobs,
           "CALLS": str(calls), "LIMIT": "60s", "PIN": pin}
    done = subprocess.run(["bash", str(ROOT / "experiments" / "reasoning_queue.sh")], env=env, timeout=60,
                          capture_output=True, text=True)
    assert done.returncode == code, done.stderr
    return calls.read_text().splitlines() if calls.is_file() else []


def files(folder: Path) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()}


def test_finished_records_are_kept_without_checkpoints(tmp_path):
    out, keep = tmp_path / "out", tmp_path / "keep"
    calls = run_queue(tmp_path, out, keep, "method:0 stopped:0 single_agent:0", pin="HEAD")  # this code: runs
    assert calls == ["trained method 0", "trained stopped 0", "trained single_agent 0"]
    assert files(keep) == {"untrained/method.json", "untrained/single_agent.json",
                           *(f"runs/{arm}/seed0/{name}" for arm in ("method", "single_agent")
                             for name in ("config.json", "experiment.json", "metrics.jsonl"))}
    log = (out / "queue.log").read_text()
    assert "end stopped 0: exit 143" in log and "queue done" in log


def test_a_new_machine_gets_back_what_an_earlier_one_finished(tmp_path):
    first, keep = tmp_path / "first", tmp_path / "keep"
    run_queue(tmp_path, first, keep, "method:0 stopped:0")
    (keep / "untrained" / "method.json").write_text('{"variant": "method", "kept": true}')
    fresh = tmp_path / "fresh"  # the machine was replaced: its OUT is empty
    calls = run_queue(tmp_path, fresh, keep, "method:0 stopped:0 method:1")
    assert calls == ["kept method 0", "trained stopped 0", "trained method 1"]
    assert json.loads((fresh / "untrained" / "method.json").read_text())["kept"]  # copied back, not redone
    assert "runs/method/seed1/experiment.json" in files(keep)
    assert not (keep / "runs" / "stopped").exists()  # unfinished: its checkpoint stays on the machine


def test_the_queue_refuses_code_other_than_the_experiments(tmp_path):
    """Every arm is trained and evaluated by one code: a checkout whose training code is not the pinned
    commit's (here: a commit git does not know) starts nothing."""
    out = tmp_path / "out"
    assert run_queue(tmp_path, out, tmp_path / "keep", "method:0", pin="0" * 40, code=2) == []
    assert "refused" in (out / "queue.log").read_text() and not (out / "untrained").exists()
