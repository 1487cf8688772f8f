"""A warm start for the tool-arithmetic task: the tiny model, fine-tuned (full weights, `WarmSpec.steps`
LM steps on the CPU, one thread, deterministic) on generated transcripts of `tool_arith` questions in
which most show a calculator call and the copy of its result into the answer, and the rest guess; the
decision to call is taught apart, as probability `WarmSpec.call_share`. A random-init model never
writes a valid `<tool_call>` by chance; this one sometimes does, and GRPO has to find out from the
rewards alone that calling pays. Saved as an ordinary HF folder, built once and cached by its recipe
(like magrpo/tiny.py):

    python -m magrpo.envs.tool_arith_warm        # prints the folder, for model.name=<folder>

500 steps were not enough (the call's format, but no copied digits). 1500 copied on an AVX2 machine but
not on an AVX-512 one, whose float sums differ: after 1500 steps only 3 of 20 greedy calls carried the
question's numbers there. So training goes on past `steps` until greedy calls and answers copy on
`copy_share` of fixed questions (`copying`), on every machine, and the test built on it holds on both.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import warnings
from dataclasses import dataclass
from pathlib import Path

from magrpo.paths import cache_root
from magrpo.tiny import TinySpec, build_once, tiny_model_path
from magrpo.tools import CALL_END, CALL_START, TOOLS, response_text, tools_preamble

from .tool_arith import product_pair, question

FORMAT_VERSION = 2  # bump when the recipe below changes in a way WarmSpec does not show


@dataclass(frozen=True)
class WarmSpec:
    call_share: float = 0.2  # the probability of calling the calculator it is taught; else it guesses a number
    shown_calls: float = 0.9  # transcripts that show a call (how to write one and copy its result)
    digits: int = 2  # env.digits of the problems
    steps: int = 1500  # at least this many LM steps, then more until the model copies (below)
    max_steps: int = 6000
    check_every: int = 250  # after `steps`, test the copying every this many steps and stop once it holds
    copy_share: float = 0.9  # of `checks` fixed questions (greedy): calls with their numbers, answers with the result
    checks: int = 16
    batch_size: int = 8
    lr: float = 3e-3
    seed: int = 0
    # The base: the tiny model at transformers' usual init (the trainer's tiny, 0.1, is wide enough for a
    # LoRA to move; at 0.02 full fine-tuning learns the call's text in ~100 steps instead of never)
    base: TinySpec = TinySpec(init_std=0.02)


def call_text(a: int, b: int) -> str:
    body = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}})
    return f"{CALL_START}{body}{CALL_END}"


def prompt_text(a: int, b: int) -> str:
    """The prompt exactly as the trainer formats it with tools=[calculator] and no chat template."""
    return tools_preamble([TOOLS.get("calculator").schema]) + question(a, b)


def transcript(rng: random.Random, calls: float, digits: int) -> tuple[str, list[tuple[str, bool]]]:
    """(prompt, segments), a call with probability `calls`, else a guess; segments are (text, written
    by the model): the tool message is not."""
    a, b = product_pair(rng, digits)
    if rng.random() < calls:
        return prompt_text(a, b), [(call_text(a, b), True), (response_text(str(a * b)), False),
                                   (f"answer: {a * b}", True)]
    return prompt_text(a, b), [(f"answer: {rng.randint(10 ** (2 * digits - 1), 10 ** (2 * digits) - 1)}", True)]


def warm_model_path(spec: WarmSpec = WarmSpec(), cache_dir: str | Path | None = None) -> Path:
    """The warm-started model's folder, built on first use (cached; the key covers the base model, the
    recipe and the prompt format, so a change to any of them builds a new one)."""
    base = tiny_model_path(spec.base, cache_dir)
    sample = transcript(random.Random(0), 1.0, spec.digits)
    payload = json.dumps({"format": FORMAT_VERSION, "base": base.name, "spec": dataclasses.asdict(spec),
                          "sample": sample}, sort_keys=True)
    final = cache_root(cache_dir) / "tool_arith_warm" / hashlib.sha256(payload.encode()).hexdigest()[:16]
    return build_once(final, lambda tmp: _build(spec, base, tmp), "warm-started tool_arith model")


def _encode(tok, prompt: str, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """Ids as the trainer sees them: the prompt and each segment tokenized apart (generation stops at
    a call, the tool message is encoded alone), then EOS; `learn` marks the model's tokens after its
    first (the first, call or guess, is taught by the decision loss in `_loss`)."""
    ids = list(tok(prompt)["input_ids"])
    learn = [False] * len(ids)
    for text, by_model in segments:
        seg = tok(text, add_special_tokens=False)["input_ids"]
        ids += seg
        learn += [by_model] * len(seg)
    learn[len(tok(prompt)["input_ids"])] = False
    return ids + [tok.eos_token_id], learn + [True]


def _build(spec: WarmSpec, base: Path, out: Path) -> None:
    import torch

    # One thread: the same weights whatever the machine's thread count (a matmul's sums depend on how
    # threads split it), and on 2 busy cores a second thread made these small steps ~3x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _train(spec, base, out)
    finally:
        torch.set_num_threads(threads)


def _train(spec: WarmSpec, base: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(spec.seed)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    rng = random.Random(spec.seed)
    shared, prompt, call, guess = _shapes(tok, spec.digits)
    first = torch.tensor([call, guess])
    target = torch.tensor([spec.call_share, 1 - spec.call_share])
    for step in range(1, spec.max_steps + 1):
        rows = [_encode(tok, *transcript(rng, spec.shown_calls, spec.digits)) for _ in range(spec.batch_size)]
        loss = _loss(model, shared, prompt, rows, tok.pad_token_id, first, target)
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step >= spec.steps and (step - spec.steps) % spec.check_every == 0:
            calls, answers = copying(model, tok, spec)
            if min(calls, answers) >= spec.copy_share:
                break
    else:
        raise RuntimeError(f"tool_arith warm start: after {spec.max_steps} steps greedy calls copy the question "
                           f"in {calls:.0%} and answers copy the result in {answers:.0%} of {spec.checks} "
                           f"questions (want {spec.copy_share:.0%})")
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    # how it went on this machine (the steps differ between CPUs whose float sums differ)
    record = {"steps": step, "calls_copy": calls, "answers_copy": answers}
    (out / "warm_start.json").write_text(json.dumps(record) + "\n")


def copying(model, tok, spec: WarmSpec) -> tuple[float, float]:
    """(share of calls, share of answers) that copy, greedy, on `spec.checks` fixed questions (their own
    seed, not the training draws): from the call's first token, does the model write the call with the
    question's numbers; after that call and its true result, does it answer with the result."""
    rng = random.Random(f"tool_arith_warm:checks:{spec.seed}")
    pairs = [product_pair(rng, spec.digits) for _ in range(spec.checks)]
    prompts = [tok(prompt_text(a, b))["input_ids"] for a, b in pairs]  # one length (fixed-length products)
    calls = [tok(call_text(a, b), add_special_tokens=False)["input_ids"] for a, b in pairs]
    answers = [tok(f"answer: {a * b}", add_special_tokens=False)["input_ids"] for a, b in pairs]
    results = [tok(response_text(str(a * b)), add_special_tokens=False)["input_ids"] for a, b in pairs]
    model.eval()
    try:
        wrote_call = _greedy(model, [p + c[:1] for p, c in zip(prompts, calls)], [c[1:] for c in calls])
        wrote_answer = _greedy(model, [p + c + r for p, c, r in zip(prompts, calls, results)], answers)
    finally:
        model.train()
    return wrote_call, wrote_answer


