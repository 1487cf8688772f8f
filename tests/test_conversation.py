"""Conversations (external.history=messages | continuation): a prompt grown turn by turn from the
sampled tokens equals a full render of the chat, for ChatML, SmolLM2's template and a Qwen3-style
one that strips reasoning from earlier replies (docs/conversations.md)."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from magrpo.conversation import Conversation, EncodingMismatch, first_chat, turn_template
from magrpo.errors import ConfigError
from magrpo.models import Agent
from magrpo.tiny import TinySpec, tiny_model_path
from magrpo.tree import Completion
from tests.chat_templates import CHATML, QWEN3_STYLE, SMOLLM2

PROMPT = "Write `def add(a, b)`."
REPLIES = ["def add(a, b):\n    return a - b", "def add(a, b):\n    return a + b"]
FEEDBACK = ["Test failed: add(1, 2) returned -1, expected 3.", "All tests passed. Say <|im_end|> if done."]
PLAIN_FEEDBACK = ["Test failed: add(1, 2) returned -1, expected 3.", "All tests passed."]


@pytest.fixture(scope="module")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(tiny_model_path(TinySpec()))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


def agent_with(tokenizer, template: str | None, **fields) -> Agent:
    tokenizer.chat_template = template
    return Agent(0, None, tokenizer, use_chat_template=template is not None, model_path="tiny", **fields)


def reply(tokenizer, text: str, end: str | None = "<|im_end|>") -> Completion:
    """A sampled reply: its text's tokens, then the end token (None: cut at the token limit)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if end is not None:
        ids = ids + [tokenizer.convert_tokens_to_ids(end)]
    return Completion(ids, text, [], finished=end is not None)


def grow(agent: Agent, conversation: Conversation, replies: list[Completion], feedbacks: list[str] = FEEDBACK
         ) -> tuple[list[int], list[int]]:
    """Two turns of the chat built incrementally: (turn-2 prompt ids, first prompt ids)."""
    first = agent.encode_prompts([PROMPT])[0]
    continuation: tuple[int, ...] = ()
    chat = first_chat(agent, PROMPT)
    for completion, feedback in zip(replies, feedbacks):
        completion.prompt_ids = first + list(continuation)
        continuation, chat = conversation.extend(0, continuation, completion, feedback, chat)
    return first + list(continuation), first


def full_render(agent: Agent, replies: list[str], feedbacks: list[str] = FEEDBACK) -> str:
    messages = [{"role": "user", "content": PROMPT}]
    for text, feedback in zip(replies, feedbacks):
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": feedback}]
    return agent.render(messages, add_generation_prompt=True)


def with_eos(tokenizer):
    """The tiny model's EOS is <|endoftext|>; a chat model ends its replies with <|im_end|>."""
    tokenizer.eos_token = "<|im_end|>"
    return tokenizer


@pytest.mark.parametrize("template", [CHATML, SMOLLM2], ids=["chatml", "smollm2"])
@pytest.mark.parametrize("system", ["", "You write Python."])
def test_incremental_ids_equal_the_full_renders_tokens(tokenizer, template, system):
    agent = agent_with(with_eos(tokenizer), template, system_prompt=system)
    ids, _ = grow(agent, Conversation([agent], "messages", "strict"), [reply(tokenizer, r) for r in REPLIES])
    full = full_render(agent, REPLIES)
    assert tokenizer.decode(ids, skip_special_tokens=False) == full
    # the feedback's spelled <|im_end|> stays characters, as in encode_prompts
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == full.count("<|im_end|>") - 1
    # token for token, where no message spells a special token: what tokenizing the whole render gives
    plain, _ = grow(agent, Conversation([agent], "messages", "strict"), [reply(tokenizer, r) for r in REPLIES],
                    PLAIN_FEEDBACK)
    assert plain == tokenizer(full_render(agent, REPLIES, PLAIN_FEEDBACK), add_special_tokens=False)["input_ids"]


