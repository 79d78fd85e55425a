"""The dense reference against a naive token-by-token recurrence over the engine's layer modules
with an explicit (layer, depth, token) KV table: hand-built exit patterns for both KV layouts."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import rel_err, tiny_model
from vllm_rlt.models.reference import DenseOuroReference


def naive_states(model, ids, loops, layout):
    """[D][S] states computed token by token; token j is read at plane min(d, last_j)
    (LAST_EXITED) or last_j (SHARED), where last_j = loops[j] - 1."""
    layers = model.model.layers
    kv = {}  # (layer, depth, token) -> (k, v)
    states = {}
    for i, tok in enumerate(ids):
        x = model.model.embed_tokens(torch.tensor([tok]))
        pos = torch.tensor([i])
        for d in range(loops[i]):
            for li, layer in enumerate(layers):
                attn = layer.self_attn
                a = layer.input_layernorm(x)
                q = attn.q_proj(a).view(1, attn.num_heads, attn.head_dim)
                k = attn.k_proj(a).view(1, attn.num_kv_heads, attn.head_dim)
                v = attn.v_proj(a).view(1, attn.num_kv_heads, attn.head_dim)
                q, k = model.rotary(pos, q, k)
                kv[(li, d, i)] = (k, v)
                keys, values = [], []
                for j in range(i):
                    last = loops[j] - 1
                    plane = min(d, last) if layout == "last_exited" else last
                    keys.append(kv[(li, plane, j)][0])
                    values.append(kv[(li, plane, j)][1])
                keys = torch.cat([*keys, k]).repeat_interleave(
                    attn.num_heads // attn.num_kv_heads, 1
                )
                values = torch.cat([*values, v]).repeat_interleave(
                    attn.num_heads // attn.num_kv_heads, 1
                )
                probs = torch.einsum("qhd,khd->hqk", q, keys).mul(attn.head_dim**-0.5).softmax(-1)
                o = torch.einsum("hqk,khd->qhd", probs, values).reshape(1, -1)
                x = x + layer.input_layernorm_2(attn.o_proj(o))
                x = x + layer.post_attention_layernorm_2(
                    layer.mlp(layer.post_attention_layernorm(x))
                )
            x = model.model.norm(x)
            states[(d, i)] = x[0]
    return states


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize(
    "loops",
    [
        [4, 4, 4, 2, 4],  # a token that exits at depth 2 followed by a token at depth 4
        [4, 4, 1, 3, 2, 4],
        [4, 4, 4, 4],
    ],
)
@torch.no_grad()
def test_reference_matches_naive_recurrence(layout, loops):
    model = tiny_model(seed=3)
    ids = [5, 17, 2, 44, 9, 30][: len(loops)]
    out = DenseOuroReference.from_model(model).run(ids, loops, layout)
    naive = naive_states(model, ids, loops, layout)
    for d in range(4):
        for i in range(len(ids)):
            if d < loops[i]:
                assert rel_err(out.hidden[d, i], naive[(d, i)]) < 1e-5, (d, i)
            else:
                assert torch.isnan(out.hidden[d, i]).all()
                assert torch.isnan(out.gate_logits[d, i])


@torch.no_grad()
def test_last_exited_history_is_visible_only_at_deeper_depths():
    """Token 1 after token 0 exits at depth 2: depths 0-1 match the full-depth run, depths 2-3
    read token 0's depth-1 K/V and so differ from it."""
    model = tiny_model(seed=4)
    ref = DenseOuroReference.from_model(model)
    full = ref.run([7, 11], [4, 4])
    early = ref.run([7, 11], [2, 4])
    assert torch.equal(full.hidden[:2], early.hidden[:2])
    assert rel_err(early.hidden[2:, 1], full.hidden[2:, 1]) > 1e-3
    shared = ref.run([7, 11], [2, 4], "shared")
    assert rel_err(shared.hidden[0, 1], early.hidden[0, 1]) > 1e-3  # SHARED reads depth 1 at once


@torch.no_grad()
def test_reference_logits_and_gate_follow_hidden():
    model = tiny_model(seed=5)
    out = DenseOuroReference.from_model(model).run([1, 2, 3], [4, 3, 4])
    h = out.hidden[1]
    gate = model.model.early_exit_gate
    assert rel_err(out.logits[1], model.lm_head(h)) < 1e-6
    assert rel_err(out.gate_logits[1], gate(h).squeeze(-1)) < 1e-6
    assert torch.isnan(out.logits[3, 1]).all()
    with pytest.raises(ValueError, match="loops"):
        DenseOuroReference.from_model(model).run([1, 2], [5, 1])
