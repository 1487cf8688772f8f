"""Token sampling from logits: pure tensor functions, no model.

`torch.multinomial` (and any per-vocabulary-entry random draw) is slow on CPU: a third of a tiny
model's decode step. Inverse-CDF sampling needs one uniform number per row.

Random streams are counter-based: the uniform that picks token t of a row is a hash of (the row's
seed, t), not a draw from a global generator. A row's samples therefore do not depend on which other
rows share its decode batch, so trees sharded over data-parallel processes (or chunked after an
out-of-memory) sample exactly what one process would have sampled.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

MASK32 = 0xFFFFFFFF
_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)  # lowbias32 (C. Wellons, "Hash function prospector")


def _mul32(x, m: int):
    """(x * m) mod 2^32 for 32-bit x without int64 overflow: the multiplier in 16-bit halves."""
    return (x * (m & 0xFFFF) + (((x * (m >> 16)) & 0xFFFF) << 16)) & MASK32


def hash32(x):
    """A 32-bit integer mix; works on Python ints and on int64 tensors (element-wise) alike."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, _MULTIPLIERS[0])
    x = x ^ (x >> 15)
    x = _mul32(x, _MULTIPLIERS[1])
    return x ^ (x >> 16)


def stream_key(*parts: int) -> int:
    """One 32-bit key from a path of non-negative ints, e.g. (seed, step, tree, joint action, agent, sample)."""
    key = 0x9E3779B9
    for part in parts:
        part = int(part)
        key = hash32(key ^ hash32((part ^ (part >> 32)) & MASK32))
    return key


def stream_uniforms(keys: torch.Tensor, counter: int | torch.Tensor) -> torch.Tensor:
    """(R,) int64 row keys -> (R,) float64 uniforms in (0, 1): draw number `counter` of each row's stream
    (53 bits from two hashes). A (S,) tensor of counters gives (R, S), column s holding draw counter[s]:
    the same integer arithmetic, so the same numbers, in one batch of tensor operations rather than
    ~40 small ones per decode step."""
    if isinstance(counter, torch.Tensor):
        keys = keys[:, None]
    hi = hash32(keys ^ hash32(2 * counter))
    lo = hash32(keys ^ hash32(2 * counter + 1))
    return ((hi << 21) + (lo >> 11)).double().add_(0.5) / 2.0**53


class Scratch:
    """Named buffers reused from call to call, each grown (never shrunk) to the largest request. Large tensors
    made fresh at every call are new pages from the kernel each time (glibc maps blocks this large anew). A
    decode's sampler: its (rows, vocabulary) float32 and float64 tensors were ~6100 page faults and three
    quarters of its time per step at 32 rows of a 49k vocabulary (10.6-14.6 ms against 2.6-3.7 ms; Intel Xeon,
    2 threads, 2026-11-29). The batched LoRA hook (magrpo.backends.hf.RowAdapters): a prefill's intermediates.
    The same operations write into kept memory, so the same bits. A tensor it hands out holds until its next
    request under the same name and dtype."""

    def __init__(self):
        self.flat: dict[tuple, torch.Tensor] = {}

    def __call__(self, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor of `shape` and `dtype` on `device`, in buffer `name`."""
        size, key = math.prod(shape), (name, dtype, device)
        flat = self.flat.get(key)
        if flat is None or flat.numel() < size:
            flat = self.flat[key] = torch.empty(size, dtype=dtype, device=device)
        return flat[:size].view(shape)

    def __len__(self) -> int:
        return len(self.flat)

    def clear(self) -> None:
        self.flat.clear()


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                      scratch: Scratch | None = None) -> torch.Tensor:
    """(R, V) logits -> (R, V) log-probs of the distribution actually sampled (temperature, then
    top-k, then top-p; filtered tokens get -inf). `scratch`: compute in its buffers (a decode's steps;
    the result is then a view of buffer "logprobs")."""
    if scratch is None:
        scores = logits.float() if temperature == 1.0 else logits.float() / temperature  # x / 1.0 is x: skip a pass
    else:
        scores = scratch("scores", logits.shape, torch.float32, logits.device).copy_(logits)
        if temperature != 1.0:
            scores.div_(temperature)
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        scores = scores.masked_fill(~top_p_keep(scores, top_p), float("-inf"))
    if scratch is None:
        return scores.log_softmax(-1)
    return torch.log_softmax(scores, -1, out=scratch("logprobs", scores.shape, scores.dtype, scores.device))


def top_p_keep(scores: torch.Tensor, top_p: float, first_k: int = 64) -> torch.Tensor:
    """(R, V) scores -> (R, V) bool, the tokens nucleus sampling keeps: in order of probability, a
    token is dropped when the mass before it already reaches top_p (the top token always stays).

    Only the most probable tokens are ranked (topk, widened 4x until they hold top_p of every row's
    mass) rather than the whole vocabulary: a full sort of 49k-150k entries per row and decode step
    costs as much as a small model's forward on CPU. Every token outside the ranked ones has at least
    their mass before it, so it is dropped whatever the rest of the order."""
    probs = scores.softmax(-1)
    k = min(first_k, probs.shape[-1])
    while True:
        top, order = probs.topk(k, dim=-1)  # descending
        cumulative = top.cumsum(-1)
        if k == probs.shape[-1] or bool((cumulative[:, -1] >= top_p).all()):
            break
        k = min(4 * k, probs.shape[-1])
    keep_ranked = (cumulative - top) < top_p
    return torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep_ranked)


def sample(logprobs: torch.Tensor, uniforms: torch.Tensor | None = None, scratch: Scratch | None = None
           ) -> torch.Tensor:
    """(R, V) log-probs -> (R,) token ids, one categorical draw per row, from `uniforms` (R,) in (0, 1)
    (default: torch's global RNG). The first index whose CDF exceeds u * total: zero-probability
    tokens are never picked.

    The CDF is float64: in float32 a 150k-token vocabulary's tail tokens add less than half an ulp
    to a sum near 1 and could never be drawn, and u near 1 rounds to 1 and lands past the last
    token with probability > 0 (a filtered one). `scratch`: the probabilities and the CDF in its buffers
    ("scores", "cdf")."""
    if scratch is None:
        cdf = logprobs.exp().cumsum(-1, dtype=torch.float64)  # exp is exact enough per token; the sum is not
    else:
        probs = torch.exp(logprobs, out=scratch("scores", logprobs.shape, torch.float32, logprobs.device))
        cdf = torch.cumsum(probs, -1, dtype=torch.float64, out=scratch("cdf", probs.shape, torch.float64, probs.device))
    if uniforms is None:
        uniforms = torch.rand(cdf.shape[0], device=cdf.device, dtype=torch.float64)
    total = cdf[:, -1:].contiguous()
    ids = torch.searchsorted(cdf, uniforms.to(cdf.device, torch.float64)[:, None] * total, right=True)
    last_positive = torch.searchsorted(cdf, total, right=False)  # where the CDF first reaches its total
    return torch.minimum(ids, last_positive).squeeze(-1)