def _greedy(model, contexts: list[list[int]], wanted: list[list[int]]) -> float:
    """Share of rows whose greedy continuation of the context starts with the wanted ids (rows grouped by
    length: no padding, so the numbers are those of each row alone)."""
    import torch

    hits = 0
    by_length: dict[tuple[int, int], list[int]] = {}
    for i, (c, w) in enumerate(zip(contexts, wanted)):
        by_length.setdefault((len(c), len(w)), []).append(i)
    with torch.no_grad():
        for (_, steps), rows in by_length.items():
            ids = torch.tensor([contexts[i] for i in rows])
            for _ in range(steps):
                ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            got = ids[:, -steps:].tolist()
            hits += sum(g == wanted[i] for g, i in zip(got, rows))
    return hits / len(contexts)


def _shapes(tok, digits: int) -> tuple[int, int, int, int]:
    """(tokens every prompt starts with, prompt length, first token of a call, of a guess). Every prompt
    starts with the same tools preamble and has the same length (products of a fixed length)."""
    rng = random.Random(0)
    prompts = [tok(transcript(rng, 1.0, digits)[0])["input_ids"] for _ in range(16)]
    if len({len(p) for p in prompts}) != 1:
        raise RuntimeError(f"tool_arith prompts differ in length: {sorted({len(p) for p in prompts})} tokens")
    shared = next(i for i, column in enumerate(zip(*prompts)) if len(set(column)) > 1)
    call, guess = (tok(text, add_special_tokens=False)["input_ids"][0] for text in (call_text(1000, 1000), "answer: 1"))
    return shared, len(prompts[0]), call, guess


def _loss(model, shared: int, prompt: int, rows: list[tuple[list[int], list[bool]]], pad_id: int, first, target):
    """Cross-entropy over the model's tokens of a batch of transcripts, plus the decision loss: at the
    first completion token, cross-entropy against (call_share, 1 - call_share) over (call, guess), so
    the model calls with probability call_share whatever share of the transcripts show calls."""
    import torch
    import torch.nn.functional as F

    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r, _ in rows])  # right padding: never attended to
    learn = torch.tensor([m + [False] * (width - len(m)) for _, m in rows])
    # Every row starts with the same tools preamble: run it once, without gradients, as a cache the
    # batch reads (~3/4 of the compute saved; the preamble's own representation is never trained).
    with torch.no_grad():
        cache = model(input_ids=ids[:1, :shared], use_cache=True).past_key_values
    cache.batch_repeat_interleave(len(rows))
    with warnings.catch_warnings():  # newer transformers call it `cache`; older ones know only this name
        warnings.simplefilter("ignore", FutureWarning)
        hidden = model.model(input_ids=ids[:, shared:], past_key_values=cache).last_hidden_state  # (B, T - shared, H)
    at = learn[:, shared + 1 :]  # position t predicts token t + 1: logits only where that token is the model's
    tokens = F.cross_entropy(model.lm_head(hidden[:, :-1][at]), ids[:, shared + 1 :][at])
    decide = F.log_softmax(model.lm_head(hidden[:, prompt - 1 - shared]), dim=-1)[:, first]  # (B, 2)
    return tokens - (decide * target).sum(-1).mean()


if __name__ == "__main__":
    print(warm_model_path())