def test_a_reply_cut_at_the_token_limit_gets_the_templates_end(tokenizer):
    agent = agent_with(with_eos(tokenizer), CHATML)
    ids, _ = grow(agent, Conversation([agent], "messages", "strict"),
                  [reply(tokenizer, REPLIES[0], end=None), reply(tokenizer, REPLIES[1])])
    assert tokenizer.decode(ids, skip_special_tokens=False) == full_render(agent, REPLIES)


def test_an_eos_the_template_does_not_write_is_left_out(tokenizer):
    tokenizer.eos_token = "<|endoftext|>"
    agent = agent_with(tokenizer, CHATML)
    ids, _ = grow(agent, Conversation([agent], "messages", "strict"),
                  [reply(tokenizer, r, end="<|endoftext|>") for r in REPLIES])
    assert tokenizer.eos_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == full_render(agent, REPLIES)


def test_qwen3_style_template_grows_from_a_fixed_base_and_keeps_the_sampled_thinking(tokenizer):
    agent = agent_with(with_eos(tokenizer), QWEN3_STYLE, template_kwargs={"enable_thinking": False})
    assert turn_template(agent).fixed_base  # appending to a render of the earlier chat would re-render the reply
    thought = [f"<think>\nplan {i}\n</think>\n\n{r}" for i, r in enumerate(REPLIES)]
    ids, _ = grow(agent, Conversation([agent], "messages", "ignore_strippable"), [reply(tokenizer, t) for t in thought])
    built = tokenizer.decode(ids, skip_special_tokens=False)
    assert "plan 0" in built  # the agent reads the thinking it sampled ...
    assert "plan 0" not in full_render(agent, thought)  # ... which the template's own render strips
    assert built.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking=false reached it
    with pytest.raises(EncodingMismatch, match="external.encoding_check=strict: agent 0's turn-2 prompt"):
        grow(agent, Conversation([agent], "messages", "strict"), [reply(tokenizer, t) for t in thought])


def test_a_wrong_delta_is_caught_by_the_check(tokenizer, monkeypatch):
    agent = agent_with(with_eos(tokenizer), CHATML)
    conversation = Conversation([agent], "messages", "ignore_strippable")
    bad = conversation.templates[0].__class__(closing="<|im_end|>\n", user_before="<|im_start|>system\n",
                                             user_after="<|im_end|>\n<|im_start|>assistant\n", fixed_base=False)
    conversation.templates[0] = bad
    with pytest.raises(EncodingMismatch, match="differs from the full render"):
        grow(agent, conversation, [reply(tokenizer, r) for r in REPLIES])
    conversation.check = "off"
    grow(agent, conversation, [reply(tokenizer, r) for r in REPLIES])  # off: no check


def test_continuation_inserts_the_feedback_into_the_reply(tokenizer):
    agent = agent_with(with_eos(tokenizer), CHATML)
    ids, first = grow(agent, Conversation([agent], "continuation"), [reply(tokenizer, r) for r in REPLIES])
    text = tokenizer.decode(ids[len(first):], skip_special_tokens=False)
    assert text == f"{REPLIES[0]}\n\n{FEEDBACK[0]}\n\n{REPLIES[1]}\n\n{FEEDBACK[1]}\n\n"
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 1  # the first prompt's own; replies go on


def test_messages_without_a_chat_template_is_refused_in_one_line(tokenizer):
    agent = agent_with(tokenizer, None)
    with pytest.raises(ConfigError) as e:
        Conversation([agent], "messages")
    assert str(e.value).startswith("external.history: messages needs a chat template") and "\n" not in str(e.value)
    Conversation([agent], "continuation")  # needs no template


@pytest.fixture(scope="module")
def chat_tiny(tmp_path_factory):
    """The tiny model with a ChatML template (its tokenizer has no <|im_start|> token: the markup is text)."""
    import shutil

    folder = tmp_path_factory.mktemp("models") / "tiny-chat"
    shutil.copytree(tiny_model_path(TinySpec()), folder)
    (folder / "chat_template.jinja").write_text(CHATML)
    return folder


