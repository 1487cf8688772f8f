"""Fakes shared by the tests: a backend, envs, feedback and a clock that stand in for the model,
the graders and time, so the tree, evaluation and expert logic run in milliseconds without a model."""
from __future__ import annotations

import copy
import re
from dataclasses import replace
from typing import Callable

from magrpo.advantage import AdvantageSettings
from magrpo.config import ExternalConfig, TrainConfig
from magrpo.env import Environment
from magrpo.feedback import Feedback
from magrpo.generation import SamplingParams
from magrpo.loss import LossSettings
from magrpo.rollout import TreeSettings
from magrpo.tree import Completion
from magrpo.update import UpdateSettings

PROBLEMS = [{"prompt": "P0", "offset": 0.0}, {"prompt": "P1", "offset": 0.25}]
B = len(PROBLEMS)
SAMPLING = SamplingParams(max_new_tokens=4)
TEXT = re.compile(r"^a(\d+)k(\d+)u(\d+)$")

# Settings objects have no defaults of their own (magrpo.config holds them all): the default config's,
# with a test's changes.
DEFAULTS = TrainConfig()


def tree_settings(**changes) -> TreeSettings:
    return replace(TreeSettings.of(DEFAULTS), **changes)


def advantage_settings(**changes) -> AdvantageSettings:
    return replace(AdvantageSettings.of(DEFAULTS), **changes)


def loss_settings(**changes) -> LossSettings:
    return replace(LossSettings.of(DEFAULTS), **changes)


def update_settings(**changes) -> UpdateSettings:
    return replace(UpdateSettings.of(DEFAULTS), **changes)


class FakeBackend:
    """`request.n` completions per request, texts "a{agent}k{k}u{uid}" with a globally unique uid;
    `cut(agent, k)` True: that completion is truncated (finished=False)."""

    def __init__(self, cut: Callable[[int, int], bool] = lambda agent, k: False):
        self.cut = cut
        self.generate_calls = 0
        self.sync_calls = 0
        self.origin: dict[int, tuple[str, int]] = {}  # uid -> (prompt, agent) of the request it answered
        self.requests_per_call: list[int] = []
        self._uid = 0

    def generate(self, requests, params):
        self.generate_calls += 1
        self.requests_per_call.append(len(requests))
        out = []
        for r in requests:
            comps = []
            for k in range(r.n):
                self._uid += 1
                self.origin[self._uid] = (r.prompt, r.agent)
                comps.append(Completion(token_ids=[k + 1, self._uid % 50], text=f"a{r.agent}k{k}u{self._uid}",
                                        prompt_ids=[len(r.prompt) % 50], finished=not self.cut(r.agent, k)))
            out.append(comps)
        return out

    def sync_weights(self):
        self.sync_calls += 1


def sum_of_indices(problem, texts):
    """Reward: the sum of the chosen completion indices k, plus the problem's offset."""
    return sum(int(TEXT.match(t).group(2)) for t in texts) + problem["offset"]


class FakeEnv(Environment):
    def __init__(self, n: int, reward: Callable = sum_of_indices):
        super().__init__(cfg=None)
        self._n = n
        self._reward = reward
        self.reward_calls = 0
        self.reward_batch_sizes: list[int] = []

    @property
    def num_agents(self) -> int:
        return self._n

    def agent_prompts(self, problem):
        return [f"{problem['prompt']}::agent{i}" for i in range(self._n)]

    def rewards(self, problems, joint_completions):
        self.reward_calls += 1
        self.reward_batch_sizes.append(len(joint_completions))
        assert len(problems) == len(joint_completions)
        return [self._reward(p, texts) for p, texts in zip(problems, joint_completions)]


