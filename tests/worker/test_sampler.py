"""The sampler: greedy is argmax, random draws follow softmax(logits / T) restricted by min-p,
top-k and top-p, a row's draw depends only on (seed, counter, its logits), and logprobs are the raw
log_softmax at the sampled token plus the true top alternatives."""

from __future__ import annotations

import pytest
import torch

from vllm_rlt.worker.sampler import SamplingTensors, gumbel_noise, penalties, sample

# 99.9% quantile of the chi-square distribution with k degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 4: 18.47, 7: 24.32}


def tensors(n, temperature=1.0, top_k=0, top_p=1.0, seeds=0, counters=None, num_logprobs=-1,
            min_p=0.0, logit_bias=None):  # fmt: skip
    """SamplingTensors for n rows; scalars broadcast, counters default to 0..n-1."""

    def rows(v):
        return list(v) if isinstance(v, (list, tuple, range)) else [v] * n

    counters = range(n) if counters is None else counters
    return SamplingTensors.build(
        rows(temperature),
        rows(top_k),
        rows(top_p),
        rows(min_p),
        rows(seeds),
        rows(counters),
        num_logprobs,
        "cpu",
        logit_bias=None if logit_bias is None else [logit_bias] * n,
    )


def draws(logits_row, n, **kw):
    """n draws for one logit row [V] over counters 0..n-1."""
    return sample(logits_row.expand(n, -1), tensors(n, **kw)).token_ids


def chi_square(ids, probs):
    counts = torch.bincount(ids, minlength=probs.numel()).double()
    expected = probs.double() * ids.numel()
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token with zero probability"
    return (((counts - expected) ** 2 / expected)[support]).sum().item(), int(support.sum()) - 1


def test_greedy_is_argmax_with_lowest_id_on_ties():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[0, 7] = logits[0, 31] = 10.0  # tie: 7 wins
    t = tensors(6, temperature=[0.0, 0.0, 0.0, 0.5, 0.0, 1.0], top_k=[0, 0, 3, 1, 0, 1])
    out = sample(logits, t)
    assert out.token_ids.dtype == torch.int64
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.token_ids[0] == 7
    assert out.logprobs is None and out.logprob_token_ids is None


def test_bf16_logits_sample_like_their_fp32_values():
    torch.manual_seed(1)
    logits = torch.randn(16, 40).bfloat16()
    t = tensors(16, temperature=[0.0, 0.7, 1.3, 1.0] * 4, top_k=[0, 5, 0, 0] * 4, top_p=0.9)
    assert torch.equal(sample(logits, t).token_ids, sample(logits.float(), t).token_ids)


def test_batch_invariance_and_seed_reproducibility():
    torch.manual_seed(2)
    n, vocab = 12, 64
    logits = torch.randn(n, vocab) * 2
    params = dict(
        temperature=[0.0, 0.5, 1.0, 1.5, 0.8, 1.0, 1.0, 0.3, 2.0, 1.0, 0.9, 1.1],
        top_k=[0, 0, 5, 0, 3, 0, 10, 0, 0, 1, 0, 20],
        top_p=[1.0, 1.0, 1.0, 0.8, 0.9, 0.5, 1.0, 1.0, 0.95, 1.0, 0.2, 0.7],
        seeds=[11, 12, 13, 14, 15, 16, 17, 18, 19, 20, -(2**62), 2**63 - 1],
        counters=[0, 3, 1, 9, 0, 2, 5, 100, 7, 1, 4, 2**40],
    )
    full = sample(logits, tensors(n, **params)).token_ids
    assert torch.equal(full, sample(logits, tensors(n, **params)).token_ids)  # reproducible

    for i in range(n):  # each row alone
        alone = tensors(1, **{k: [v[i]] for k, v in params.items()})
        assert sample(logits[i : i + 1], alone).token_ids.item() == full[i].item()

    # shuffled, inside a batch padded with different rows
    perm = torch.randperm(n).tolist()
    other = torch.randn(5, vocab)
    mixed_logits = torch.cat([other[:2], logits[perm], other[2:]])
    extra = dict(temperature=1.0, top_k=4, top_p=0.6, seeds=99, counters=0)
    mixed = {k: [extra[k]] * 2 + [v[i] for i in perm] + [extra[k]] * 3 for k, v in params.items()}
    got = sample(mixed_logits, tensors(n + 5, **mixed)).token_ids[2 : 2 + n]
    assert got.tolist() == full[perm].tolist()