@pytest.fixture(scope="module")
def chat_agents(chat_tiny):
    from magrpo.models import load_agents
    from tests.conftest import SMALL, compose

    agents = load_agents(compose([*SMALL, f"model.name={chat_tiny}"]), 2)
    assert all(a.use_chat_template for a in agents)
    return agents


@pytest.mark.parametrize("mode", ["messages", "continuation"])
def test_each_child_prompt_is_its_parents_prompt_and_reply_then_the_feedback(chat_tiny, chat_agents, mode):
    from magrpo.backends.hf import HFBackend
    from magrpo.conversation import conversation_of
    from magrpo.envs.length_ratio import LengthRatioEnv
    from magrpo.external.plain import plain
    from magrpo.feedback import Feedback
    from magrpo.generation import SamplingParams
    from magrpo.rollout import expand_trees
    from tests.conftest import SMALL, compose
    from tests.fakes import tree_settings

    cfg = compose([*SMALL, f"model.name={chat_tiny}", f"external.history={mode}", "external.encoding_check=strict"])
    agents = chat_agents
    env = LengthRatioEnv(LengthRatioEnv.Config(num_agents=2))
    conversation = conversation_of(cfg.external, agents)
    rollout = expand_trees(env.problems("train")[:2], env, HFBackend(agents), Feedback(cfg.external, env, plain),
                           tree_settings(num_generations=2, num_turns=3), SamplingParams(max_new_tokens=6), seed=1,
                           conversation=conversation)
    nodes = rollout.nodes
    assert [n.turn for n in nodes].count(2) == 2 * 2 * 2  # every branch grew to the third turn
    for node in nodes[2:]:
        parent_id, j = node.parent
        parent = nodes[parent_id]
        for a in range(2):
            chosen = parent.completions[a][parent.joint[j][a]]
            own = node.completions[a][0].prompt_ids
            assert own[: len(chosen.prompt_ids)] == chosen.prompt_ids  # the parent's prompt, as it was sampled
            reply = Conversation.reply_ids(agents[a], chosen)
            assert own[len(chosen.prompt_ids) : len(chosen.prompt_ids) + len(reply)] == reply  # its own tokens
            feedback = agents[a].tokenizer.decode(own[len(chosen.prompt_ids) + len(reply):])
            assert feedback.count("Revise your previous answer") == 1  # plain, in a chat: only the request
            assert PROMPT_OF_LENGTH_RATIO not in feedback


PROMPT_OF_LENGTH_RATIO = "Write about"  # every length_ratio first prompt starts so


@pytest.mark.slow
def test_a_messages_run_trains_and_logs_the_feedback_as_the_next_prompt(chat_tiny, make_cfg):
    import json

    from magrpo.trainer import train

    run = train(make_cfg(f"model.name={chat_tiny}", "external.mode=plain", "external.history=messages",
                         "trainer.num_turns=2", "trainer.steps=1", "eval.every=0"))
    nodes = [node for line in open(run / "rollouts.jsonl") for node in json.loads(line)["nodes"]]
    later = [n for n in nodes if n["turn"] == 1]
    assert len(later) == 2 * 2  # two trees, two joint actions each
    assert all(p == "Revise your previous answer and give an improved version." for n in later for p in n["prompts"])
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert metrics[-1]["step"] == 1


