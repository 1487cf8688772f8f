"""The tiny local model: builds, reloads like a hub model, is deterministic and cached."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import magrpo.tiny as tiny
from magrpo.tiny import TinySpec, tiny_model_path

SAMPLES = [
    "def f(x):\n    return [i ** 2 for i in range(x)]\n",
    "café — naïve 你好 🎉 Ωμέγα",
    "a\t\tb     c\r\n\n\n    \t",
    "",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_path(cache_dir=tmp_path_factory.mktemp("cache_a"))


def test_reload_like_a_hub_model(built: Path) -> None:
    tok = AutoTokenizer.from_pretrained(built)
    model = AutoModelForCausalLM.from_pretrained(built)
    assert tok.padding_side == "left"
    assert tok.pad_token_id is not None and tok.eos_token_id is not None
    assert tok.pad_token_id != tok.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.vocab_size == len(tok)
    assert model.generation_config.pad_token_id == tok.pad_token_id
    for text in SAMPLES:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        assert tok(tok.decode(ids), add_special_tokens=False)["input_ids"] == ids
    # Special tokens are atomic, not split into bytes.
    assert tok("a<|endoftext|>", add_special_tokens=False)["input_ids"][-1] == tok.eos_token_id
    assert not list(built.parent.glob(".*.tmp")), "temp build folder left behind"


def test_deterministic(built: Path, tmp_path: Path) -> None:
    other = tiny_model_path(cache_dir=tmp_path)
    assert other.name == built.name and other != built
    a, b = load_file(built / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert AutoTokenizer.from_pretrained(built).get_vocab() == AutoTokenizer.from_pretrained(other).get_vocab()


def test_cached(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(tiny, "_build", fail)
    mtime = built.stat().st_mtime_ns
    assert tiny_model_path(cache_dir=built.parent.parent) == built
    assert built.stat().st_mtime_ns == mtime
    # A different spec is a different folder (and would need a build).
    with pytest.raises(AssertionError, match="rebuilt"):
        tiny_model_path(TinySpec(seed=1), cache_dir=built.parent.parent)


def test_lost_race_uses_winner(built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If another process renames its folder into place first, we use it and clean up ours."""
    final = tmp_path / "tiny" / built.name

    def racing_build(spec: TinySpec, out: Path, files: list[Path]) -> None:
        shutil.copytree(built, final)  # the "winner" finishes first
        shutil.copytree(built, out, dirs_exist_ok=True)

    monkeypatch.setattr(tiny, "_build", racing_build)
    assert tiny_model_path(cache_dir=tmp_path) == final
    assert sorted(p.name for p in (tmp_path / "tiny").iterdir()) == [built.name]


def test_batched_left_padded_sampling(built: Path) -> None:
    tok = AutoTokenizer.from_pretrained(built)
    model = AutoModelForCausalLM.from_pretrained(built).eval()
    prompts = ["x", "def add(a, b):\n", "import os\nimport sys\n\nclass Config:\n    pass\n"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    lengths = batch["attention_mask"].sum(1)
    assert len(set(lengths.tolist())) == 3
    width = batch["input_ids"].shape[1]
    assert (batch["input_ids"][0, : width - int(lengths[0])] == tok.pad_token_id).all()  # pads on the left
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, max_new_tokens=8, min_new_tokens=8)
    assert out.shape == (3, width + 8)
    assert torch.equal(out[:, :width], batch["input_ids"])
    new = out[:, width:]
    assert ((0 <= new) & (new < model.config.vocab_size)).all()
    assert len({tuple(row) for row in new.tolist()}) > 1  # sampled, not one degenerate row


def test_param_count(built: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(built)
    n = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    assert 500_000 <= n <= 2_000_000, n


def test_a_cold_build_leaves_the_callers_random_state_as_it_was(tmp_path: Path) -> None:
    """The trainer seeds, then loads its model: a build that reseeded (the tiny model, the warm
    starts) gave a first run on an empty cache other LoRA initial weights than every later run, and
    the default-rollouts golden test failed on every cold cache from step 2 on."""
    import random

    import numpy as np

    def draws() -> tuple:
        return random.random(), float(np.random.rand()), torch.rand(3).tolist()

    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    want = draws()
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    tiny_model_path(cache_dir=tmp_path)  # cold: builds, and its build seeds torch with TinySpec.seed
    assert draws() == want
