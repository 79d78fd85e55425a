"""Sampling for self-speculative decoding (docs/design/speculative.md §4): draft tokens from the
draft distribution, and the acceptance of a window's drafts against the target distribution.

Greedy rows draft the argmax and accept a draft while it equals the target's argmax, so their
tokens are those of plain decoding. Random rows use standard rejection sampling: a draft `x`
drawn from `q` is accepted with probability min(1, p(x) / q(x)); at the first rejection the
token is drawn from normalize(max(0, p - q)); when every draft is accepted one more token is
drawn from the target. The output distribution is then exactly the target's. `p` and `q` are the
distributions plain sampling draws from (logit bias, temperature, min-p, top-k, top-p applied;
requests with penalties do not speculate).

All randomness is counter-based, as in `sampler.py`: the noise of a decision is a function of the
request's seed, the output index of the token it decides and a salt per kind of decision (draft,
accept, residual; the final token of a fully accepted window takes plain sampling's noise). Each
output index is decided once, with noise no earlier decision saw, so the result is reproducible
and the streams are independent.
"""

from __future__ import annotations

import torch

from vllm_rlt.tensor_utils import counter_uniform
from vllm_rlt.worker.sampler import (
    SamplingTensors,
    biased,
    greedy_rows,
    gumbel_noise,
    processed_logits,
)

_SALT_SHIFT = 40  # salts go above every counter a request reaches
DRAFT, ACCEPT, RESIDUAL = 1, 2, 3  # salts of the decisions (plain sampling: 0)


def salted(t: SamplingTensors, salt: int) -> torch.Tensor:
    """[N] int64 counters of `t` in the noise stream `salt`."""
    return t.counters + (salt << _SALT_SHIFT)


def draft_tokens(logits: torch.Tensor, t: SamplingTensors | None):
    """Draft tokens of `logits` [N, V] (`t` None: every row is greedy): (token ids [N] int64, the
    draft distribution [N, V] fp32 (None when every row is greedy))."""
    logits = biased(logits, t)
    greedy_ids = logits.argmax(dim=-1)
    if t is None or t.all_greedy:
        return greedy_ids, None
    scaled = processed_logits(logits, t)
    vocab_ids = torch.arange(logits.shape[-1], device=logits.device)
    noise = gumbel_noise(t.seeds, salted(t, DRAFT), vocab_ids)
    token_ids = torch.where(greedy_rows(t), greedy_ids, (scaled + noise).argmax(dim=-1))
    return token_ids, scaled.softmax(dim=-1)


def accept(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_drafts: torch.Tensor,
    t: SamplingTensors | None,
):
    """Accept a prefix of each window's drafts.

    logits: [N, K + 1, V] target logits of each window's positions (row j gives the token after
    position j); drafts: [N, K] int64 draft tokens (column j-1: the token at window offset j);
    draft_probs: [N, K, V] fp32 the distributions they were drawn from (None: all greedy);
    num_drafts: [N] int64 drafts of each window (<= K; later columns are padding);
    t: sampling tensors of the N * (K + 1) rows, row-major, counters = output index (None: every
    row is greedy).
    Returns (tokens [N, K + 1] int64: the accepted drafts then one token of the target,
    counts [N] int64: how many of them are valid, 1..num_drafts + 1).
    """
    n, width, vocab = logits.shape
    k = width - 1
    flat = biased(logits.reshape(n * width, vocab), t)
    target_greedy = flat.argmax(dim=-1).reshape(n, width)
    columns = torch.arange(k, device=logits.device)
    valid = columns[None, :] < num_drafts[:, None]
    ok = drafts == target_greedy[:, :k]
    random = t is not None and not t.all_greedy
    if random:
        greedy = greedy_rows(t).reshape(n, width)
        p = processed_logits(flat, t).softmax(dim=-1).reshape(n, width, vocab)
        p_draft = p[:, :k].gather(-1, drafts[..., None])[..., 0]
        q_draft = draft_probs.gather(-1, drafts[..., None])[..., 0]
        zero = torch.zeros(1, dtype=torch.int64, device=logits.device)
        u = counter_uniform(t.seeds, salted(t, ACCEPT), zero).reshape(n, width)[:, :k]
        ok = torch.where(greedy[:, :k], ok, u * q_draft <= p_draft)
    ok &= valid
    num_accepted = ok.long().cumprod(dim=-1).sum(dim=-1)  # [N]
    last = num_accepted[:, None]  # column of the target's token
    final = target_greedy.gather(-1, last)[:, 0]
    if random:
        vocab_ids = torch.arange(vocab, device=logits.device)
        rejected = num_accepted < num_drafts
        stream = torch.where(rejected.repeat_interleave(width), RESIDUAL << _SALT_SHIFT, 0)
        noise = gumbel_noise(t.seeds, t.counters + stream, vocab_ids).reshape(n, width, vocab)
        p_last = p.gather(1, last[..., None].expand(n, 1, vocab))[:, 0]
        padded = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)
        q_last = padded.gather(1, last[..., None].expand(n, 1, vocab))[:, 0]
        # rejected: normalize(max(0, p - q)); all accepted: p itself (q_last is zero padding)
        residual = (p_last - torch.where(rejected[:, None], q_last, 0.0)).clamp_(min=0.0)
        noise_last = noise.gather(1, last[..., None].expand(n, 1, vocab))[:, 0]
        sampled = (residual.log() + noise_last).argmax(dim=-1)
        final = torch.where(greedy.gather(-1, last)[:, 0], final, sampled)
    tokens = torch.cat([drafts, drafts[:, :1]], dim=1).scatter(1, last, final[:, None])
    return tokens, num_accepted + 1
