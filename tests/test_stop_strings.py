"""Stop strings (generation.stop, agents[i].stop): a completion ends with the token that completes
the first one, that token kept, finished and not truncated; per agent in one batched call; combined
with the tool loop's call marker, the first in the text wins; the same strings in training and in
evaluation (docs/backends.md#stop-strings)."""
from __future__ import annotations

import json
import re
import shlex

import pytest

from magrpo.generation import GenerationRequest, SamplingParams, StopStrings
from magrpo.tool_loop import generate_with_tools
from magrpo.toolbox import Toolbox
from magrpo.tools import ToolStats, resolve, response_text
from tests.conftest import ROOT
from tests.fakes import ToolScriptBackend

SAMPLED = SamplingParams(max_new_tokens=14, logprobs=True)


@pytest.fixture(scope="module")
def backend():
    """The tiny model's HF backend with two agents on one base model (one decode serves both)."""
    from magrpo.backends.hf import HFBackend
    from magrpo.models import load_agents
    from tests.conftest import SMALL, compose

    return HFBackend(load_agents(compose([*SMALL, "lora.r=4"]), 2))


def sample(backend, agent=0, stop=(), params=SAMPLED, seed=3):
    """One seeded sample of agent `agent` for a fixed prompt."""
    [[c]] = backend.generate([GenerationRequest("Write some code.", agent, 1, seed, stop=stop)], params)
    return c


def text_of(backend, ids) -> str:
    return backend.agents[0].tokenizer.decode(ids)


@pytest.fixture(scope="module")
def full(backend):
    """The seeded sample without stop strings."""
    c = sample(backend)
    assert len(c.token_ids) >= 12, "the seeded sample is too short for these tests: pick another seed"
    return c


def written(backend, full, start: int, end: int) -> str:
    """A stop string the seeded sample writes: the text of its tokens start..end-1."""
    return text_of(backend, full.token_ids[start:end])


def assert_cut_at(backend, cut, full, stop: str) -> None:
    """`cut` is `full` through the token that completes `stop`: the same tokens and log-probs."""
    n = len(cut.token_ids)
    assert cut.token_ids == full.token_ids[:n] and cut.logprobs == pytest.approx(full.logprobs[:n])
    assert stop in text_of(backend, cut.token_ids) and stop not in text_of(backend, cut.token_ids[:-1])
    assert cut.text == backend.agents[0].tokenizer.decode(cut.token_ids, skip_special_tokens=True)


def test_a_stop_string_ends_the_completion_finished_with_its_tokens_kept(backend, full):
    stop = written(backend, full, 4, 6)
    cut = sample(backend, stop=(stop,))
    assert len(cut.token_ids) <= 6 and cut.finished  # an end, not a truncation
    assert_cut_at(backend, cut, full, stop)
    unmatched = sample(backend, stop=("never written\x00",))
    assert unmatched.token_ids == full.token_ids and unmatched.finished == full.finished


def test_agents_stop_at_their_own_strings_in_one_batched_call(backend, full):
    early, late = written(backend, full, 2, 4), written(backend, full, 9, 12)
    # The two agents' adapters are equal here (LoRA B starts at zero): the same seed, the same sample.
    calls = backend.generate_calls
    requests = [GenerationRequest("Write some code.", 0, 1, 3, stop=(early,)),
                GenerationRequest("Write some code.", 1, 1, 3, stop=(late,)),
                GenerationRequest("Write some code.", 1, 1, 3)]
    [[first], [second], [none]] = backend.generate(requests, SAMPLED)
    assert backend.generate_calls == calls + 1  # one decode for both agents
    assert_cut_at(backend, first, full, early)
    assert_cut_at(backend, second, full, late)
    assert len(first.token_ids) < len(second.token_ids) and first.finished and second.finished
    assert none.token_ids == full.token_ids and none.finished == full.finished


@pytest.mark.parametrize("agent_first", [True, False], ids=["stop_first", "call_end_first"])
def test_a_stop_string_and_a_tool_call_marker_the_first_in_the_text_wins(backend, full, agent_first):
    """A stop string ends the turn (finished), a call's end pauses it (not finished)."""
    early, late = written(backend, full, 2, 4), written(backend, full, 9, 12)
    alone = sample(backend, stop=(early,))
    assert len(alone.token_ids) < len(sample(backend, stop=(late,)).token_ids)
    stop, marker = (early, late) if agent_first else (late, early)
    both = sample(backend, stop=(stop,), params=SamplingParams(14, logprobs=True, stop=(marker,)))
    assert both.token_ids == alone.token_ids and both.finished == agent_first


def pieces_tokenizer(pieces: dict[int, str]):
    """A tokenizer whose token i reads pieces[i]: tokens that carry several characters."""
    class Tokenizer:
        decoded_rows = 0  # rows of batch_decode calls (what the stop check costs)

        def decode(self, ids, **_):
            return "".join(pieces[i] for i in ids)

        def batch_decode(self, rows, **_):
            self.decoded_rows += len(rows)
            return [self.decode(ids) for ids in rows]

    return Tokenizer()


