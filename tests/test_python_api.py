"""`magrpo.train(config, env=..., feedback=...)`: the documented example runs, and every input is
checked as the command line checks it (the same ConfigError one-liners)."""
from __future__ import annotations

import json
import runpy
import subprocess
import sys

import pytest

import magrpo
from magrpo.api import configure
from magrpo.errors import ConfigError
from tests.conftest import ROOT, SMALL


def documented_example() -> str:
    doc = (ROOT / "docs" / "python-api.md").read_text()
    return "# my_run.py" + doc.split("```python\n# my_run.py")[1].split("```")[0]


@pytest.fixture(scope="module")
def example_run(tmp_path_factory):
    """docs/python-api.md's example run as a script (`python my_run.py`), once: its run dir."""
    import contextlib
    import io

    from magrpo.env import ENVS

    folder = tmp_path_factory.mktemp("example")
    (folder / "my_run.py").write_text(documented_example())
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.chdir(folder)
        try:
            runpy.run_path(str(folder / "my_run.py"), run_name="__main__")
        finally:
            ENVS._items.pop("__main__:Relay", None)
    return folder / printed.getvalue().strip().splitlines()[-1]


@pytest.mark.slow  # trains end to end (two steps of the tiny model)
def test_the_documented_example_trains_a_plugin_env_with_a_feedback_function(example_run):
    config = json.loads((example_run / "config.json").read_text())
    assert config["env"] == {"name": "__main__:Relay", "n": 4}
    assert config["external"]["mode"] == "__main__:again"
    assert [json.loads(line)["step"] for line in open(example_run / "metrics.jsonl")] == [1, 2]


@pytest.mark.slow
def test_each_agent_keeps_its_own_role_at_turn_two(example_run):
    """The documented feedback function builds on each agent's own first prompt: a function that
    used `prompt` (the problem's text) would drop "You start." / "You finish ..." from turn 2."""
    roles = ["You start.", "You finish the other's count."]
    trees = [json.loads(line) for line in open(example_run / "rollouts.jsonl")]
    second_turn = [node for tree in trees for node in tree["nodes"] if node["turn"] == 1]
    assert second_turn
    for node in second_turn:
        for agent, role in enumerate(roles):
            assert node["prompts"][agent].startswith(role), node["prompts"][agent]
            assert roles[1 - agent] not in node["prompts"][agent]


def test_import_magrpo_loads_neither_torch_nor_hydra():
    code = "import sys, magrpo; magrpo.train; print('torch' in sys.modules, 'hydra' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]  # magrpo.train itself imports them on first call


@pytest.mark.parametrize("override,config", [
    ("trainer.joint_mode=crossed", {"trainer": {"joint_mode": "crossed"}}),  # a value check (validate)
    ("trainer.lr=fast", {"trainer": {"lr": "fast"}}),  # a type
    ("trainer.nope=1", {"trainer": {"nope": 1}}),  # an unknown key
    ("model=nope", {"model": "nope"}),  # a group option
    ("env.name=nope", {"env": "nope"}),  # an env name
    ("env.bogus=1", {"env": {"name": "length_ratio", "bogus": 1}}),  # a key the env does not have
])
def test_a_bad_value_raises_the_command_lines_error(run_cli, override, config):
    code, lines = run_cli(*SMALL, override)
    assert code == 2 and len(lines) == 1
    for given in ([*SMALL, override], {**SMALL_MAPPING, **config}):
        with pytest.raises(ConfigError) as raised:
            magrpo.train(given)
        assert lines[0] == f"config error: {raised.value}"


SMALL_MAPPING = {"env": "length_ratio", "model": "tiny", "external": "length_ratio"}


def test_a_bad_env_or_feedback_argument_is_the_error_of_its_key(run_cli):
    _, (line,) = run_cli(*SMALL, "external.mode=nope")
    with pytest.raises(ConfigError) as raised:
        magrpo.train(SMALL, feedback="nope")
    assert line == f"config error: {raised.value}"
    _, (line,) = run_cli(*SMALL, "env.name=nope")
    with pytest.raises(ConfigError) as raised:
        magrpo.train(SMALL, env="nope")
    assert line == f"config error: {raised.value}"
    with pytest.raises(ConfigError, match="^env: expected an Environment"):
        magrpo.train(SMALL, env=object())
    with pytest.raises(ConfigError, match="^feedback: expected a feedback function"):
        magrpo.train(SMALL, feedback=42)
    with pytest.raises(ConfigError, match="^config: expected a TrainConfig"):
        magrpo.train("trainer.steps=2")


def test_the_three_config_forms_compose_the_same_config(make_cfg):
    # a string under `model` picks the option alone: the dtype pin of SMALL has no place beside it here
    overrides = [*(o for o in SMALL if not o.startswith("model.dtype")), "trainer.lr=0.5", "env.ratio=3"]
    from_list = configure(overrides)[0]
    mapping = {**SMALL_MAPPING, "logging": {"progress": False, "wandb": {"mode": "disabled"}},
               "trainer": {"steps": 2, "batch_size": 2, "num_generations": 2, "lr": 0.5},
               "generation": {"max_new_tokens": 6}, "eval": {"max_problems": 2, "num_samples": 2},
               "env": {"name": "length_ratio", "ratio": 3}}
    assert configure(mapping)[0] == from_list
    assert configure(from_list)[0] == from_list  # a TrainConfig: every key set again, and checked


def test_an_env_argument_replaces_the_configs_env_and_keeps_keys_of_its_own():
    from magrpo.envs.code.env import CodeEnv

    cfg = configure(SMALL, env=CodeEnv)[0]  # SMALL picks length_ratio: replaced by the code env's defaults
    assert cfg.env["name"] == "code" and "ratio" not in cfg.env
    cfg = configure({"env": {"timeout_s": 2.0}}, env="code")[0]
    assert cfg.env["timeout_s"] == 2.0
