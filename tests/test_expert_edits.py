"""expert_edits end to end: the openai backend against a real local server (concurrent requests,
fallbacks counted, key refused at start-up), and training runs with the reference expert."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from magrpo.config import ExpertConfig, ExternalConfig
from magrpo.feedback import Branch, Feedback
from magrpo.trainer import train
from tests.conftest import ROOT, SMALL
from tests.openai_server import CHAT, HANG, MODELS, Reply

pytest.importorskip("openai")

AUX = "def aux(x):\n    return x - int(x)\n"
MAIN = "def truncate_number(number: float) -> float:\n    aux(number)\n    return number + 1\n"
# braces inside the code strings, prose and a fence around the object
EDITS = ('Here you go:\n```json\n{"aux": "def aux(x):\\n    return {0: x % 1.0}[0]", '
         '"main": "def truncate_number(number: float) -> float:\\n    parts = {\\"frac\\": aux(number)}\\n'
         '    return parts[\\"frac\\"]"}\n```')
CODE_RUN = ["env=code", "model=tiny", "env.train_split='test[:2]'", "env.eval_split='test[2:3]'",
            "generation.max_new_tokens=16", "trainer.steps=1", "eval.num_samples=1"]


@pytest.fixture(scope="module")
def env(truncate_env):
    return truncate_env


def openai_feedback(env, url, tmp_path, **expert):
    settings = dict(backend="openai", base_url=url, timeout_s=0.5, max_retries=1, backoff_s=0.01,
                    cache=str(tmp_path / "cache.sqlite"))
    feedback = Feedback(ExternalConfig(mode="expert_edits", expert=ExpertConfig(**{**settings, **expert})), env)
    feedback.check()
    return feedback


def branches(env, count):
    problem = env.problems("train")[0]
    first = env.agent_prompts(problem)
    mains = [MAIN.replace("+ 1", f"+ {i + 1}") for i in range(count)]  # distinct code: distinct expert prompts
    scored = env.score([problem] * count, [[AUX, main] for main in mains])
    return [Branch(problem["prompt"], [AUX, main], [[p] for p in first], [[AUX], [main]], dict(s.context))
            for main, s in zip(mains, scored)]


def test_openai_expert_edits_reach_the_prompts_and_requests_overlap(env, server, tmp_path):
    # One turn's requests run together: the server sees several in flight at once while each waits out its
    # delay. (A wall-clock bound here failed on a busy 2-core machine: 0.61-0.71 s against 0.6 s.)
    server.delay, server.answer = 0.5, lambda prompt: EDITS
    feedback = openai_feedback(env, server.url, tmp_path, timeout_s=5.0)
    out = feedback(branches(env, 6))
    assert server.max_inflight >= 3
    assert "proposes this `truncate_number`:\n```python\ndef truncate_number(number: float) -> float:\n" \
           "    parts = {\"frac\": aux(number)}\n    return parts[\"frac\"]\n```" in out[0][1]
    assert "proposes this `aux`:\n```python\ndef aux(x):\n    return {0: x % 1.0}[0]\n```" in out[0][0]
    request = server.chat_requests()[0]["json"]["messages"][0]["content"]
    assert "0/3 passed; first failing test: assert candidate(3.5) == 0.5" in request and '"aux", "main"' in request
    m = feedback.metrics()
    assert m["expert/calls"] == 6 and m["expert/fallbacks"] == 0 and m["expert/reference"] == 0.0


@pytest.mark.parametrize("failure", [Reply(status=500), Reply(delay=1.0)], ids=["500", "timeout"])
def test_failing_requests_are_retried_then_fall_back_to_level_feedback(env, server, tmp_path, failure):
    server.answer = lambda prompt: EDITS
    feedback = openai_feedback(env, server.url, tmp_path)
    server.script(CHAT, failure, failure)  # first try and its one retry
    (out,) = feedback(branches(env, 1))
    assert len(server.chat_requests()) == 2
    assert "Feedback on the combined program:\n" in out[1] and "expert" not in out[1]
    m = feedback.metrics()
    assert m["expert/failures"] == 1 and m["expert/retries"] == 1 and m["expert/fallbacks"] == 1


def test_unparsable_reply_falls_back_and_the_cache_serves_repeats(env, server, tmp_path):
    feedback = openai_feedback(env, server.url, tmp_path)  # default answer: not JSON
    (out,) = feedback(branches(env, 1))
    assert "Feedback on the combined program:" in out[1]
    assert feedback.metrics()["expert/fallbacks"] == 1
    server.answer = lambda prompt: EDITS
    again = openai_feedback(env, server.url, tmp_path)
    again(branches(env, 1))  # same prompt: served from the cache, even though the server now answers
    assert len(server.chat_requests()) == 1
    assert again.metrics()["expert/cache_hits"] == 1


def run_cli(tmp_path, *overrides):
    env = dict(os.environ, HF_HUB_OFFLINE="1", MAGRPO_EXPERT_TEST_KEY="sk-wrong")
    cmd = [sys.executable, "train.py", *SMALL, *CODE_RUN, f"logging.run_dir={tmp_path / 'run'}", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_rejected_key_stops_at_start_up_with_one_line(server, tmp_path):
    server.script(MODELS, Reply(status=401))
    proc = run_cli(tmp_path, "external=expert_edits", f"external.expert.base_url={server.url}",
                   "external.expert.api_key_env=MAGRPO_EXPERT_TEST_KEY")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("config error: external.expert.api_key_env:") and "401" in lines[0]
    assert server.requests[0]["headers"]["authorization"] == "Bearer sk-wrong"
    assert not (tmp_path / "run").exists()  # nothing trained, no run directory


@pytest.mark.slow
def test_training_with_the_openai_expert_logs_expert_metrics(server, tmp_path):
    server.answer = lambda prompt: EDITS
    proc = run_cli(tmp_path, "external=expert_edits", f"external.expert.base_url={server.url}",
                   f"external.expert.cache={tmp_path / 'cache.sqlite'}", "eval.at_end=false")
    assert proc.returncode == 0, proc.stderr
    (metrics,) = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    # 2 trees x K=2 expanding branches at turn 0: one request each unless two prompts coincide
    assert metrics["expert/calls"] + metrics["expert/cache_hits"] == 4 and metrics["expert/fallbacks"] == 0
    config = json.load(open(tmp_path / "run" / "config.json"))
    assert config["external"]["expert"]["backend"] == "openai" and config["external"]["expert"]["model"] == "fake-model"


COOLDOWN_S = 3600  # longer than any run of the test below


@pytest.mark.slow
def test_training_against_a_hung_expert_finishes_with_bounded_feedback_time(server, tmp_path):
    """A server that accepts requests and never answers (defaults: 60 s x 4 attempts per request, per
    turn): the first turn ends at the 2 s turn deadline and opens the breaker, later turns send nothing.
    The cool-down outlasts the run: a background probe (sent once a cool-down ends, and still hanging
    when the run stops) would be a fifth request whenever a slow machine made the run last longer
    than the default 30 s."""
    server.fault = HANG
    start = time.monotonic()
    proc = run_cli(
        tmp_path,
        "external=expert_edits",
        f"external.expert.base_url={server.url}",
        "external.expert.cache=off",
        "external.expert.turn_deadline_s=2",
        "external.expert.breaker_failures=2",
        f"external.expert.breaker_cooldown_s={COOLDOWN_S}",
        "trainer.steps=3",
        "eval.at_end=false",
    )
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - start < 120  # the model load and 3 tiny steps; no 4-minute expert turns
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["expert/fallbacks"] for m in metrics] == [4, 4, 4]  # every branch got the level_feedback prompt
    assert metrics[0]["perf/feedback_s"] < 10  # loosely: the 2 s deadline
    for m in metrics[1:]:  # the breaker is open: no request, no waiting
        assert m["expert/breaker_open"] == 4 and m["perf/feedback_s"] < 2
    assert len(server.chat_requests()) == sum(m["expert/calls"] for m in metrics) == 4


def test_default_expert_is_the_offline_reference_and_the_run_says_so(make_cfg, capsys):
    run = train(make_cfg(*CODE_RUN, "external=expert_edits", "trainer.num_turns=2"))
    assert "offline reference expert" in capsys.readouterr().err
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert metrics[-1]["expert/reference"] == 1.0 and metrics[-1]["expert/calls"] > 0
    assert json.load(open(run / "config.json"))["external"]["expert"]["backend"] == "reference"


def test_hf_expert_answers_a_turn_in_one_batch_and_caches(env, tmp_path):
    expert = ExpertConfig(backend="hf", model="tiny", max_tokens=8, cache=str(tmp_path / "cache.sqlite"))
    feedback = Feedback(ExternalConfig(mode="expert_edits", expert=expert), env)
    feedback.check()  # loads the model now: a bad name fails before training
    out = feedback(branches(env, 3))
    assert len(out) == 3 and all(len(prompts) == 2 for prompts in out)
    m = feedback.metrics()
    # a random tiny model writes no JSON: every branch falls back, and says so in the metrics
    assert m["expert/calls"] == 3 and m["expert/fallbacks"] == 3
    feedback(branches(env, 3))
    assert feedback.metrics()["expert/cache_hits"] == 3
