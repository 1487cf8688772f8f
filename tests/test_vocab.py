"""magrpo/vocab.py: the chunked log-probs of the sampled tokens, their gradient, and the entropy are the
plain autograd formulas' numbers (gather - logsumexp of logits.float() / T) bit for bit, whatever the
chunk size, in float32 and in bfloat16, on a small and a SmolLM2-sized vocabulary."""
from __future__ import annotations

import pytest
import torch

from magrpo import vocab


def plain_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    x = logits.float()
    x = x / temperature if temperature != 1.0 else x
    return torch.gather(x, -1, targets[..., None]).squeeze(-1) - torch.logsumexp(x, dim=-1)


def plain_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    x = logits.float()
    x = x / temperature if temperature != 1.0 else x
    return torch.logsumexp(x, dim=-1) - (x.softmax(-1) * x).sum(-1)


def case(dtype: torch.dtype, rows: int = 37, words: int = 1000):
    g = torch.Generator().manual_seed(rows + words)
    logits = (3 * torch.randn(rows, words, generator=g)).to(dtype)
    targets = torch.randint(0, words, (rows,), generator=g)
    weights = torch.randn(rows, generator=g)  # a loss that weighs each token differently
    return logits, targets, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows,words", [(1, 1000), (13, 1000), (37, 1000), (1000, 1000), (8, 49152)])
def test_log_probs_and_their_gradient_are_the_plain_formulas(dtype, temperature, chunk_rows, words):
    logits, targets, weights = case(dtype, words=words)
    ours_in = logits.clone().requires_grad_()
    theirs_in = logits.clone().requires_grad_()
    ours = vocab.target_logprobs(ours_in, targets, temperature, chunk_bytes=chunk_rows * 4 * logits.shape[1])
    theirs = plain_logprobs(theirs_in, targets, temperature)
    assert ours.dtype == torch.float32 and torch.equal(ours, theirs)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    assert ours_in.grad.dtype == dtype and torch.equal(ours_in.grad, theirs_in.grad)


def test_leading_dimensions_are_kept():
    logits, targets, _ = case(torch.float32, rows=12)
    ours = vocab.target_logprobs(logits.view(3, 4, -1), targets.view(3, 4), chunk_bytes=1)
    assert ours.shape == (3, 4) and torch.equal(ours.view(-1), plain_logprobs(logits, targets, 1.0))


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 17, 43, 1024])
def test_chunks_cover_every_row_once_and_none_is_a_handful(rows):
    """A chunk of a few rows would let torch split each row's sum between threads (other bits)."""
    chunks = vocab._chunks(rows, 49152, vocab.CHUNK_BYTES)
    assert [i for c in chunks for i in range(c.start, c.stop)] == list(range(rows))
    assert all(c.stop - c.start >= vocab.MIN_ROWS for c in chunks) or chunks == [slice(0, rows)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_entropy_is_the_plain_formula_with_and_without_a_gradient(dtype, temperature):
    logits, _, weights = case(dtype, words=49152)
    chunked = vocab.entropy(logits, temperature, chunk_bytes=8 * 4 * logits.shape[1])
    assert not chunked.requires_grad and torch.equal(chunked, plain_entropy(logits, temperature))
    with_grad = logits.clone().requires_grad_()
    bonus = vocab.entropy(with_grad, temperature)  # an entropy bonus trains through it
    (bonus * weights).sum().backward()
    assert with_grad.grad is not None and with_grad.grad.abs().sum() > 0
