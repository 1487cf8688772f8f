"""Every user-facing config key is documented in the README, with a docstring in magrpo/config.py."""
from __future__ import annotations

import dataclasses
import importlib.util

from magrpo.config import TrainConfig
from tests.conftest import ROOT


def config_table_rows():
    spec = importlib.util.spec_from_file_location("config_table", ROOT / "scripts" / "config_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.rows()


def leaf_keys(cls, prefix=""):
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from leaf_keys(type(default), f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def test_every_config_key_has_a_docstring_and_a_readme_row():
    documented = {key for key, _, text in config_table_rows() if text}
    readme = (ROOT / "README.md").read_text()
    for key in leaf_keys(TrainConfig):
        assert key in documented, f"{key} has no docstring in magrpo/config.py"
        assert f"`{key}`" in readme, f"{key} is missing from README.md's configuration table"


def test_readme_feedback_examples_are_what_the_modes_print():
    spec = importlib.util.spec_from_file_location("feedback_examples", ROOT / "scripts" / "feedback_examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readme = (ROOT / "README.md").read_text()
    for mode, prompt in module.examples().items():
        stale = f"README's {mode} example is stale: run scripts/feedback_examples.py"
        assert f"`{mode}`:\n\n~~~text\n{prompt}\n~~~" in readme, stale


def test_readme_custom_feedback_function_runs_and_fits_in_15_lines(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    code = "# my_feedback.py" + readme.split("```python\n# my_feedback.py")[1].split("```")[0]
    assert len(code.strip().splitlines()) <= 15
    (tmp_path / "my_feedback.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    from envs.code.env import CodeEnv
    from magrpo.config import ExternalConfig
    from magrpo.feedback import Branch, Feedback

    env = CodeEnv(CodeEnv.Config(train_split="test[2:3]", eval_split="test[3:4]"))
    problem = env.problems("train")[0]
    main = "def truncate_number(number):\n    return number\n"
    context = env.score([problem], [["def aux(x):\n    return x\n", main]])[0].context
    first = env.agent_prompts(problem)
    feedback = Feedback(ExternalConfig(mode="my_feedback:first_failure"), env)
    (out,) = feedback([Branch(problem["prompt"], ["a", main], [[p] for p in first], [["a"], [main]], context)])
    assert out[1].startswith(first[1]) and "This test fails: assert candidate(3.5) == 0.5" in out[1]
