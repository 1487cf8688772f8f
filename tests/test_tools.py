"""Tools inside a turn (issue 31, points 1 and 3): the call parser, concurrent execution whose
every failure is an error message rather than a crash, and the loop that splices tool results into a
turn, masked out of the loss."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import asdict

import pytest

from magrpo.config import TrainConfig
from magrpo.errors import ConfigError
from magrpo.generation import GenerationRequest, SamplingParams
from magrpo.tool_loop import generate_with_tools
from magrpo.toolbox import Toolbox
from magrpo.tools import (
    MAX_ARGUMENT_DEPTH,
    MAX_CALL_CHARS,
    CallError,
    Tool,
    ToolCall,
    ToolStats,
    execute_calls,
    function_tool,
    parse_call,
    resolve,
    response_text,
)
from tests.fakes import ToolScriptBackend


def call(body: str) -> str:
    return f"I will compute. <tool_call>{body}</tool_call>"


def run(calls, *tools, timeout_s=5.0, max_output_chars=1000, max_concurrency=8):
    return execute_calls(calls, list(tools) or resolve(["calculator"]), timeout_s, max_output_chars, max_concurrency)


# --- the call format -------------------------------------------------------------------------------

def test_parse_a_good_call():
    assert parse_call(call('{"name": "calculator", "arguments": {"expression": "1+2"}}')) == \
        ToolCall("calculator", {"expression": "1+2"})


def test_parse_arguments_given_as_a_json_string():
    assert parse_call(call('{"name": "f", "arguments": "{\\"x\\": 1}"}')) == ToolCall("f", {"x": 1})


def test_a_reply_without_a_call_is_none():
    assert parse_call("The answer is 4.") is None
    assert parse_call("<tool_call>{} and more text") is None  # no end marker: generation ran out


def nested(depth: int) -> str:
    """Arguments `depth` objects deep: {"x": {"x": ... 1}}."""
    return '{"x": ' * depth + "1" + "}" * depth


@pytest.mark.parametrize("body,kind", [
    ('{"name": "calculator", "arguments": {', "bad_json"),
    ('["calculator"]', "bad_json"),
    ('{"arguments": {}}', "bad_json"),
    ('{"name": "calculator", "arguments": [1, 2]}', "bad_arguments"),
    # what small models write in a loop: Python's JSON parser raised RecursionError (issue 44)
    ('{"name": "calculator", "arguments": ' + "[" * 1000, "bad_json"),
    ('{"name": "calculator", "arguments": "' + "[" * 1000 + '"}', "bad_json"),  # the same as a JSON string
    # past Python's 4,300-digit limit for int(): a ValueError that is no JSONDecodeError
    ('{"name": "calculator", "arguments": {"x": ' + "1" * 4301 + "}}", "bad_json"),
    # valid, but deeper than any tool needs: later copies (dataclasses.asdict for feedback) recursed past the limit
    ('{"name": "calculator", "arguments": ' + nested(600) + "}", "bad_arguments"),
    ('{"name": "calculator", "arguments": ' + nested(MAX_ARGUMENT_DEPTH + 1) + "}", "bad_arguments"),
    ('{"name": "calculator", "arguments": {"x": "' + "1" * MAX_CALL_CHARS + '"}}', "bad_arguments"),
])
def test_parse_errors_name_their_kind(body, kind):
    parsed = parse_call(call(body))
    assert isinstance(parsed, CallError) and parsed.kind == kind and parsed.message.startswith("error: ")
    assert len(parsed.message) < 200  # one short line for the model, never the call echoed back


def test_arguments_as_deep_as_the_bound_are_a_call():
    parsed = parse_call(call('{"name": "f", "arguments": ' + nested(MAX_ARGUMENT_DEPTH) + "}"))
    assert isinstance(parsed, ToolCall)


# --- executing a round -----------------------------------------------------------------------------

def test_calculator_answers_and_refuses_what_is_not_arithmetic():
    ok, bad, huge = run([ToolCall("calculator", {"expression": "(2 + 3) * 4"}),
                         ToolCall("calculator", {"expression": "__import__('os').getcwd()"}),
                         ToolCall("calculator", {"expression": "9 ** 9 ** 9"})])
    assert (ok.text, ok.error) == ("20", None)
    assert bad.error == "raised" and "not arithmetic" in bad.text
    assert huge.error == "raised" and "exponent too large" in huge.text
    # powers chained under the exponent bound: each step is refused once it passes 4096 bits
    [chained] = run([ToolCall("calculator", {"expression": "((10 ** 100) ** 100) ** 100"})])
    assert chained.error == "raised" and "result too large" in chained.text, chained


def test_unknown_tool_lists_the_tools():
    [r] = run([ToolCall("search", {"q": "x"})])
    assert r.error == "unknown_tool"
    assert r.text == "error: unknown tool 'search'; tools: calculator"


def test_bad_arguments_are_an_error_message():
    [r] = run([ToolCall("calculator", {"expr": "1"})])
    assert r.error == "bad_arguments" and r.text.startswith("error: bad arguments for 'calculator'")


def test_a_parse_error_becomes_its_result():
    [r] = run([CallError("bad_json", "error: the call is not valid JSON (x)")])
    assert (r.text, r.error) == ("error: the call is not valid JSON (x)", "bad_json")


def test_a_tool_that_raises():
    def broken(x: str) -> str:
        raise RuntimeError("disk on fire")

    [r] = run([ToolCall("broken", {"x": "1"})], function_tool(broken))
    assert r.error == "raised" and r.text == "error: 'broken' raised RuntimeError: disk on fire"


def test_a_tool_that_hangs_times_out_and_the_round_goes_on():
    release = threading.Event()

    def hang() -> str:
        release.wait(60)
        return "late"

    try:
        hung, ok = run([ToolCall("hang", {}), ToolCall("calculator", {"expression": "2*3"})],
                       function_tool(hang), *resolve(["calculator"]), timeout_s=0.2)
    finally:
        release.set()
    assert hung.error == "timeout" and hung.text == "error: 'hang' timed out after 0.2 s"
    assert ok.text == "6"


def test_an_async_tool_that_hangs_is_cancelled():
    cancelled = threading.Event()

    async def slow() -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    [r] = run([ToolCall("slow", {})], function_tool(slow), timeout_s=0.1)
    assert r.error == "timeout" and cancelled.is_set()


def test_megabytes_of_output_are_cut_with_a_marker():
    def flood() -> str:
        return "x" * 5_000_000

    [r] = run([ToolCall("flood", {})], function_tool(flood), max_output_chars=100)
    assert r.error == "truncated"
    assert r.text == "x" * 100 + "... [truncated: 4999900 more characters]"


def test_an_error_message_is_cut_too():
    [r] = run([ToolCall("x" * 500, {})], max_output_chars=30)
    assert r.error == "unknown_tool" and len(r.text) < 80 and r.text.endswith("more characters]")


def test_async_tool():
    async def echo(text: str) -> str:
        await asyncio.sleep(0)
        return text.upper()

    [r] = run([ToolCall("echo", {"text": "hi"})], function_tool(echo))
    assert (r.text, r.error) == ("HI", None)


def test_a_rounds_calls_run_at_the_same_time():
    # Each call waits until all four are inside the tool at once: run one after another, they would
    # break the barrier (its timeout is far beyond any slowness of the machine) and report errors.
    barrier = threading.Barrier(4, timeout=60)

    def meet(i: int) -> str:
        barrier.wait()
        return str(i)

    results = run([ToolCall("meet", {"i": i}) for i in range(4)], function_tool(meet), timeout_s=120)
    assert [r.text for r in results] == ["0", "1", "2", "3"]


def test_max_concurrency_bounds_the_calls_in_flight():
    lock, inside, peak = threading.Lock(), [0], [0]

    def work() -> str:
        with lock:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        time.sleep(0.02)
        with lock:
            inside[0] -= 1
        return "ok"

    results = run([ToolCall("work", {}) for _ in range(6)], function_tool(work), max_concurrency=2)
    assert [r.text for r in results] == ["ok"] * 6 and peak[0] <= 2


def test_a_calls_seconds_are_its_own_not_the_time_its_round_took_around_it():
    """tools/seconds sums each call's own time. An async tool that blocks the event loop for 0.3 s delays
    every other call of the round; an instant call next to it still ran for almost nothing."""
    async def hog() -> str:
        time.sleep(0.3)  # blocks the loop (a badly written async tool)
        return "done"

    async def instant() -> str:
        return "ok"

    slow, quick = run([ToolCall("hog", {}), ToolCall("instant", {})], function_tool(hog), function_tool(instant))
    assert slow.seconds >= 0.3
    assert quick.seconds < 0.1, quick.seconds


def test_stats_count_calls_and_errors_by_kind():
    stats = ToolStats()
    stats.add(run([ToolCall("calculator", {"expression": "1"}), ToolCall("nope", {}), ToolCall("nope", {})]))
    metrics = stats.metrics()
    assert metrics["tools/calls"] == 3 and metrics["tools/errors/unknown_tool"] == 2
    assert "tools/errors/raised" not in metrics and metrics["tools/seconds"] >= 0


# --- choosing tools --------------------------------------------------------------------------------

def test_unknown_tool_name_is_a_config_error_listing_the_tools():
    expected = (r"tools.names: 'nope' is not allowed; choose one of: calculator, run_python, run_tests; "
                r".*module:function")
    with pytest.raises(ConfigError, match=expected):
        resolve(["nope"], "tools.names")


def test_module_function_and_module_tool():
    tool = Tool("shout", {"name": "shout"}, str.upper)
    import tests.test_tools as here

    here.SHOUT = tool
    by_fn, by_tool = resolve(["magrpo.tools:calculator", "tests.test_tools:SHOUT"])
    assert by_fn.name == "calculator" and by_fn.schema["parameters"]["required"] == ["expression"]
    assert by_tool is tool
    with pytest.raises(ConfigError, match="has no Tool or function 'missing'"):
        resolve(["magrpo.tools:missing"])


def test_tools_on_the_command_line(run_cli):
    code, lines = run_cli("tools=[nope]")
    assert code == 2 and "tools.names" in lines[-1] and "calculator" in lines[-1]


def test_no_tools_configured_means_no_tool_loop():
    with Toolbox.open(TrainConfig().tools) as box:
        assert not box and box.schemas == ()


# --- the loop --------------------------------------------------------------------------------------

CALC = call('{"name": "calculator", "arguments": {"expression": "6*7"}}')


def settings(max_calls=4):
    return Toolbox(tuple(resolve(["calculator"])), max_calls, 5.0, 1000, 8)


def loop(backend, max_new_tokens=400, max_calls=4, k=3, stats=None):
    requests = [GenerationRequest("P", agent=0, n=k, seed=7)]
    params = SamplingParams(max_new_tokens=max_new_tokens, logprobs=True)
    return generate_with_tools(backend, requests, params, settings(max_calls), backend.encode, stats or ToolStats())


def test_a_call_is_run_its_result_spliced_in_masked_and_generation_resumes():
    backend = ToolScriptBackend([CALC, " So it is 42."])
    stats = ToolStats()
    [[c, *_]] = loop(backend, stats=stats)
    tool = response_text("42")
    assert c.text == CALC + tool + " So it is 42."
    assert c.token_ids == ToolScriptBackend.ids(0, c.text) and c.finished
    # model_mask False exactly on the tool message's tokens; log-probs for model tokens only
    assert c.model_mask == [True] * len(CALC) + [False] * len(tool) + [True] * len(" So it is 42.")
    assert len(c.logprobs) == len(CALC) + len(" So it is 42.")
    assert c.prompt_ids == [1]  # the prompt, not the resumed turn
    assert stats.calls == 3 and not stats.errors


def test_each_completion_records_its_calls_for_envs_feedback_and_metrics():
    from magrpo.trainer import turn_tool_metrics

    backend = ToolScriptBackend([call('{"name": "nope", "arguments": {}}'), CALC, " So it is 42."])
    [[c, *_]] = loop(backend, k=2)
    assert [(r["name"], r["arguments"], r["output"], r["error"]) for r in c.tool_calls] == [
        ("nope", {}, "error: unknown tool 'nope'; tools: calculator", "unknown_tool"),
        ("calculator", {"expression": "6*7"}, "42", None)]
    plain = ToolScriptBackend(["The answer is 42."])
    [[quiet, *_]] = loop(plain)
    assert quiet.tool_calls == []
    metrics = turn_tool_metrics(1, [c, quiet])
    assert (metrics["tools/turn_1/calls"], metrics["tools/turn_1/errors"], metrics["tools/turn_1/call_rate"]) == \
        (2, 1, 0.5)
    assert metrics["train/turn_1/masked_token_share"] == (len(c.model_mask) - sum(c.model_mask)) / (
        len(c.token_ids) + len(quiet.token_ids))
    assert turn_tool_metrics(0, [quiet]) == {}  # no tools, no new rows


def test_resuming_a_turn_keeps_the_requests_own_continuation():
    backend = ToolScriptBackend([CALC, " done"])
    requests = [GenerationRequest("P", agent=0, n=1, seed=7, continuation=(5, 6))]
    generate_with_tools(backend, requests, SamplingParams(max_new_tokens=400), settings(), backend.encode, ToolStats())
    _, [resumed] = backend.calls
    assert resumed.continuation[:2] == (5, 6)  # a conversation's earlier turns, then this turn's tokens
    assert resumed.continuation[2:] == tuple(ToolScriptBackend.ids(0, CALC + response_text("42")))


def test_all_branches_resume_in_one_generate_call_on_streams_of_their_own():
    backend = ToolScriptBackend([CALC, " done"])
    loop(backend, k=3)
    first, resumed = backend.calls
    assert backend.generate_calls == 2 and len(resumed) == 3 and all(r.n == 1 for r in resumed)
    assert len({r.seed for r in resumed} | {first[0].seed}) == 4


def test_a_turn_without_a_call_is_one_generate_call_and_unmasked():
    backend = ToolScriptBackend(["The answer is 42."])
    [[c, *_]] = loop(backend)
    assert backend.generate_calls == 1 and c.model_mask is None and c.text == "The answer is 42."


def test_max_calls_ends_the_turn():
    backend = ToolScriptBackend([CALC])  # calls again after every result
    [[c, *_]] = loop(backend, max_calls=2)
    assert backend.generate_calls == 3 and c.text.count("<tool_response>") == 2 and not c.finished


def test_call_rate_counts_completions_with_a_call_once_however_many_calls():
    stats = ToolStats()
    loop(ToolScriptBackend([CALC]), max_calls=2, k=3, stats=stats)  # 3 completions, 2 calls each
    loop(ToolScriptBackend(["The answer is 42."]), k=1, stats=stats)  # 1 completion, no call
    assert (stats.completions, stats.calling, stats.calls) == (4, 3, 6)
    assert stats.metrics()["tools/call_rate"] == 0.75
    assert "tools/call_rate" not in ToolStats().metrics()  # no completion generated: no rate


def test_a_bad_call_gets_an_error_message_and_the_turn_goes_on():
    backend = ToolScriptBackend([call('{"name": "calculator", "arguments": {'), " sorry"])
    stats = ToolStats()
    [[c, *_]] = loop(backend, k=1, stats=stats)
    assert "error: the call is not valid JSON" in c.text and c.text.endswith(" sorry")
    assert stats.errors == {"bad_json": 1}


@pytest.mark.parametrize("max_new_tokens", [len(CALC) + 5, len(CALC) + 40, len(CALC) + 45])
def test_the_turn_never_exceeds_its_token_budget(max_new_tokens):
    backend = ToolScriptBackend([CALC, " So it is 42, as the calculator says."])
    [[c, *_]] = loop(backend, max_new_tokens=max_new_tokens)
    assert len(c.token_ids) <= max_new_tokens and not c.finished
    assert c.token_ids == ToolScriptBackend.ids(0, c.text)  # a tool message is whole or absent
    if len(CALC) + len(response_text("42")) >= max_new_tokens:  # no room to read the result: ends at its call
        assert c.text == CALC and c.model_mask is None and backend.generate_calls == 1
    else:
        assert len(c.logprobs) == sum(c.model_mask) < len(c.token_ids)


def test_only_tools_max_concurrency_may_change_on_resume(make_cfg):
    from magrpo.checkpoint import config_changes

    stored = asdict(make_cfg("tools=[calculator]"))
    assert config_changes(stored, asdict(make_cfg("tools=[calculator]", "tools.max_concurrency=2"))) == {}
    assert list(config_changes(stored, asdict(make_cfg("tools=[calculator]", "tools.timeout_s=2")))) == \
        ["tools.timeout_s"]


def test_tools_compose_from_names_and_modules(run_cli, make_cfg):
    assert make_cfg("tools=[calculator]", "backend=vllm").tools.names == ["calculator"]  # vllm runs tools too
    cfg = make_cfg("tools=[calculator]", "tools.max_calls=2")
    assert cfg.tools.names == ["calculator"] and cfg.tools.max_calls == 2
    assert make_cfg("tools.names=[magrpo.tools:calculator]").tools.names == ["magrpo.tools:calculator"]
    code, lines = run_cli("tools.timeout_s=0")
    assert code == 2 and "tools.timeout_s" in lines[-1]


# --- the hf backend: a stop string and a resumed turn ----------------------------------------------

@pytest.fixture(scope="module")
def tiny_backend():
    import torch

    from magrpo.backends.hf import HFBackend
    from magrpo.models import load_agents
    from tests.conftest import SMALL, compose

    torch.manual_seed(0)  # peft draws the adapter's A at load: the same agent in every process
    return HFBackend(load_agents(compose([*SMALL, "lora.r=4"]), 1))


def test_hf_stops_at_a_stop_string_and_keeps_it(tiny_backend):
    req = GenerationRequest("Write some code.", agent=0, n=2, seed=3)
    params = SamplingParams(max_new_tokens=24, logprobs=True)
    full = tiny_backend.generate([req], params)[0]
    tok = tiny_backend.agents[0].tokenizer
    # A stop string the sample writes (its 5th..7th tokens' text): it must end there, that text kept.
    text = tok.decode(full[0].token_ids)
    stop = tok.decode(full[0].token_ids[4:7]).strip() or text[-3:]
    stopped = tiny_backend.generate([req], SamplingParams(max_new_tokens=24, logprobs=True, stop=(stop,)))[0]
    assert len(stopped[0].token_ids) <= 7 and not stopped[0].finished
    for before, after in zip(full, stopped):
        head = tok.decode(after.token_ids)
        n = len(after.token_ids)
        assert after.token_ids == before.token_ids[:n] and after.logprobs == pytest.approx(before.logprobs[:n])
        if stop in tok.decode(before.token_ids):
            assert stop in head and stop not in tok.decode(after.token_ids[:-1]) and not after.finished


def test_hf_continuation_resumes_the_same_greedy_turn(tiny_backend):
    params = SamplingParams(max_new_tokens=12, greedy=True)
    [[whole]] = tiny_backend.generate([GenerationRequest("Hello", agent=0, n=1)], params)
    head = tuple(whole.token_ids[:5])
    [[rest]] = tiny_backend.generate([GenerationRequest("Hello", agent=0, n=1, continuation=head)],
                                     SamplingParams(max_new_tokens=7, greedy=True))
    assert rest.prompt_ids == whole.prompt_ids + list(head)
    assert list(head) + rest.token_ids == whole.token_ids


def test_tool_backend_implements_the_whole_protocol():
    from magrpo.tool_loop import ToolBackend
    from tests.test_backend_interface import attributes_set_by_init, protocol_members

    methods, attributes = protocol_members()
    assert methods | attributes <= attributes_set_by_init(ToolBackend)


def test_make_backend_wraps_only_when_tools_are_configured(make_cfg):
    from magrpo.backends import make_backend
    from magrpo.backends.hf import HFBackend
    from magrpo.tool_loop import ToolBackend

    assert type(make_backend(make_cfg(), [])) is HFBackend
    cfg = make_cfg("tools=[calculator]")
    with Toolbox.open(cfg.tools) as box:
        assert type(make_backend(cfg, [], box)) is ToolBackend
        assert type(make_backend(cfg, [])) is HFBackend  # no toolbox, no tools


@pytest.mark.slow
def test_a_training_run_calls_tools_and_masks_their_output(make_cfg, monkeypatch):
    """The tiny model never writes `<tool_call>`: here any text ending in "e" is a call of the
    calculator, so a real run stops, calls, resumes, masks and updates through the hf backend."""
    import json

    import magrpo.tool_loop
    from magrpo.trainer import train

    monkeypatch.setattr(magrpo.tool_loop, "CALL_END", "e")
    monkeypatch.setattr(magrpo.tool_loop, "parse_call", lambda text: (
        ToolCall("calculator", {"expression": "6*7"}) if text.endswith("e") else None))
    run = train(make_cfg("tools=[calculator]", "tools.max_calls=2", "generation.max_new_tokens=24"))
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert all(m["tools/calls"] > 0 and m["tools/call_rate"] > 0 for m in metrics)
    assert any(m["train/agent_0/masked_token_share"] > 0 for m in metrics)
    assert all(m["tools/turn_0/calls"] > 0 and 0 < m["tools/turn_0/call_rate"] <= 1 for m in metrics)
    assert any(m["train/turn_0/masked_token_share"] > 0 for m in metrics)
    assert "<tool_response>\\n42\\n</tool_response>" in (run / "rollouts.jsonl").read_text()


CALC_SCHEMAS = tuple(t.schema for t in resolve(["calculator"]))


def test_a_template_without_tools_gets_them_described_in_the_prompt(tiny_backend):
    from dataclasses import replace

    agent = tiny_backend.agents[0]
    assert "tools" not in str(agent.tokenizer.chat_template)
    with_tools = replace(agent, tool_schemas=CALC_SCHEMAS)
    assert with_tools.format_prompt("Add.") == agent.format_prompt(
        "You may call these tools, one at a time, by writing <tool_call>{\"name\": NAME, \"arguments\": {...}}"
        "</tool_call>; the result follows in <tool_response>:\n" + json.dumps(CALC_SCHEMAS[0]) + "\n\nAdd.")


def test_a_template_that_takes_tools_shows_them_itself(tiny_backend, monkeypatch):
    from dataclasses import replace

    agent = replace(tiny_backend.agents[0], tool_schemas=CALC_SCHEMAS, use_chat_template=True)
    monkeypatch.setattr(agent.tokenizer, "chat_template",
                        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}")
    assert agent.format_prompt("Add.") == "[calculator]Add."
    assert replace(agent, tool_schemas=()).format_prompt("Add.") == "Add."


def test_load_agents_gives_every_agent_the_toolboxs_schemas(make_cfg):
    from magrpo.models import load_agents

    cfg = make_cfg("tools=[calculator]")
    with Toolbox.open(cfg.tools) as box:
        assert box.schemas == CALC_SCHEMAS
        assert [a.tool_schemas for a in load_agents(cfg, 2, box.schemas)] == [CALC_SCHEMAS] * 2


def test_every_completion_is_the_text_of_its_tokens_when_branches_resume_with_unequal_room():
    """Resumed branches share one generate call; each has its own room left. The call used to ask for
    the largest and cut each branch's ids to its own, keeping the whole text: the env and feedback then
    scored text the model never sampled (the branch with less room read 'So it is 42.' that it did not
    write)."""
    short_call = call('{"name": "calculator", "arguments": {"expression": "1"}}')
    long_call = call('{"name": "calculator", "arguments": {"expression": "1 + 1 + 1 + 1 + 1 + 1"}}')
    answer = " So it is " + "forty-two, " * 10 + "done."
    backend = ToolScriptBackend({"A": [short_call, answer], "B": [long_call, answer]})
    requests = [GenerationRequest(p, agent=0, n=1, seed=7) for p in ("A", "B")]
    room = len(long_call) + len(response_text("6")) + 20
    [[a], [b]] = generate_with_tools(backend, requests, SamplingParams(max_new_tokens=room), settings(),
                                     backend.encode, ToolStats())
    for c in (a, b):
        assert c.text == "".join(map(chr, c.token_ids)) and len(c.token_ids) == room and not c.finished
    _, resumed = backend.calls
    assert [r.max_new_tokens for r in resumed] == [room - len(short_call) - len(response_text("1")), 20]


def test_a_stray_end_marker_is_a_counted_bad_json_call_and_the_turn_goes_on():
    """Generation pauses at </tool_call>. Written in prose or code with no <tool_call> before it, it
    used to end the turn there as if cut at its budget (not finished), with no metric."""
    stray = "The closing tag is </tool_call>"
    assert parse_call(stray) == CallError("bad_json", parse_call(stray).message)
    assert "</tool_call> ends no call" in parse_call(stray).message
    backend = ToolScriptBackend([stray, " and that is all."])
    stats = ToolStats()
    [[c]] = loop(backend, k=1, stats=stats)
    assert c.finished and c.text.endswith(" and that is all.")
    assert stats.metrics()["tools/errors/bad_json"] == 1


def test_a_run_with_tools_logs_every_turns_tool_metrics_zero_where_nothing_was_called():
    """A turn without a call logged no tools/turn_t/* at all: a dashboard's curve skipped those steps."""
    from magrpo.trainer import turn_tool_metrics

    [[quiet]] = loop(ToolScriptBackend(["The answer is 42."]), k=1)
    metrics = turn_tool_metrics(1, [quiet], tools=True)
    assert {key: metrics[key] for key in ("tools/turn_1/calls", "tools/turn_1/errors", "tools/turn_1/call_rate",
                                          "train/turn_1/masked_token_share")} == dict.fromkeys(
        ["tools/turn_1/calls", "tools/turn_1/errors", "tools/turn_1/call_rate", "train/turn_1/masked_token_share"], 0)
