"""Stateful tools and the tool context (issue 31, point 1): verl's create / execute / release once per
rollout branch that calls (a `Turn` of the tool loop), released whatever happened; function tools
that ask for the context with a keyword-only `context`; the problem carried from the rollout."""
from __future__ import annotations

import threading
import time

import pytest

from magrpo.errors import ConfigError
from magrpo.generation import GenerationRequest, SamplingParams
from magrpo.tool_loop import generate_with_tools
from magrpo.tool_state import ToolContext
from magrpo.toolbox import Toolbox
from magrpo.tools import Tool, ToolCall, ToolStats, execute_calls, function_tool, resolve, stateful_tool
from tests.fakes import SAMPLING, FakeEnv, RecordingFeedback, ToolScriptBackend, serial, tree_settings


class Recorder:
    """A stateful tool that records its lifecycle: each handle is a fresh list of the calls it served."""

    behaviour = {"raise": False, "sleep_s": 0.0, "release_raises": False}

    def __init__(self):
        self.created: list[ToolContext] = []
        self.released: list[list] = []
        self.lock = threading.Lock()

    @classmethod
    def schema(cls) -> dict:
        return {"name": "note", "description": "Remember a word.",
                "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}

    def create(self, context: ToolContext) -> list:
        with self.lock:
            self.created.append(context)
        return []

    def execute(self, handle: list, word: str) -> str:
        time.sleep(self.behaviour["sleep_s"])
        if self.behaviour["raise"]:
            raise RuntimeError("broken")
        handle.append(word)
        return f"{len(handle)} word(s): {' '.join(handle)}"

    def release(self, handle: list) -> None:
        with self.lock:
            self.released.append(handle)
        if self.behaviour["release_raises"]:
            raise OSError("cannot let go")


@pytest.fixture
def recorder(monkeypatch):
    monkeypatch.setattr(Recorder, "behaviour", dict(Recorder.behaviour))
    return Recorder()


def note(word: str) -> str:
    return f'Noting. <tool_call>{{"name": "note", "arguments": {{"word": "{word}"}}}}</tool_call>'


def loop(tools, script, requests, timeout_s=5.0, max_calls=4, stats=None, backend=None):
    backend = backend or ToolScriptBackend(script)
    settings = Toolbox(tuple(tools), max_calls, timeout_s, 1000, 8)
    return generate_with_tools(backend, requests, SamplingParams(max_new_tokens=600), settings, backend.encode,
                               stats or ToolStats())


CALLER = GenerationRequest("CALL", agent=1, n=3, seed=1, context={"task_id": "T1"})
QUIET = GenerationRequest("QUIET", agent=0, n=2, seed=2, context={"task_id": "T1"})
SCRIPT = {"CALL": [note("a"), note("b"), " done"], "QUIET": [" nothing to call"]}


def test_one_create_and_one_release_per_branch_that_calls_none_for_the_others(recorder):
    [calling, quiet] = loop([stateful_tool(recorder)], SCRIPT, [CALLER, QUIET])
    # 3 calling branches, 2 calls each: one handle per branch, kept across its calls, released once
    assert len(recorder.created) == 3 and len(recorder.released) == 3
    assert sorted(map(id, recorder.released)) == sorted({id(h) for h in recorder.released})
    assert all(handle == ["a", "b"] for handle in recorder.released)
    assert all("2 word(s): a b" in c.text for c in calling) and all("tool_response" not in c.text for c in quiet)
    assert recorder.created == [ToolContext({"task_id": "T1"}, 1)] * 3  # the request's context and agent


def test_release_comes_after_errors_and_timeouts(recorder):
    recorder.behaviour["raise"] = True
    stats = ToolStats()
    [calling, _] = loop([stateful_tool(recorder)], SCRIPT, [CALLER, QUIET], stats=stats)
    assert stats.errors == {"raised": 6} and len(recorder.created) == 3 and len(recorder.released) == 3
    recorder.behaviour.update({"raise": False, "sleep_s": 0.5})
    stats = ToolStats()
    loop([stateful_tool(recorder)], SCRIPT, [CALLER], timeout_s=0.05, stats=stats)
    assert stats.errors == {"timeout": 6} and len(recorder.created) == 6 and len(recorder.released) == 6


def test_release_comes_when_a_generate_call_raises(recorder):
    backend = ToolScriptBackend(SCRIPT)
    first_call = backend.generate

    def generate(requests, params):
        if backend.generate_calls:  # the resume after the first round's calls
            raise MemoryError("out of memory")
        return first_call(requests, params)

    backend.generate = generate
    with pytest.raises(MemoryError):
        loop([stateful_tool(recorder)], SCRIPT, [CALLER, QUIET], backend=backend)
    assert len(recorder.created) == 3 and len(recorder.released) == 3


def test_a_failed_release_is_counted_not_raised(recorder):
    recorder.behaviour["release_raises"] = True
    stats = ToolStats()
    loop([stateful_tool(recorder)], SCRIPT, [CALLER, QUIET], stats=stats)
    assert stats.errors == {"release": 3} and stats.metrics()["tools/errors/release"] == 3


def test_a_create_that_outlives_its_timeout_releases_its_handle_when_it_comes():
    done, released = threading.Event(), []

    class SlowStart:
        schema = {"name": "slow", "parameters": {"type": "object", "properties": {}}}

        def create(self, context):
            time.sleep(0.3)
            return "late handle"

        def execute(self, handle):
            return "never"

        def release(self, handle):
            released.append(handle)
            done.set()

    [r] = execute_calls([ToolCall("slow", {})], [stateful_tool(SlowStart)], 0.05, 100, 1)
    assert r.error == "timeout" and released == []
    assert done.wait(30) and released == ["late handle"]


def test_async_stateful_tool():
    log = []

    class Async:
        schema = {"name": "echo", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}

        async def create(self, context):
            log.append("create")
            return "h"

        async def execute(self, handle, x):
            return f"{handle}:{x}"

        async def release(self, handle):
            log.append(f"release {handle}")

    [r] = execute_calls([ToolCall("echo", {"x": "1"})], [stateful_tool(Async)], 5.0, 100, 1)
    assert (r.text, r.error, log) == ("h:1", None, ["create", "release h"])


def test_bad_arguments_create_nothing(recorder):
    [r] = execute_calls([ToolCall("note", {"wrd": "x"})], [stateful_tool(recorder)], 5.0, 100, 1)
    assert r.error == "bad_arguments" and recorder.created == [] and recorder.released == []


# --- a function tool asks for the context --------------------------------------------------------

def whoami(greeting: str, *, context: ToolContext) -> str:
    """Say who calls."""
    return f"{greeting}, agent {context.agent} on {context.problem['task_id']}"


def test_a_function_tool_gets_the_context_through_a_keyword_only_parameter():
    tool = function_tool(whoami)
    assert tool.schema["parameters"] == {"type": "object", "properties": {"greeting": {"type": "string"}},
                                         "required": ["greeting"]}  # context is no argument of the model's
    [r] = loop([tool], {"CALL": ['<tool_call>{"name": "whoami", "arguments": {"greeting": "hi"}}</tool_call>',
                                 " ok"]}, [GenerationRequest("CALL", agent=1, n=1, context={"task_id": "T7"})])
    assert "hi, agent 1 on T7" in r[0].text


def test_the_model_cannot_pass_its_own_context():
    [r] = execute_calls([ToolCall("whoami", {"greeting": "hi", "context": {"task_id": "forged"}})],
                        [function_tool(whoami)], 5.0, 200, 1)
    assert r.error == "bad_arguments" and "context" in r.text and "forged" not in r.text


# --- choosing a stateful tool --------------------------------------------------------------------

def test_module_class_resolves_to_a_stateful_tool():
    [tool] = resolve(["tests.test_stateful_tools:Recorder"])
    assert tool.name == "note" and isinstance(tool.state, Recorder) and tool.schema == Recorder.schema()

    class NoName(Recorder):
        schema = {"description": "no name"}

    import tests.test_stateful_tools as here

    here.NoName = NoName
    with pytest.raises(ConfigError, match=r"tools: 'tests.test_stateful_tools:NoName': not a usable stateful tool"):
        resolve(["tests.test_stateful_tools:NoName"])


def test_plain_tools_are_unchanged():
    tool = resolve(["calculator"])[0]
    assert isinstance(tool, Tool) and tool.state is None


# --- the context travels from the rollout ---------------------------------------------------------

def test_the_context_takes_no_part_in_equality_or_hashing():
    a, b = GenerationRequest("p", 0, 1, context={"x": 1}), GenerationRequest("p", 0, 1)
    assert a == b and hash(a) == hash(b)


class ContextEnv(FakeEnv):
    def tool_context(self, problem):
        return {"seen": problem["prompt"]}


def test_training_and_evaluation_requests_carry_the_envs_tool_context():
    from magrpo.evaluation import run_paths
    from magrpo.rollout import expand_trees

    problems = [{"prompt": "P0"}, {"prompt": "P1"}]
    env = ContextEnv(2, reward=lambda problem, texts: 0.0)
    backend = ToolScriptBackend(["x"])
    expand_trees(problems, env, backend, serial(RecordingFeedback(), env),
                 tree_settings(num_generations=2, num_turns=2), SAMPLING)
    run_paths(problems, env, backend, serial(RecordingFeedback(), env), 2, SAMPLING)
    requests = [r for call in backend.calls for r in call]
    assert len(requests) == 2 * 2 * (1 + 2) + 2 * 2 * 2  # trees: 1 + K nodes per problem; paths: 2 turns
    assert {r.context["seen"] for r in requests} == {"P0", "P1"}
    assert all(r.context == {"seen": r.prompt.split("::")[0]} for r in requests if "::" in r.prompt)
