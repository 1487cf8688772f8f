"""The `hf` expert: a local transformers chat model (hub id, local folder, `tiny` or `smollm2-135m`)
answering every expert prompt of a turn in one batched generate call."""
from __future__ import annotations

import threading
import time

from magrpo.config import ExpertConfig

from .cache import ExpertCache
from .stats import ExpertStats


class HFExpert:
    name = "hf"

    def __init__(self, cfg: ExpertConfig, cache: ExpertCache | None):
        self.cfg, self.cache, self.model = cfg, cache, cfg.model
        self._lock = threading.Lock()
        self._loaded = None
        self.counts = ExpertStats()

    def check(self) -> None:
        """Load now, so a bad name fails before training (one line, like model.name)."""
        self._load()

    def _load(self):
        if self._loaded is None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            from magrpo.errors import ConfigError
            from magrpo.models import resolve_model_path

            # The expert is its own model: `tiny` here is the default tiny model, whatever model.* says.
            path = resolve_model_path(self.model, "external.expert.model")
            try:
                tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
                model = AutoModelForCausalLM.from_pretrained(path).eval()
            except (OSError, ValueError) as e:
                raise ConfigError(
                    "external.expert.model", f"cannot load {self.model!r}: {str(e).splitlines()[0]}"
                ) from None
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
            self._loaded = (tokenizer, model)
        return self._loaded

    def complete(self, prompts: list[str]) -> list[str | None]:
        replies: list[str | None] = [self.cache.get(self.name, self.model, p) if self.cache else None for p in prompts]
        todo = [i for i, r in enumerate(replies) if r is None]
        self.counts.add(cache_hits=len(prompts) - len(todo))
        if todo:
            start = time.perf_counter()
            with self._lock:  # one generate at a time; the batch is the parallelism
                texts = self._generate([prompts[i] for i in todo])
            self.counts.add(calls=len(todo), latency_s_total=time.perf_counter() - start)
            for i, text in zip(todo, texts):
                replies[i] = text
                if self.cache:
                    self.cache.put(self.name, self.model, prompts[i], text)
        return replies

    def _generate(self, prompts: list[str]) -> list[str]:
        import torch

        tokenizer, model = self._load()
        if tokenizer.chat_template:
            prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                     add_generation_prompt=True) for p in prompts]
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not tokenizer.chat_template)
        greedy = self.cfg.temperature == 0
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=self.cfg.max_tokens, do_sample=not greedy,
                                 temperature=None if greedy else self.cfg.temperature, top_p=None, top_k=None,
                                 pad_token_id=tokenizer.pad_token_id)
        return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)

    def stats(self) -> dict[str, float]:
        return self.counts.snapshot()

    def reset_stats(self) -> None:
        self.counts.reset()
