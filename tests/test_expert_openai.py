"""The expert client layer against a real HTTP server that speaks the OpenAI API (no mocks of openai)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("openai")

from magrpo.config import ExpertConfig
from magrpo.external.expert import ExpertCache, ExpertError, OpenAIExpert, open_cache, parse_edits
from magrpo.external.expert.breaker import CLOSED, OPEN, PROBE, Breaker
from tests.fakes import FakeClock
from tests.openai_server import CHAT, ERROR_500, GARBAGE, HANG, MODELS, Reply

ROOT = Path(__file__).resolve().parent.parent
def _expert(url: str, max_concurrency: int = 8, cache: ExpertCache | None = None, **cfg) -> OpenAIExpert:
    settings = dict(base_url=url, model="fake-model", timeout_s=5.0, max_retries=2, backoff_s=0.01,
                    api_key_env="MAGRPO_TEST_KEY")
    return OpenAIExpert(ExpertConfig(**{**settings, **cfg}), max_concurrency=max_concurrency, cache=cache)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- concurrency -------------------------------------------------------------------------------


def test_requests_overlap_up_to_max_concurrency(server):
    server.delay = 0.3
    prompts = [f"p{i}" for i in range(8)]
    replies = _expert(server.url, max_concurrency=8).complete(prompts)
    assert replies == [f"reply to: {p}" for p in prompts]  # order kept
    assert server.max_inflight >= 4  # they ran together (a wall-clock bound failed under load)


def test_max_concurrency_one_is_serial(server):
    server.delay = 0.05
    prompts = [f"p{i}" for i in range(4)]
    expert = _expert(server.url, max_concurrency=1)
    assert expert.complete(prompts) == [f"reply to: {p}" for p in prompts]
    assert server.max_inflight == 1
    assert expert.stats()["calls"] == 4


def test_identical_prompts_share_one_request(server):
    expert = _expert(server.url)
    assert expert.complete(["a", "b", "a"]) == ["reply to: a", "reply to: b", "reply to: a"]
    assert len(server.chat_requests()) == 2
    assert expert.stats()["cache_hits"] == 1


# --- retries -----------------------------------------------------------------------------------


@pytest.mark.parametrize("failure", [Reply(delay=0.6), Reply(status=500), Reply(status=503)],
                         ids=["timeout", "500", "503"])
def test_retryable_failure_is_retried_then_none(server, failure):
    server.script(CHAT, *[failure] * 3)
    expert = _expert(server.url, timeout_s=0.2, max_retries=2)
    assert expert.complete(["p"]) == [None]
    assert len(server.chat_requests()) == 3  # max_retries + 1
    stats = expert.stats()
    assert (stats["calls"], stats["failures"], stats["retries"]) == (1, 1, 2)


def test_rate_limit_then_success(server):
    server.script(CHAT, Reply(status=429))
    expert = _expert(server.url)
    assert expert.complete(["p"]) == ["reply to: p"]
    assert len(server.chat_requests()) == 2
    stats = expert.stats()
    assert (stats["calls"], stats["failures"], stats["retries"]) == (1, 0, 1)
    assert stats["latency_s_total"] > 0


@pytest.mark.parametrize("status", [400, 401, 404])
def test_client_error_is_not_retried(server, status):
    server.script(CHAT, Reply(status=status))
    expert = _expert(server.url, max_retries=3)
    assert expert.complete(["p"]) == [None]
    assert len(server.chat_requests()) == 1
    stats = expert.stats()
    assert (stats["failures"], stats["retries"]) == (1, 0)


NO_TEXT = {"choices": [{"index": 0, "message": {"role": "assistant", "content": None}, "finish_reason": "stop"}]}


@pytest.mark.parametrize("body", [NO_TEXT, {"choices": []}, {"unexpected": 1}, "an HTML page"],
                         ids=["null", "no-choices", "no-keys", "str"])
def test_malformed_success_counts_as_failure(server, body):
    server.script(CHAT, Reply(body=body))
    expert = _expert(server.url)
    assert expert.complete(["p"]) == [None]
    stats = expert.stats()
    assert (stats["failures"], stats["retries"]) == (1, 0)


def test_unreachable_server_fails_after_retries():
    expert = _expert(f"http://127.0.0.1:{_closed_port()}/v1", max_retries=1)
    assert expert.complete(["p"]) == [None]
    stats = expert.stats()
    assert (stats["failures"], stats["retries"]) == (1, 1)


def test_reset_stats(server):
    expert = _expert(server.url)
    expert.complete(["p"])
    expert.reset_stats()
    assert set(expert.stats().values()) == {0.0}


# --- faults: Retry-After, turn deadline, circuit breaker ---------------------------------------


def test_breaker_opens_after_consecutive_failures_and_probes_once_per_cooldown():
    clock = FakeClock()
    breaker = Breaker(3, 10.0, clock)
    assert [breaker.record(False) for _ in range(3)] == [False, False, True]  # the third opens it
    assert breaker.allow() == OPEN
    clock.now += 9.9
    assert breaker.allow() == OPEN
    clock.now += 0.2
    assert [breaker.allow(), breaker.allow()] == [PROBE, OPEN]  # one probe; the rest still fall back
    assert breaker.record(False) is False  # the probe failed: another cool-down, no new "opened"
    assert breaker.allow() == OPEN
    clock.now += 10.1
    assert breaker.allow() == PROBE
    breaker.record(True)
    assert breaker.allow() == CLOSED and breaker.failures == 0 and not breaker.is_open


def test_breaker_counts_only_consecutive_failures_and_zero_disables_it():
    breaker = Breaker(2, 10.0, FakeClock())
    for ok in (False, True, False, True, False):
        breaker.record(ok)
    assert breaker.allow() == CLOSED
    never = Breaker(0, 10.0, FakeClock())
    assert not any(never.record(False) for _ in range(50)) and never.allow() == CLOSED


def test_retry_after_is_honoured(server):
    server.script(CHAT, Reply(status=429, headers={"Retry-After": "1"}))
    expert = _expert(server.url, backoff_s=0.01)
    start = time.monotonic()
    assert expert.complete(["p"]) == ["reply to: p"]
    assert time.monotonic() - start >= 0.9  # the server's 1 s, not the 0.01 s backoff
    assert len(server.chat_requests()) == 2 and expert.stats()["retries"] == 1


def test_retry_after_forms():
    import email.utils
    from types import SimpleNamespace

    from magrpo.external.expert.openai_backend import _retry_after

    def error(value):
        return SimpleNamespace(response=SimpleNamespace(headers={"retry-after": value} if value is not None else {}))

    assert _retry_after(error("7")) == 7.0 and _retry_after(error("1.5")) == 1.5
    assert 25 < _retry_after(error(email.utils.formatdate(time.time() + 30, usegmt=True))) <= 30
    assert _retry_after(error(email.utils.formatdate(time.time() - 30, usegmt=True))) == 0.0  # in the past
    assert _retry_after(error("soon")) == _retry_after(error(None)) == _retry_after(SimpleNamespace()) == 0.0


def test_retry_after_beyond_the_turn_deadline_fails_at_once(server):
    server.script(CHAT, Reply(status=429, headers={"Retry-After": "30"}))
    expert = _expert(server.url, turn_deadline_s=3.0)
    start = time.monotonic()
    assert expert.complete(["p"]) == [None]
    assert time.monotonic() - start < 2.5  # no pointless wait for a retry that could not finish in time
    assert len(server.chat_requests()) == 1
    assert (expert.stats()["failures"], expert.stats()["retries"]) == (1, 0)


def test_garbage_reply_is_a_failure_not_an_exception(server):
    server.script(CHAT, GARBAGE)
    expert = _expert(server.url, max_concurrency=1)  # p gets the scripted garbage
    assert expert.complete(["p", "q"]) == [None, "reply to: q"]
    assert expert.stats()["failures"] == 1


def test_a_hung_server_costs_one_turn_at_most_the_deadline(server):
    server.fault = HANG
    expert = _expert(server.url, max_concurrency=2, timeout_s=60.0, max_retries=3, turn_deadline_s=1.0,
                     breaker_failures=0)
    start = time.monotonic()
    assert expert.complete([f"p{i}" for i in range(4)]) == [None] * 4
    assert time.monotonic() - start < 10  # 1 s deadline, loosely: never 60 s x 4 attempts
    # p0, p1 are cut off just before the deadline, without retries; p2, p3 never start
    assert len(server.chat_requests()) == 2
    stats = expert.stats()
    assert (stats["calls"], stats["failures"], stats["retries"], stats["late"]) == (2, 2, 0, 2)


# p0 tries twice, p1 once more: the breaker opens after 3 failed requests, p1 does not retry, p2.. are not
# sent. A garbage reply is not retried (like any malformed reply): p0, p1, p2 fail once each.
RETRIED = (2, 2, 1, 4)  # calls, failures, retries, breaker_open


def test_late_requests_count_as_failures_for_the_breaker(server):
    """A transport that ignores its timeout (a server trickling bytes) leaves requests running past
    the deadline; they still trip the breaker, so later turns do not wait for the deadline again."""
    expert = _expert(server.url, turn_deadline_s=0.5, breaker_failures=2)
    sent = []
    expert._request = lambda prompt, deadline, max_retries: sent.append(prompt) or time.sleep(3)  # never in time
    assert expert.complete(["a", "b"]) == [None, None]
    assert expert.stats()["late"] == 2 and expert.breaker.is_open
    assert expert.complete(["c"]) == [None]
    assert sent == ["a", "b"] and expert.stats()["breaker_open"] == 1  # "c" was not sent


@pytest.mark.parametrize("fault,counts", [(ERROR_500, RETRIED), (HANG, RETRIED), (GARBAGE, (3, 3, 0, 3)),
                                          (Reply(status=429, headers={"Retry-After": "0"}), RETRIED)],
                         ids=["500", "hang", "garbage", "429"])
def test_breaker_opens_falls_back_without_requests_then_probes_after_the_cooldown(server, fault, counts):
    server.fault = fault
    clock = FakeClock()
    expert = _expert(server.url, max_concurrency=1, max_retries=1, timeout_s=0.3, breaker_failures=3,
                     breaker_cooldown_s=30.0)
    expert.breaker.clock = clock
    assert expert.complete([f"p{i}" for i in range(6)]) == [None] * 6
    assert len(server.chat_requests()) == 3
    stats = expert.stats()
    assert (stats["calls"], stats["failures"], stats["retries"], stats["breaker_open"]) == counts
    assert expert.complete([f"q{i}" for i in range(6)]) == [None] * 6  # still cooling down: nothing sent
    assert len(server.chat_requests()) == 3 and expert.stats()["breaker_open"] == counts[3] + 6

    server.fault = None  # the server recovers
    clock.now += 31
    assert expert.complete(["r0"]) == [None]  # r0 probes in the background; its branch falls back
    expert.probe.join(10)
    assert len(server.chat_requests()) == 4 and not expert.breaker.is_open
    assert expert.complete(["r2"]) == ["reply to: r2"]


def test_dead_server_costs_nothing_per_turn_once_the_breaker_is_open(server):
    server.fault = HANG
    expert = _expert(server.url, timeout_s=0.5, max_retries=3, turn_deadline_s=30.0, breaker_failures=2)
    expert.complete([f"p{i}" for i in range(4)])  # 4 requests time out at about the same time: the breaker opens
    sent = len(server.chat_requests())
    assert expert.breaker.is_open and 4 <= sent <= 5  # the first to fail may retry before the second fails
    start = time.monotonic()
    for turn in range(5):
        assert expert.complete([f"t{turn}-{i}" for i in range(8)]) == [None] * 8
    assert time.monotonic() - start < 2  # five turns of 8 prompts: no request waits on the server
    assert len(server.chat_requests()) == sent and expert.stats()["breaker_open"] == 40


@pytest.mark.parametrize("override,allowed", [("turn_deadline_s=0", "must be > 0"),
                                              ("breaker_failures=-1", "must be >= 0"),
                                              ("breaker_cooldown_s=-1", "must be >= 0.0")])
def test_deadline_and_breaker_settings_are_checked(override, allowed):
    from magrpo.errors import ConfigError
    from magrpo.validation import validate
    from tests.conftest import SMALL, compose

    with pytest.raises(ConfigError) as e:
        validate(compose([*SMALL, f"external.expert.{override}"]))
    assert e.value.key == f"external.expert.{override.split('=')[0]}" and allowed in str(e.value)


PROBE_AT_EXIT = """
import socket, time
from magrpo.external.expert import OpenAIExpert
from magrpo.config import ExpertConfig
hung = socket.socket(); hung.bind(("127.0.0.1", 0)); hung.listen(8)  # accepts connections, never answers
cfg = ExpertConfig(base_url=f"http://127.0.0.1:{hung.getsockname()[1]}/v1", model="m", timeout_s=120,
                   turn_deadline_s=1, breaker_failures=1, breaker_cooldown_s=0)
