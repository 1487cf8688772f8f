"""`train(cfg)` with backend=vllm on the tiny model: 3 steps for align and cross (vllm venv only)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="vllm not installed: bash scripts/setup_vllm.sh, then run with that venv's python")

from magrpo.trainer import train


@pytest.mark.slow
@pytest.mark.parametrize("mode,extra", [("align", []), ("cross", ["trainer.tis_cap=2.0"])])
def test_three_step_run_with_the_vllm_backend(make_cfg, mode, extra):
    run = train(make_cfg("backend=vllm", "trainer.steps=3", f"trainer.joint_mode={mode}", "trainer.lr=5e-2", *extra))
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    last = metrics[-1]
    for agent in (0, 1):
        # T=1, no top-k/p: the engine's sampling log-probs are the trainer's up to numerics
        assert last[f"train/agent_{agent}/logp_mismatch"] < 1e-3
        assert abs(last[f"train/agent_{agent}/is_weight_mean"] - 1) < 1e-2
        assert ("tis_clip_frac" in str(last)) == bool(extra)
    assert "perf/prefix_cache_hit_rate" in last and "eval/turn_1/greedy_reward_mean" in last
    assert (run / "adapters" / "agent_1" / "adapter_model.safetensors").exists()
