"""Turns as a conversation (external.history=messages | continuation): how a child node's prompt
grows from its parent's, in token ids, so an agent reads exactly the tokens it sampled before.

messages: the agent's chat is [system], user (its first prompt), assistant (its turn-1 reply), user
(the feedback), ... rendered by its chat template. The ids of turn t+1's prompt are turn t's prompt
ids, the reply's sampled ids, then the template's text between them and the next generation (the
end of the assistant message, the new user message, the generation prompt), found once per
tokenizer by rendering probe chats (`TurnTemplate`). Appending to a render of the earlier chat
works for templates that render a message the same whatever follows it; one that re-renders earlier
replies (Qwen3 strips their <think> blocks) gets its deltas from a fixed base chat instead. Each
prompt so built is compared with a full render of the chat (external.encoding_check).

continuation: the feedback text is inserted into the agent's reply (between blank lines) and the
model continues that same reply; the inserted tokens belong to the next node's prompt, so they
never enter the loss.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from .errors import ConfigError, MagrpoError
from .tree import Completion

if TYPE_CHECKING:  # for annotations only: magrpo.models imports nothing of this module
    from .models import Agent

CONTENT_SLOT = "\ue001magrpo-slot\ue001"  # private-use characters: no chat template writes them

PROBE_USER, PROBE_REPLY = "Question?", "Answer."
THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)


class EncodingMismatch(MagrpoError):
    """An incrementally encoded prompt differs from the full render of its chat (external.encoding_check)."""


@dataclass(frozen=True)
class TurnTemplate:
    """What a chat template writes between an assistant reply's content and the next generation."""

    closing: str  # after the reply's content, e.g. "<|im_end|>\n"
    user_before: str  # before the next user message's content, e.g. "<|im_start|>user\n"
    user_after: str  # after it, through the generation prompt, e.g. "<|im_end|>\n<|im_start|>assistant\n"
    fixed_base: bool  # the template re-renders earlier replies: deltas come from a fixed base chat


def turn_template(agent: Agent, role: str = "user", key: str = "external.history",
                  fallback: str = "use external.history=continuation") -> TurnTemplate:
    """Probe the agent's chat template for what follows a reply when the next message has `role`
    (user: feedback; tool: a tool's result); a ConfigError naming `key` when it cannot be grown."""
    def render(messages: list[dict], gen: bool) -> str:
        return agent.render(messages, add_generation_prompt=gen)

    user = {"role": "user", "content": PROBE_USER}
    replied = render([user, {"role": "assistant", "content": CONTENT_SLOT}], False)
    if replied.count(CONTENT_SLOT) != 1:
        raise ConfigError(key, f"agent {agent.index}'s chat template rewrites assistant messages, so its chat "
                               f"cannot be grown message by message; {fallback}")
    closing = replied.split(CONTENT_SLOT)[1]
    bases = [([user, {"role": "assistant", "content": PROBE_REPLY}], False), ([user], True)]
    for base, fixed in bases:
        before = render(base, False)
        after = render([*base, {"role": role, "content": CONTENT_SLOT}], True)
        if after.startswith(before) and after.count(CONTENT_SLOT) == 1:
            user_before, user_after = after[len(before):].split(CONTENT_SLOT)
            return TurnTemplate(closing, user_before, user_after, fixed)
    raise ConfigError(key, f"agent {agent.index}'s chat template renders earlier messages differently once a "
                           f"{role} message follows, so its chat cannot be grown message by message; {fallback}")


def tool_message(agent: Agent, template: TurnTemplate, result: str) -> tuple[str, list[int]]:
    """A tool's result as the chat template's own tool message after a reply that stopped at its call
    (the reply did not end its message: the template's end of it comes first). (text, ids); the text
    as a completion's text shows it (special tokens left out)."""
    ids = [*encode_markup(agent, template.closing + template.user_before), *encode_text(agent, result),
           *encode_markup(agent, template.user_after)]
    return agent.tokenizer.decode(ids, skip_special_tokens=True), ids