@pytest.mark.parametrize("stop, pause, finished", [(("ab",), ("</c>",), False), (("</c>",), ("ab",), True),
                                                   (("b",), ("ab",), True)])
def test_one_token_completing_both_goes_to_the_one_that_ends_first_a_tie_to_the_stop_string(stop, pause, finished):
    from magrpo.backends.hf import cut_at_end

    tok = pieces_tokenizer({1: "x", 2: "</c>ab", 3: "y"})
    assert cut_at_end(tok, [1, 2, 3], set(), stop, pause) == ([1, 2], finished)


def test_a_stop_string_in_the_eos_tokens_own_text_does_not_count():
    from magrpo.backends.hf import cut_at_end

    tok = pieces_tokenizer({1: "x", 9: "<|end|>"})
    assert cut_at_end(tok, [1, 9], {9}, ("<|",), ()) == ([1, 9], True)
    assert cut_at_end(tok, [1, 1], {9}, ("<|",), ()) == ([1, 1], False)  # cut at max_new_tokens


def test_the_stop_check_decodes_only_rows_whose_newest_token_can_complete_a_stop_string():
    import torch

    from magrpo.backends.hf import StopCheck

    tok = pieces_tokenizer({1: "x", 2: "</c", 3: ">y", 4: "  "})
    new = torch.tensor([[1, 2, 3], [2, 1, 1], [3, 3, 2]])
    assert StopCheck(tok, [("</c>",)] * 3)(torch.arange(3), new).tolist() == [True, False, False]
    assert tok.decoded_rows == 1  # only row 0 ends in a token holding ">"
    assert StopCheck(tok, [("c  ",)] * 3)(torch.arange(3), torch.tensor([[2, 4], [1, 4], [1, 1]])).tolist() == [
        True, False, False]
    assert tok.decoded_rows == 4  # a stop string ending in whitespace: every row is decoded


def brute_stopped(tok, stops, new) -> list[bool]:
    """The stop check without any shortcut: decode every row's tail."""
    window = max(len(s) for row in stops for s in row) + 1
    return [any(s in tok.decode(ids[-window:]) for s in row) for row, ids in zip(stops, new.tolist())]


def brute_position(tok, stop, ids):
    window = max(len(s) for s in stop) + 1
    return next((t + 1 for t in range(len(ids)) if any(s in tok.decode(ids[max(0, t + 1 - window): t + 1])
                                                      for s in stop)), None)


def test_the_stop_checks_shortcuts_agree_with_decoding_every_tail_on_a_real_tokenizer():
    """Random token strings of the tiny model's byte-level tokenizer (split characters, special tokens,
    whitespace): every row stops at the same step, and is cut at the same token, as without shortcuts."""
    import torch
    from transformers import AutoTokenizer

    from magrpo.backends.hf import StopCheck, stop_position
    from magrpo.tiny import TinySpec, tiny_model_path

    tok = AutoTokenizer.from_pretrained(tiny_model_path(TinySpec()))
    gen = torch.Generator().manual_seed(0)
    snippets = [tok.encode(text) for text in (")", "\n\n", " é", "</tool_call>", " x = 1")]  # é: two byte tokens
    rows = []
    for _ in range(48):  # random tokens with whole snippets between, so that stop strings occur
        row = torch.randint(0, len(tok), (20,), generator=gen).tolist()
        for at in sorted(torch.randint(0, 16, (4,), generator=gen).tolist(), reverse=True):
            row[at:at] = snippets[int(torch.randint(0, len(snippets), (1,), generator=gen))]
        rows.append(row[:20])
    new = torch.tensor(rows)
    written = [tok.decode(new[r, 10:12].tolist()) for r in range(6)]
    stops = [(")",), ("</tool_call>",), ("\n\n",), ("é",), (written[0], "x"), (written[1],)] * 8
    check = StopCheck(tok, stops)  # one per decode call, as in the backend
    first, expected = [None] * 48, [None] * 48  # per row, the step at which it stops (the decode loop's use)
    for step in range(1, new.shape[1] + 1):
        for r, (got, want) in enumerate(zip(check(torch.arange(48), new[:, :step]).tolist(),
                                            brute_stopped(tok, stops, new[:, :step]))):
            first[r] = first[r] or (step if got else None)
            expected[r] = expected[r] or (step if want else None)
    assert first == expected
    assert sum(step is not None for step in expected) >= 12  # the stop strings do occur
    for stop, ids in zip(stops, new.tolist()):
        assert stop_position(tok, stop, ids) == brute_position(tok, stop, ids)


# --- the tool loop: an agent's stop string ends the turn, a call's end pauses it ---------------------

CALC = 'I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


def tool_turn(replies: list[str], stop: tuple[str, ...]):
    backend = ToolScriptBackend(replies)
    settings = Toolbox(tuple(resolve(["calculator"])), 4, 5.0, 1000, 8)
    [[c]] = generate_with_tools(backend, [GenerationRequest("P", 0, 1, 7, stop=stop)], SamplingParams(400),
                                settings, backend.encode, ToolStats())
    return backend, c