def test_host_flags_take_exact_shortcuts():
    """all_greedy / any_cut / min_p None only skip work: the general path gives the same
    tokens."""
    torch.manual_seed(3)
    logits = torch.randn(32, 100)
    for kw in (dict(temperature=0.0), dict(temperature=0.9), dict(temperature=1.0, top_p=0.7),
               dict(temperature=1.0, min_p=0.2)):  # fmt: skip
        fast = tensors(32, **kw)
        min_p = torch.zeros(32) if fast.min_p is None else fast.min_p  # (0: off)
        general = SamplingTensors(
            fast.temperature, fast.top_k, fast.top_p, min_p, fast.seeds, fast.counters, -1
        )
        assert not general.all_greedy and general.any_cut
        assert torch.equal(sample(logits, fast).token_ids, sample(logits, general).token_ids)
    assert tensors(2, temperature=0.0).all_greedy
    assert tensors(2, temperature=1.0, top_k=1).all_greedy
    assert not tensors(2, temperature=1.0).any_cut
    assert tensors(2, temperature=1.0, min_p=0.1).min_p is not None
    assert tensors(2, temperature=1.0).min_p is None
    assert tensors(2, temperature=0.0, min_p=0.1).min_p is None  # (greedy rows cut nothing)


def test_different_seeds_and_counters_give_different_draws():
    logits = torch.zeros(1, 1000)  # uniform: two draws collide with probability 1/1000
    by_counter = draws(logits[0], 200, seeds=5)
    assert by_counter.unique().numel() > 150
    by_seed = sample(logits.expand(200, -1), tensors(200, seeds=range(200), counters=0))
    assert by_seed.token_ids.unique().numel() > 150
    other_seed = draws(logits[0], 200, seeds=6)
    assert (other_seed != by_counter).float().mean() > 0.9
    # consecutive draws of one request are not correlated
    assert (by_counter[1:] == by_counter[:-1]).sum() < 5


def test_gumbel_noise_moments():
    g = gumbel_noise(torch.arange(200), torch.arange(200) * 7, torch.arange(500))
    assert g.shape == (200, 500) and g.dtype == torch.float32 and torch.isfinite(g).all()
    assert abs(g.mean().item() - 0.5772) < 0.01  # Euler-Mascheroni constant
    assert abs(g.var().item() - 1.6449) < 0.02  # pi^2 / 6


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
def test_frequencies_match_softmax(temperature):
    torch.manual_seed(4)
    logits = torch.randn(8) * 1.5
    probs = (logits / temperature).softmax(-1)
    stat, dof = chi_square(draws(logits, 4000, temperature=temperature, seeds=123), probs)
    assert stat < CHI2_999[dof], stat
    # across seeds at a fixed counter too
    ids = sample(
        logits.expand(4000, -1), tensors(4000, temperature=temperature, seeds=range(4000))
    ).token_ids
    stat, dof = chi_square(ids, probs)
    assert stat < CHI2_999[dof], stat


def test_top_k_stays_inside_top_k_and_renormalises():
    torch.manual_seed(5)
    logits = torch.randn(50)
    ids = draws(logits, 3000, temperature=0.8, top_k=5, seeds=7)
    top5 = logits.topk(5).indices
    assert torch.isin(ids, top5).all()
    probs = torch.zeros(50)
    probs[top5] = (logits[top5] / 0.8).softmax(-1)
    stat, dof = chi_square(ids, probs)
    assert stat < CHI2_999[dof], stat


def test_top_p_stays_inside_nucleus():
    probs = torch.tensor([0.05, 0.4, 0.02, 0.3, 0.15, 0.05, 0.02, 0.01])
    logits = probs.log()
    # 0.4 + 0.3 = 0.7 reaches 0.65: the nucleus is {1, 3}, sampled 4 : 3
    ids = draws(logits, 3000, top_p=0.65, seeds=8)
    nucleus = torch.zeros(8)
    nucleus[[1, 3]] = torch.tensor([0.4, 0.3]) / 0.7
    stat, dof = chi_square(ids, nucleus)
    assert stat < CHI2_999[dof], stat
    # 0.7 does not reach 0.71: token 4 joins
    assert set(draws(logits, 2000, top_p=0.71, seeds=8).tolist()) == {1, 3, 4}
    # a tiny top_p keeps the top token alone
    assert set(draws(logits, 500, top_p=1e-6, seeds=8).tolist()) == {1}


