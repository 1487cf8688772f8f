"""Supervised fine-tuning for warm starts (envs/tool_arith_warm.py, envs/code/tool_warm.py): token
cross-entropy over the model's own tokens of transcripts, plus a *decision* loss at the reply's first
token, taught as a probability over a few choices (call a tool, or answer directly) so that the warm
start keeps both behaviours for GRPO to choose between, whatever share of the transcripts show each.

Builds run in a child process pinned to portable kernels (`build_pinned`, magrpo.pinned), so one
recipe gives one model on every CPU kind.
"""
from __future__ import annotations

import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from . import lifeline, pinned
from .errors import MagrpoError


class WarmStartError(MagrpoError, RuntimeError):
    """A warm start could not be built (one line saying what to do)."""


@dataclass(frozen=True)
class Example:
    """One transcript: token ids, which of them are the model's own (the loss covers those), and where
    the reply starts (`decide`: that token is taught by the decision loss, not by cross-entropy)."""

    ids: list[int]
    learn: list[bool]
    decide: int


def loss(model, batch: Sequence[Example], choices, target, pad_id: int):
    """Mean cross-entropy over the model's tokens (all but each reply's first) plus, at the reply's
    first token, cross-entropy against `target` (probabilities over the token ids `choices`), averaged
    over the batch. The prefix every row shares (up to the first decision) runs once, without
    gradients, as a KV cache the batch reads: it is never in the loss."""
    import torch
    import torch.nn.functional as F

    from .models import cache_keyword

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    body, head = base.model, base.lm_head
    width = max(len(e.ids) for e in batch)
    ids = torch.tensor([e.ids + [pad_id] * (width - len(e.ids)) for e in batch])  # right padding: never attended to
    learn = torch.tensor([e.learn + [False] * (width - len(e.learn)) for e in batch])
    learn[torch.arange(len(batch)), torch.tensor([e.decide for e in batch])] = False
    shared = _shared_prefix(batch)
    key = cache_keyword(model)
    extra = {}
    with warnings.catch_warnings():  # older transformers warn on the newer name's absence
        warnings.simplefilter("ignore", FutureWarning)
        if shared:
            with torch.no_grad():
                cache = getattr(body(input_ids=ids[:1, :shared], use_cache=True), key)
            cache.batch_repeat_interleave(len(batch))
            extra = {key: cache}
        hidden = body(input_ids=ids[:, shared:], **extra).last_hidden_state  # (B, width - shared, H)
    at = learn[:, shared + 1:]  # position t predicts token t + 1: logits only where that token is the model's
    tokens = F.cross_entropy(head(hidden[:, :-1][at]), ids[:, shared + 1:][at])
    rows = torch.arange(len(batch))
    before = torch.tensor([e.decide - 1 - shared for e in batch])
    decide = F.log_softmax(head(hidden[rows, before]), dim=-1)[:, choices]  # (B, len(choices))
    return tokens - (decide * target).sum(-1).mean()


def _shared_prefix(batch: Sequence[Example]) -> int:
    """Tokens every row starts with, stopping a token before the earliest decision (its logits must be
    computed with gradients)."""
    limit = min(e.decide for e in batch) - 1
    first = batch[0].ids
    for n in range(limit):
        if any(e.ids[n] != first[n] for e in batch):
            return n
    return limit


def fit(model, batches: Iterable[Sequence[Example]], *, choices: Sequence[int], target: Sequence[float],
        pad_id: int, lr: float, stop: Callable[[int], bool] = lambda step: False,
        label: str = "warm start", log_every: int = 50, total: int | None = None) -> int:
    """AdamW steps over `batches` (until they run out, or `stop(step)` says so after a step); returns
    the steps taken. Progress goes to stderr: the step, the loss, the time so far and, given the most
    steps it can take (`total`), how long the rest takes at the pace so far."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    choices_t, target_t = torch.tensor(list(choices)), torch.tensor(list(target))
    model.train()
    start, step, running, most = time.perf_counter(), 0, 0.0, total
    for step, batch in enumerate(batches, 1):
        value = loss(model, batch, choices_t, target_t, pad_id)
        optim.zero_grad()
        value.backward()
        optim.step()
        running += value.item()
        if not math.isfinite(running):
            raise WarmStartError(f"{label}: the loss is {value.item()} at step {step}; lower the learning rate")
        if step % log_every == 0:
            spent = time.perf_counter() - start
            left = f", at most {spent / step * (most - step):.0f} s more" if most and most > step else ""
            print(f"{label}: step {step}{f' of at most {most}' if most else ''} loss {running / log_every:.4f} "
                  f"({spent:.0f} s{left})", file=sys.stderr, flush=True)
            running = 0.0
        if stop(step):
            break
    return step


def build_pinned(target: str, arguments: Mapping[str, Any], out: Path, label: str) -> None:
    """Run `module:function(out=..., **arguments)` in a child pinned to portable kernels (magrpo.pinned),
    so the build gives the same weights on every CPU kind; in this process where pinning is not
    possible (not x86-64), saying so. The child's progress is passed on to stderr; its `error: ...`
    line (a MagrpoError) comes back as a WarmStartError with that line."""
    import importlib
    import json
    import subprocess

    if not pinned.supported():
        print(f"{label}: kernels cannot be pinned on this CPU; the model may differ from other machines'",
              file=sys.stderr)
        module, function = target.split(":")
        getattr(importlib.import_module(module), function)(out=str(out), **arguments)
        return
    # Under a lifeline supervisor: a trainer killed meanwhile (SIGKILL too) does not leave a build running.
    args = lifeline.command(pinned.command(["--call", target, json.dumps({"out": str(out), **arguments})]),
                            own_pids=False)
    error = None
    with subprocess.Popen(args, env=pinned.pinned_env(), stderr=subprocess.PIPE, text=True, errors="replace") as proc:
        for line in proc.stderr:
            if line.startswith("error: "):
                error = line[len("error: "):].strip()
            else:
                sys.stderr.write(line)
    if proc.returncode != 0:
        raise WarmStartError(error or f"{label}: the build failed (exit {proc.returncode}; its output is above)")


# The steps whose weights a build hashes (weights_digest): two machines whose builds end with other weights
# find the first step where they part (the pinned kernels are not bit-exact across CPU vendors: magrpo.pinned).
TRACE_STEPS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def weights_digest(model) -> str:
    """sha256 of the parameters' values in name order (not of a saved file, whose header a library may write
    otherwise)."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def write_record(out: Path, record: Mapping[str, Any]) -> None:
    """`warm_start.json` in the built folder: how the build went, whether its kernels were pinned, and
    the saved weights' sha256, which two machines can compare (pinned, the same under one machine's kernel
    sets; across CPU vendors it differs: magrpo.pinned)."""
    import hashlib
    import json

    digest = hashlib.sha256()
    for f in sorted(out.glob("*.safetensors")):
        digest.update(f.read_bytes())
    full = {**record, "pinned_kernels": pinned.active(), "weights_sha256": digest.hexdigest()}
    (out / "warm_start.json").write_text(json.dumps(full) + "\n")


def main_printing(build: Callable[[], Path]) -> int:
    """A warm start's command line: print the built folder, or one line saying why not (exit 1)."""
    try:
        print(build())
    except MagrpoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