expert = OpenAIExpert(cfg, max_concurrency=2, cache=None)
assert expert.complete(["a"]) == [None]  # cut off at the deadline: the breaker opens
while not expert.breaker.is_open:  # on a loaded machine "a" may be counted a moment after the turn ends
    time.sleep(0.01)
assert expert.complete(["b"]) == [None]  # cool-down 0: "b" probes in the background, hung for 120 s
assert expert.probe.is_alive()
"""


def test_requests_hung_in_the_background_do_not_delay_exit():
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", PROBE_AT_EXIT], cwd=ROOT, check=True, timeout=60)
    assert time.monotonic() - start < 30  # the probe's 120 s are not waited for


# --- start-up check ----------------------------------------------------------------------------


@pytest.mark.parametrize("status", [401, 403])
def test_check_rejected_key_is_one_line_error(server, status):
    server.script(MODELS, Reply(status=status))
    with pytest.raises(ExpertError) as info:
        _expert(server.url).check()
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith("external.expert.api_key_env: ")
    assert "$MAGRPO_TEST_KEY" in text and f"scripted error {status}" in text


def test_check_unreachable_base_url():
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    with pytest.raises(ExpertError) as info:
        _expert(url).check()
    assert str(info.value).startswith(f"external.expert.base_url: cannot reach {url}")
    assert "\n" not in str(info.value)


def test_check_picks_first_served_model(server):
    served = {"id": "served-a", "object": "model", "created": 0, "owned_by": "x"}
    server.script(MODELS, Reply(body={"object": "list", "data": [served]}))
    expert = _expert(server.url, model="")
    expert.check()
    assert expert.model == "served-a"
    expert.complete(["p"])
    assert server.chat_requests()[0]["json"]["model"] == "served-a"


def test_check_tolerates_missing_models_endpoint(server):
    server.script(MODELS, Reply(status=404), Reply(status=404))
    _expert(server.url).check()  # a named model: fine without /models
    with pytest.raises(ExpertError, match="external.expert.model"):
        _expert(server.url, model="").check()  # nothing to pick from


def test_missing_openai_package_is_one_line_error(server, monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)  # makes `import openai` raise ImportError
    with pytest.raises(ExpertError) as info:
        _expert(server.url)
    assert str(info.value) == ("external.expert.backend: openai backend needs the openai package: "
                               "pip install 'magrpo[expert]'")


def test_importing_the_package_does_not_import_openai():
    code = "import sys, external.expert; assert 'openai' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# --- request shape -----------------------------------------------------------------------------


def test_key_from_env_is_sent_as_bearer(server, monkeypatch):
    monkeypatch.setenv("MAGRPO_TEST_KEY", "sk-test-123")
    _expert(server.url, temperature=0.5, max_tokens=77).complete(["hello"])
    (request,) = server.chat_requests()
    assert request["headers"]["authorization"] == "Bearer sk-test-123"
    body = request["json"]
    assert body["model"] == "fake-model" and body["messages"] == [{"role": "user", "content": "hello"}]
    assert (body["temperature"], body["max_tokens"]) == (0.5, 77)


# --- cache -------------------------------------------------------------------------------------


def test_cache_serves_a_second_instance(server, tmp_path):
    path = tmp_path / "sub" / "cache.sqlite"
    assert _expert(server.url, cache=ExpertCache(path)).complete(["p"]) == ["reply to: p"]
    second = _expert(server.url, cache=ExpertCache(path))
    assert second.complete(["p"]) == ["reply to: p"]
    assert len(server.chat_requests()) == 1
    assert (second.stats()["cache_hits"], second.stats()["calls"]) == (1, 0)


def test_cache_from_a_thread_pool_and_failures_not_cached(server, tmp_path):
    path = tmp_path / "cache.sqlite"
    server.script(CHAT, Reply(status=400))
    first = _expert(server.url, max_concurrency=1, cache=ExpertCache(path)).complete(["p0"])
    assert first == [None]
    prompts = [f"p{i}" for i in range(16)]
    _expert(server.url, max_concurrency=8, cache=ExpertCache(path)).complete(prompts)
    assert len(server.chat_requests()) == 17  # p0 asked again: its failure was not cached
    again = _expert(server.url, max_concurrency=8, cache=ExpertCache(path))
    assert again.complete(prompts) == [f"reply to: {p}" for p in prompts]
    assert again.stats()["cache_hits"] == 16 and len(server.chat_requests()) == 17


def test_a_reply_holding_a_lone_surrogate_is_cached_and_returned_as_valid_text(server, tmp_path):
    """The JSON escape \\ud800 in a reply gives a lone surrogate, which sqlite (UTF-8) refused: the
    reply was lost as a failure; a tokenizer would raise TypeError on it."""
    server.answer = lambda prompt: f"fix {chr(0xD800)}"
    path = tmp_path / "cache.sqlite"
    assert _expert(server.url, cache=ExpertCache(path)).complete(["p"]) == ["fix \ufffd"]
    assert _expert(server.url, cache=ExpertCache(path)).complete(["p"]) == ["fix \ufffd"]
    assert len(server.chat_requests()) == 1


def test_cache_key_includes_model(tmp_path):
    cache = ExpertCache(tmp_path / "c.sqlite")
    cache.put("openai", "m1", "p", "r1")
    assert cache.get("openai", "m1", "p") == "r1"
    assert cache.get("openai", "m2", "p") is None and cache.get("hf", "m1", "p") is None


def test_open_cache_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("MAGRPO_CACHE", str(tmp_path / "root"))
    assert open_cache("off") is None
    assert open_cache("auto").path == tmp_path / "root" / "expert_cache.sqlite"
    assert open_cache(str(tmp_path / "x.sqlite")).path == tmp_path / "x.sqlite"
    (tmp_path / "dir.sqlite").mkdir()
    with pytest.raises(ExpertError, match="external.expert.cache"):
        open_cache(str(tmp_path / "dir.sqlite"))


# --- parse_edits -------------------------------------------------------------------------------

KEYS = ("aux", "main")
AUX = "def aux(d):\n    return {k: v for k, v in d.items()}"
MAIN = "def main(x):\n    table = {'a': 1, \"b\": {2: 3}}\n    return aux(table)"


def test_parse_fenced_json_with_prose():
    edits = json.dumps({"aux": AUX, "main": MAIN}, indent=2)
    text = "Here are my edits:\n```json\n" + edits + "\n```\nHope this helps!"
    assert parse_edits(text, KEYS) == {"aux": AUX, "main": MAIN}


def test_parse_braces_and_dicts_inside_code_strings():
    assert parse_edits(json.dumps({"aux": AUX, "main": MAIN}), KEYS) == {"aux": AUX, "main": MAIN}


def test_parse_skips_stray_brace_and_objects_without_keys():
    text = 'Use a dict {like this and {"unrelated": 1} then:\n' + json.dumps({"aux": AUX, "main": MAIN}) + "\n} bye"
    assert parse_edits(text, KEYS) == {"aux": AUX, "main": MAIN}


def test_parse_raw_newlines_inside_strings():
    text = '{"aux": "def aux():\n    return 1", "main": "def main():\n\treturn 2"}'  # not strict JSON
    assert parse_edits(text, KEYS) == {"aux": "def aux():\n    return 1", "main": "def main():\n\treturn 2"}


def test_parse_missing_or_null_key_is_empty():
    assert parse_edits('{"main": "x = 1"}', KEYS) == {"aux": "", "main": "x = 1"}
    assert parse_edits('{"aux": null, "main": 3}', KEYS) == {"aux": "", "main": "3"}


@pytest.mark.parametrize("text", ["", "no json here", "{not: json}", '{"other": 1}', "[1, 2]", '{"aux": "unterminated',
                                  '{"aux": ' + "[" * 1000])  # Python's JSON parser raised RecursionError
def test_parse_garbage_is_none(text):
    assert parse_edits(text, KEYS) is None


def test_parse_drops_fence_lines_inside_raw_string_values():
    text = '```json\n{"aux": "\n```python\ndef aux():\n    return 1\n```\n", "main": ""}\n```'
    assert parse_edits(text, KEYS) == {"aux": "\n\ndef aux():\n    return 1\n\n", "main": ""}