def test_top_p_applies_after_temperature_and_top_k():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])
    # T = 0.5 sharpens the head: softmax(2 * logits) puts ~0.867 on token 0
    assert set(draws(logits, 1000, temperature=0.5, top_p=0.85, seeds=9).tolist()) == {0}
    assert set(draws(logits, 1000, temperature=0.5, top_p=0.9, seeds=9).tolist()) == {0, 1}
    # top-k 3 renormalises first: top-3 mass of softmax(logits) is 0.665, 0.245, 0.090
    ids = draws(logits, 2000, top_k=3, top_p=0.9, seeds=9)  # 0.665 + 0.245 = 0.91 >= 0.9
    assert set(ids.tolist()) == {0, 1}


def test_min_p_keeps_the_tokens_within_min_p_of_the_most_likely_after_temperature():
    probs = torch.tensor([0.05, 0.4, 0.02, 0.3, 0.15, 0.05, 0.02, 0.01])
    logits = probs.log()
    # p >= 0.25 * 0.4 = 0.1: {1, 3, 4}, renormalised 0.4 : 0.3 : 0.15
    ids = draws(logits, 3000, min_p=0.25, seeds=8)
    kept = torch.zeros(8)
    kept[[1, 3, 4]] = torch.tensor([0.4, 0.3, 0.15]) / 0.85
    stat, dof = chi_square(ids, kept)
    assert stat < CHI2_999[dof], stat
    # min_p 1 keeps the most likely token alone, at any temperature: greedy
    assert set(draws(logits, 500, temperature=3.0, min_p=1.0, seeds=8).tolist()) == {1}
    # after temperature: T = 0.5 squares the ratios (0.3 / 0.4)^2 = 0.5625 >= 0.5, 0.14 < 0.5
    assert set(draws(logits, 1000, temperature=0.5, min_p=0.5, seeds=8).tolist()) == {1, 3}
    # before top-p, which renormalises over min-p's survivors: 0.4 / 0.85 = 0.47 reaches 0.45
    # (top-p alone would keep {1, 3}: 0.4 does not)
    assert set(draws(logits, 1000, min_p=0.25, top_p=0.45, seeds=8).tolist()) == {1}
    assert set(draws(logits, 1000, top_p=0.45, seeds=8).tolist()) == {1, 3}
    # off (0) samples from everything
    assert len(set(draws(logits, 3000, min_p=0.0, seeds=8).tolist())) == 8


def test_logit_bias_shifts_the_logits_every_row_samples_from_but_not_the_logprobs():
    probs = torch.tensor([0.05, 0.4, 0.02, 0.3, 0.15, 0.05, 0.02, 0.01])
    logits = probs.log()
    # +100 forces a token, greedy or not; -100 bans the argmax
    for temperature in (0.0, 1.0):
        assert set(draws(logits, 300, temperature=temperature, seeds=2,
                         logit_bias=((6, 100.0),)).tolist()) == {6}  # fmt: skip
    assert set(draws(logits, 300, temperature=0.0, logit_bias=((1, -100.0),)).tolist()) == {3}
    # a bias of log 2 doubles a token's odds: sampled from the renormalised distribution
    shifted = probs.clone()
    shifted[7] *= 2
    ids = draws(logits, 4000, seeds=5, logit_bias=((7, float(torch.tensor(2.0).log())),))
    stat, dof = chi_square(ids, shifted / shifted.sum())
    assert stat < CHI2_999[dof], stat
    out = sample(logits.expand(4, -1), tensors(4, num_logprobs=2, logit_bias=((6, 100.0),)))
    assert out.token_ids.tolist() == [6] * 4
    torch.testing.assert_close(out.logprobs[:, 0], logits.log_softmax(-1)[[6] * 4])
    # rows without a bias (padding: token 0, bias 0) sample as if there were none
    mixed = SamplingTensors.build([0.0] * 2, [0] * 2, [1.0] * 2, [0.0] * 2, [0] * 2, [0, 1], -1,
                                  "cpu", logit_bias=[((6, 100.0),), None])  # fmt: skip
    assert sample(logits.expand(2, -1), mixed).token_ids.tolist() == [6, 1]


