"""Every check that can run before the model loads runs there (issue 45): a plugin that does not import,
an MCP entry of the wrong shape, a feedback function that cannot take the call, and
external.history=messages on a model without a chat template are one line naming the key, exit 2,
before any model loads (run_cli fails the test on a model load) and before the run dir exists."""
from __future__ import annotations

import pytest

from tests.conftest import SMALL


@pytest.mark.parametrize("source, error", [
    ("def f(:\n", "SyntaxError: invalid syntax (broken_plugin_{}.py, line 1)"),
    ("raise RuntimeError('no config for me')\n", "RuntimeError: no config for me"),
])
@pytest.mark.parametrize("key", ["plugins", "external.mode"])
def test_a_plugin_that_does_not_import_is_a_plugin_error(run_cli, tmp_path, source, error, key):
    """It was `error: unexpected SyntaxError: ...` (exit 1), which reads like a bug of magrpo."""
    name = f"broken_plugin_{len(source)}"
    (tmp_path / f"{name}.py").write_text(source)
    value = f"[{name}]" if key == "plugins" else f"{name}:feedback"
    code, lines = run_cli(*SMALL, f"{key}={value}")
    assert (code, lines) == (2, [f"config error: {key}: importing module {name!r} raised "
                                 f"{error.format(len(source))}"])
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("override, line", [
    ("tools.mcp=[{command:[python],env:[A,B]}]",
     "tools.mcp[0].env: must be a mapping, e.g. {NAME: VALUE}; got list ['A', 'B']"),
    ("tools.mcp=[{command:[python]},{command:python}]",
     "tools.mcp[1].command: must be a list, e.g. [a, b]; got str 'python'"),
    ("agents=[{stop: x}]", "agents[0].stop: must be a list, e.g. [a, b]; got str 'x'"),
])
def test_an_entry_of_the_wrong_shape_names_its_key(run_cli, override, line):
    """`tools.mcp[0].env` as a list was `config error: config: Cannot merge DictConfig with ListConfig`."""
    assert run_cli(*SMALL, override) == (2, [f"config error: {line}"])


def test_a_feedback_function_that_cannot_take_the_call_stops_before_the_model(run_cli):
    """It was found at the first turn, after the model had loaded (`raised at turn 0: TypeError`)."""
    code, lines = run_cli(*SMALL, "external.mode=tests.feedback_probe:wrong_signature")
    assert (code, lines) == (2, [
        "config error: external.mode: feedback function 'tests.feedback_probe:wrong_signature' "
        "(tests.feedback_probe.wrong_signature) cannot be called as fn(prompt, agent_completions, num_agents, "
        "prompt_history_per_agent, response_history_per_agent, **context): it does not take the argument "
        "'agent_completions'"])


def test_a_feedback_function_needing_a_context_key_the_env_lacks(run_cli, tmp_path):
    (tmp_path / "needs_key.py").write_text(
        "def fb(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent, *, "
        "stdout):\n    return [prompt] * num_agents\n")
    code, lines = run_cli(*SMALL, "env=code", "external.mode=needs_key:fb")
    assert code == 2 and len(lines) == 1 and lines[0].startswith(
        "config error: external.mode: feedback function 'needs_key:fb' (needs_key.fb) cannot be called as fn("), lines
    assert "it needs 'stdout', which neither the call nor the context gives (env CodeEnv's context: " in lines[0]


@pytest.mark.parametrize("extra", [[], ["model.chat_template=never"]])
def test_messages_history_without_a_chat_template_stops_before_the_model(run_cli, extra):
    """It was found by conversation_of, after the weights had loaded."""
    code, lines = run_cli(*SMALL, "external.history=messages", *extra)
    lines = [line for line in lines if not line.startswith("building tiny model")]  # run_cli's empty cache
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("config error: external.history: messages needs a chat template, and agent 0's "
                               "model (") and lines[0].endswith(
        ") has none or model.chat_template=never; use external.history=continuation"), lines