def test_a_stop_string_before_the_call_ends_the_turn_without_calling():
    backend, c = tool_turn(["Done.\n```\n" + CALC], stop=("\n```\n",))
    assert c.text == "Done.\n```\n" and c.finished and not c.tool_calls and backend.generate_calls == 1


def test_a_call_before_the_stop_string_runs_and_the_resumed_reply_stops_at_it():
    backend, c = tool_turn([CALC + "\n```\nnever", " So it is 42.\n```\nmore prose"], stop=("\n```\n",))
    assert c.text == CALC + response_text("42") + " So it is 42.\n```\n" and c.finished
    assert [r.stop for call in backend.calls for r in call] == [("\n```\n",)] * 2


# --- configuration ------------------------------------------------------------------------------------

def test_agents_get_generation_stop_unless_they_have_their_own(make_cfg):
    stops = StopStrings.of(make_cfg("generation.stop=[A]", "agents=[{stop: [B]}, {stop: []}]"))
    assert [stops.of_agent(i) for i in range(3)] == [("B",), (), ("A",)]
    assert StopStrings.of(make_cfg()).of_agent(0) == ()


def test_backslash_escapes_in_a_stop_string_are_read_as_in_python(make_cfg):
    cfg = make_cfg('generation.stop=["\\n```\\n", "a\\\\n", "\\d"]')
    assert cfg.generation.stop == ["\\n```\\n", "a\\\\n", "\\d"]  # Hydra keeps them as written
    assert StopStrings.of(cfg).default == ("\n```\n", "a\\n", "\\d")


def test_the_documented_code_example_stops_at_a_closing_fence(make_cfg):
    """The docs' command lines, split as a shell splits them (single quotes keep everything)."""
    section = (ROOT / "docs" / "backends.md").read_text().split("## Stop strings")[1]
    block = re.search(r"~~~bash\n(.*?)~~~", section, re.S)[1]
    every, agent_1 = [shlex.split(line.split("train.py", 1)[1], comments=True) for line in block.splitlines()]
    assert StopStrings.of(make_cfg(*every)).of_agent(1) == ("\n```\n",)
    stops = StopStrings.of(make_cfg(*agent_1))
    assert (stops.of_agent(0), stops.of_agent(1)) == ((), ("\n```\n",))


@pytest.mark.parametrize("override, key", [('generation.stop=["x", ""]', "generation.stop"),
                                           ('agents=[{stop: [""]}]', "agents[0].stop")])
def test_an_empty_stop_string_is_a_one_line_config_error(run_cli, override, key):
    code, lines = run_cli(override)
    assert code == 2 and key in lines[-1] and "must not be empty" in lines[-1]


@pytest.mark.parametrize("override, key", [('generation.stop=["x\ufffd"]', "generation.stop"),
                                           ('agents=[{stop: ["\ufffd"]}]', "agents[0].stop")])
def test_a_stop_string_holding_the_replacement_character_is_a_one_line_config_error(run_cli, override, key):
    """The vLLM stop-string test failed when its stop string was a partial byte's U+FFFD: vLLM ended
    the completion a token after `hf` did. Such a string is refused at start-up."""
    code, lines = run_cli(override)
    assert code == 2 and key in lines[-1] and "U+FFFD" in lines[-1]


# --- a training run -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_training_run_ends_completions_at_the_stop_string_in_training_and_evaluation(make_cfg, monkeypatch):
    """`e` is in most of the tiny model's texts: completions end at it, finished, in rollouts.jsonl."""
    from magrpo.backends.hf import HFBackend
    from magrpo.trainer import train

    seen = []  # (request, its completions, the agent's tokenizer) of every generate call
    generate = HFBackend.generate

    def recording(self, requests, params):
        out = generate(self, requests, params)
        seen.extend((r, cs, self.agents[r.agent].tokenizer) for r, cs in zip(requests, out))
        return out

    monkeypatch.setattr(HFBackend, "generate", recording)
    run = train(make_cfg("generation.stop=[e]", "agents=[{stop: []}]", "trainer.steps=1",
                         "generation.max_new_tokens=12"))
    assert {(r.agent, r.stop) for r, _, _ in seen} == {(0, ()), (1, ("e",))}
    assert {r.n for r, _, _ in seen} == {1, 2}  # evaluation's paths (K=1) and training's trees (K=2)
    stopped = [(c, tok) for r, cs, tok in seen if r.agent == 1 for c in cs if "e" in c.text]
    assert stopped, "no completion of agent 1 wrote an e: pick another stop string"
    for c, tok in stopped:  # through the token that completes the first e, an end, not a truncation
        assert c.finished and "e" not in tok.decode(c.token_ids[:-1], skip_special_tokens=True)
    records = [json.loads(line) for line in open(run / "rollouts.jsonl")]
    logged = [text for r in records for node in r["nodes"] for text in node["completions"][1] if "e" in text]
    assert logged and set(logged) <= {c.text for c, _ in stopped}
