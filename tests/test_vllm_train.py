"""`train(cfg)` with backend=vllm on the tiny model: 3 steps for align and cross, and the align run
again under `torchrun --nproc_per_node=2` (one engine per process) against it (vllm venv only)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vllm not installed: bash scripts/setup_vllm.sh, then run with that venv's python")

from magrpo.trainer import train
from tests.conftest import ROOT, SMALL, compose

RUN = ["backend=vllm", "trainer.steps=3", "trainer.lr=5e-2"]
MODES = {"align": [], "cross": ["trainer.tis_cap=2.0"]}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """mode -> the run dir of a single-process run in that mode (made on first use, shared by the tests)."""
    runs = {}

    def get(mode):
        if mode not in runs:
            run_dir = tmp_path_factory.mktemp(mode) / "run"
            runs[mode] = train(compose([*SMALL, f"logging.run_dir={run_dir}", *RUN, f"trainer.joint_mode={mode}",
                                        *MODES[mode]]))
        return runs[mode]

    return get


def metrics(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_three_step_run_with_the_vllm_backend(single, mode):
    run = single(mode)
    steps = metrics(run)
    assert [m["step"] for m in steps] == [1, 2, 3]
    last = steps[-1]
    for agent in (0, 1):
        # T=1, no top-k/p: the engine's sampling log-probs are the trainer's up to numerics
        assert last[f"train/agent_{agent}/logp_mismatch"] < 1e-3
        assert abs(last[f"train/agent_{agent}/is_weight_mean"] - 1) < 1e-2
        assert ("tis_clip_frac" in str(last)) == bool(MODES[mode])
    assert "perf/prefix_cache_hit_rate" in last and "eval/turn_1/greedy_reward_mean" in last
    assert (run / "adapters" / "agent_1" / "adapter_model.safetensors").exists()


def torchrun(run_dir, *overrides):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "train.py", *SMALL, f"logging.run_dir={run_dir}", *RUN, "trainer.joint_mode=align",
                           "checkpoint.every=1", *overrides], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 processes" in proc.stderr and proc.stderr.count("magrpo: done") == 1
    return proc.stderr


@pytest.mark.slow
def test_two_processes_each_with_its_engine_sample_the_single_process_trees_and_resume(single, tmp_path):
    """Each rank starts its own engine, syncs its own adapters (the probe guard runs on every rank)
    and samples its share of the trees with per-request seeds: rank 0 gathers the same trees as one
    process and logs the same numbers, both runs exit 0. Stopped after step 2 and resumed, the
    engines first receive the checkpoint's adapters (else the stale-adapter guard stops the run)."""
    one = single("align")
    run_dir = tmp_path / "two"
    torchrun(run_dir, "trainer.steps=2", "eval.at_end=false")  # evaluation as in the uninterrupted run
    assert "resuming from" in torchrun(run_dir, "resume=auto")
    assert (run_dir / "rollouts.jsonl").read_bytes() == (one / "rollouts.jsonl").read_bytes()
    for a, b in zip(metrics(one), metrics(run_dir), strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if not key.startswith("perf/"):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
