"""`SamplingParams.prompt_logprobs`: each prompt token after the first gets the logprob the model
gives it after the positions before it, at full depth, with the top alternatives. Oracle: the
dense reference model's logits at the last depth; the same in fp32 on the CPU whatever the
chunking, WCPB, other requests in the batch, n samples or a cached prefix (to the rounding of
the LM head, which scores rows in batches of different shapes)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from tests.engine.harness import make_engine
from vllm_rlt.models.reference import DenseOuroReference
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.sampling_params import SamplingParams

TOP = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("m"), vocab_size=256, seed=11)


def _reference(eng, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), V] logprobs of the dense reference at the last depth."""
    depth = eng.model.num_loops
    out = DenseOuroReference.from_model(eng.model).run(prompt, [depth] * len(prompt), "last_exited")
    return out.logits[depth - 1].double().log_softmax(-1)


def _scored(eng, prompts: list[list[int]]) -> dict:
    """Outputs of the prompts (submitted together, 3 sampled tokens each), prompts scored."""
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=3, temperature=0.7, seed=i, prompt_logprobs=TOP,
                                ignore_eos=True)  # fmt: skip
        eng.add_request(f"r{i}", prompt, params)
    return {o.request_id: o for o in eng.generate_all()}


def _close(a: dict, b: dict, tol: float) -> bool:
    return a.keys() == b.keys() and all(abs(a[t] - b[t]) < tol for t in a)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"prefill_chunk_size": 4, "max_num_batched_tokens": 8},
        {"wavefront_chunked_prefill": True, "prefill_chunk_size": 4, "max_num_batched_tokens": 8},
        {"enable_prefix_caching": True},
    ],
    ids=["whole", "chunked", "wcpb", "prefix-cache"],
)
def test_prompt_tokens_score_as_the_reference_does(model_dir, options):
    rng = random.Random(3)
    shared = rng.choices(range(256), k=6)
    prompts = [shared + rng.choices(range(256), k=rng.randint(1, 9)) for _ in range(3)]
    eng = make_engine(model_dir, **options)
    outs = _scored(eng, prompts + prompts[:1])  # the repeat hits the prefix cache when on
    whole = _scored(make_engine(model_dir), prompts)
    for i, prompt in enumerate(prompts):
        got = outs[f"r{i}"].prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        ref = _reference(eng, prompt)
        for p in range(1, len(prompt)):
            top = ref[p - 1].topk(TOP)
            want = {prompt[p]: float(ref[p - 1, prompt[p]])}
            want.update(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            assert _close(got[p], want, 1e-4), (i, p)
            assert _close(got[p], whole[f"r{i}"].prompt_logprobs[p], 1e-5), (i, p)
    again, first = outs["r3"].prompt_logprobs, outs["r0"].prompt_logprobs
    assert again[0] is None
    assert all(_close(a, b, 1e-5) for a, b in zip(again[1:], first[1:], strict=True))


def test_n_samples_share_one_scoring_and_the_rest_is_unchanged(model_dir):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    eng = make_engine(model_dir)
    plain = SamplingParams(max_tokens=4, temperature=0.8, seed=7, n=2, ignore_eos=True)
    eng.add_request("a", prompt, plain)
    eng.add_request("b", prompt, replace(plain, prompt_logprobs=0))
    a, b = sorted(eng.generate_all(), key=lambda o: o.request_id)
    assert a.prompt_logprobs is None
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert all(len(e) == 1 and next(iter(e)) == tok
               for e, tok in zip(b.prompt_logprobs[1:], prompt[1:], strict=True))  # fmt: skip
