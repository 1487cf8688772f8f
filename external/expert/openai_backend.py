"""Expert replies from an OpenAI-compatible chat endpoint (vLLM, Ollama, DeepSeek, OpenAI, ...).

Requests of one turn overlap on daemon threads and share one deadline (turn_deadline_s): what is
still pending then falls back, and a hung request never holds up the turn or the process's exit.
Timeouts, connection errors, 429 and 5xx are retried with jittered exponential backoff (a 429's
Retry-After, when longer, is waited instead). A circuit breaker stops asking a failing server for a
cool-down and then probes it in the background. A request that still fails returns None (the
caller falls back); everything is counted in `stats()`.
"""
from __future__ import annotations

import email.utils
import logging
import os
import random
import threading
import time
from collections import deque
from typing import Any, Callable

from magrpo.config import ExpertConfig
from magrpo.errors import valid_text

from .breaker import OPEN, PROBE, Breaker
from .cache import ExpertCache
from .errors import ExpertError
from .stats import ExpertStats

log = logging.getLogger(__name__)


class OpenAIExpert:
    """One chat completion per prompt, with disk cache, retries and bounded concurrency."""

    name = "openai"

    def __init__(self, cfg: ExpertConfig, max_concurrency: int, cache: ExpertCache | None):
        self.cfg = cfg
        self.model = cfg.model  # "" until check() picks the first served model
        self.max_concurrency = max_concurrency
        self.cache = cache
        self._openai, self._client = _build_client(cfg)
        self.counts = ExpertStats()
        self.breaker = Breaker(cfg.breaker_failures, cfg.breaker_cooldown_s)
        self._jitter = random.Random()  # its own generator: the global ones (seeded for training) stay untouched
        self.probe: threading.Thread | None = None  # the latest background probe (tests wait on it)

    def check(self) -> None:
        """Start-up check: the endpoint answers and accepts the key; resolves an empty model name."""
        openai, base = self._openai, self.cfg.base_url
        try:
            served = [m.id for m in self._client.models.list()]
        except openai.APIStatusError as e:
            if e.status_code in (401, 403):
                env = self.cfg.api_key_env
                unset = "" if os.environ.get(env) else f" (${env} is not set)"
                raise ExpertError(
                    "external.expert.api_key_env",
                    f"{base} rejected the key from ${env}{unset} ({e.status_code}): {_server_message(e)}",
                ) from None
            if e.status_code != 404:
                raise ExpertError(
                    "external.expert.base_url", f"{base}/models answered {e.status_code}: {_server_message(e)}"
                ) from None
            served = []  # some servers have no /models; the first completion will tell
        except openai.APIConnectionError as e:
            raise ExpertError("external.expert.base_url", f"cannot reach {base}: {_reason(e)}") from None
        if not self.model:
            if not served:
                raise ExpertError("external.expert.model", f"{base} lists no models; set external.expert.model")
            self.model = served[0]
        elif served and self.model not in served:
            # A warning, not an error: some servers accept aliases they do not list (Ollama's name vs name:latest).
            log.warning("expert model %r is not among the models %s lists: %s", self.model, base, ", ".join(served[:5]))

    def complete(self, prompts: list[str]) -> list[str | None]:
        """The reply to each prompt, in order; None where the request failed after its retries, the
        breaker was open, or the turn deadline passed first."""
        if not self.model:
            raise ExpertError("external.expert.model", "not set and not resolved: call check() before complete()")
        # Identical prompts (branches that wrote the same code) share one request.
        unique = list(dict.fromkeys(prompts))
        deadline = time.monotonic() + self.cfg.turn_deadline_s
        # Requests are cut off a little before the turn ends, so they are counted (and seen by the
        # breaker) as failures; "late" is left to a transport that ignores its timeout.
        cutoff = deadline - min(1.0, 0.1 * self.cfg.turn_deadline_s)
        replies = _map_until(lambda p: self._complete_one(p, cutoff), unique, self.max_concurrency, cutoff, deadline)
        late = len(unique) - len(replies)
        if late:
            log.warning(
                "expert: %d request(s) to %s still pending at the turn deadline (external.expert.turn_deadline_s"
                "=%g); their branches fall back",
                late,
                self.cfg.base_url,
                self.cfg.turn_deadline_s,
            )
        for _ in range(late):  # failures to the breaker too: a server that never lets a request end must trip it
            self._record(False)
        self.counts.add(cache_hits=len(prompts) - len(unique), late=late)
        return [replies.get(p) for p in prompts]

    def stats(self) -> dict[str, float]:
        """calls (prompts sent to the server), cache_hits, failures, retries, breaker_open (prompts not
        sent: the breaker was open), late (queued or in flight at the turn deadline), latency_s_total (wall time of
        the calls, retries and backoff included; mean = latency_s_total / calls)."""
        return self.counts.snapshot()

    def reset_stats(self) -> None:
        self.counts.reset()

    def _complete_one(self, prompt: str, deadline: float) -> str | None:
        if self.cache is not None:
            hit = self.cache.get(self.name, self.model, prompt)
            if hit is not None:
                self.counts.add(cache_hits=1)
                return hit
        state = self.breaker.allow()
        if state == OPEN:
            self.counts.add(breaker_open=1)
            return None
        if state == PROBE:
            # In the background with no retries: a hung server costs the turn nothing; the branch falls back.
            self.counts.add(breaker_open=1)
            self.probe = threading.Thread(target=self._request, args=(prompt, time.monotonic() + self.cfg.timeout_s, 0),
                                          daemon=True, name="magrpo-expert-probe")
            self.probe.start()
            return None
        return self._request(prompt, deadline, self.cfg.max_retries)

    def _request(self, prompt: str, deadline: float, max_retries: int) -> str | None:
        start = time.monotonic()
        reply, error = self._ask(prompt, deadline, max_retries)
        self.counts.add(calls=1, latency_s_total=time.monotonic() - start)
        if reply is None:
            self.counts.add(failures=1)
            log.warning("expert request to %s failed: %s", self.cfg.base_url, error)
            return None
        if self.cache is not None:
            self.cache.put(self.name, self.model, prompt, reply)
        return reply

    def _ask(self, prompt: str, deadline: float, max_retries: int) -> tuple[str | None, str]:
        """(reply, "") or (None, why) after at most max_retries retries of retryable errors, none
        after the deadline or once the breaker is open."""
        attempt, error = 0, ""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None, "turn deadline passed (external.expert.turn_deadline_s)"
            if attempt and self.breaker.is_open:  # it opened while this request slept before its retry
                return None, f"{error}; circuit breaker open"
            try:
                response = self._client.chat.completions.create(
                    model=self.model,
                    messages=[{"role": "user", "content": prompt}],
                    temperature=self.cfg.temperature,
                    max_tokens=self.cfg.max_tokens,
                    timeout=min(self.cfg.timeout_s, remaining),  # a hung server is cut off at the deadline
                )
            except self._openai.OpenAIError as e:
                self._record(False)
                error, retry_after = _describe(e), _retry_after(e)
                if not self._retryable(e) or attempt == max_retries:
                    return None, error
            except Exception as e:  # noqa: BLE001  a 200 whose body is not JSON (e.g. cut off): the run goes on
                self._record(False)
                return None, f"unreadable reply: {_one_line(f'{type(e).__name__}: {e}')}"
            else:
                # A proxy's non-JSON 200 page comes back as a plain str, without choices.
                choices = getattr(response, "choices", None)
                content = choices[0].message.content if choices else None
                self._record(bool(content))
                # valid text: the JSON escape \ud800 gives a lone surrogate, which the cache and a tokenizer refuse
                return (valid_text(content), "") if content else (None, "no reply text in the response")
            wait = max(self.cfg.backoff_s * 2**attempt * (0.5 + self._jitter.random()), retry_after)
            if time.monotonic() + wait >= deadline:  # the retry could not finish in time: fail now, not later
                return None, f"{error}; no time left to retry after {wait:.1f} s"
            if self.breaker.is_open:
                return None, f"{error}; circuit breaker open"
            time.sleep(wait)
            attempt += 1
            self.counts.add(retries=1)

    def _record(self, ok: bool) -> None:
        if self.breaker.record(ok):
            log.warning("expert at %s failed %d times in a row: not asking it for %g s (branches fall back; "
                        "external.expert.breaker_failures, breaker_cooldown_s)", self.cfg.base_url,
                        self.breaker.failures, self.breaker.cooldown_s)

    def _retryable(self, e: Exception) -> bool:
        """Timeouts, connection errors, 429 and 5xx may pass; other 4xx (bad key, bad request) will not."""
        if isinstance(e, self._openai.APIConnectionError):  # APITimeoutError is one too
            return True
        return isinstance(e, self._openai.APIStatusError) and (e.status_code == 429 or e.status_code >= 500)


