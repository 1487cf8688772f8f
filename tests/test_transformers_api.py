"""magrpo calls transformers (and peft) through their current APIs: a training step of the tiny model
(load, generate, update, evaluate, save) meets no deprecated name, so a routine upgrade that removes
one cannot break a run. Current transformers (5.24) names the KV cache keyword and output field
`cache` (`past_key_values` warns, and goes in 5.40): magrpo.models.cache_keyword picks the name."""
from __future__ import annotations

import logging
import warnings

import transformers.utils.logging  # noqa: F401  (adds Logger.warning_once, which the test records)

from magrpo.trainer import train


def test_a_training_step_raises_no_future_warning_and_logs_no_deprecation(make_cfg, monkeypatch):
    logged: list[str] = []  # transformers reports some renames (e.g. reading out.past_key_values) by log only
    monkeypatch.setattr(logging.Logger, "warning_once", lambda self, msg, *args, **kwargs: logged.append(str(msg)))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=FutureWarning)
        train(make_cfg("trainer.steps=1"))  # with the evaluation at the end: greedy decoding too
    assert [m for m in logged if "deprecated" in m] == []


def test_the_cache_keyword_follows_the_model_forward():
    """A model written for older transformers (or remote code) still gets `past_key_values`."""
    import torch

    from magrpo.models import cache_keyword

    class Old(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=None):
            return input_ids

    class New(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, cache=None, use_cache=None):
            return input_ids

    class Wrapped(torch.nn.Module):  # a peft model: the base model's forward decides
        def get_base_model(self):
            return New()

    assert [cache_keyword(m) for m in (Old(), New(), Wrapped())] == ["past_key_values", "cache", "cache"]
