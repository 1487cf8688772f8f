"""The SmolLM2 run_tests warm start's transcripts (envs/code/tool_warm.py), built with the tiny model's
tokenizer: no SmolLM2 load. The build itself (`python -m magrpo.envs.code.tool_warm`) is checked on
the tiny model with a few transcripts: it runs pinned to portable kernels and records how it went."""
from __future__ import annotations

import json

import pytest

from magrpo.conversation import encode_text
from magrpo.envs.code.easy import generate
from magrpo.envs.code.tool_warm import WarmSpec, build_transcripts, code_env, prompt_agents, warm_model_path
from magrpo.tiny import tiny_model_path
from magrpo.tools import RESPONSE_START, ToolCall, parse_call

SPEC = WarmSpec(transcripts=24)


@pytest.fixture(scope="module")
def built():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path(), padding_side="left")
    env, agents = code_env(2), prompt_agents(tok, 2)
    return tok, env, agents, build_transcripts(env, agents, SPEC)


def test_calls_parse_with_the_tool_loops_parser_to_run_tests_and_the_intended_code(built):
    tok, _, _, transcripts = built
    calls = [t for t in transcripts if t.call is not None]
    assert calls and len(calls) < len(transcripts)  # both behaviours are shown
    for t in calls:
        # What generation would stop at: the first model segment, decoded from its ids
        parsed = parse_call(tok.decode(t.segments[0][0]))
        assert parsed == ToolCall(name="run_tests", arguments=t.call["arguments"])
    for t in transcripts:
        if t.call is None:
            assert parse_call(t.texts[0]) is None and len(t.segments) == 1


def test_the_loss_mask_leaves_out_exactly_the_tool_output(built):
    tok, _, agents, transcripts = built
    for t in transcripts:
        mask, ids = t.learn_mask(), t.ids()
        assert not any(mask[: len(t.prompt_ids)]) and ids[-1] == tok.eos_token_id and mask[-1]
        masked = [i for i, learn in zip(ids[len(t.prompt_ids):], mask[len(t.prompt_ids):]) if not learn]
        if t.call is None:
            assert masked == []
            continue
        response = t.texts[1]
        assert response.startswith(f"\n{RESPONSE_START}") and "examples passed" in response
        assert masked == encode_text(agents[t.agent], response)  # the tool loop's own encoding of it
        assert [learn for _, learn in t.segments] == [True, False, True]


def test_wrong_drafts_get_failures_and_the_final_code_passes(built):
    _, _, _, transcripts = built
    outputs = [t.texts[1] for t in transcripts if t.call is not None]
    assert any("FAILED" in o for o in outputs) and any("FAILED" not in o for o in outputs)


def test_only_train_problems_are_used(built):
    tok, env, _, transcripts = built
    train = {p["task_id"]: p for p in env.problems("train")}
    heldout = generate()["heldout"]
    for t in transcripts:
        assert t.task_id in train and t.task_id.startswith("Easy/train/")
        prompt = tok.decode(t.prompt_ids)
        assert train[t.task_id]["prompt"].strip() in prompt
        assert not any(p["prompt"].strip() in prompt for p in heldout)


def test_the_transcripts_are_deterministic(built):
    _, env, agents, transcripts = built
    again = build_transcripts(env, agents, SPEC)
    assert [(t.ids(), t.learn_mask()) for t in again] == [(t.ids(), t.learn_mask()) for t in transcripts]


def test_the_build_runs_pinned_and_records_its_transcripts_and_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    spec = WarmSpec(model=str(tiny_model_path()), transcripts=6)
    folder = warm_model_path(spec, cache_dir=tmp_path)
    record = json.loads((folder / "warm_start.json").read_text())
    assert record["pinned_kernels"] is True and record["transcripts"] == 6 and 0 < record["with_call"] < 6
    assert len(record["weights_sha256"]) == 64
    AutoModelForCausalLM.from_pretrained(folder)  # an ordinary HF folder: the LoRA is merged
    assert not [p for p in folder.parent.iterdir() if p != folder]  # no build folder left beside it