def test_penalties_follow_vllm_repetition_then_frequency_and_presence():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]] * 2)
    counts = torch.tensor([[0, 2, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    in_prompt = torch.tensor([[True, False, False, False, True, False]] * 2)
    penalty = [(0.5, 0.25, 2.0), (0.0, 0.0, 1.0)]  # row 1: none
    t = SamplingTensors.build([0.0] * 2, [0] * 2, [1.0] * 2, [0.0] * 2, [0] * 2, [0] * 2, 0,
                              "cpu", penalty=penalty, seen=(counts, in_prompt))  # fmt: skip
    want = torch.tensor([2.0 / 2, -1.0 * 2 - 0.25 * 2 - 0.5, 0.5 / 2 - 0.25 - 0.5, 3.0,
                         -2.0 * 2, 1.0])  # fmt: skip
    torch.testing.assert_close(penalties(logits, t)[0], want, rtol=0, atol=0)
    assert torch.equal(penalties(logits, t)[1], logits[1])  # bits unchanged without one
    out = sample(logits, t)
    assert out.token_ids.tolist() == [3, 3]
    torch.testing.assert_close(out.logprobs[:, 0], logits.log_softmax(-1)[:, 3])  # raw
    # a penalty that moves the argmax: token 3 seen 4 times at frequency 1
    counts[0, 3] = 4
    assert sample(logits, t).token_ids.tolist() == [0, 3]


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(6)
    logits = torch.randn(10, 30) * 3
    t = tensors(
        10,
        temperature=[0.0, 0.5, 2.0, 1.0, 1.0] * 2,
        top_k=[0, 0, 3, 0, 0] * 2,
        top_p=0.8,
        num_logprobs=4,
    )
    out = sample(logits, t)
    ref = logits.log_softmax(-1)
    assert out.logprobs.shape == (10, 5) and out.logprob_token_ids.shape == (10, 5)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    assert torch.equal(out.logprob_token_ids[:, 0], out.token_ids)
    torch.testing.assert_close(out.logprobs[:, 0], ref.gather(-1, out.token_ids[:, None])[:, 0])
    top = ref.topk(4, dim=-1)
    torch.testing.assert_close(out.logprobs[:, 1:], top.values)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    assert (out.logprobs[:, 1:-1] >= out.logprobs[:, 2:]).all()  # descending
    # the ids match their values
    torch.testing.assert_close(out.logprobs, ref.gather(-1, out.logprob_token_ids))

    zero = sample(logits.bfloat16(), tensors(10, num_logprobs=0))
    assert zero.logprobs.shape == (10, 1) and zero.logprobs.dtype == torch.float32
    torch.testing.assert_close(
        zero.logprobs[:, 0],
        logits.bfloat16().float().log_softmax(-1).gather(-1, zero.token_ids[:, None])[:, 0],
    )


@pytest.mark.gpu
def test_cuda_matches_batch_invariance_at_full_vocab():
    torch.manual_seed(7)
    n, vocab = 64, 49152
    logits = (torch.randn(n, vocab, device="cuda") * 4).bfloat16()
    params = dict(
        temperature=[0.0, 0.7, 1.0, 1.3] * 16,
        top_k=[0, 0, 50, 0] * 16,
        top_p=[1.0, 0.9, 1.0, 0.95] * 16,
        seeds=list(range(n)),
        counters=[3] * n,
    )

    def build(idx):
        return SamplingTensors.build(
            *[[params[k][i] for i in idx] for k in params], num_logprobs=5, device="cuda"
        )

    full = sample(logits, build(range(n)))
    perm = torch.randperm(n).tolist()
    shuffled = sample(logits[perm], build(perm))
    assert torch.equal(shuffled.token_ids, full.token_ids[perm])
    for i in range(0, n, 7):
        assert sample(logits[i : i + 1], build([i])).token_ids.item() == full.token_ids[i].item()
    assert torch.equal(full.token_ids[::4], logits[::4].argmax(-1))
