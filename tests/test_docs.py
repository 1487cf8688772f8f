"""The README and docs/ match the code: every config key documented (docs/configuration.md is
generated and up to date), the feedback examples are what the modes print, the custom feedback
function runs, every documented train.py command composes, and every link resolves."""
from __future__ import annotations

import dataclasses
import importlib.util
import re
import shlex

import pytest

from magrpo.config import TrainConfig
from tests.conftest import ROOT

# reference pages, then the result pages (docs/results/)
DOCS = sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "docs" / "results").glob("*.md"))


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def leaf_keys(cls, prefix=""):
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from leaf_keys(type(default), f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def test_every_config_key_has_a_docstring_and_a_row_in_the_generated_table():
    table = load_script("config_table")
    documented = {key for key, text in table.rows() if text}
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for key in leaf_keys(TrainConfig):
        assert key in documented, f"{key} has no docstring in magrpo/config.py"
        assert f"| `{key}` |" in doc, f"{key} is missing from docs/configuration.md's key table"
    assert table.render(doc) == doc, "docs/configuration.md is stale: run python scripts/config_table.py"


def test_config_table_shows_what_train_py_composes_not_only_the_schema():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    # configs/train.yaml picks model=smollm2-135m and env=code; the dataclasses say tiny / length_ratio
    assert "| `model.name` | `smollm2-135m` | `tiny` |" in doc
    assert "| `env` | `{name: code, ...}` | `{name: length_ratio}` |" in doc


def test_feedback_examples_are_what_the_modes_print():
    doc = (ROOT / "docs" / "feedback.md").read_text()
    for mode, prompt in load_script("feedback_examples").examples().items():
        assert f"`{mode}`:\n\n~~~text\n{prompt}\n~~~" in doc, (
            f"docs/feedback.md's {mode} example is stale: run scripts/feedback_examples.py"
        )


def test_custom_feedback_function_runs_and_fits_in_15_lines(tmp_path, monkeypatch):
    doc = (ROOT / "docs" / "feedback.md").read_text()
    code = "# my_feedback.py" + doc.split("```python\n# my_feedback.py")[1].split("```")[0]
    assert len(code.strip().splitlines()) <= 15
    (tmp_path / "my_feedback.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from magrpo.config import ExternalConfig
    from magrpo.envs.code.env import CodeEnv
    from magrpo.feedback import Branch, Feedback

    env = CodeEnv(CodeEnv.Config(train_split="test[2:3]", eval_split="test[3:4]"))
    problem = env.problems("train")[0]
    main = "def truncate_number(number):\n    return number\n"
    context = env.score([problem], [["def aux(x):\n    return x\n", main]])[0].context
    first = env.agent_prompts(problem)
    feedback = Feedback(ExternalConfig(mode="my_feedback:first_failure"), env)
    (out,) = feedback([Branch(problem["prompt"], ["a", main], [[p] for p in first], [["a"], [main]], context)])
    assert out[1].startswith(first[1]) and "This test fails: assert candidate(3.5) == 0.5" in out[1]


def test_readme_starts_with_the_run_and_the_test_command():
    first_block = (ROOT / "README.md").read_text().split("```bash\n")[1].split("```")[0].splitlines()
    assert first_block[0].startswith("bash scripts/setup.sh && .venv/bin/python train.py ")
    assert first_block[1].startswith("bash .ci/run ")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "-m pytest -q -p no:cacheprovider" in ci and '"$@"' in ci  # .ci/run is the test command
    assert '-m "not alone"' in ci and "-m alone" in ci  # the parallel part, then what must run alone


def documented_train_commands() -> list[tuple[str, list[str]]]:
    """(where, overrides) of every `train.py ...` line in the bash blocks of README.md and docs/."""
    out = []
    for path in [ROOT / "README.md", *DOCS]:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if "train.py" not in line:
                    continue
                args = shlex.split(line.split("train.py", 1)[1].split("  #")[0], comments=True)
                overrides = [a for a in args if "=" in a and not a.startswith("-")]
                out.append((f"{path.name}: {line.strip()}", overrides))
    return out


def test_documented_train_commands_compose():
    from magrpo.cli import compose
    from magrpo.errors import ConfigError
    from magrpo.sweep import expand

    commands = documented_train_commands()
    assert len(commands) >= 10
    for where, overrides in commands:
        if "MAGRPO_PLUGINS=" in where or any(
            o.startswith(("plugins=", "external.mode=my_")) or re.search(r"=[A-Za-z_][\w.]*:[A-Za-z_]\w*$", o)
            for o in overrides
        ):  # a `module:name` value, not a split like 'test[16:]' or a URL
            continue  # needs the user's own modules: tests/test_cli_conventions.py runs such commands
        try:
            for _, run in expand(overrides):  # a `-m` sweep: every run; other commands: one
                compose(run)
        except ConfigError as e:
            pytest.fail(f"{where}: {e}")


def test_documented_python_modules_exist():
    import importlib.util

    modules = set()
    for path in [ROOT / "README.md", *DOCS]:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            modules.update(re.findall(r"python -m ([\w.]+)", block))
    assert {"magrpo.report", "magrpo.viz", "magrpo.port"} <= modules
    for module in modules:
        assert importlib.util.find_spec(module) is not None, f"python -m {module} is documented but does not exist"


def test_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200  # the reference lives in docs/


LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


@pytest.mark.parametrize("path", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_every_relative_link_resolves(path):
    for target in LINK.findall(path.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{path.name}: link to {target} points nowhere"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", dest.read_text(), re.M)
            assert anchor in {slug(h) for h in headings}, f"{path.name}: no heading for #{anchor} in {dest.name}"
