"""`env.dataset=easy`: small Python function problems generated from templates, sized for SmolLM2-135M.

Splits `train`, `heldout` and `train_reach` (the part of `train` from the templates within the
untrained SmolLM2-135M's reach, REACH below); HF split syntax applies: `train[:40]`, `heldout[:50%]`. Held-out
problems are never seen in training, on two levels:

* by template: templates marked `heldout=True` in easy_templates.py give held-out problems only;
* by instance: for the other templates, each distinct set of constants (`Spec.key`: the divisor,
  the letters, the bounds, ...) goes to one split only, and held-out instances take their entry-point
  name from a name kept for them (the template's last name), so no signature is shared either.

Each record is HumanEval-style: `prompt` (signature + docstring with 1-3 `>>>` examples), `test`
(`def check(candidate): assert ...`, the visible examples plus edge cases such as an empty input),
`entry_point`, and, for tests and the offline expert only, `canonical_solution` (the body, as in
HumanEval) and `template`/`key`.

Generated at load time, not shipped as a file: it takes milliseconds, is pure stdlib and seeded
(string seeds hash with SHA-512 in `random`, so PYTHONHASHSEED does not matter), and a shipped copy
could drift from the generator. Expected outputs come from running the reference bodies here
in-process: they are this module's own code, never a model's.
"""
from __future__ import annotations

import random
from functools import lru_cache

from .easy_templates import PARAM_NAMES, TEMPLATES, Spec, Template

SEED = 0
SPLITS = ("train", "heldout")
# `train_reach`: the training problems of the templates the untrained SmolLM2-135M passes at all. Sampled
# 4 times each (2 agents, 1 turn, T 0.7, 128 tokens) on the first 80 train problems, it passed 0.066 of its
# paths, below the 10-40% where GRPO groups carry signal; only these 8 templates ever passed
# (docs/data/easy_learning/selected/selection.json, 2026-11-27). Training-side tuning only: held-out is
# unchanged, and the other templates' held-out problems still count.
REACH = ("long_words", "add_to_all", "scale_shift", "power_all", "keep_multiples", "count_letters", "keep_between",
         "replace_letter")
TRAIN_PER_TEMPLATE = 24  # at most this many instances (distinct keys) of a template in training
HELD_PER_TEMPLATE = 4  # ... and of a shared template in held-out (a fifth of its keys, at least one)
HELD_ONLY_PER_TEMPLATE = 12  # instances of a held-out-only template
PATIENCE = 50  # draws without a new key after which a template's key space counts as exhausted


def _keys(t: Template, seed: int) -> list[tuple[tuple, int]]:
    """(key, draw index) of the template's distinct instances, in a seeded shuffled order."""
    want = HELD_ONLY_PER_TEMPLATE if t.heldout else TRAIN_PER_TEMPLATE + HELD_PER_TEMPLATE
    seen: dict[tuple, int] = {}
    i = last_new = 0
    while len(seen) < want * 3 and i - last_new < PATIENCE:  # 3x: enough to choose from
        key = t.draw(random.Random(f"easy:{seed}:{t.name}:{i}")).key
        if key not in seen:
            seen[key], last_new = i, i
        i += 1
    keys = list(seen.items())
    random.Random(f"easy:{seed}:{t.name}:order").shuffle(keys)
    return keys


def _assign(t: Template, keys: list[tuple[tuple, int]]) -> dict[str, list[int]]:
    """Draw indices per split: held-out first (a fifth of the keys, 1..HELD_PER_TEMPLATE), then training."""
    if t.heldout:
        return {"train": [], "heldout": [i for _, i in keys[:HELD_ONLY_PER_TEMPLATE]]}
    held = min(HELD_PER_TEMPLATE, max(1, len(keys) // 5))
    return {"heldout": [i for _, i in keys[:held]], "train": [i for _, i in keys[held:held + TRAIN_PER_TEMPLATE]]}


def _fill(text: str, names: dict[str, str]) -> str:
    for placeholder, name in names.items():
        text = text.replace("{" + placeholder + "}", name)
    return text


def _record(t: Template, spec: Spec, split: str, rng: random.Random) -> dict:
    """One HumanEval-style record of an instance; names and the number of visible examples from `rng`."""
    pool = t.names if t.heldout else (t.names[-1:] if split == "heldout" else t.names[:-1])
    entry = rng.choice(pool)
    names = {p: rng.choice(choices) for p, choices in PARAM_NAMES.items()}
    header = f"def {entry}({', '.join(_fill(p, names) for p in t.params)}) -> {t.returns}:"
    body = _fill(spec.body, names)
    namespace: dict = {}
    exec(f"{header}\n{body}", namespace)  # the template's own reference (module docstring)
    args = list({repr(a): a for a in spec.args}.values())  # distinct inputs, in order
    calls = [f"({', '.join(repr(x) for x in a)})" for a in args]
    outputs = [repr(namespace[entry](*a)) for a in args]
    visible = [i for i in range(len(args)) if i > 0][: rng.randint(1, 3)] or [0]  # not the empty edge case
    examples = "".join(f"    >>> {entry}{calls[i]}\n    {outputs[i]}\n" for i in visible)
    prompt = f'{header}\n    """{_fill(spec.doc, names)}\n{examples}    """\n'
    test = "def check(candidate):\n" + "".join(f"    assert candidate{c} == {o}\n" for c, o in zip(calls, outputs))
    return {"task_id": "", "prompt": prompt, "test": test, "entry_point": entry, "canonical_solution": body,
            "template": t.name, "key": repr(spec.key)}


@lru_cache(maxsize=4)
def _generate(seed: int) -> dict[str, tuple[dict, ...]]:
    out: dict[str, list[dict]] = {split: [] for split in SPLITS}
    for t in TEMPLATES:
        for split, draws in _assign(t, _keys(t, seed)).items():
            for i in draws:
                spec = t.draw(random.Random(f"easy:{seed}:{t.name}:{i}"))
                out[split].append(_record(t, spec, split, random.Random(f"easy:{seed}:{t.name}:{i}:{split}")))
    for split, records in out.items():
        random.Random(f"easy:{seed}:{split}").shuffle(records)  # templates interleaved: `train[:40]` is a mix
        for number, record in enumerate(records):
            record["task_id"] = f"Easy/{split}/{number}"
    return {split: tuple(records) for split, records in out.items()}


def generate(seed: int = SEED) -> dict[str, list[dict]]:
    """{"train": [...], "heldout": [...], "train_reach": [...]}: fresh copies of the records, the same
    for the same seed. `train_reach` is the part of `train` from the REACH templates, in train order,
    with train's task ids (they are the same problems)."""
    splits = {split: [dict(r) for r in records] for split, records in _generate(seed).items()}
    return {**splits, "train_reach": [dict(r) for r in splits["train"] if r["template"] in REACH]}
