"""End-to-end runs of `train(cfg)` on the tiny model: outputs on disk, and every adapter trains."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from magrpo.trainer import train


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def lora_tensors(run_dir, agent):
    return load_file(str(run_dir / "adapters" / f"agent_{agent}" / "adapter_model.safetensors"))


@pytest.mark.parametrize(
    "overrides,num_agents,nodes_per_tree",
    [
        ([], 2, 1 + 2),  # align, K=2, T=2
        (["trainer.joint_mode=cross"], 2, 1 + 4),  # K^N = 4 children
        (["env.num_agents=1"], 1, 1 + 2),  # plain GRPO
        pytest.param(["trainer.num_turns=3", "trainer.joint_mode=cross", "env.num_agents=3"], 3, 1 + 8 + 64,
                     marks=pytest.mark.slow),  # 73 nodes a tree; the shape itself: test_tree_shape.py
    ],
)
def test_run_writes_documented_outputs(make_cfg, overrides, num_agents, nodes_per_tree):
    run = train(make_cfg(*overrides))
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ["train/reward_mean", "train/turn_0/reward_mean", "train/agent_0/loss", "tree/leaves",
                "perf/gen_s", "perf/tokens_per_s", "env_step", f"train/agent_{num_agents - 1}/grad_norm"]:
        assert key in metrics[-1], key
    trees = read_jsonl(run / "rollouts.jsonl")
    assert len(trees) == 2 * 2  # steps * batch_size
    for tree in trees:
        nodes = tree["nodes"]
        assert len(nodes) == nodes_per_tree
        assert nodes[0]["parent"] is None and nodes[0]["turn"] == 0
        for node in nodes:
            assert len(node["prompts"]) == len(node["completions"]) == len(node["advantages"]) == num_agents
            for ja in node["joint_actions"]:
                assert len(ja["agents"]) == num_agents
                if ja["child"] is not None:
                    child = nodes[ja["child"]]
                    assert child["parent"] == [node["id"], node["joint_actions"].index(ja)]
                    assert child["turn"] == node["turn"] + 1
    config = json.loads((run / "config.json").read_text())
    assert config["trainer"]["steps"] == 2
    for agent in range(num_agents):
        assert lora_tensors(run, agent)


def test_every_agent_adapter_changes_and_only_its_own(make_cfg):
    # lr high enough to see movement in 2 steps; B matrices start at zero, so any change is training.
    run = train(make_cfg("trainer.lr=1e-2"))
    for agent in (0, 1):
        tensors = lora_tensors(run, agent)
        b_norm = sum(float(t.norm()) for name, t in tensors.items() if "lora_B" in name)
        assert b_norm > 0, f"agent {agent}'s adapter did not train"
    a0, a1 = lora_tensors(run, 0), lora_tensors(run, 1)
    assert any(not torch.equal(a0[k], a1[k]) for k in a0 if "lora_B" in k)


def test_ppo_epochs_and_kl_path_runs_and_reports_kl(make_cfg):
    run = train(make_cfg("trainer.ppo_epochs=2", "trainer.kl_coef=0.1", "trainer.lr=1e-2",
                         "trainer.loss_agg=seq_mean", "trainer.baseline=rloo", "trainer.advantage_scale=std"))
    last = read_jsonl(run / "metrics.jsonl")[-1]
    # After a first update the adapter differs from the base: the k3 KL is positive.
    assert last["train/agent_0/kl"] > 0
    assert 0 <= last["train/agent_0/clip_frac"] <= 1


def test_early_termination_is_logged(make_cfg):
    # Every reward is >= -1, so every turn-0 branch stops: only roots remain.
    run = train(make_cfg("trainer.early_termination_threshold=-1"))
    metrics = read_jsonl(run / "metrics.jsonl")
    assert all(m["train/turn_0/terminated"] == 2 * 2 for m in metrics)  # B * K branches
    assert all(m["tree/nodes"] == 2 for m in metrics)


def test_an_offline_wandb_run_sends_no_telemetry(make_cfg, monkeypatch):
    """wandb's telemetry follows its process-wide settings, not wandb.init(mode=...): an offline run used to
    start an exporter that sent to wandb's server from a background thread a minute later."""
    otel = pytest.importorskip("wandb.analytics.opentelemetry.opentelemetry_proxy")
    monkeypatch.setenv("WANDB_SILENT", "true")
    train(make_cfg("logging.wandb.mode=offline", "trainer.steps=1"))
    proxy = otel.get_open_telemetry_proxy()
    if proxy is not None:
        proxy.shutdown(timeout_millis=2_000)  # send now, where conftest's no_network sees it
    assert proxy is None


def test_wandb_offline_and_periodic_adapter_saves(make_cfg, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = train(make_cfg("logging.wandb.mode=offline", "checkpoint.every=1", "checkpoint.keep=5"))
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb")), "no wandb offline run written"
    for step in (1, 2):
        for agent in (0, 1):
            assert (run / "checkpoints" / f"step_{step:06d}" / f"agent_{agent}" / "adapter_model.safetensors").is_file()
