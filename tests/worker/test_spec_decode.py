"""Speculative sampling math (`worker/spec_decode.py`) on synthetic distributions: rejection
sampling returns tokens distributed as the target at every window offset (chi-square
goodness of fit at significance 1e-3 per offset over 40,000 windows), accepts drafts at the
rate theory gives, and greedy windows accept exactly the argmax-agreeing prefix."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import chi_square_sf
from vllm_rlt.worker.sampler import SamplingTensors, processed_logits
from vllm_rlt.worker.spec_decode import accept, draft_tokens

N, K, V = 40_000, 2, 6
ALPHA = 1e-3


def tensors(seeds, counters, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
            logit_bias=None) -> SamplingTensors:  # fmt: skip
    n = len(seeds)
    return SamplingTensors.build(
        [temperature] * n,
        [top_k] * n,
        [top_p] * n,
        [min_p] * n,
        seeds,
        counters,
        -1,
        "cpu",
        logit_bias=[logit_bias] * n,
    )


def goodness_of_fit(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's test of `tokens` against `probs` (cells below 5 expected merged)."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return chi_square_sf(stat, int(keep.sum()) - 1)


@pytest.mark.parametrize(
    "settings", [{}, {"temperature": 0.7, "top_k": 4}, {"top_p": 0.8}, {"min_p": 0.3}]
)
def test_rejection_sampling_keeps_the_target_distribution(settings):
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(K + 1, V, generator=gen) * 1.5  # the same context in every window
    draft = target[:K] + torch.randn(K, V, generator=gen)  # a draft that differs
    seeds = list(range(N))
    start = 7  # output index of the first drafted token
    # drafts in turn: window offset j's token from draft row j - 1
    drafted, probs = [], []
    for j in range(K):
        t = tensors(seeds, [start + j] * N, **settings)
        ids, q = draft_tokens(draft[j].expand(N, V), t)
        drafted.append(ids)
        probs.append(q)
    rows = tensors([s for s in seeds for _ in range(K + 1)], [start + j for _ in seeds
                   for j in range(K + 1)], **settings)  # fmt: skip
    tokens, counts = accept(
        target.expand(N, K + 1, V),
        torch.stack(drafted, 1),
        torch.stack(probs, 1),
        torch.full((N,), K),
        rows,
    )
    p = processed_logits(target, tensors([0] * (K + 1), [0] * (K + 1), **settings)).softmax(-1)
    q = processed_logits(draft, tensors([0] * K, [0] * K, **settings)).softmax(-1)
    for j in range(K + 1):
        reached = counts > j
        p_value = goodness_of_fit(tokens[reached, j], p[j])
        print(f"offset {j + 1}: {int(reached.sum())} tokens, p {p_value:.3g}")
        assert p_value > ALPHA
    # draft j is accepted with probability sum(min(p_j, q_j)) once reached
    for j in range(K):
        reached = counts > j
        rate = float((counts[reached] > j + 1).double().mean())
        want = float(torch.minimum(p[j], q[j]).sum())
        assert abs(rate - want) < 4 * (want * (1 - want) / int(reached.sum())) ** 0.5 + 1e-9


def test_greedy_accepts_the_agreeing_prefix():
    target = torch.zeros(3, K + 1, V)
    target[:, :, 2] = 1.0  # the target's argmax is 2 everywhere
    target[1, 1, 4] = 2.0  # window 1, offset 2: 4
    drafts = torch.tensor([[2, 2], [2, 2], [3, 2]])
    t = tensors([0] * 3 * (K + 1), [0] * 3 * (K + 1), temperature=0.0)
    tokens, counts = accept(target, drafts, None, torch.tensor([2, 2, 1]), t)
    assert counts.tolist() == [3, 2, 1]
    assert tokens[0].tolist() == [2, 2, 2]  # both accepted, then the target's token
    assert tokens[1, :2].tolist() == [2, 4]  # the second draft differs: the target's 4
    assert tokens[2, 0].item() == 2  # the first draft differs


def test_greedy_drafts_and_targets_take_the_biased_argmax():
    """A logit bias moves both the draft and the target: the window's tokens are those of
    plain greedy decoding with the bias."""
    target = torch.zeros(2, K + 1, V)
    target[:, :, 2] = 1.0  # raw argmax 2; with +2 on token 5: 5
    t = tensors([0] * 2 * (K + 1), [0] * 2 * (K + 1), temperature=0.0, logit_bias=((5, 2.0),))
    drafts, probs = draft_tokens(target[:, 0], tensors([0] * 2, [0] * 2, temperature=0.0,
                                                       logit_bias=((5, 2.0),)))  # fmt: skip
    assert drafts.tolist() == [5, 5] and probs is None
    tokens, counts = accept(target, torch.tensor([[5, 5], [2, 5]]), None, torch.tensor([2, 2]), t)
    assert counts.tolist() == [3, 1]
    assert tokens[0].tolist() == [5, 5, 5] and tokens[1, 0].item() == 5
