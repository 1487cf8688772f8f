"""No text from outside stops a run (issue 44): a program's exception, a tool's output, an expert's
reply or the model's own JSON may hold a lone surrogate (`chr(0xD800)`, or the JSON escape \\ud800),
which a Python string holds but no tokenizer or UTF-8 file takes. Each reaches them with U+FFFD in
its place (`magrpo.errors.valid_text`). The call parser's own bounds are in tests/test_tools.py."""
from __future__ import annotations

import itertools
import json

import pytest

from magrpo.errors import valid_text
from magrpo.tools import ToolCall, execute_calls, function_tool, parse_call

LONE = chr(0xD800)


def valid(text: str) -> bool:
    text.encode("utf-8")  # raises UnicodeEncodeError on a lone surrogate
    return True


def test_valid_text_replaces_each_lone_surrogate_and_keeps_everything_else():
    assert valid_text(f"a{LONE}b\udfff") == "a\ufffdb\ufffd"
    assert valid_text("plain, ✓, 😀, \ufffd") == "plain, ✓, 😀, \ufffd"


# --- the model's call and a tool's answer ------------------------------------------------------------

def test_a_call_whose_json_escapes_a_lone_surrogate_reaches_the_tool_as_valid_text():
    parsed = parse_call('<tool_call>{"name": "f\\ud800", "arguments": {"x\\udc00": ["\\ud800", 1]}}</tool_call>')
    assert parsed == ToolCall("f\ufffd", {"x\ufffd": ["\ufffd", 1]})


def echo(text: str) -> str:
    return f"got {text}{LONE}"


def refuse(text: str) -> str:
    raise ValueError(f"no {text}{LONE}")


def huge() -> int:
    return 10**5000  # str() of it raises ValueError: more than 4,300 digits


def test_a_tools_output_and_its_exceptions_message_reach_the_model_as_valid_text():
    answered, raised = execute_calls([ToolCall("echo", {"text": "x"}), ToolCall("refuse", {"text": "x"})],
                                     [function_tool(echo), function_tool(refuse)], 5.0, 1000, 8)
    assert (answered.text, answered.error) == ("got x\ufffd", None)
    assert (raised.text, raised.error) == ("error: 'refuse' raised ValueError: no x\ufffd", "raised")


def test_an_answer_that_str_cannot_write_is_a_tool_that_raised():
    [r] = execute_calls([ToolCall("huge", {})], [function_tool(huge)], 5.0, 1000, 8)
    assert r.error == "raised" and r.text.startswith("error: 'huge' raised ValueError: Exceeds the limit")


# --- a graded program's exception: the judge's verdict, in feedback and in run_tests ---------------

RAISES = "def truncate_number(number: float) -> float:\n    raise ValueError(chr(0xD800))\n    return number\n"
AUX = "def aux(x):\n    return x - int(x)\n"


def test_a_programs_lone_surrogate_reaches_level_feedback_as_valid_text(truncate_env):
    from magrpo.config import ExternalConfig
    from magrpo.feedback import Branch, Feedback

    problem = truncate_env.problems("train")[0]
    [scored] = truncate_env.score([problem], [[AUX, RAISES]])
    assert scored.context["first_failure"]["error"] == "ValueError: \ufffd"  # the env's context, for every mode
    branch = Branch(problem["prompt"], [AUX, RAISES], [[p] for p in truncate_env.agent_prompts(problem)],
                    [[AUX], [RAISES]], dict(scored.context))
    [prompts] = Feedback(ExternalConfig(mode="level_feedback"), truncate_env)([branch])
    assert all(valid(p) for p in prompts) and "  Error: ValueError: \ufffd" in prompts[1]


def test_a_programs_lone_surrogate_reaches_run_tests_output_as_valid_text(truncate_env):
    from magrpo.tool_state import Session, ToolContext
    from magrpo.tools import resolve

    context = ToolContext(truncate_env.tool_context(truncate_env.problems("train")[0]), 1)
    [r] = execute_calls([ToolCall("run_tests", {"code": RAISES})], resolve(["run_tests"]), 30.0, 4000, 8,
                        sessions=[Session(context)])
    assert r.error is None and "FAILED: truncate_number(3.5): expected 0.5, but ValueError: \ufffd" in r.text


# --- feedback: whatever a mode or an expert returns ----------------------------------------------

def test_a_feedback_functions_lone_surrogate_reaches_the_prompt_as_valid_text():
    from magrpo.config import ExternalConfig
    from magrpo.feedback import Branch, Feedback

    def shout(prompt, agent_completions, num_agents, **context):
        return [f"{prompt} {LONE}"] * num_agents

    [prompts] = Feedback(ExternalConfig(), None, target=shout)([Branch("P", ["a", "b"], [["P"], ["P"]],
                                                                        [["a"], ["b"]])])
    assert prompts == ["P \ufffd", "P \ufffd"]


# --- a run ---------------------------------------------------------------------------------------

SCRIPT = [  # what the replies' calls say, in turn
    '<tool_call>{"name": "run_tests", "arguments": ' + "[" * 1000 + "</tool_call>",  # as small models loop
    '<tool_call>{"name": "run_tests", "arguments": ' + json.dumps({"code": RAISES}) + "}</tool_call>",
    '<tool_call>{"name": "refuse", "arguments": {"text": "x"}}</tool_call>',
    '<tool_call>{"name": "refuse", "arguments": ' + '{"x": ' * 600 + "1" + "}" * 600 + "}</tool_call>",
]


@pytest.mark.slow
def test_a_code_env_run_whose_calls_loop_deep_and_quote_lone_surrogates_finishes(tmp_path, monkeypatch):
    """The tiny model never writes `<tool_call>`: here its replies that end in "e" make the calls of
    SCRIPT in turn, through the real parser, tools, judge, tokenizer, feedback and rollouts.jsonl.
    Each one ended such a run with exit 1: RecursionError in the parser, TypeError in the tokenizer
    (run_tests quoting the program's ValueError(chr(0xD800)), a tool's own exception), RecursionError
    in feedback (dataclasses.asdict of arguments 600 deep)."""
    import magrpo.tool_loop
    from magrpo.cli import main
    from tests.conftest import SMALL

    script = itertools.cycle(SCRIPT)
    monkeypatch.setattr(magrpo.tool_loop, "CALL_END", "e")
    monkeypatch.setattr(magrpo.tool_loop, "parse_call", lambda text: parse_call(next(script)) if text.endswith("e")
                        else None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "run"
    code = main([*SMALL, "env=code", "external=plain", "tools=[run_tests,tests.test_outside_text:refuse]",
                 "tools.max_calls=2", "trainer.steps=1", "trainer.batch_size=1", "trainer.num_turns=2",
                 "generation.max_new_tokens=64", "eval.at_end=false", "env.train_split='test[2:3]'",
                 "env.eval_split='test[3:4]'", f"logging.run_dir={run}"])
    assert code == 0
    [metrics] = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert all(metrics.get(f"tools/errors/{kind}", 0) > 0 for kind in ("bad_json", "raised", "bad_arguments"))
    rollouts = (run / "rollouts.jsonl").read_text()
    assert "but ValueError: \\ufffd" in rollouts and "raised ValueError: no x\\ufffd" in rollouts
