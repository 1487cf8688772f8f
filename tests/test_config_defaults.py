"""Every default lives once, in the schemas (magrpo/config.py, each env's Config): a YAML option under
configs/ holds only what it changes, so editing a default in one place cannot leave a stale copy."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

import magrpo.envs  # noqa: F401  (registers the built-in envs)
from magrpo.config import TrainConfig, flatten
from magrpo.env import ENVS

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
OPTIONS = sorted(p for p in CONFIGS.glob("*/*.yaml"))


def schema_defaults(env_name: str | None = None) -> dict:
    """Dotted key -> default of TrainConfig (and of env `env_name`'s Config under env.*)."""
    defaults = flatten(dataclasses.asdict(TrainConfig()))
    if env_name in ENVS:
        defaults.update(flatten(dataclasses.asdict(ENVS.get(env_name).Config()), "env"))
    return defaults


def option_values(path: Path) -> dict:
    """The dotted keys an option sets: `# @package _global_` files from the root, others under their group."""
    text = path.read_text()
    values = yaml.safe_load(text) or {}
    values.pop("defaults", None)
    prefix = "" if "@package _global_" in text else path.parent.name
    return flatten(values, prefix)


@pytest.mark.parametrize("path", OPTIONS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_option_repeats_a_schema_default(path):
    values = option_values(path)
    defaults = schema_defaults(values.get("env.name"))
    # env.name, model.name and external.mode say which option it is, even where they equal the default
    identity = ("env.name", "model.name", "external.mode")
    repeated = {k: v for k, v in values.items() if k not in identity and k in defaults and defaults[k] == v}
    assert not repeated, f"{path.relative_to(CONFIGS.parent)} repeats schema defaults: {repeated}"


def test_the_checker_sees_a_repeated_default(tmp_path):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "x.yaml").write_text("steps: 40\nlr: 0.5\n")
    values = option_values(tmp_path / "trainer" / "x.yaml")
    assert values == {"trainer.steps": 40, "trainer.lr": 0.5}
    assert schema_defaults()["trainer.steps"] == 40


def test_every_option_train_yaml_picks_exists():
    from magrpo.cli import group_options

    picked = yaml.safe_load((CONFIGS / "train.yaml").read_text())["defaults"]
    chosen: dict[str, str] = {}
    for entry in picked:
        if isinstance(entry, dict):
            (group, option), = entry.items()
            if option is None:  # a group with no default option (external: external.mode=auto)
                continue
            group = group.removeprefix("optional ")  # optional too: experiment=cpu_smollm2-135m sizes the default run
            option = re.sub(r"\$\{(\w+)\}", lambda m: chosen[m.group(1)], option)  # cpu_${model}
            chosen[group] = option
            assert option in group_options(group), f"{group}={option}"


def test_an_env_option_holds_its_config_defaults_and_nothing_else():
    """env=NAME comes from the env's Config (no YAML copy): overriding any of its keys works, and
    switching env drops the other env's keys."""
    from magrpo.cli import compose

    code = compose(["env.timeout_s=9"]).env
    assert code["timeout_s"] == 9 and code["dataset"] == "humaneval" and code["reward"]["tests"] == 1.0
    toy = compose(["env=length_ratio", "env.ratio=3"]).env
    assert toy == {"name": "length_ratio", **dataclasses.asdict(ENVS.get("length_ratio").Config()), "ratio": 3}
