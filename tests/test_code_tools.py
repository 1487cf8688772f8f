"""The code env's tools (issue 31, point 4): `run_tests` runs code on the problem's visible examples and
never shows a hidden test; `run_python` runs a snippet in the judge's sandbox under a short limit, and
the hostile snippets (reading the tests or the judge, escaping processes, writing outside, the
network, hanging, flooding, bytes that are not UTF-8) are contained."""
from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from magrpo.envs.code import isolation
from magrpo.envs.code.env import CodeEnv
from magrpo.envs.code.examples import Example, visible_examples
from magrpo.envs.code.script import run_script
from magrpo.envs.code.tools import run_python, run_tests
from magrpo.tool_state import ToolContext
from magrpo.tools import ToolCall, execute_calls, resolve
from tests import hostile

# It counts the host's processes, /tmp entries or SysV objects: it runs alone (.ci/run, docs/testing.md).
pytestmark = pytest.mark.alone

CHECKOUT = Path(__file__).resolve().parent.parent
HIDDEN = ("1.33", "123.456")  # HumanEval/2's hidden cases; its docstring shows only truncate_number(3.5) == 0.5
RIGHT = "def truncate_number(number: float) -> float:\n    return number % 1.0\n"
WRONG = "def truncate_number(number: float) -> float:\n    return number\n"


@pytest.fixture(scope="module")
def context(truncate_env) -> ToolContext:
    """What the tools of agent 1 see on HumanEval/2, with a one-second limit (the hang cases)."""
    [problem] = truncate_env.problems("train")
    ctx = truncate_env.tool_context(problem)
    limits = dataclasses.replace(ctx["tool_limits"], timeout_s=1.0, cpu_s=1)
    return ToolContext({**ctx, "tool_limits": limits}, 1)


# --- visible examples -----------------------------------------------------------------------------

def test_visible_examples_come_from_the_docstring_in_both_forms():
    prompt = ('import math\n\ndef helper():\n    """>>> f(9)\n    9"""\n\ndef f(x):\n    """Add one.\n'
              "    >>> f(1)\n    2\n    >>> f(2) == 3\n    f(5) ==> 6\n    f(7) ➞ 8.\n    >>> g(1)\n    5\n"
              "    >>> f(0)\n    Traceback (most recent call last):\n    f(x) is prose, f(3) is 4\n    \"\"\"\n")
    assert visible_examples(prompt, "f") == (Example("f(1)", "2"), Example("f(2)", "3"), Example("f(5)", "6"),
                                             Example("f(7)", "8"))


def test_the_tool_context_holds_the_statement_and_never_the_tests(truncate_env, context):
    [problem] = truncate_env.problems("train")
    ctx = truncate_env.tool_context(problem)
    assert set(ctx) == {"task_id", "prompt", "entry_point", "preamble", "examples", "tool_limits"}
    assert ctx["examples"] == (Example("truncate_number(3.5)", "0.5"),)
    assert not any(value in str(dict(ctx)) for value in HIDDEN) and all(value in problem["test"] for value in HIDDEN)
    assert ctx["tool_limits"].timeout_s == 2.0 and ctx["tool_limits"].mode == "bwrap"  # env.tool_timeout_s
    assert truncate_env.tool_context(problem) is ctx  # built once per problem


# --- run_tests ------------------------------------------------------------------------------------

def test_run_tests_says_what_passed_and_what_came_back(context):
    assert run_tests(RIGHT, context=context) == "1 of 1 examples passed\npassed: truncate_number(3.5) == 0.5"
    assert run_tests(f"```python\n{WRONG}```", context=context) == \
        "0 of 1 examples passed\nFAILED: truncate_number(3.5): expected 0.5, got 3.5"
    raising = "def truncate_number(number):\n    print('trying', number)\n    raise ValueError('no')\n"
    assert run_tests(raising, context=context) == ("0 of 1 examples passed\nFAILED: truncate_number(3.5): "
                                                   "expected 0.5, but ValueError: no\nstdout:\ntrying 3.5")


@pytest.mark.parametrize("code", [RIGHT, WRONG, "def truncate_number(n):\n    while True:\n        pass\n",
                                  "import sys\ndef truncate_number(n):\n    print(sys.argv, open(__file__).read())\n"])
def test_run_tests_never_shows_a_hidden_test(context, code):
    out = run_tests(code, context=context)
    assert out.startswith(("0 of 1", "1 of 1")) and not any(value in out for value in HIDDEN), out


def test_run_tests_refuses_code_without_the_entry_point_or_that_does_not_parse(context):
    assert run_tests("def aux(x):\n    return x\n", context=context) == \
        "error: the code defines no function `truncate_number`, which the examples call"
    assert run_tests("def truncate_number(:", context=context).startswith("error: the code does not parse")


def test_run_tests_is_registered_and_reads_the_branch_context(context):
    [ok, other_env] = execute_calls([ToolCall("run_tests", {"code": RIGHT})] * 2, resolve(["run_tests"]), 30.0,
                                    4000, 2)  # no session given: no context
    assert ok.error == other_env.error == "raised" and "comes with the code env" in ok.text


# --- run_python -----------------------------------------------------------------------------------

def test_run_python_shows_exit_status_output_and_traceback(context):
    assert run_python("print('hi')\nimport sys\nprint('oops', file=sys.stderr)\nsys.exit(3)", context=context) == \
        "exit status 3\nstdout:\nhi\nstderr:\noops"
    out = run_python("def f():\n    return 1 / 0\nf()", context=context)
    assert out.startswith("exit status 1\nstderr:\nTraceback (most recent call last):\n  File \"<snippet>\", line 3")
    assert out.endswith("ZeroDivisionError: division by zero") and "candidate" not in out


