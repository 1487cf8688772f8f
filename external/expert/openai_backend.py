"""Expert replies from an OpenAI-compatible chat endpoint (vLLM, Ollama, DeepSeek, OpenAI, ...).

Requests of one batch overlap in a thread pool; timeouts, connection errors, 429 and 5xx are
retried with exponential backoff; a request that still fails returns None (the caller falls back)
and is counted in `stats()`.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from magrpo.config import ExpertConfig

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

    def check(self) -> None:
        """Start-up check: the endpoint answers and accepts the key; resolves an empty model name."""
        openai, base = self._openai, self.cfg.base_url
        try:
            served = [m.id for m in self._client.models.list()]
        except openai.APIStatusError as e:
            if e.status_code in (401, 403):
                env = self.cfg.api_key_env
                unset = "" if os.environ.get(env) else f" (${env} is not set)"
                raise ExpertError("external.expert.api_key_env", f"{base} rejected the key from ${env}{unset} ({e.status_code}): {_server_message(e)}") from None
            if e.status_code != 404:
                raise ExpertError("external.expert.base_url", f"{base}/models answered {e.status_code}: {_server_message(e)}") from None
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
        """The reply to each prompt, in order; None where the request failed after its retries."""
        if not self.model:
            raise ExpertError("external.expert.model", "not set and not resolved: call check() before complete()")
        # Identical prompts (branches that wrote the same code) share one request.
        unique = list(dict.fromkeys(prompts))
        with ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
            replies = dict(zip(unique, pool.map(self._complete_one, unique)))
        self.counts.add(cache_hits=len(prompts) - len(unique))
        return [replies[p] for p in prompts]

    def stats(self) -> dict[str, float]:
        """calls (prompts sent to the server), cache_hits, failures, retries, latency_s_total
        (wall time of the calls, retries and backoff included; mean = latency_s_total / calls)."""
        return self.counts.snapshot()

    def reset_stats(self) -> None:
        self.counts.reset()

    def _complete_one(self, prompt: str) -> str | None:
        if self.cache is not None:
            hit = self.cache.get(self.name, self.model, prompt)
            if hit is not None:
                self.counts.add(cache_hits=1)
                return hit
        start = time.monotonic()
        reply, error = self._ask(prompt)
        self.counts.add(calls=1, latency_s_total=time.monotonic() - start)
        if reply is None:
            self.counts.add(failures=1)
            log.warning("expert request to %s failed: %s", self.cfg.base_url, error)
            return None
        if self.cache is not None:
            self.cache.put(self.name, self.model, prompt, reply)
        return reply

    def _ask(self, prompt: str) -> tuple[str | None, str]:
        """(reply, "") or (None, why) after at most max_retries retries of retryable errors."""
        attempt = 0
        while True:
            try:
                response = self._client.chat.completions.create(
                    model=self.model,
                    messages=[{"role": "user", "content": prompt}],
                    temperature=self.cfg.temperature,
                    max_tokens=self.cfg.max_tokens,
                )
            except self._openai.OpenAIError as e:
                if not self._retryable(e) or attempt == self.cfg.max_retries:
                    return None, _describe(e)
            else:
                # A proxy's non-JSON 200 page comes back as a plain str, without choices.
                choices = getattr(response, "choices", None)
                content = choices[0].message.content if choices else None
                return (content, "") if content else (None, "no reply text in the response")
            time.sleep(self.cfg.backoff_s * 2**attempt)
            attempt += 1
            self.counts.add(retries=1)

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
        raise ExpertError("external.expert.backend", "openai backend needs the openai package: pip install 'magrpo[expert]'") from None
    client = openai.OpenAI(
        base_url=cfg.base_url,
        # Local servers (vLLM, Ollama) ignore the key, but the client refuses to start without one.
        api_key=os.environ.get(cfg.api_key_env) or "EMPTY",
        timeout=cfg.timeout_s,
        max_retries=0,  # our own retries: counted, and limited to retryable errors
    )
    return openai, client


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