def test_a_template_that_shows_tools_gets_each_result_as_its_own_tool_message(tokenizer):
    from magrpo.generation import GenerationRequest, SamplingParams
    from magrpo.tool_loop import generate_with_tools, text_encoder, tool_messages
    from magrpo.toolbox import Toolbox
    from magrpo.tools import ToolStats, resolve
    from tests.chat_templates import QWEN_TOOLS

    calculator = resolve(["calculator"])
    agent = agent_with(with_eos(tokenizer), QWEN_TOOLS, tool_schemas=(calculator[0].schema,))
    assert agent.shows_tools()
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    answer = "It is 42."

    class Scripted:  # the call, then (once a tool message is in the turn) the answer and <|im_end|>
        def generate(self, requests, params):
            out = []
            for r in requests:
                text = answer if r.continuation else call
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                ids += [tokenizer.eos_token_id] if r.continuation else []
                prompt = agent.encode_prompts([r.prompt])[0] + list(r.continuation)
                out.append([Completion(ids, text, prompt, finished=bool(r.continuation))])
            return out

    [[turn]] = generate_with_tools(Scripted(), [GenerationRequest(PROMPT, 0, 1, seed=1)],
                                   SamplingParams(max_new_tokens=200), Toolbox(tuple(calculator), 2, 5, 1000, 2),
                                   text_encoder([agent]), ToolStats(), tool_messages([agent]))
    full = agent.render([{"role": "user", "content": agent.user_content(PROMPT)},
                         {"role": "assistant", "content": call}, {"role": "tool", "content": "42"}],
                        add_generation_prompt=True)
    built = tokenizer.decode(turn.prompt_ids + turn.token_ids, skip_special_tokens=False)
    assert built == full + answer + "<|im_end|>"  # the template's own tool message, between the two replies
    inserted = [t for t, model in zip(turn.token_ids, turn.model_mask) if not model]
    assert tokenizer.decode(inserted, skip_special_tokens=False) == \
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert "<tool_response>\n42\n</tool_response>" in turn.text and "<|im_start|>" not in turn.text


def test_a_rounds_tool_messages_encode_in_one_call_as_they_do_one_by_one(chat_agents):
    from magrpo.conversation import encode_text, encode_texts

    agent = chat_agents[0]
    texts = ["", "ok", "<tool_response>\n42\n</tool_response>", f"x{agent.tokenizer.eos_token}y", " é = 1", ""]
    one_by_one = [list(agent.tokenizer(t, add_special_tokens=False, split_special_tokens=True)["input_ids"])
                  if t else [] for t in texts]  # the tokenizer itself, text by text
    assert encode_texts(agent, texts) == one_by_one
    assert [encode_text(agent, t) for t in texts] == one_by_one
    assert encode_texts(agent, ["", ""]) == [[], []]
    assert agent.tokenizer.eos_token_id not in encode_texts(agent, texts)[3]  # spelled, not the special token


class Continuing:
    """external.history=continuation as the expander sees it (the ids do not matter here)."""

    mode = "continuation"

    def extend(self, agent, continuation, completion, feedback, chat):
        return (*continuation, 0), []


