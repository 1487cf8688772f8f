"""A warm start for the tool-arithmetic task: the tiny model, fine-tuned (full weights, magrpo.sft) on
generated transcripts of `tool_arith` questions in which most show a calculator call and the copy of
its result into the answer, and the rest guess; the decision to call is taught apart, as probability
`WarmSpec.call_share`. A random-init model never writes a valid `<tool_call>` by chance; this one
sometimes does, and GRPO has to find out from the rewards alone that calling pays. Saved as an
ordinary HF folder, built once and cached by its recipe (like magrpo/tiny.py):

    python -m magrpo.envs.tool_arith_warm        # prints the folder, for model.name=<folder>

It trains at least `steps` LM steps, then more until greedy calls and answers copy on `copy_share`
of fixed questions (`copying`). The build runs pinned to portable kernels (magrpo.pinned), so it takes
the same steps to the same weights under every kernel set of one machine (across vendors the weights
differ in their last bits: magrpo.pinned): unpinned, with a constant lr of 3e-3 and no
clipping, it converged on an AMX Xeon and on AVX2 machines and never in 6000 steps on an AMD EPYC with
AVX512-BF16, where its loss spiked (0.64 -> 0.99 between steps 750 and 1000) and the copying was lost.
At lr 1.5e-3 the recipe also converged unpinned under every kernel set tried, in 500-1000 steps
(docs/benchmarks.md, "Warm starts").
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from magrpo import sft
from magrpo.paths import cache_root
from magrpo.tiny import TinySpec, build_once, tiny_model_path
from magrpo.tools import CALL_END, CALL_START, TOOLS, response_text, tools_preamble

from .tool_arith import product_pair, question

FORMAT_VERSION = 3  # bump when the recipe below changes in a way WarmSpec does not show
LABEL = "tool_arith warm start"


@dataclass(frozen=True)
class WarmSpec:
    call_share: float = 0.2  # the probability of calling the calculator it is taught; else it guesses a number
    shown_calls: float = 0.9  # transcripts that show a call (how to write one and copy its result)
    digits: int = 2  # env.digits of the problems
    steps: int = 500  # at least this many LM steps, then more until the model copies (below)
    max_steps: int = 6000
    check_every: int = 250  # after `steps`, test the copying every this many steps and stop once it holds
    copy_share: float = 0.9  # of `checks` fixed questions (greedy): calls with their numbers, answers with the result
    checks: int = 16
    batch_size: int = 8
    lr: float = 1.5e-3
    seed: int = 0
    # The base: the tiny model at transformers' usual init (the trainer's tiny, 0.1, is wide enough for a
    # LoRA to move; at 0.02 full fine-tuning learns the call's text in ~100 steps instead of never)
    base: TinySpec = TinySpec(init_std=0.02)

    @classmethod
    def from_dict(cls, d: dict) -> "WarmSpec":
        return cls(**{**d, "base": TinySpec(**d["base"])})


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
    arguments = {"spec": dataclasses.asdict(spec), "base": str(base)}
    return build_once(final, lambda tmp: sft.build_pinned("magrpo.envs.tool_arith_warm:build", arguments, tmp, LABEL),
                      "warm-started tool_arith model")


def example(tok, prompt: str, segments: list[tuple[str, bool]]) -> sft.Example:
    """Ids as the trainer sees them: the prompt and each segment tokenized apart (generation stops at
    a call, the tool message is encoded alone), then EOS; `learn` marks the model's tokens."""
    ids = list(tok(prompt)["input_ids"])
    decide, learn = len(ids), [False] * len(ids)
    for text, by_model in segments:
        seg = tok(text, add_special_tokens=False)["input_ids"]
        ids += seg
        learn += [by_model] * len(seg)
    return sft.Example(ids + [tok.eos_token_id], learn + [True], decide)


def build(out: str, spec: dict, base: str) -> None:
    """The build, in the pinned child (magrpo.sft.build_pinned)."""
    _train(WarmSpec.from_dict(spec), Path(base), Path(out))


def _train(spec: WarmSpec, base: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(spec.seed)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    rng = random.Random(spec.seed)

    def batches():
        while True:
            yield [example(tok, *transcript(rng, spec.shown_calls, spec.digits)) for _ in range(spec.batch_size)]

    shares: dict[str, float] = {}
    trace: dict[str, str] = {}  # step -> the weights' sha256 after it (sft.TRACE_STEPS)

    def stop(step: int) -> bool:
        if step in sft.TRACE_STEPS:
            trace[str(step)] = sft.weights_digest(model)
        if step < spec.steps or ((step - spec.steps) % spec.check_every and step < spec.max_steps):
            return False
        shares["calls"], shares["answers"] = copying(model, tok, spec)
        print(f"{LABEL}: step {step}: greedy calls copy {shares['calls']:.0%}, answers {shares['answers']:.0%}",
              file=sys.stderr, flush=True)
        if min(shares.values()) >= spec.copy_share:
            return True
        if step >= spec.max_steps:
            raise sft.WarmStartError(
                f"{LABEL}: after {step} step{'s' * (step != 1)} greedy calls copy the question in "
                f"{shares['calls']:.0%} and answers copy the result in {shares['answers']:.0%} of {spec.checks} "
                f"questions (want {spec.copy_share:.0%}); "
                f"try another seed (python -m magrpo.envs.tool_arith_warm --seed 1) and please report it")
        return False

    steps = sft.fit(model, batches(), choices=_choices(tok), target=[spec.call_share, 1 - spec.call_share],
                    pad_id=tok.pad_token_id, lr=spec.lr, stop=stop,
                    label=LABEL, log_every=spec.check_every, total=spec.max_steps)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    sft.write_record(out, {"steps": steps, "calls_copy": shares["calls"], "answers_copy": shares["answers"],
                           "trace_sha256": trace})


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


def _choices(tok) -> tuple[int, int]:
    """The first token of a call and of a guess: the reply's decision."""
    return tuple(tok(text, add_special_tokens=False)["input_ids"][0] for text in (call_text(1000, 1000), "answer: 1"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m magrpo.envs.tool_arith_warm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=WarmSpec.seed, help="the build's seed (default %(default)s)")
    args = parser.parse_args(argv)
    return sft.main_printing(lambda: warm_model_path(dataclasses.replace(WarmSpec(), seed=args.seed)))


if __name__ == "__main__":
    sys.exit(main())
