"""Hydra's command-line conventions and plugins: `plugins=` / $MAGRPO_PLUGINS and
`env.name=package.module:Class` select a user's env and feedback from the command line alone,
`--config-dir/--config-name`, `+experiment=NAME`, `--cfg job|hydra|all` and `-m` sweeps."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

from magrpo.cli import compose, main
from tests.conftest import ROOT, SMALL

ENV_CODE = '''
from dataclasses import dataclass
from magrpo.env import ENVS, Environment

@ENVS.register("my_echo")
class EchoEnv(Environment):
    @dataclass
    class Config:
        n: int = 4
        """problems per split"""
        fail: bool = False
        """raise while scoring (a run that fails in a sweep)"""

    num_agents = 2

    def problems(self, split):
        return [{"prompt": f"Say {i}:"} for i in range(self.cfg.n)]

    def agent_prompts(self, problem):
        return [problem["prompt"], problem["prompt"] + " (answer)"]

    def rewards(self, problems, joint_completions):
        if self.cfg.fail:
            raise RuntimeError("told to fail")
        return [min(1.0, len(a) / 20) for a, _ in joint_completions]
'''
FEEDBACK_CODE = '''
from magrpo.feedback import FEEDBACK

@FEEDBACK.register("my_again")
def again(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent, **context):
    return [prompt_history_per_agent[i][0] + " Again:" for i in range(num_agents)]  # each agent's own role kept
'''
CREDIT_CODE = '''
import numpy as np
from magrpo.advantage import BASELINES, CREDITS

BASELINES.register("my_zero")(lambda rewards: np.zeros_like(rewards))
CREDITS.register("my_mean")(CREDITS.get("mean"))  # (N, K) credit from (joint, returns, k)
'''
TOY = [o for o in SMALL if not o.startswith(("env=", "external="))]  # tiny model, small sizes


@pytest.fixture
def user_pkg(tmp_path, monkeypatch):
    """A user's package in the current directory (not installed): my_pkg.envs and my_pkg.feedback."""
    pkg = tmp_path / "my_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "envs.py").write_text(ENV_CODE)
    (pkg / "feedback.py").write_text(FEEDBACK_CODE)
    (pkg / "credit.py").write_text(CREDIT_CODE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # plugins put the current directory on it
    yield tmp_path
    from magrpo.advantage import BASELINES, CREDITS
    from magrpo.env import ENVS
    from magrpo.feedback import FEEDBACK

    for name in ("my_pkg", "my_pkg.envs", "my_pkg.feedback", "my_pkg.credit"):
        sys.modules.pop(name, None)
    for registry, name in ((ENVS, "my_echo"), (ENVS, "my_pkg.envs:EchoEnv"), (FEEDBACK, "my_again"),
                           (BASELINES, "my_zero"), (CREDITS, "my_mean")):
        registry._items.pop(name, None)  # the next test imports a fresh copy of the package


def train_py(*args: str, cwd, env=None):
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        check=False,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, **(env or {})),
    )


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_plugins_make_a_user_env_and_feedback_selectable_by_name(user_pkg, monkeypatch):
    cfg = compose(["plugins=[my_pkg.envs,my_pkg.feedback]", "env=my_echo", "env.n=3", "external.mode=my_again"])
    assert cfg.env == {"name": "my_echo", "n": 3, "fail": False}  # its own Config's defaults, no code-env key
    assert cfg.plugins == ["my_pkg.envs", "my_pkg.feedback"]
    monkeypatch.setenv("MAGRPO_PLUGINS", "my_pkg.envs")
    assert compose(["env.name=my_echo"]).env == {"name": "my_echo", "n": 4, "fail": False}


def test_plugin_baselines_and_credit_rules_are_valid_choices(user_pkg):
    from magrpo.validation import validate

    cfg = compose(["plugins=[my_pkg.credit]", "trainer.baseline=my_zero", "trainer.cross_credit=my_mean", *TOY])
    validate(cfg)  # without the plugin: "'my_zero' is not allowed; choose one of: max, mean, none, rloo"
    assert (cfg.trainer.baseline, cfg.trainer.cross_credit) == ("my_zero", "my_mean")


def test_env_name_class_path_replaces_the_env_node(user_pkg):
    cfg = compose(["env.name=my_pkg.envs:EchoEnv", "env.n=16"])  # no `+`: n is the class's own key
    assert cfg.env == {"name": "my_pkg.envs:EchoEnv", "n": 16, "fail": False}