def test_continuation_scores_the_whole_reply_not_the_last_fragment():
    """A turn in continuation mode samples a fragment that goes on the same reply: the env scores the
    reply so far (earlier fragments, the feedback between them, the new fragment), as the model read
    it; a code env scored only the fragment, often code-less ("the code above is right")."""
    from magrpo.rollout import expand_trees
    from tests.fakes import PROBLEMS, SAMPLING, FakeBackend, FakeEnv, serial, tree_settings

    seen: list[list[str]] = []

    def reward(problem, texts):
        seen.append(list(texts))
        return 0.0

    def feedback(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
        return [f"fix {text}" for text in agent_completions]

    env = FakeEnv(2, reward)
    tree = tree_settings(num_generations=1, num_turns=3, joint_mode="align")
    rollout = expand_trees(PROBLEMS[:1], env, FakeBackend(), serial(feedback, env), tree, SAMPLING,
                           conversation=Continuing())
    first, second, third = rollout.nodes
    reply0, reply1, reply2 = (node.completions[0][0].text for node in (first, second, third))
    assert len({reply0, reply1, reply2}) == 3
    assert [texts[0] for texts in seen] == [
        reply0,
        f"{reply0}\n\nfix {reply0}\n\n{reply1}",
        f"{reply0}\n\nfix {reply0}\n\n{reply1}\n\nfix {reply1}\n\n{reply2}",
    ]
    assert third.completions[0][0].text == reply2  # the node keeps the fragment it sampled (the loss's tokens)


THINK = "<think>\nThe calculator knows.\n</think>\n\n"


def tool_turn(tokenizer, agent, call: str):
    """Turn 1 of a tool-using agent: `call`, the calculator's result as the template's tool message,
    then "It is 42." and the end of the message."""
    from magrpo.generation import GenerationRequest, SamplingParams
    from magrpo.tool_loop import generate_with_tools, text_encoder, tool_messages
    from magrpo.toolbox import Toolbox
    from magrpo.tools import ToolStats, resolve

    class Scripted:
        def generate(self, requests, params):
            out = []
            for r in requests:
                text = "It is 42." if r.continuation else call
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                ids += [tokenizer.eos_token_id] if r.continuation else []
                prompt = agent.encode_prompts([r.prompt])[0] + list(r.continuation)
                out.append([Completion(ids, text, prompt, finished=bool(r.continuation))])
            return out

    calculator = resolve(["calculator"])
    [[turn]] = generate_with_tools(Scripted(), [GenerationRequest(PROMPT, 0, 1, seed=1)],
                                   SamplingParams(max_new_tokens=200), Toolbox(tuple(calculator), 2, 5, 1000, 2),
                                   text_encoder([agent]), ToolStats(), tool_messages([agent]))
    return turn


@pytest.mark.parametrize("template, think, check", [
    ("QWEN_TOOLS", "", "strict"),  # Qwen2.5-style: the grown prompt is the full render, character for character
    ("QWEN3_TOOLS", "", "strict"),
    ("QWEN3_TOOLS", THINK, "ignore_strippable"),  # Qwen3 strips earlier replies' <think> from the render
])
def test_a_conversation_grows_past_a_tool_call_on_qwen_style_tool_templates(tokenizer, template, think, check):
    """external.history=messages with a template that renders tools: a call in turn 1 made turn 2 stop with
    EncodingMismatch, in strict and in ignore_strippable (the check rendered the whole turn, tool message
    included, as one assistant message). The turn is now the assistant's parts with the result a tool
    message between them, as the template renders it."""
    import tests.chat_templates as templates
    from magrpo.tools import resolve

    schema = resolve(["calculator"])[0].schema
    agent = agent_with(with_eos(tokenizer), getattr(templates, template), tool_schemas=(schema,))
    call = think + '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    turn = tool_turn(tokenizer, agent, call)
    conversation = Conversation([agent], "messages", check)
    ids, chat = conversation.extend(0, (), turn, FEEDBACK[0], first_chat(agent, PROMPT))
    assert [m["role"] for m in chat] == ["user", "assistant", "tool", "assistant", "user"]
    assert chat[1]["content"] == call and chat[2]["content"] == "42" and chat[3]["content"] == "It is 42."
    built = tokenizer.decode(turn.prompt_ids + list(ids), skip_special_tokens=False)
    full = agent.render(chat, add_generation_prompt=True)
    assert (built == full) == (check == "strict")
    if check != "strict":
        with pytest.raises(EncodingMismatch, match="use external.encoding_check=ignore_strippable"):
            Conversation([agent], "messages", "strict").extend(0, (), turn, FEEDBACK[0], first_chat(agent, PROMPT))


def test_the_mismatch_advice_fits_the_check_in_use(tokenizer):
    """ignore_strippable advised "use ignore_strippable", the mode already in use."""
    agent = agent_with(with_eos(tokenizer), CHATML)
    conversation = Conversation([agent], "messages", "ignore_strippable")
    with pytest.raises(EncodingMismatch) as e:
        conversation.compare(agent, agent.encode_prompts(["something else"])[0], first_chat(agent, PROMPT))
    assert "use external.encoding_check=ignore_strippable" not in str(e.value)
    assert "external.encoding_check=off keeps the prompts as built" in str(e.value)
