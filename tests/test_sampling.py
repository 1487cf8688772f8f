"""Token sampling: the distribution drawn from, and the draws themselves."""
from __future__ import annotations

import math

import pytest
import torch

from magrpo.sampling import MASK32, hash32, sample, sampling_logprobs, stream_key, stream_uniforms, top_p_keep


def test_temperature_scales_logits_before_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    got = sampling_logprobs(logits, temperature=2.0, top_k=0, top_p=1.0)
    torch.testing.assert_close(got, torch.log_softmax(torch.tensor([[0.0, 0.5, 1.0]]), -1))


def test_top_k_keeps_the_k_most_likely():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    got = sampling_logprobs(logits, temperature=1.0, top_k=2, top_p=1.0)
    assert torch.isinf(got[0, [0, 2]]).all()
    # renormalised over {1: e^3, 3: e^2}
    torch.testing.assert_close(got[0, 1], torch.tensor(3 - math.log(math.exp(3) + math.exp(2))))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    # p=0.7: 0.5 < 0.7 so the 0.3 token stays (mass before it 0.5 < 0.7); mass before 0.15 is 0.8 -> dropped
    got = sampling_logprobs(probs.log(), temperature=1.0, top_k=0, top_p=0.7)
    kept = torch.isfinite(got[0])
    assert kept.tolist() == [True, True, False, False]
    torch.testing.assert_close(got[0, :2].exp(), torch.tensor([0.625, 0.375]))


def test_samples_follow_the_distribution_and_never_pick_zero_probability():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    logp = probs.log().expand(200_000, -1)
    counts = torch.bincount(sample(logp), minlength=5).float() / 200_000
    assert counts[1] == 0 and counts[4] == 0
    # binomial std at n=2e5 is ~0.0011: 0.006 is > 5 sigma
    torch.testing.assert_close(counts, probs, atol=6e-3, rtol=0)


def test_sample_is_reproducible_under_the_global_seed():
    logp = torch.randn(64, 100).log_softmax(-1)
    torch.manual_seed(3)
    a = sample(logp)
    torch.manual_seed(3)
    assert torch.equal(a, sample(logp))


def test_stream_hash_is_the_same_on_python_ints_and_tensors():
    keys = [0, 1, 2**31, 2**32 - 1, stream_key(7, 3, 1)]
    assert hash32(torch.tensor(keys)).tolist() == [hash32(k) for k in keys]
    assert len({stream_key(0, tree) for tree in range(10_000)}) == 10_000  # no collisions among nearby paths


def test_stream_uniforms_are_uniform_and_independent_of_the_other_rows():
    keys = torch.tensor([stream_key(0, i) for i in range(100_000)])
    u = stream_uniforms(keys, 5)
    assert 0 < float(u.min()) and float(u.max()) < 1
    # mean and variance of U(0, 1): 1/2 and 1/12; std of the mean at n=1e5 is ~0.0009
    assert abs(float(u.mean()) - 0.5) < 5e-3 and abs(float(u.var()) - 1 / 12) < 5e-3
    assert abs(float(torch.corrcoef(torch.stack([u, stream_uniforms(keys, 6)]))[0, 1])) < 0.02
    # a row's draw depends on its key and counter only
    assert torch.equal(stream_uniforms(keys[17:18], 5), u[17:18])
    assert not torch.equal(stream_uniforms(keys[:100], 6), u[:100])


def test_stream_samples_follow_the_distribution():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    logp = probs.log().expand(200_000, -1)
    uniforms = stream_uniforms(torch.tensor([stream_key(1, i) for i in range(200_000)]), 0)
    counts = torch.bincount(sample(logp, uniforms), minlength=5).float() / 200_000
    assert counts[1] == 0 and counts[4] == 0
    torch.testing.assert_close(counts, probs, atol=6e-3, rtol=0)


def test_a_uniform_next_to_one_never_picks_a_filtered_last_token():
    # The largest uniform stream_uniforms makes is 1 - 2^-54; in float32 it rounds to 1.0 and the
    # draw landed past the last token with probability > 0, on a token top-k/top-p had removed.
    logprobs = torch.log(torch.tensor([[0.25, 0.75, 0.0]]))
    u = torch.tensor([1.0 - 2.0**-54], dtype=torch.float64)
    assert sample(logprobs, u).item() == 1
    assert sample(logprobs, torch.tensor([1e-300], dtype=torch.float64)).item() == 0