def test_a_user_feedback_function_by_import_path_and_plugins_in_a_config_file(user_pkg):
    from magrpo.trainer import prepare

    cfg = compose(["env.name=my_pkg.envs:EchoEnv", "external.mode=my_pkg.feedback:again", *TOY,
                   f"logging.run_dir={user_pkg / 'run'}"])
    env, feedback = prepare(cfg)  # resolves the function (from the current directory) and loads the data
    assert feedback.name == "my_pkg.feedback:again" and len(env.problems("train")) == 4
    (user_pkg / "mine.yaml").write_text("defaults:\n  - train\n  - _self_\nplugins: [my_pkg.envs]\n")
    cfg = compose(["env=my_echo"], user_pkg, "mine")  # the config file's plugins are imported before composing
    assert cfg.env["name"] == "my_echo" and cfg.plugins == ["my_pkg.envs"]


def documented(path: str) -> str:
    """The python block of docs/environments.md that starts with `# path`."""
    doc = (ROOT / "docs" / "environments.md").read_text()
    return f"# {path}" + doc.split(f"```python\n# {path}")[1].split("```")[0]


@pytest.fixture
def documented_pkg(tmp_path, monkeypatch):
    """docs/environments.md's plugin env and feedback function, as written, as the package my_pkg."""
    from magrpo.env import ENVS
    from magrpo.feedback import FEEDBACK

    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    for module in ("envs", "feedback"):
        (tmp_path / "my_pkg" / f"{module}.py").write_text(documented(f"my_pkg/{module}.py"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    for name in ("my_pkg", "my_pkg.envs", "my_pkg.feedback"):
        sys.modules.pop(name, None)
    ENVS._items.pop("my_env", None)
    FEEDBACK._items.pop("my_again", None)


def test_the_documented_plugin_env_runs(documented_pkg):
    from magrpo.trainer import prepare

    cfg = compose(["plugins=[my_pkg.envs]", "env=my_env", "env.n=16", *TOY,
                   f"logging.run_dir={documented_pkg / 'run'}"])
    env, _ = prepare(cfg)
    assert len(env.problems("train")) == 16 and env.rewards([{}], [["x" * 10, "y"]]) == [0.5]


def test_the_documented_plugin_feedback_keeps_each_agents_own_role(documented_pkg):
    """Agent 1's role (" (answer)") is in its turn-2 prompt and not in agent 0's: the function builds
    on each agent's own first prompt, not on `prompt` (the problem's text, the same for both)."""
    from magrpo.feedback import Branch
    from magrpo.trainer import prepare

    cfg = compose(["plugins=[my_pkg.envs,my_pkg.feedback]", "env=my_env", "external.mode=my_again", *TOY,
                   f"logging.run_dir={documented_pkg / 'run'}"])
    env, feedback = prepare(cfg)
    problem = env.problems("train")[0]
    first = env.agent_prompts(problem)
    (second,) = feedback([Branch(problem["prompt"], ["1", "2"], [[p] for p in first], [["1"], ["2"]])])
    assert first[1].endswith(" (answer)") and not first[0].endswith(" (answer)")
    assert [p.startswith(f"{f}\n") for p, f in zip(second, first)] == [True, True], second


def test_env_name_alone_switches_to_that_envs_node():
    toy = compose(["env.name=length_ratio", "env.ratio=3"]).env
    assert toy == {**compose(["env=length_ratio"]).env, "ratio": 3}
    assert "dataset" not in toy  # the default code env's keys do not leak in
    assert compose(["env=code", "env.name=length_ratio"]).env["name"] == "length_ratio"  # the last one wins
    assert compose(["env.name=length_ratio", "env=code"]).env["name"] == "code"


def test_a_user_envs_bad_key_is_one_line_listing_its_own_keys(user_pkg):
    proc = train_py("env.name=my_pkg.envs:EchoEnv", "env.bogus=1", cwd=user_pkg)
    assert proc.returncode == 2
    assert one_line(proc.stderr) == "config error: env.bogus: unknown key; allowed under env: name, fail, n"
    proc = train_py("plugins=[my_pkg.nope]", cwd=user_pkg)
    assert proc.returncode == 2 and one_line(proc.stderr).startswith(
        "config error: plugins: cannot import module 'my_pkg.nope'"
    )


@pytest.mark.slow
def test_user_env_and_feedback_from_the_command_line_alone_train(user_pkg):
    run = user_pkg / "run"
    proc = train_py("plugins=[my_pkg.feedback]", "env.name=my_pkg.envs:EchoEnv", "external.mode=my_again",
                    *TOY, f"logging.run_dir={run}", cwd=user_pkg)
    assert proc.returncode == 0, proc.stderr
    steps = [json.loads(line).get("step") for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 2
    config = json.loads((run / "config.json").read_text())
    assert config["env"]["name"] == "my_pkg.envs:EchoEnv" and config["plugins"] == ["my_pkg.feedback"]
    assert config["external"]["mode"] == "my_again"


def test_user_config_dir_and_name(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tiny_wide.yaml").write_text(
        "# @package _global_\nmodel:\n  name: tiny\n  tiny_hidden_size: 256\n"
    )
    (tmp_path / "mine.yaml").write_text(textwrap.dedent("""\
        defaults:
          - train                      # the built-in entry config, then change its choices
          - override env: length_ratio
          - override model: tiny_wide  # an option of my own, beside the built-in ones
          - _self_
        trainer:
          steps: 5
        """))
    assert main(["--config-dir", str(tmp_path), "--config-name", "mine", "--cfg", "job", "logging.progress=false"]) == 0
    out = capsys.readouterr().out
    assert "steps: 5" in out and "name: length_ratio" in out and "tiny_hidden_size: 256" in out
    # A YAML that starts from the schema alone; unknown keys in it are still caught.
    (tmp_path / "bare.yaml").write_text(
        "defaults:\n  - base_train\n  - env: length_ratio\n  - _self_\ntrainer:\n  lr: 0.5\n"
    )
    cfg = compose([], tmp_path, "bare")
    assert cfg.trainer.lr == 0.5 and cfg.env["name"] == "length_ratio" and cfg.model.name == "tiny"
    (tmp_path / "typo.yaml").write_text("defaults:\n  - base_train\n  - _self_\ntrainer:\n  lrr: 0.5\n")
    assert main(["-cd", str(tmp_path), "-cn", "typo"]) == 2
    assert capsys.readouterr().err.startswith("config error: trainer.lrr: unknown key")


def test_env_name_changed_in_a_config_file_says_to_select_the_env(tmp_path):
    from magrpo.errors import ConfigError
    from magrpo.trainer import prepare

    (tmp_path / "mine.yaml").write_text("defaults:\n  - train\n  - _self_\nenv:\n  name: length_ratio\n")
    with pytest.raises(
        ConfigError, match=r"env\.dataset: a key of another env, not of env 'length_ratio' .* env=length_ratio"
    ):
        prepare(compose([], tmp_path, "mine"))


def test_experiment_presets():
    plain = dataclasses.asdict(compose(["env=length_ratio", "model=tiny", "external=length_ratio"]))
    assert dataclasses.asdict(compose(["+experiment=toy"])) == plain
    assert dataclasses.asdict(compose(["experiment=toy"])) == plain
    # The run size of `python train.py` moved from model/smollm2-135m.yaml to an experiment: unchanged.
    default = compose([])
    assert (default.trainer.steps, default.trainer.batch_size, default.trainer.num_generations) == (3, 1, 2)
    assert (default.eval.at_start, default.eval.max_problems, default.eval.num_samples) == (True, 2, 0)
    assert (default.trainer.lr, default.generation.max_new_tokens, default.generation.temperature) == (1e-4, 128, 0.7)
    assert compose(["model=tiny"]).trainer.steps == 40  # other models keep the schema's sizes


def test_cfg_prints_the_config(capsys):
    assert main(["--cfg", "job", *SMALL]) == 0
    job = capsys.readouterr().out
    assert "trainer:" in job and "steps: 2" in job and "hydra:" not in job
    assert main([*SMALL, "--cfg"]) == 0 and capsys.readouterr().out == job  # bare --cfg = job
    assert main(["--cfg=all", *SMALL]) == 0
    out = capsys.readouterr().out
    assert out.startswith("hydra:") and "choices:" in out and "env: length_ratio" in out and job in out


def test_sweep_expansion_follows_hydras_basic_sweeper():
    from magrpo.sweep import expand

    runs = expand(["trainer.seed=range(0,2)", "lora.target_modules=[q_proj,v_proj]", "env.fail=true,false"])
    assert [swept for swept, _ in runs] == [["trainer.seed=0", "env.fail=true"], ["trainer.seed=0", "env.fail=false"],
                                            ["trainer.seed=1", "env.fail=true"], ["trainer.seed=1", "env.fail=false"]]
    assert runs[1][1] == ["trainer.seed=0", "lora.target_modules=[q_proj,v_proj]", "env.fail=false"]  # order kept
    assert expand(["trainer.lr=0.5"]) == [([], ["trainer.lr=0.5"])]


@pytest.mark.slow
def test_multirun_sweep_runs_every_combination_and_summarises(tmp_path):
    sweep = tmp_path / "sweep"
    proc = train_py("-m", "trainer.lr=1e-3,1e-2", "trainer.seed=0,1", *SMALL, "trainer.steps=1", "eval.at_end=false",
                    f"logging.run_dir={sweep}", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    runs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    # Hydra's order (the last list varies fastest) and its spelling of the values
    assert runs == ["0-trainer.lr=0.001,trainer.seed=0", "1-trainer.lr=0.001,trainer.seed=1",
                    "2-trainer.lr=0.01,trainer.seed=0", "3-trainer.lr=0.01,trainer.seed=1"]
    assert json.loads((sweep / runs[3] / "config.json").read_text())["trainer"]["lr"] == 1e-2
    rows = (sweep / "summary.tsv").read_text().splitlines()
    assert rows[0].split("\t")[:4] == ["run", "status", "step", "train/reward_mean"]
    assert [r.split("\t")[:3] for r in rows[1:]] == [[name, "ok", "1"] for name in runs]
    assert "| run | status |" in proc.stdout  # the markdown table is printed too


@pytest.mark.slow
def test_a_failing_sweep_run_is_reported_and_the_sweep_goes_on(user_pkg):
    sweep = user_pkg / "sweep"
    proc = train_py("-m", "plugins=[my_pkg.envs]", "env=my_echo", "env.fail=true,false", "external=plain", *TOY,
                    "trainer.steps=1", "eval.at_end=false", f"logging.run_dir={sweep}", cwd=user_pkg)
    assert proc.returncode == 1, proc.stderr
    rows = [r.split("\t") for r in (sweep / "summary.tsv").read_text().splitlines()[1:]]
    assert rows[0][0] == "0-env.fail=true" and "told to fail" in rows[0][1]
    assert rows[1][:3] == ["1-env.fail=false", "ok", "1"]


def test_a_bad_value_in_any_sweep_run_stops_before_training(tmp_path, capsys):
    assert main(["-m", *SMALL, "trainer.num_generations=2,1", f"logging.run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("config error: trainer.num_generations: must be >= 2")
        and "(sweep run 1-trainer.num_generations=1)" in err
    )
    assert not any(tmp_path.iterdir())


BAD = {
    # arguments: (key named first on the line, words the line must contain)
    "env.name=json:Nope": ("env.name", ["'json:Nope'", "no Environment subclass"]),
    "env.name=no_such_pkg.mod:Env": ("env.name", ["cannot import module 'no_such_pkg.mod'"]),
    "env.name=length_ratio env.dataset=x": ("env.dataset", ["unknown key", "ratio"]),
    "plugins=[no_such_plugin]": ("plugins", ["cannot import module 'no_such_plugin'"]),
    "experiment=nope": ("experiment", ["'nope'", "cpu_smollm2-135m, gpu_coder, toy"]),
    "--cfg nope": ("--cfg", ["'nope'", "job, hydra, all"]),
    "--config-dir /no/such/dir": ("--config-dir", ["not a folder"]),
    "--config-name": ("--config-name", ["needs a value"]),
    "--config-name nope": ("--config-name", ["no nope.yaml"]),
    "-m trainer.lr=1e-3,-1": ("trainer.lr", ["> 0", "sweep run 1-trainer.lr=-1"]),
    "-m trainer.lr=[": ("trainer.lr", ["cannot parse 'trainer.lr=['"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_flag_or_override_is_one_line(case, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # a sweep that wrongly ran would write here
    assert main(case.split()) == 2
    key, words = BAD[case]
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"config error: {key}:"), line
    for word in words:
        assert word in line, (word, line)


def test_a_sweep_stops_with_the_run_a_signal_stopped(tmp_path, capsys):
    """A SIGTERM used to end one run (exit 0) and the sweep went on to the next."""
    from magrpo.cli import Args, guarded
    from magrpo.errors import Stopped
    from magrpo.sweep import sweep

    trained = []

    def run(args, overrides, run_dir, dry=False):
        if not dry:
            trained.append(run_dir.name)
            raise Stopped(15, f"SIGTERM after step 1; checkpoint written, continue with resume=auto "
                              f"logging.run_dir={run_dir}")

    code = sweep(Args(["trainer.seed=0,1", f"logging.run_dir={tmp_path}"]), run, guarded)
    assert code == 143 and trained == ["0-trainer.seed=0"]
    assert "stopped: SIGTERM after step 1" in capsys.readouterr().err
