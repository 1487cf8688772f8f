"""Resuming a checkpoint written before magrpo gained a key: the key at its default is no change
(the run goes on as it was); set to anything else it is a change like any other."""
from __future__ import annotations

import copy
from dataclasses import asdict

import pytest

from magrpo.checkpoint import check_config, config_changes
from magrpo.errors import ConfigError


def written_before(config: dict, *dotted: str) -> dict:
    """The config as an older magrpo stored it: without the given keys."""
    old = copy.deepcopy(config)
    for key in dotted:
        *parents, leaf = key.split(".")
        node = old
        for part in parents:
            node = node[part]
        del node[leaf]
    return old


@pytest.fixture
def current(make_cfg):
    cfg = make_cfg()
    return asdict(cfg)


def test_a_key_added_later_at_its_default_is_no_change(current):
    stored = written_before(current, "trainer.entropy_coef", "trainer.group_by", "reward.team_weight")
    assert config_changes(stored, current) == {}
    check_config("ckpt", stored, current)  # no error


def test_a_key_added_later_but_set_is_a_change(current):
    stored = written_before(current, "trainer.entropy_coef")
    current["trainer"]["entropy_coef"] = 0.1
    assert config_changes(stored, current) == {"trainer.entropy_coef": (0.0, 0.1)}
    with pytest.raises(ConfigError, match=r"resume: .*trainer\.entropy_coef.*resume_force=\[trainer\.entropy_coef\]"):
        check_config("ckpt", stored, current)


def test_an_env_key_added_later_at_its_default_is_no_change(current):
    stored = written_before(current, "env.ratio")
    assert config_changes(stored, current) == {}
    current["env"]["ratio"] = 3.0
    assert list(config_changes(stored, current)) == ["env.ratio"]


def test_a_key_the_checkpoint_has_and_the_code_lost_is_still_a_change(current):
    stored = copy.deepcopy(current)
    stored["trainer"]["retired_option"] = 1
    assert "trainer.retired_option" in config_changes(stored, current)


@pytest.mark.parametrize("stored_value,now", [(False, "off"), (True, "attempts")])
def test_external_history_written_as_a_bool_means_its_mode(make_cfg, stored_value, now):
    """external.history was a bool before it had modes: a checkpoint's false/true is off/attempts."""
    current = asdict(make_cfg(f"external.history={now}"))
    stored = copy.deepcopy(current)
    stored["external"]["history"] = stored_value
    assert config_changes(stored, current) == {}
    assert list(config_changes(stored, asdict(make_cfg("external.history=messages")))) == ["external.history"]


@pytest.mark.parametrize("given,mode", [("true", "attempts"), ("false", "off"), ("messages", "messages")])
def test_external_history_takes_the_old_bools_on_the_command_line(make_cfg, given, mode):
    assert make_cfg(f"external.history={given}").external.history == mode