def _build_client(cfg: ExpertConfig) -> tuple[Any, Any]:
    """(the openai module, a client); openai is an optional dependency, imported only here."""
    try:
        import openai
    except ImportError:
        raise ExpertError(
            "external.expert.backend", "openai backend needs the openai package: pip install 'magrpo[expert]'"
        ) from None
    client = openai.OpenAI(
        base_url=cfg.base_url,
        # Local servers (vLLM, Ollama) ignore the key, but the client refuses to start without one.
        api_key=os.environ.get(cfg.api_key_env) or "EMPTY",
        timeout=cfg.timeout_s,
        max_retries=0,  # our own retries: counted, and limited to retryable errors
    )
    return openai, client


def _map_until(
    fn: Callable[[str], Any], items: list[str], workers: int, start_by: float, deadline: float
) -> dict[str, Any]:
    """{item: fn(item)} for the items started by `start_by` and done by `deadline` (time.monotonic()),
    at most `workers` at once.
    Daemon threads: one still blocked in a request after the deadline delays neither the caller nor
    the interpreter's exit (a ThreadPoolExecutor's workers are joined at exit)."""
    todo, done, changed = deque(items), {}, threading.Condition()

    def work() -> None:
        while True:
            with changed:
                if not todo or time.monotonic() >= start_by:
                    return
                item = todo.popleft()
            try:
                result = fn(item)
            except Exception:
                log.exception("expert request failed unexpectedly")
                result = None
            with changed:
                done[item] = result
                changed.notify()

    for _ in range(min(workers, len(items))):
        threading.Thread(target=work, daemon=True, name="magrpo-expert").start()
    with changed:
        changed.wait_for(lambda: len(done) == len(items), timeout=max(0.0, deadline - time.monotonic()))
        return dict(done)


def _retry_after(e: Any) -> float:
    """Seconds a 429/503 asks us to wait (Retry-After: seconds or an HTTP date); 0 when it says nothing."""
    response = getattr(e, "response", None)
    value = response.headers.get("retry-after", "").strip() if response is not None else ""
    if not value:
        return 0.0
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return 0.0


def _server_message(e: Any) -> str:
    """The server's own words from an APIStatusError, on one short line."""
    body = e.body
    if isinstance(body, dict):
        body = body.get("message") or body
    return _one_line(str(body) if body else e.message)


def _reason(e: Any) -> str:
    """Why a connection failed: the transport's error (e.g. Connection refused) beats openai's generic text."""
    return _one_line(str(e.__cause__ or e.message) or type(e).__name__)


def _describe(e: Any) -> str:
    status = getattr(e, "status_code", None)
    return f"{status}: {_server_message(e)}" if status else _reason(e)


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
