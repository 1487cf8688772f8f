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

from external.expert import ExpertCache, ExpertError, OpenAIExpert, open_cache, parse_edits  # noqa: E402
from magrpo.config import ExpertConfig  # noqa: E402
from tests.openai_server import CHAT, MODELS, Reply  # noqa: E402  (the `server` fixture: conftest.py)

ROOT = Path(__file__).resolve().parent.parent
def _expert(url: str, max_concurrency: int = 8, cache: ExpertCache | None = None, **cfg) -> OpenAIExpert:
    settings = dict(base_url=url, model="fake-model", timeout_s=5.0, max_retries=2, backoff_s=0.01, api_key_env="MAGRPO_TEST_KEY")
    return OpenAIExpert(ExpertConfig(**{**settings, **cfg}), max_concurrency=max_concurrency, cache=cache)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- concurrency -------------------------------------------------------------------------------


def test_requests_overlap_up_to_max_concurrency(server):
    server.delay = 0.3
    prompts = [f"p{i}" for i in range(8)]
    start = time.monotonic()
    replies = _expert(server.url, max_concurrency=8).complete(prompts)
    elapsed = time.monotonic() - start
    assert replies == [f"reply to: {p}" for p in prompts]  # order kept
    assert server.max_inflight >= 4
    assert elapsed < 8 * 0.3 / 2


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


@pytest.mark.parametrize("failure", [Reply(delay=0.6), Reply(status=500), Reply(status=503)], ids=["timeout", "500", "503"])
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


@pytest.mark.parametrize("body", [NO_TEXT, {"choices": []}, {"unexpected": 1}, "an HTML page"], ids=["null", "no-choices", "no-keys", "str"])
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
    server.script(MODELS, Reply(body={"object": "list", "data": [{"id": "served-a", "object": "model", "created": 0, "owned_by": "x"}]}))
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
    assert str(info.value) == "external.expert.backend: openai backend needs the openai package: pip install 'magrpo[expert]'"


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
    text = "Here are my edits:\n```json\n" + json.dumps({"aux": AUX, "main": MAIN}, indent=2) + "\n```\nHope this helps!"
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


@pytest.mark.parametrize("text", ["", "no json here", "{not: json}", '{"other": 1}', "[1, 2]", '{"aux": "unterminated'])
def test_parse_garbage_is_none(text):
    assert parse_edits(text, KEYS) is None


def test_parse_drops_fence_lines_inside_raw_string_values():
    text = '```json\n{"aux": "\n```python\ndef aux():\n    return 1\n```\n", "main": ""}\n```'
    assert parse_edits(text, KEYS) == {"aux": "\n\ndef aux():\n    return 1\n\n", "main": ""}