class Conversation:
    """Grows each agent's prompt ids from turn to turn (one instance per run, built from the agents)."""

    def __init__(self, agents: Sequence[Agent], mode: str, check: str = "ignore_strippable"):
        self.agents, self.mode, self.check = list(agents), mode, check
        self.templates: dict[int, TurnTemplate] = {}
        if mode == "messages":
            from .models import no_chat_template  # torch and transformers: only for a conversation's agents

            for agent in self.agents:
                if not agent.use_chat_template:
                    raise no_chat_template(agent.index, agent.model_path)
                self.templates[agent.index] = turn_template(agent)

    def extend(self, agent: int, continuation: Sequence[int], completion: Completion, feedback: str,
               chat: Sequence[dict]) -> tuple[tuple[int, ...], list[dict]]:
        """(the next turn's continuation, its chat). The continuation (ids after the encoded first prompt)
        is this turn's, the reply's ids, then the feedback; `chat` holds the messages before this reply
        (the first user message first) and grows by the reply's messages and the feedback: the chat the
        full-render check renders (continuation mode keeps none)."""
        a = self.agents[agent]
        reply = self.reply_ids(a, completion)
        if self.mode == "continuation":
            return (*continuation, *reply, *encode_text(a, f"\n\n{feedback}\n\n")), []
        template = self.templates[agent]
        closing = template.closing
        if len(reply) < len(completion.token_ids):  # the reply ended with an EOS: the template's own end?
            eos = a.tokenizer.decode(completion.token_ids[-1:], skip_special_tokens=False)
            if closing.startswith(eos):
                reply, closing = list(completion.token_ids), closing[len(eos):]
        ids = (*continuation, *reply, *encode_markup(a, closing + template.user_before),
               *encode_text(a, feedback), *encode_markup(a, template.user_after))
        chat = [*chat, *turn_messages(a, completion), {"role": "user", "content": feedback}]
        if self.check != "off":
            self.compare(a, [*completion.prompt_ids[: len(completion.prompt_ids) - len(continuation)], *ids], chat)
        return ids, chat

    @staticmethod
    def reply_ids(agent: Agent, completion: Completion) -> list[int]:
        """The reply's sampled ids without a final EOS (the chat's own markup ends the message)."""
        ids = list(completion.token_ids)
        if completion.finished and ids and ids[-1] in agent.eos_ids():
            ids.pop()
        return ids

    def compare(self, agent: Agent, ids: list[int], chat: Sequence[dict]) -> None:
        full = agent.render(list(chat), add_generation_prompt=True)
        built = agent.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if self.check == "ignore_strippable":
            same = strippable(built) == strippable(full)
        else:
            same = built == full
        if not same:
            at = next((i for i, (x, y) in enumerate(zip(built, full)) if x != y), min(len(built), len(full)))
            turn = sum(m["role"] == "user" for m in chat)
            advice = ("use external.encoding_check=ignore_strippable if the template strips parts of earlier "
                      "replies (or off)" if self.check == "strict" else
                      "the template renders this chat otherwise than message by message: external.encoding_check="
                      "off keeps the prompts as built (the model then reads what no full render shows), or use "
                      "external.history=continuation")
            raise EncodingMismatch(
                f"external.encoding_check={self.check}: agent {agent.index}'s turn-{turn} prompt, built "
                f"turn by turn, differs from the full render of its chat at character {at}: "
                f"{built[max(0, at - 30):at + 30]!r} vs {full[max(0, at - 30):at + 30]!r}; {advice}")


def first_chat(agent: Agent, prompt: str) -> list[dict]:
    """A conversation's chat before the first reply: the first user message (tools the template does
    not show described in front of it, as the first prompt was encoded)."""
    return [{"role": "user", "content": agent.user_content(prompt)}]


def turn_messages(agent: Agent, completion: Completion) -> list[dict]:
    """A reply as chat messages: one assistant message; where the agent's template shows tools (its tool
    results were spliced in as the template's own tool messages, magrpo.tool_loop.tool_messages), the
    assistant's parts with each result a tool message between them, as the template renders such a turn.
    The parts are the text of the sampled tokens; the results those of its calls, in order."""
    mask = completion.model_mask
    if mask is None or all(mask) or not agent.shows_tools():
        return [{"role": "assistant", "content": completion.text}]
    outputs = iter(call["output"] for call in completion.tool_calls)
    messages, start = [], 0
    for end in range(1, len(mask) + 1):
        if end == len(mask) or mask[end] != mask[start]:
            if mask[start]:
                text = agent.tokenizer.decode(completion.token_ids[start:end], skip_special_tokens=True)
                messages.append({"role": "assistant", "content": text})
            else:
                messages.append({"role": "tool", "content": next(outputs)})
            start = end
    if messages[-1]["role"] == "tool":  # a result the turn ended on: the reply's message still closes
        messages.append({"role": "assistant", "content": ""})
    return messages


def conversation_of(external_cfg, agents: Sequence[Agent]) -> Conversation | None:
    """The run's Conversation (external.history=messages | continuation), else None."""
    if external_cfg.history not in ("messages", "continuation"):
        return None
    return Conversation(agents, external_cfg.history, external_cfg.encoding_check)


def strippable(text: str) -> str:
    """The text without <think> blocks and whitespace: what a template may drop from earlier replies."""
    return "".join(THINK_BLOCK.sub("", text).split())


def encode_markup(agent: Agent, text: str) -> list[int]:
    """Template text: its special tokens (`<|im_start|>`) are tokens."""
    return list(agent.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def encode_text(agent: Agent, text: str) -> list[int]:
    """Message content: plain characters, even where it spells a special token."""
    return encode_texts(agent, [text])[0]


def encode_texts(agent: Agent, texts: list[str]) -> list[list[int]]:
    """encode_text of each text, in one tokenizer call (a round's tool messages): plain characters,
    even where a text spells a special token."""
    if not any(texts):
        return [[] for _ in texts]
    ids = agent.tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return [list(row) if text else [] for text, row in zip(texts, ids)]