def test_run_python_honours_the_env_sandbox(truncate_env, tmp_path):
    cfg = dataclasses.replace(truncate_env.cfg, sandbox="unsafe")
    unsafe = CodeEnv(cfg)
    [problem] = unsafe.problems("train")
    limits = unsafe.tool_context(problem)["tool_limits"]
    assert limits.mode == "unsafe"
    assert run_script("import os\nprint(os.getcwd())", limits).stdout.startswith(tempfile_root())
    assert run_script("import os\nprint(os.getcwd())", dataclasses.replace(limits, mode="bwrap")).stdout == "/tmp\n"


def tempfile_root() -> str:
    import tempfile

    return str(Path(tempfile.gettempdir()) / "magrpo-sandbox-")


def attack(code: str) -> str:
    """A corpus program of tests/hostile.py (its `f` answers 2 only if its attack worked) as a snippet."""
    return f"{code}\nprint('attack answered', f(1))\n"


@pytest.mark.parametrize("name", ["read_dataset", "read_checkout", "find_judge_source", "read_host_processes",
                                  "network_namespace_escape", "write_own_modules", "nested_user_namespace"])
def test_a_snippet_cannot_read_the_tests_the_judge_or_the_host(context, name):
    code = hostile.readers(CHECKOUT)[name]
    bait = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", hostile.SECRET])
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind("\0magrpo-hostile")
        listener.listen()
        run_tests(RIGHT, context=context)  # a warm judge exists to be looked for
        out = run_python(attack(code), context=context)
    finally:
        bait.kill()
        bait.wait()
        listener.close()
    assert "attack answered 2" not in out, out


SANDBOX_UIDS = range(isolation.UID_BASE, isolation.UID_BASE + isolation.UID_SPAN)


def no_leftovers() -> list[str]:
    deadline = time.monotonic() + 3  # SIGKILLed processes may take a moment to go
    while hostile.leftovers(SANDBOX_UIDS) and time.monotonic() < deadline:
        time.sleep(0.05)
    return hostile.leftovers(SANDBOX_UIDS)


@pytest.mark.parametrize("name", ["background_sleep", "setsid_escape", "daemon_ignoring_sigterm"])
def test_a_snippets_background_processes_die_with_it(context, name):
    out = run_python(f"{hostile.hostile_corpus(Path('/nonexistent'))[name]}\nf(1)\nprint('left')", context=context)
    assert out.startswith("exit status 0") and no_leftovers() == []


def test_a_snippet_that_hangs_is_killed_at_the_time_limit(context):
    start = time.monotonic()
    out = run_python("import subprocess\nsubprocess.Popen(['sleep', '100'])\nwhile True:\n    pass\n", context=context)
    assert out == "timed out after 1 s (killed)" and time.monotonic() - start < 10 and no_leftovers() == []


def test_a_snippet_cannot_write_outside_its_tmp_or_reach_the_network(context, tmp_path):
    target = tmp_path / "escaped.txt"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        out = run_python(f"open({str(target)!r}, 'w').write('escaped')", context=context)
        assert out.startswith("exit status 1") and "Error" in out and not target.exists()
        out = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)", context=context)
        assert out.startswith("exit status 1") and "Error" in out, out
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    finally:
        listener.close()


def test_megabytes_of_output_and_bytes_that_are_not_utf8_come_back_capped_and_readable(context):
    out = run_python("import sys\nsys.stdout.write('x' * 50_000_000)\nsys.stderr.buffer.write(b'\\xff\\xfe\\x80 bad')",
                     context=context)
    limit = context.problem["tool_limits"].output_bytes
    assert out.startswith("exit status 0\nstdout:\nxxx") and f"[stdout cut at {limit} bytes]" in out
    assert len(out) < 2 * limit + 200 and "\ufffd\ufffd\ufffd bad" in out
    out.encode("utf-8")  # valid text for the tokenizer


def test_a_snippet_too_large_for_its_pipe_is_refused(context):
    [r] = execute_calls([ToolCall("run_python", {"code": "#" * 70_000})], resolve(["run_python"]), 30.0, 4000, 1,
                        sessions=[_session(context)])
    assert r.error == "raised" and "more than 60000" in r.text


def _session(context: ToolContext):
    from magrpo.tool_state import Session

    return Session(context)


# --- a run from the command line -----------------------------------------------------------------

@pytest.mark.slow
def test_a_code_env_run_with_run_tests_shows_the_calls_and_results_in_rollouts(tmp_path, monkeypatch):
    """The tiny model never writes `<tool_call>`: here any text ending in "e" is a call of run_tests
    with a right answer, so a real code-env run stops, runs the examples, splices and resumes."""
    import magrpo.tool_loop
    from magrpo.cli import main
    from tests.conftest import SMALL

    monkeypatch.setattr(magrpo.tool_loop, "CALL_END", "e")
    monkeypatch.setattr(magrpo.tool_loop, "parse_call", lambda text: (
        ToolCall("run_tests", {"code": RIGHT}) if text.endswith("e") else None))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "run"
    code = main([*SMALL, "env=code", "external=plain", "tools=[run_tests]", "tools.max_calls=1", "trainer.steps=1",
                 "trainer.batch_size=1", "trainer.num_turns=1", "generation.max_new_tokens=64", "eval.at_end=false",
                 "env.train_split='test[2:3]'", "env.eval_split='test[3:4]'", f"logging.run_dir={run}"])
    assert code == 0
    [metrics] = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert metrics["tools/calls"] > 0
    rollouts = (run / "rollouts.jsonl").read_text()
    assert "1 of 1 examples passed\\npassed: truncate_number(3.5) == 0.5" in rollouts
    assert not any(value in rollouts.split("<tool_response>", 1)[1] for value in HIDDEN)
