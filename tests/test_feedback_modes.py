"""The built-in feedback modes on the code env: exact prompts for fixed aux/main pairs (syntax
error, failing test, all passed, aux ignored), the shared options, and the offline reference expert."""
from __future__ import annotations

import pytest

from magrpo.config import ConfigError, ExternalConfig
from magrpo.envs.code.env import CodeEnv
from magrpo.feedback import Branch, Feedback

AUX = "def aux(x):\n    return x - int(x)\n"
WRAPPER = "```python\ndef truncate_number(number: float) -> float:\n    return aux(number)\n```"
IGNORES = "def truncate_number(number: float) -> float:\n    aux(number)\n    return number + 1\n"
BROKEN = "def truncate_number(number: float) -> float:\n    return (number +\n"
USES = "def truncate_number(number: float) -> float:\n    frac = aux(number)\n    return frac\n"


@pytest.fixture(scope="module")
def env(truncate_env):
    return truncate_env


def prompts_for(env, mode, aux, main, **options):
    """Next-turn prompts of both agents for one branch, as the trainer would build them."""
    problem = env.problems("train")[0]
    assert problem["entry_point"] == "truncate_number"
    first = env.agent_prompts(problem)
    scored = env.score([problem], [[aux, main]])[0]
    feedback = Feedback(ExternalConfig(mode=mode, **options), env)
    feedback.check()
    branch = Branch(problem["prompt"], [aux, main], [[p] for p in first], [[aux], [main]], dict(scored.context))
    (out,) = feedback([branch])
    return first, out, feedback


def feedback_part(first, prompt, name="truncate_number"):
    """The text between the agent's first prompt and the revision instruction."""
    assert prompt.startswith(first + "\n\n")
    body = prompt[len(first) + 2:]
    instruction = f"\n\nRevise your code. Output only the code of `def {name}(...)`, with a return statement."
    assert body.endswith(instruction)
    return body[: -len(instruction)]


PREVIOUS_MAIN = "Your previous code:\n```python\n{}\n```"


def test_level_feedback_failing_test_and_ignored_aux(env):
    first, out, _ = prompts_for(env, "level_feedback", AUX, IGNORES)
    assert feedback_part(first[1], out[1]) == PREVIOUS_MAIN.format(
        "def truncate_number(number: float) -> float:\n    aux(number)\n    return number + 1") + """

Feedback on the combined program:
- `aux`: defined with a return.
- `truncate_number`: defined with a return.
- syntax: the combined program parses.
- tests: 0/3 passed.
  First failing test:
    assert candidate(3.5) == 0.5
  Error: AssertionError
- aux usage: `truncate_number` calls `aux` but ignores its result."""


def test_level_feedback_syntax_error_has_line_and_column(env):
    first, out, _ = prompts_for(env, "level_feedback", AUX, BROKEN)
    tail = feedback_part(first[1], out[1]).split("Feedback on the combined program:\n")[1]
    assert tail == """- `aux`: defined with a return.
- `truncate_number`: not found with a return statement.
- syntax error in your code at line 2, column 12: '(' was never closed
- tests: not run (the program is incomplete)."""
    # the aux writer is told whose code is broken
    assert "- syntax error in the code of `truncate_number` at line 2, column 12" in out[0]


def test_level_feedback_all_passed_warns_about_thin_wrapper(env):
    first, out, _ = prompts_for(env, "level_feedback", AUX, WRAPPER)
    tail = feedback_part(first[1], out[1]).split("Feedback on the combined program:\n")[1]
    assert tail == """- `aux`: defined with a return.
- `truncate_number`: defined with a return.
- syntax: the combined program parses.
- tests: 3/3 passed.
- aux usage: `truncate_number` uses the result of `aux`.
- warning: `truncate_number` only returns `aux(...)`; do part of the work in `truncate_number` itself."""


@pytest.mark.parametrize("main,expected", [
    (USES, ["passed"] * 6),
    (WRAPPER, ["passed"] * 5 + ["failed"]),
    (IGNORES, ["passed", "passed", "passed", "failed", "failed", "failed"]),
    (BROKEN, ["passed", "failed", "failed", "failed", "failed", "failed"]),
])
def test_level_passed_lists_every_level(env, main, expected):
    first, out, _ = prompts_for(env, "level_passed", AUX, main)
    names = ["aux defined", "truncate_number defined", "syntax", "tests", "aux used",
             "truncate_number does more than return aux(...)"]
    checks = "Checks:\n" + "\n".join(f"- {n}: {e}" for n, e in zip(names, expected))
    assert feedback_part(first[0], out[0], "aux").endswith("\n\n" + checks)


@pytest.mark.parametrize("main,line", [(USES, "Result: all checks passed."),
                                       (WRAPPER, "Result: not all checks passed."),
                                       (BROKEN, "Result: not all checks passed.")])
def test_passed_is_one_line(env, main, line):
    first, out, _ = prompts_for(env, "passed", AUX, main)
    assert feedback_part(first[1], out[1]).endswith("```\n\n" + line)


