"""Porting from CoMLRL: `aligned` is an alias of align (and `crossed` stays an error), and
`python -m magrpo.port` turns an LLM_Collab-layout config into overrides that compose and train,
listing every key it cannot map with a reason."""
from __future__ import annotations

import shlex

import pytest
import yaml

from magrpo.cli import compose
from magrpo.errors import ConfigError
from magrpo.port import Ported, main, port, render
from magrpo.validation import validate
from tests.conftest import ROOT

EXAMPLE = ROOT / "tests" / "data" / "comlrl_magrpo_code.yaml"


def example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def test_aligned_is_an_alias_of_align_and_crossed_is_still_an_error():
    cfg = compose(["trainer.joint_mode=aligned"])
    assert cfg.trainer.joint_mode == "align"  # one name in config.json and for resume checks
    with pytest.raises(ConfigError, match="'crossed' is not allowed; choose one of: align, cross"):
        validate(compose(["trainer.joint_mode=crossed"]))


def test_example_maps_the_trainer_keys():
    ported = port(example())
    assert ported.overrides[:6] == ["model=hf", "model.name=Qwen/Qwen2.5-Coder-1.5B", "model.dtype=bfloat16",
                                    "agents=[{finetune:full},{finetune:full}]",  # CoMLRL trains every weight
                                    "env=code", "env.dataset=humaneval"]
    for override in ["env.train_split='test[32:160]'", "trainer.seed=7", "generation.temperature=0.7",
                     "generation.top_k=0", "generation.max_new_tokens=200", "env.num_agents=2", "trainer.num_turns=2",
                     "trainer.num_generations=4", "trainer.discount=1.0", "trainer.joint_mode=align",
                     "trainer.early_termination_threshold=-0.5", "trainer.lr=3e-05", "trainer.baseline=rloo",
                     "trainer.advantage_scale=none", "external=level_feedback", "logging.wandb.tags=[magrpo,humaneval]",
                     "trainer.steps=64",  # 2 epochs x 128 problems / 4 trees per step
                     "trainer.weight_decay=0.01", "trainer.max_grad_norm=0", "trainer.loss_agg=dr_grpo"]:
        assert override in ported.overrides, override
    assert "undiscounted" in dict(ported.differences)["magrpo.discount"]  # 0.9 in the file, unused by CoMLRL
    # CoMLRL: r * 2 - 4; the code env: (levels + shift) * scale = (levels - 2) * 2
    assert {"env.reward.scale=2.0", "env.reward.shift=-2.0"} <= set(ported.overrides)


def test_example_lists_every_unmapped_key_with_a_reason():
    unmapped = dict(port(example()).unmapped)
    assert set(unmapped) == {
        "model.type", "model.max_length", "output.base_dir", "output.save_final_model", "external.sandbox_slice",
        "magrpo.parallel_training", "magrpo.agent_devices", "magrpo.logging_steps", "magrpo.rollout_buffer_size",
        "magrpo.train_batch_size", "magrpo.eval_batch_size", "wandb.dir"}
    assert all(len(why) > 10 for why in unmapped.values())
    differences = dict(port(example()).differences)
    assert "MEAN reward" in differences["magrpo.early_termination_threshold"]


def test_cross_takes_comlrl_sum_credit_and_crossed_is_not_guessed():
    cross = port({"magrpo": {"joint_mode": "cross"}})
    assert {"trainer.joint_mode=cross", "trainer.cross_credit=sum"} <= set(cross.overrides)
    crossed = port({"magrpo": {"joint_mode": "crossed"}})
    assert not any(o.startswith("trainer.joint_mode") for o in crossed.overrides)
    assert "magrpo.joint_mode" in dict(crossed.unmapped)


def test_older_layout_and_comlrl_defaults_are_reported():
    ported = port({"model": {"name": "m/x", "model_kwargs": {"torch_dtype": "float16"}},
                   "magrpo": {"learning_rate": 2e-5, "reward_shift": -4, "handoff": "random", "mystery": 1}})
    assert {"model.dtype=float16", "trainer.lr=2e-05", "env.reward.shift=-4.0"} <= set(ported.overrides)
    unmapped = dict(ported.unmapped)
    assert "magrpo.handoff" in unmapped and "magrpo.mystery" in unmapped
    relied_on = dict(ported.differences)  # the file relies on CoMLRL's early termination at -0.2
    assert "-0.2" in relied_on["magrpo.early_termination_threshold (not in the file)"]


def test_printed_command_gives_back_the_overrides():
    ported = port(example())
    text = render(str(EXAMPLE), ported)
    command = "\n".join(line for line in text.splitlines() if not line.startswith("#")).split("\n\n")[0]
    assert shlex.split(command.replace("\\\n", " "))[2:] == ported.overrides
    assert "#   external.sandbox_slice: " in text


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main([str(EXAMPLE)]) == 0
    (tmp_path / "bad.yaml").write_text("trainer: {lr: 1}\n")
    assert main([str(tmp_path / "bad.yaml")]) == 2
    assert main([str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("config error: magrpo: the file has no `magrpo:` section")
    assert "cannot be read" in err[1]


@pytest.mark.slow
def test_ported_overrides_compose_and_train_two_steps_on_the_tiny_model(tmp_path, monkeypatch):
    from magrpo.trainer import train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ported: Ported = port(example())
    # the tiny model instead of the hub model, and a 2-step run; everything else as ported
    kept = [o for o in ported.overrides if not o.startswith("model")]
    cfg = compose([*kept, "model=tiny", "trainer.steps=2", "trainer.batch_size=1", "generation.max_new_tokens=8",
                   "eval.max_problems=1", "logging.progress=false", "logging.wandb.mode=disabled",
                   f"logging.run_dir={tmp_path / 'run'}"])
    assert (cfg.trainer.joint_mode, cfg.trainer.baseline, cfg.env["reward"]["shift"]) == ("align", "rloo", -2.0)
    run = train(cfg)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
