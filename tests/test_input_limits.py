"""No input can take the machine's memory: a huge problem record stops at start-up, a huge prompt
from a feedback function stops the run naming it, and a data file is read line by line with a
line-length limit (a UTF-8 byte-order mark accepted). Each is one line naming the limit."""
from __future__ import annotations

import gzip
import json
import tracemalloc

import pytest

from magrpo.config import ExternalConfig
from magrpo.errors import ConfigError, FeedbackError
from magrpo.feedback import Feedback
from magrpo.inputs import jsonl_lines
from magrpo.rollout import expand_trees
from magrpo.trainer import prepare
from tests.fakes import PROBLEMS, SAMPLING, FakeBackend, FakeEnv, tree_settings

HUGE = {"prompt": "P2", "offset": 0.0, "tests": ["x" * 600, "y" * 600]}  # 1,219 characters, keys included


def test_a_huge_problem_record_stops_at_start_up_naming_it(make_cfg):
    """A 60 MB record used to grow the process to 24 GB until the OOM killer ended it, printing nothing."""
    from magrpo.envs.length_ratio import LengthRatioEnv

    env = LengthRatioEnv(LengthRatioEnv.Config())
    env.problems = lambda split: [*PROBLEMS, HUGE]
    with pytest.raises(ConfigError) as e:
        prepare(make_cfg("limits.max_problem_chars=1000", "eval.at_end=false"), env)
    assert str(e.value) == ("limits.max_problem_chars: problem 2 of the train split ('P2') holds 1,219 characters of "
                            "text, more than 1,000; fix the data, or raise the limit (0 = none)")
    # 0: no limit (its PROBLEMS lack the env's own fields, so its prompts are not written either)
    prepare(make_cfg("limits.max_problem_chars=0", "limits.max_prompt_chars=0", "eval.at_end=false"), env)


def test_a_huge_turn0_prompt_from_a_small_record_stops_at_start_up_naming_the_env(make_cfg):
    """The record limit cannot see a prompt the env builds from a small record (a template repeating a
    field): the env's own prompts are measured at start-up too."""
    from magrpo.envs.length_ratio import LengthRatioEnv

    env = LengthRatioEnv(LengthRatioEnv.Config())
    env.agent_prompts = lambda problem: [problem["prompt"] * 3000] * env.num_agents
    with pytest.raises(ConfigError, match=r"^limits.max_prompt_chars: .*LengthRatioEnv.agent_prompts wrote [\d,]+ "
                                          r"characters for agent 0 on train problem 0, more than 2,000"):
        prepare(make_cfg("limits.max_prompt_chars=2000", "eval.at_end=false"), env)
    prepare(make_cfg("limits.max_prompt_chars=0", "eval.at_end=false"), env)  # 0: no limit


def test_a_huge_feedback_prompt_names_the_function():
    env = FakeEnv(2)

    def verbose(**kw):
        return ["ok", "z" * 2001]

    feedback = Feedback(ExternalConfig(), env, verbose, max_prompt_chars=2000)
    with pytest.raises(FeedbackError) as e:
        expand_trees(PROBLEMS, env, FakeBackend(), feedback, tree_settings(num_generations=2, num_turns=2), SAMPLING)
    assert str(e.value) == ("feedback function 'verbose' (tests.test_input_limits.test_a_huge_feedback_prompt_names_the"
                            "_function.<locals>.verbose) returned a prompt of 2,001 characters for agent 1, more than "
                            "limits.max_prompt_chars=2,000; return shorter prompts, or raise the limit (0 = none)")


@pytest.mark.parametrize("key", ["limits.max_problem_chars", "limits.max_prompt_chars"])
def test_a_negative_limit_is_one_line(run_cli, key):
    from tests.conftest import SMALL

    code, err = run_cli(*SMALL, f"{key}=-1")
    assert code == 2 and err == [f"config error: {key}: must be >= 0, got -1 (0 = no limit)"]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_a_huge_line_is_refused_after_reading_only_the_limit(tmp_path, suffix):
    path = tmp_path / f"data{suffix}"
    opener = gzip.open if suffix.endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(b'{"a": 1}\n{"b": "' + b"x" * (8 * 2**20) + b'"}\n')
    tracemalloc.start()
    with pytest.raises(ConfigError) as e:
        list(jsonl_lines(path, "env.train_split", max_line_bytes=2**20))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert str(e.value) == (f"env.train_split: {path} line 2 is longer than 1,048,576 bytes; split or shorten that "
                            f"record (nothing was read past its first 1,048,576 bytes)")
    assert peak < 4 * 2**20  # the 8 MB line was never held


def test_a_byte_order_mark_is_accepted_and_blank_lines_skipped(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes("\ufeff".encode() + b'{"a": 1}\n\n{"b": 2}')
    assert [(n, json.loads(text)) for n, text in jsonl_lines(path, "k")] == [(1, {"a": 1}), (3, {"b": 2})]


def test_a_line_of_exactly_the_limit_is_read(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'"' + b"x" * 8 + b'"\n')  # 10 bytes and its newline
    assert list(jsonl_lines(path, "k", max_line_bytes=10)) == [(1, '"xxxxxxxx"\n')]


def test_a_file_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": "\xff"}\n')
    with pytest.raises(ConfigError, match=r"^k: .*data.jsonl line 2 is not UTF-8 \(byte 7\); save the file as UTF-8$"):
        list(jsonl_lines(path, "k"))