def test_plain_shows_previous_code_and_optionally_the_partner(env):
    first, out, _ = prompts_for(env, "plain", AUX, IGNORES)
    previous = "Your previous code:\n```python\ndef aux(x):\n    return x - int(x)\n```"
    assert feedback_part(first[0], out[0], "aux") == previous
    _, out, _ = prompts_for(env, "plain", AUX, IGNORES, show_partner=True)
    assert "The other agent's previous code (`truncate_number`):\n```python\ndef truncate_number" in out[0]
    assert "The other agent's previous code (`aux`):\n```python\ndef aux(x):" in out[1]


def test_original_prompt_off_keeps_a_role_line_and_drops_the_problem(env):
    first, out, _ = prompts_for(env, "passed", AUX, USES, original_prompt=False)
    assert out[1].startswith("You are agent 1 of 2 and you write `truncate_number`.\n\nYour previous code:")
    assert first[1] not in out[1]


def test_history_lists_earlier_attempts_of_the_branch(env):
    problem = env.problems("train")[0]
    first = env.agent_prompts(problem)
    scored = env.score([problem], [[AUX, USES]])[0]
    feedback = Feedback(ExternalConfig(mode="plain", history=True), env)
    old_main = "def truncate_number(number):\n    return 0\n"
    branch = Branch(problem["prompt"], [AUX, USES], [[first[0], "p0"], [first[1], "p1"]],
                    [["def aux(x):\n    return 1\n", AUX], [old_main, USES]], dict(scored.context))
    (out,) = feedback([branch])
    attempt = "Attempt 1:\n```python\ndef truncate_number(number):\n    return 0\n```"
    assert "Your earlier attempts, oldest first:\n" + attempt in out[1]
    assert out[1].index("earlier attempts") < out[1].index("Your previous code")


def test_code_env_context_matches_its_declared_keys(env):
    problem = env.problems("train")[0]
    context = env.score([problem], [[AUX, IGNORES]])[0].context
    assert set(context) == CodeEnv.context_keys
    assert context["passed"] == 0 and context["total"] == 3 and context["aux_usage"] == "ignored"
    assert context["first_failure"] == {"case": "assert candidate(3.5) == 0.5", "error": "AssertionError"}


@pytest.mark.parametrize("mode", ["level_feedback", "level_passed", "passed", "expert_edits"])
def test_code_modes_refuse_an_env_without_code_context(mode):
    from magrpo.envs.length_ratio import LengthRatioEnv

    with pytest.raises(ConfigError, match="external.mode: .*env=code"):
        Feedback(ExternalConfig(mode=mode), LengthRatioEnv(LengthRatioEnv.Config())).check()


def test_reference_expert_reveals_the_canonical_solution_only_when_tests_fail(env):
    first, out, fb = prompts_for(env, "expert_edits", AUX, IGNORES)
    assert feedback_part(first[1], out[1]).endswith(
        "An expert reviewed the program and proposes this `truncate_number`:\n"
        "```python\ndef truncate_number(number: float) -> float:\n    return number % 1.0\n```")
    assert "proposes this `aux`:\n```python\ndef aux(number: float) -> float:\n    return number % 1.0\n```" in out[0]
    metrics = fb.metrics()
    assert metrics["expert/calls"] == 1 and metrics["expert/fallbacks"] == 0 and metrics["expert/reference"] == 1.0
    first, out, _ = prompts_for(env, "expert_edits", AUX, USES)
    assert feedback_part(first[1], out[1]).endswith(
        "An expert reviewed the program and proposes no changes to your `truncate_number`.")


def test_reference_expert_without_canonical_solution_falls_back_to_level_feedback(env):
    problem = dict(env.problems("train")[0], canonical_solution="")
    first = env.agent_prompts(problem)
    scored = env.score([problem], [[AUX, IGNORES]])[0]
    fb = Feedback(ExternalConfig(mode="expert_edits"), env)
    branch = Branch(problem["prompt"], [AUX, IGNORES], [[p] for p in first], [[AUX], [IGNORES]], dict(scored.context))
    (out,) = fb([branch])
    assert "Feedback on the combined program:\n" in out[1] and "expert" not in out[1]
    metrics = fb.metrics()
    assert metrics["expert/fallbacks"] == 1 and metrics["expert/failures"] == 1
    assert fb.metrics()["expert/fallbacks"] == 0  # reset on read: per-step numbers


@pytest.mark.parametrize("overrides,mode", [
    (["env=length_ratio"], "length_ratio"),  # the env's default_feedback (it was plain: the attribute did nothing)
    (["env=code"], "plain"),
    (["env=length_ratio", "external=plain"], "plain"),  # a mode the user picks wins
    (["env=length_ratio", "external.mode=plain"], "plain"),
])
def test_an_envs_default_feedback_is_the_mode_unless_one_is_chosen(make_cfg, overrides, mode):
    from magrpo.cli import compose
    from magrpo.trainer import prepare

    cfg = compose([*overrides, "model=tiny", "env.train_size=2" if "env=length_ratio" in overrides else
                   "env.train_split='test[:2]'", "eval.at_end=false"])
    _, feedback = prepare(cfg)
    assert feedback.name == mode and cfg.external.mode == mode  # config.json records the mode that ran


def test_an_env_without_default_feedback_gets_plain():
    from magrpo.feedback import mode_for
    from tests.fakes import PassEnv

    assert PassEnv.default_feedback is None and mode_for("auto", PassEnv(None)) == "plain"
    assert mode_for("passed", PassEnv(None)) == "passed"
