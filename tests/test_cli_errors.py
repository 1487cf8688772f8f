"""Bad input on the command line: one line naming the key and what is allowed, exit code 2, no
stack trace, and no model loaded. The cases call the CLI's main() in-process (run_cli, conftest.py);
a few run `train.py` in a new interpreter for the real exit code and a clean stderr (no warnings)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, SMALL

CASES = {
    # override: (key named first on the line, words the line must contain)
    "trainer.foo=1": ("trainer.foo", ["unknown key", "num_generations"]),
    "foo=1": ("foo", ["unknown key", "trainer"]),
    "trainer.steps=abc": ("trainer.steps", ["abc"]),
    "trainer.num_generations=1": ("trainer.num_generations", [">= 2"]),
    "trainer.num_turns=0": ("trainer.num_turns", [">= 1"]),
    "trainer.joint_mode=crossed": ("trainer.joint_mode", ["'crossed'", "align, cross"]),
    "external.history=chat": ("external.history", ["'chat'", "off, attempts, messages, continuation"]),
    "model.chat_template_kwargs.enable_thinking=false": ("model.chat_template_kwargs.enable_thinking",
                                                         ["+model.chat_template_kwargs.enable_thinking=VALUE"]),
    "trainer.baseline=median": ("trainer.baseline", ["mean, none, rloo", "max", "plugins=[", "@BASELINES.register"]),
    "external.mode=nope": ("external.mode", ["'nope'", "plain", "external.mode=my_pkg.feedback:my_function",
                                             "plugins=[my_pkg.feedback]"]),
    "external=nope": ("external", ["'nope'", "plain", "external.mode=my_pkg.feedback:my_function"]),
    "external.mode=no_such_pkg.mod:fn": ("external.mode", ["no_such_pkg.mod"]),
    "external.mode=json:no_such_fn": ("external.mode", ["no_such_fn"]),
    "model.name=/does/not/exist": ("model.name", ["/does/not/exist", "not an existing folder"]),
    "model=nope": ("model", ["'nope'", "tiny"]),
    "env.name=nope": ("env.name", ["'nope'", "length_ratio", "plugins=[my_pkg.envs]", "env.name=my_pkg.envs:MyEnv"]),
    "env=nope": ("env", ["'nope'", "choose one of: code, ", "plugins=[my_pkg.envs]", "env.name=my_pkg.envs:MyEnv"]),
    "+experiment=nope": ("experiment", ["'nope'", "toy"]),  # an optional group: unchecked, it would train
    # more command-line cases, in process: tests/test_cli_conventions.py
    "--verbose": ("--verbose", ["unknown flag", "--config-dir"]),
    "env.bogus=1": ("env.bogus", ["unknown key", "dataset, eval_split"]),  # the code env's keys only
    "env=length_ratio env.ratio=big": ("env.ratio", ["float", "big"]),
    "env=length_ratio external.mode=level_feedback": ("external.mode", ["'level_feedback'", "env=code"]),
    "resume=/no/such/checkpoint": ("resume", ["not a complete checkpoint folder"]),
    "resume=auto": ("resume", ["logging.run_dir"]),
    "resume_force=[trainer.lrr]": ("resume_force", ["'trainer.lrr'", "not a config key or section"]),
    "checkpoint.keep=0": ("checkpoint.keep", [">= 1"]),
    "env=length_ratio env.eval_size=0": ("env.eval_size", ["selects no eval problems"]),  # more in test_bad_input.py
    "env=code env.timeout_s=-1": ("env.timeout_s", ["> 0"]),
    "reward.on_error=ignore": ("reward.on_error", ["'ignore'", "raise, zero"]),
    "external.max_concurrency=0": ("external.max_concurrency", [">= 1"]),
    "backend=sglang": ("backend", ["'sglang'", "hf, vllm"]),
    "backend=vllm": ("backend", ["vllm is not installed", "magrpo[vllm]", "scripts/setup_vllm.sh"]),
    "backend=vllm generation.temperature=2.5": ("generation.temperature", ["up to 2"]),
    "vllm.kv_cache_gb=0": ("vllm.kv_cache_gb", [">= 1"]),
    "external.expert.backend=claude": ("external.expert.backend", ["'claude'", "auto, reference, openai, hf"]),
    "external.mode=expert_edits external.expert.backend=openai": ("external.expert.base_url", ["required"]),
    "external.mode=expert_edits external.expert.base_url=http://127.0.0.1:9/v1":
        ("external.expert.base_url", ["cannot reach http://127.0.0.1:9/v1"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gives_one_line_naming_the_key(run_cli, case):
    key, words = CASES[case]
    code, lines = run_cli(*case.split())
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"config error: {key}:"), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_an_unregistered_env_says_how_to_add_ones_own_from_python_too(make_cfg):
    """The Python API and an env name that only fails when the env is built (a hand-made config)."""
    import magrpo
    from magrpo.errors import ConfigError
    from magrpo.trainer import prepare

    with pytest.raises(ConfigError, match=r"^env.name: 'nope' is not allowed; .*plugins=\[my_pkg.envs\]"):
        magrpo.train(SMALL, env="nope")
    cfg = make_cfg()
    cfg.env = {"name": "nope"}
    with pytest.raises(ConfigError, match=r"^env.name: 'nope' is not allowed; .*env.name=my_pkg.envs:MyEnv"):
        prepare(cfg)


def train_py(*argv: str, **env: str) -> tuple[int, list[str]]:
    """`python train.py argv` as a user runs it: (exit code, non-blank stderr lines)."""
    proc = subprocess.run([sys.executable, "train.py", *argv], cwd=ROOT, env=dict(os.environ, **env),
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, [line for line in proc.stderr.splitlines() if line.strip()]


def test_a_bad_key_exits_2_with_one_line_and_builds_no_model(tmp_path):
    code, lines = train_py("trainer.joint_mode=crossed", MAGRPO_CACHE=str(tmp_path / "cache"))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("config error: trainer.joint_mode: 'crossed'"), lines
    assert not (tmp_path / "cache").exists()  # the tiny model was not built


def test_an_unknown_flag_exits_2_with_one_line():
    code, lines = train_py("--lr=1")
    assert (code, lines) == (2, ["config error: --lr=1: unknown flag; use key=value overrides or one of: --cfg, "
                                 "--config-dir, --config-name, -m (see --help)"])


def test_a_hub_model_with_the_hub_unreachable_is_one_line_and_no_download_is_tried(tmp_path, monkeypatch, capsys):
    """With no network (and no HF_HUB_OFFLINE) it used to print 23 download retry lines before its one
    clear line; conftest.py's no_network fails the test if a download is tried."""
    import huggingface_hub.constants

    import magrpo.hub
    from magrpo.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(magrpo.hub, "reachable", lambda: False)  # what the probe finds with no network
    code = main([*SMALL, f"logging.run_dir={tmp_path / 'run'}", "model.name=no-such-org/no-such-model"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and lines == ["config error: model.name: cannot load 'no-such-org/no-such-model': the hub "
                                   "(huggingface.co:443) cannot be reached and the local cache holds no copy; give a "
                                   "local folder, or run once with network access"], lines


def test_hub_id_that_cannot_be_loaded_is_one_line(tmp_path, monkeypatch, capsys):
    """Found only while loading the model (offline here: conftest.py's no_network), so no run_cli guard."""
    from magrpo.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["model.name=no-such-org/no-such-model"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("config error: model.name: cannot load 'no-such-org/no-such-model'"), lines
