"""The tool-arithmetic env (envs/tool_arith.py) and its warm start's transcripts: fixed-length
problems, the answer format (a tool result never counts as the answer), the team reward."""
from __future__ import annotations

import random

import pytest

from magrpo.envs.tool_arith import ToolArithEnv, final_answer, product_pair
from magrpo.envs.tool_arith_warm import call_text, transcript
from magrpo.errors import ConfigError
from magrpo.tools import parse_call, response_text


def env(**kw):
    return ToolArithEnv(ToolArithEnv.Config(**kw))


def test_every_product_has_twice_the_digits_so_every_prompt_has_one_length():
    rng = random.Random(0)
    for digits in (2, 3, 4):
        pairs = [product_pair(rng, digits) for _ in range(200)]
        assert {(len(str(a)), len(str(b)), len(str(a * b))) for a, b in pairs} == {(digits, digits, 2 * digits)}
    prompts = {len(p) for problem in env().problems("train") for p in env().agent_prompts(problem)}
    assert prompts == {len("What is 47*86?")}


def test_the_splits_are_seeded_and_differ():
    assert env().problems("train") == env().problems("train")
    assert env().problems("train")[0]["pairs"] != env().problems("eval")[0]["pairs"]


def test_the_answer_is_the_last_answer_line_and_a_tool_result_never_counts():
    [problem] = env(train_size=1).problems("train")
    (a, b), = problem["pairs"]
    right = f"answer: {a * b}"
    tool_only = call_text(a, b) + response_text(str(a * b))
    texts = [right, f"answer: 1\n{right}", f"{right} answer: 1", tool_only, tool_only + right, "no answer"]
    assert env().rewards([problem] * len(texts), [[t] for t in texts]) == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert final_answer("answer:  -12") == -12 and final_answer("42") is None


def test_two_agents_each_get_their_own_product_and_share_the_reward():
    two = env(num_agents=2, train_size=1)
    [problem] = two.problems("train")
    (a, b), (c, d) = problem["pairs"]
    assert two.agent_prompts(problem) == [f"What is {a}*{b}?", f"What is {c}*{d}?"]
    assert two.rewards([problem], [[f"answer: {a * b}", "answer: 0"]]) == [0.5]


def test_bad_keys_are_config_errors():
    with pytest.raises(ConfigError, match="env.digits"):
        env(digits=1)


def test_a_warm_start_transcript_is_a_call_the_parser_reads_then_the_copied_answer():
    prompt, segments = transcript(random.Random(0), 1.0, 2)
    (call, by_model), (tool, by_tool), (answer, _) = segments
    a, b = map(int, prompt.rsplit("What is ", 1)[1].rstrip("?").split("*"))
    assert parse_call(call).arguments == {"expression": f"{a}*{b}"} and by_model and not by_tool
    assert tool == response_text(str(a * b)) and final_answer(answer) == a * b
    _, [(guess, _)] = transcript(random.Random(0), 0.0, 2)
    assert len(str(final_answer(guess))) == 4
