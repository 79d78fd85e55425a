"""Token sampling over a batch of logit rows, vectorised and independent of batch composition.

A request's logit bias is added to its logits first, then its penalties apply (repetition, then
frequency and presence, as vLLM's). Greedy rows take the argmax (ties -> lowest id). Random rows
apply temperature, then min-p, then top-k, then top-p (vLLM's order), and sample with the
Gumbel-max trick: the noise for (row, vocab id v) is a counter-based hash of (seed, counter, v),
so a request's token depends only on its seed, its output-token index and its logits - never on
the other rows of the batch or their order. Logprobs come from the raw logits (fp32 log_softmax
before the bias, the penalties, temperature, min-p, top-k and top-p), as vLLM reports them by
default.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_rlt.core.sched.execution_batch import SampledToken
from vllm_rlt.sampling_params import (
    GREEDY_TEMPERATURE_EPS,
    MAX_LOGIT_BIAS,
    penalized,
    samples_greedily,
)
from vllm_rlt.tensor_utils import counter_uniform, to_device_packed


@dataclass(frozen=True)
class SamplingTensors:
    temperature: torch.Tensor  # [N] float32; below 1e-5 (0) = greedy
    top_k: torch.Tensor  # [N] int64; 0 = off
    top_p: torch.Tensor  # [N] float32; 1.0 = off
    min_p: torch.Tensor | None  # [N] float32, 0 = off; None: no random row uses it
    seeds: torch.Tensor  # [N] int64 per-request seed (the engine draws one for unseeded requests)
    counters: torch.Tensor  # [N] int64 index of the output token being sampled (0-based)
    num_logprobs: int  # most top alternatives asked for in the batch; -1 = no logprobs at all
    all_greedy: bool = False  # host-known: every row is greedy, so skip the random path
    any_cut: bool = True  # host-known: some random row cuts with top-k or top-p (a sort)
    # logit bias: [N, B] token ids and their biases (padding: token 0, bias 0); None: no row has
    bias_ids: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    # penalties: [3, N] float32 presence, frequency and repetition (None: no row has one), and
    # what they read, [N, V] output counts and prompt flags (`PenaltyState.rows`)
    penalty: torch.Tensor | None = None
    seen: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(
        cls,
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        min_p: list[float],
        seeds: list[int],
        counters: list[int],
        num_logprobs: int,
        device: torch.device | str,
        logit_bias: list | None = None,
        penalty: list | None = None,
        seen: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SamplingTensors:
        """One tensor per field from per-row lists (row i of every list is row i of the logits;
        `logit_bias`: each row's (id, bias) pairs or None; `penalty`: each row's (presence,
        frequency, repetition) or None where no row has one, `seen` then what they read),
        uploaded together."""
        host = [np.asarray(temperature, np.float32), np.asarray(top_k, np.int64),
                np.asarray(top_p, np.float32), np.asarray(min_p, np.float32),
                np.asarray(seeds, np.int64), np.asarray(counters, np.int64)]  # fmt: skip
        all_greedy, any_cut, any_min_p = shortcuts(*host[:4])
        if penalty is not None:
            host.append(np.asarray(penalty, np.float32).T.copy())
        if logit_bias is not None and any(logit_bias):
            host += bias_arrays(logit_bias, max(len(b or ()) for b in logit_bias))
        temperature_t, top_k_t, top_p_t, min_p_t, seeds_t, counters_t, *more = to_device_packed(
            host, torch.device(device)
        )
        penalty_t = more.pop(0) if penalty is not None else None
        return cls(
            temperature=temperature_t,
            top_k=top_k_t,
            top_p=top_p_t,
            min_p=min_p_t if any_min_p else None,
            seeds=seeds_t,
            counters=counters_t,
            num_logprobs=num_logprobs,
            all_greedy=all_greedy,
            any_cut=any_cut,
            bias_ids=more[0] if more else None,
            bias=more[1] if more else None,
            penalty=penalty_t,
            seen=seen if penalty is not None else None,
        )

    @classmethod
    def of(cls, params, counters: list[int], num_logprobs: int, device,
           seen: tuple[torch.Tensor, torch.Tensor] | None = None) -> SamplingTensors:  # fmt: skip
        """`build` from per-row settings objects (`temperature`, `top_k`, `top_p`, `min_p`,
        `seed`, `logit_bias` and penalty attributes, as NewRequestData); `seen`: what their
        penalties read, where some row has one."""
        penalty = penalty_rows(params) if any(penalized(p) for p in params) else None
        if penalty is not None and seen is None:
            raise ValueError("rows with penalties need their output counts (seen)")
        return cls.build(
            temperature=[p.temperature for p in params],
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params],
            logit_bias=[p.logit_bias for p in params],
            seeds=[p.seed for p in params],
            counters=counters,
            num_logprobs=num_logprobs,
            device=device,
            penalty=penalty,
            seen=seen,
        )


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64 sampled tokens
    logprobs: torch.Tensor | None  # [N, 1 + num_logprobs] float32: sampled, then top descending
    logprob_token_ids: torch.Tensor | None  # [N, 1 + num_logprobs] int64 ids matching `logprobs`


def sample(logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
    """Sample one token per row of `logits` [N, V] (any float dtype, CPU or CUDA)."""
    shifted = penalties(biased(logits, t), t)
    greedy_ids = shifted.argmax(dim=-1)
    if t.all_greedy:
        token_ids = greedy_ids
    else:
        noise = gumbel_noise(
            t.seeds, t.counters, torch.arange(logits.shape[-1], device=logits.device)
        )
        random_ids = (processed_logits(shifted, t) + noise).argmax(dim=-1)
        token_ids = torch.where(greedy_rows(t), greedy_ids, random_ids)
    if t.num_logprobs < 0:
        return SamplerOutput(token_ids, None, None)
    logprobs, logprob_token_ids = token_logprobs(logits, token_ids, t.num_logprobs)
    return SamplerOutput(token_ids, logprobs, logprob_token_ids)


def bias_arrays(logit_bias: list, width: int = MAX_LOGIT_BIAS) -> list[np.ndarray]:
    """[N, width] token ids and float32 biases of each row's (id, bias) pairs (None: none),
    padded with token 0 and bias 0 (adding 0 changes no logit)."""
    ids = np.zeros((len(logit_bias), width), dtype=np.int64)
    values = np.zeros((len(logit_bias), width), dtype=np.float32)
    for i, pairs in enumerate(logit_bias):
        if pairs:
            ids[i, : len(pairs)], values[i, : len(pairs)] = zip(*pairs, strict=True)
    return [ids, values]


def biased(logits: torch.Tensor, t: SamplingTensors | None) -> torch.Tensor:
    """`logits` with each row's logit bias added (fp32), or as they are when no row has one."""
    if t is None or t.bias is None:
        return logits
    return logits.float().scatter_add(-1, t.bias_ids, t.bias)


