"""Log-probs of the sampled tokens and the policy's entropy, a few rows of logits at a time.

The update scores every model token of a micro-batch against the whole vocabulary. Written as plain
tensor code (`logits.float() / T`, gather, logsumexp, and autograd's backward of them) that makes
about six temporaries of (tokens, vocabulary) float32 values: on SmolLM2 (49152 words) 200 MB each
for 1024 tokens. On a CPU each is fresh memory whose pages fault and are zeroed again; a torch profile
of one bfloat16 update pass (32 completions of 32 tokens, 2026-11-28, 2-core AMD EPYC) put ~1.7 s of
its ~5 s in them (logsumexp's backward alone 0.87 s).

Here the float32 work runs on chunks of rows small enough to be served again and again from memory
already in use (`CHUNK_BYTES`), and the gradient of the logits is written straight into one tensor of
the logits' own dtype. Each row's numbers come from the same operations in the same order as the
plain code's: the log-probs, their gradient and the entropy are its numbers bit for bit
(tests/test_vocab.py; checked 2026-11-28 also under ATEN_CPU_CAPABILITY=avx2 and =default, 1 and 2
threads, 1 to 1024 rows).
"""
from __future__ import annotations

import torch

CHUNK_BYTES = 8 << 20  # float32 bytes per chunk: well under glibc's largest mmap threshold (32 MiB)
MIN_ROWS = 8


def _chunks(rows: int, vocab: int, chunk_bytes: int) -> list[slice]:
    """Row ranges of about chunk_bytes of float32 logits, none under MIN_ROWS rows (a short tail joins
    the chunk before it): for a handful of rows torch splits each row's reduction between threads, and
    its sums would no longer be the plain code's to the last bit."""
    step = max(MIN_ROWS, chunk_bytes // (4 * max(1, vocab)))
    starts = list(range(0, rows, step))
    if len(starts) > 1 and rows - starts[-1] < MIN_ROWS:
        starts.pop()
    return [slice(start, end) for start, end in zip(starts, [*starts[1:], rows])]


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    x = logits.float()
    return x / temperature if temperature != 1.0 else x


def _entropy_of(x: torch.Tensor) -> torch.Tensor:
    """(..., V) float32 scaled logits -> (...) entropy of their softmax."""
    return torch.logsumexp(x, dim=-1) - (x.softmax(-1) * x).sum(-1)


class _TargetLogprobs(torch.autograd.Function):
    """(N, V) logits, (N,) targets -> (N,) float32 log-softmax(logits / T)[target]."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, chunk_bytes: int):
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for rows in _chunks(logits.shape[0], logits.shape[1], chunk_bytes):
            x = _scaled(logits[rows], temperature)
            lse[rows] = torch.logsumexp(x, dim=-1)
            out[rows] = torch.gather(x, -1, targets[rows, None]).squeeze(-1) - lse[rows]
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.chunk_bytes = temperature, chunk_bytes
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for rows in _chunks(logits.shape[0], logits.shape[1], ctx.chunk_bytes):
            x = _scaled(logits[rows], ctx.temperature)
            g = grad[rows, None]
            # d/dx (x[t] - logsumexp(x)) = onehot(t) - softmax(x), in autograd's own order
            d = -g * torch.exp(x - lse[rows, None])
            d.scatter_add_(-1, targets[rows, None], g)
            grad_logits[rows] = d / ctx.temperature if ctx.temperature != 1.0 else d
        return grad_logits, None, None, None


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """logits (..., V) predicting targets (...) -> (...) float32 log p(target) under logits / temperature,
    with its gradient to the logits."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = _TargetLogprobs.apply(flat, targets.reshape(-1), float(temperature), int(chunk_bytes))
    return out.reshape(targets.shape)


def entropy(logits: torch.Tensor, temperature: float = 1.0, chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """logits (..., V) -> (...) float32 entropy of softmax(logits / temperature), in nats. Chunked and
    without a gradient when the logits need none; else the plain autograd formula (an entropy bonus)."""
    if logits.requires_grad and torch.is_grad_enabled():
        return _entropy_of(_scaled(logits, temperature))
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    with torch.no_grad():
        for rows in _chunks(flat.shape[0], flat.shape[1], chunk_bytes):
            out[rows] = _entropy_of(_scaled(flat[rows], temperature))
    return out.reshape(logits.shape[:-1])