class RecordingFeedback:
    """Returns one distinct prompt per agent and keeps a deep copy of every call's arguments."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
        out = [f"fb{len(self.calls)}-a{i}" for i in range(num_agents)]
        self.calls.append(copy.deepcopy(dict(
            prompt=prompt, agent_completions=agent_completions, num_agents=num_agents,
            prompt_history_per_agent=prompt_history_per_agent,
            response_history_per_agent=response_history_per_agent, returned=out)))
        return out


def serial(fn, env) -> Feedback:
    """One branch at a time, so a recording function sees the calls in branch order."""
    return Feedback(ExternalConfig(max_concurrency=1), env, fn)


class AlternatingBackend:
    """Greedy rows always write "pass"; sampled rows alternate pass, fail, pass, ... in call order."""

    def __init__(self):
        self.generate_calls = 0
        self.greedy_calls = 0
        self.counter = 0

    def generate(self, requests, params):
        self.generate_calls += 1
        self.greedy_calls += params.greedy
        out = []
        for r in requests:
            assert r.n == 1  # evaluation paths: one completion per agent per node
            if params.greedy:
                text = "pass"
            else:
                text = "pass" if self.counter % 2 == 0 else "fail"
                self.counter += 1
            out.append([Completion([1], text, [2], True)])
        return out

    def sync_weights(self):
        pass


class PassEnv(Environment):
    num_agents = 1

    def agent_prompts(self, problem):
        return [problem["prompt"]]

    def outcomes(self, problems, joint_completions):
        return [{"reward": float(t[0] == "pass"), "passed": float(t[0] == "pass")} for t in joint_completions]


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tiny_qwen2(vocab_size: int, num_hidden_layers: int, seed: int = 0):
    """A randomly initialised Qwen2 of a few thousand parameters (hidden 16): no download, no cache."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=num_hidden_layers,
                                        num_attention_heads=2, num_key_value_heads=1, intermediate_size=32))


def lora_tiny_qwen2():
    """tiny_qwen2 (vocab 32, 2 layers) wrapped with a LoRA on every linear layer as load_agents wraps its
    models, non-zero from the start (init_lora_weights=False), in train mode: the update's test model."""
    from peft import LoraConfig, get_peft_model

    from magrpo.models import peft_deprecation_silenced

    lora = LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    with peft_deprecation_silenced():
        model = get_peft_model(tiny_qwen2(vocab_size=32, num_hidden_layers=2), lora)
    model.train()
    return model


class ToolScriptBackend:
    """Character-level (a token is `ord(c)`): a request whose turn so far holds i tool responses gets
    `replies[min(i, last)]`, cut at `params.stop` (kept, no EOS), at the request's own `stop` (kept,
    finished) and at its budget (the request's `max_new_tokens`, else the call's). `replies`
    may also be a dict: a script per request prompt."""

    def __init__(self, replies: list[str] | dict[str, list[str]]):
        self.replies = replies
        self.generate_calls = 0
        self.calls: list[list] = []  # per generate call: its requests

    @staticmethod
    def ids(agent: int, text: str) -> list[int]:
        return [ord(c) for c in text]

    @classmethod
    def encode(cls, agent: int, texts: list[str]) -> list[list[int]]:  # the tool loop's EncodeText
        return [cls.ids(agent, text) for text in texts]

    def generate(self, requests, params):
        self.generate_calls += 1
        self.calls.append(list(requests))
        out = []
        for r in requests:
            seen = "".join(map(chr, r.continuation)).count("<tool_response>")
            script = self.replies[r.prompt] if isinstance(self.replies, dict) else self.replies
            text = script[min(seen, len(script) - 1)]
            # (end, is a pause marker): the first to end wins, the request's own stop strings a tie
            ends = sorted((text.index(s) + len(s), s not in r.stop) for s in (*r.stop, *params.stop) if s in text)
            finished = not ends or not ends[0][1]
            text = text[: ends[0][0]] if ends else text
            if len(text) > r.budget(params):
                text, finished = text[: r.budget(params)], False
            ids = self.ids(r.agent, text)
            out.append([Completion(ids, text, [len(r.prompt), *r.continuation], finished,
                                   [-0.5] * len(ids) if params.logprobs else None) for _ in range(r.n)])
        return out