def penalty_rows(params) -> list[tuple[float, float, float]]:
    """Each row's (presence, frequency, repetition) penalties."""
    return [(p.presence_penalty, p.frequency_penalty, p.repetition_penalty) for p in params]


def penalties(logits: torch.Tensor, t: SamplingTensors | None) -> torch.Tensor:
    """`logits` with each row's penalties applied (fp32), or as they are when no row has one:
    the positive logits of tokens in the prompt or the output divided by the repetition
    penalty, the negative ones multiplied; then frequency times each token's output count and
    presence for every token the output holds subtracted. Rows without penalties keep their
    values (x / 1, x * 1, x - 0)."""
    if t is None or t.penalty is None:
        return logits
    counts, in_prompt = t.seen
    x = logits.float()
    presence, frequency, repetition = (v[:, None] for v in t.penalty)
    seen = counts > 0
    x = torch.where(seen | in_prompt, torch.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * counts - presence * seen


def shortcuts(temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
              min_p: np.ndarray) -> tuple[bool, bool, bool]:  # fmt: skip
    """(every row takes the argmax, some random row cuts with top-k or top-p, some random row
    uses min-p) from host copies of the settings (the floats in float32, as on the device):
    flags that let the sampler skip work without a device sync."""
    greedy = (temperature < GREEDY_TEMPERATURE_EPS) | (top_k == 1)
    cuts = (top_k > 0) | (top_p < 1.0)
    return bool(greedy.all()), bool((cuts & ~greedy).any()), bool(((min_p > 0) & ~greedy).any())


def plain_argmax(params) -> bool:
    """Whether every row of `params` (per-row settings objects, as `SamplingTensors.of` takes)
    takes the argmax of its logits as they are (greedy, no logit bias, no penalties): then the
    caller needs no sampling tensors (host check, no device work)."""
    return all(
        samples_greedily(p.temperature, p.top_k) and not p.logit_bias and not penalized(p)
        for p in params
    )


def greedy_rows(t: SamplingTensors) -> torch.Tensor:
    """[N] bool: the rows that take the argmax."""
    return (t.temperature < GREEDY_TEMPERATURE_EPS) | (t.top_k == 1)


def processed_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """[N, V] fp32 logits of the distribution random rows sample from: temperature, then min-p,
    top-k and top-p (cut tokens at -inf); greedy rows get a throwaway value."""
    temperature = torch.where(greedy_rows(t), torch.ones_like(t.temperature), t.temperature)
    scaled = logits.float() / temperature[:, None]
    if t.min_p is not None:
        # p / p_max >= min_p is scaled - max >= log(min_p) (log 0 = -inf keeps every token)
        floor = scaled.amax(dim=-1, keepdim=True) + t.min_p[:, None].log()
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    if t.any_cut:
        scaled = scaled.masked_fill(scaled < _cutoff(scaled, t.top_k, t.top_p), float("-inf"))
    return scaled


def _cutoff(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[N, 1] smallest kept value: top-k, then top-p over the renormalised top-k survivors.

    Tokens tied with the cutoff are kept too, so the kept set does not depend on sort order.
    """
    sorted_vals = scaled.sort(dim=-1, descending=True).values
    positions = torch.arange(scaled.shape[-1], device=scaled.device)
    keep = (top_k[:, None] <= 0) | (positions[None, :] < top_k[:, None])
    probs = sorted_vals.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the better tokens (exclusive cumsum)
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    num_kept = keep.sum(dim=-1, keepdim=True).clamp_(min=1)  # keep is a prefix of the sort
    return sorted_vals.gather(-1, num_kept - 1)


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_ids: torch.Tensor):
    """[N, V] float32 standard Gumbel noise, a pure function of (seeds[i], counters[i], v).

    seeds, counters: [N] int64; vocab_ids: [V] int64 (>= 0, < 2**31).
    """
    w = counter_uniform(seeds, counters, vocab_ids)
    return -torch.log(-torch.log1p(-w))  # -log(Exp(1)) is Gumbel(0, 1)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int):
    """Raw-logit logprobs: column 0 the sampled token, then the top `num_logprobs` descending."""
    logprobs = logits.float().log_softmax(dim=-1)
    ids = token_ids[:, None]
    values = logprobs.gather(-1, ids)
    if num_logprobs > 0:
        top_values, top_ids = logprobs.topk(num_logprobs, dim=-1)
        values = torch.cat([values, top_values], dim=-1)
        ids = torch.cat([ids, top_ids], dim=-1)
    return values, ids


def host_tokens(ids: list[int], lps: list | None, lp_ids: list | None, wants: list[int]):
    """`SampledToken`s from read-back sampler output (`SamplerOutput` as lists; `wants[i]`:
    the top alternatives row i asked for, -1 for none)."""
    result = []
    for i, want in enumerate(wants):
        if lps is None or want < 0:
            result.append(SampledToken(ids[i], None, ()))
        else:
            top = tuple(zip(lp_ids[i][1 : 1 + want], lps[i][1 : 1 + want], strict=True))
            result.append(SampledToken(ids[i], lps[i][0], top))
    return result