def test_tail_tokens_of_a_large_vocabulary_keep_their_share():
    # 100k tail tokens of probability 1e-8 after a head of 0.999: each adds less than half a float32
    # ulp to a CDF near 1, so none could be drawn in float32. A uniform in the middle of token j's
    # interval must draw token j.
    tail = 100_000
    probs = torch.cat([torch.tensor([0.999], dtype=torch.float64), torch.full((tail,), 1e-8, dtype=torch.float64)])
    logprobs = probs.log().float()[None, :]
    exact = logprobs.double().exp()[0]
    cdf = exact.cumsum(0)
    for j in (1, 500, 50_000, tail):
        u = ((cdf[j - 1] + cdf[j]) / 2 / cdf[-1]).reshape(1)
        assert sample(logprobs, u).item() == j


def full_sort_top_p_keep(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering by a sort of the whole vocabulary (the definition top_p_keep must match)."""
    probs = scores.softmax(-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    keep_sorted = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


@pytest.mark.parametrize("spread", [0.1, 1.0, 4.0, 12.0])  # near-flat rows need the ranked set widened
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.999])
def test_top_p_on_the_top_candidates_keeps_what_a_full_sort_keeps(spread, top_p):
    g = torch.Generator().manual_seed(int(spread * 1000 + top_p * 10))
    scores = torch.randn(16, 5000, generator=g) * spread
    scores[3, 100:] = float("-inf")  # a row already cut by top-k
    got = top_p_keep(scores, top_p)
    assert torch.equal(got, full_sort_top_p_keep(scores, top_p))
    assert got.any(-1).all()  # the top token always stays


def test_top_p_widens_until_the_ranked_tokens_hold_p():
    scores = torch.zeros(2, 1000)  # flat: 900 of 1000 tokens are needed to reach 0.9
    scores[1, 0] = 20.0  # one dominant token: the first 64 ranked suffice
    kept = top_p_keep(scores, 0.9, first_k=4)
    assert kept[0].sum() == 900 and kept[1].sum() == 1


def test_a_table_of_stream_uniforms_holds_exactly_each_step_s_draws():
    """The decode loop draws every step's uniforms at once: column t must be draw t, bit for bit."""
    keys = torch.tensor([stream_key(3, i) for i in range(50)] + [0, MASK32])  # and the extreme keys
    table = stream_uniforms(keys, torch.arange(40))
    assert table.shape == (52, 40) and table.dtype == torch.float64
    for t in range(40):
        assert torch.equal(table[:, t], stream_uniforms(keys, t))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 50, 0.9), (1.3, 0, 0.8)])
def test_a_decodes_scratch_buffers_give_the_fresh_tensors_bits_step_after_step(temperature, top_k, top_p):
    """A decode's sampler writes into buffers reused from step to step (magrpo.sampling.Scratch): the same
    log-probs and tokens bit for bit as fresh tensors, as the rows shrink and grow again."""
    from magrpo.sampling import Scratch

    g = torch.Generator().manual_seed(1)
    scratch = Scratch()
    for rows in (8, 8, 5, 3, 8):  # rows leave a decode; a larger request grows the buffers
        logits = (torch.randn(rows, 4999, generator=g) * 4).bfloat16()
        uniforms = torch.rand(rows, dtype=torch.float64, generator=g)
        want_logp = sampling_logprobs(logits, temperature, top_k, top_p)
        want = sample(want_logp, uniforms)
        got_logp = sampling_logprobs(logits, temperature, top_k, top_p, scratch)
        assert torch.equal(got_logp, want_logp)
        assert torch.equal(sample(got_logp, uniforms, scratch), want)
        assert torch.equal(got_logp, want_logp)  # sampling leaves the log-probs' buffer alone


def test_scratch_hands_out_the_same_memory_until_a_request_outgrows_it():
    from magrpo.sampling import Scratch

    scratch, cpu = Scratch(), torch.device("cpu")
    first = scratch("cdf", (4, 10), torch.float64, cpu)
    again = scratch("cdf", (3, 10), torch.float64, cpu)
    assert first.dtype == again.dtype == torch.float64 and again.shape == (3, 10)
    assert again.data_ptr() == first.data_ptr()
    assert scratch("scores", (4, 10), torch.float32, cpu).data_ptr() != first.data_ptr()  # another name, other memory
    assert scratch("cdf", (5, 10), torch.float64, cpu).shape == (5, 10) and len(scratch) == 2
    scratch.clear()
    assert not scratch
