"""Native Huginn-0125 (tomg-group-umd, `RavenForCausalLM`) over packed rows (docs/models.md §3).

The stages differ from Ouro's in three ways:

- the prelude is the scaled embedding plus `n_layers_in_prelude` attention blocks; it returns
  the state row `[s0 | e]` of width 2E: the initial recurrent state s0 ("like-init" noise, a pure
  function of the request's seed and the position, scaled by its `init_scale`) beside the
  prelude output e, which the adapter re-injects at every recurrence;
- a recurrence maps `[s | e]` to `[core(adapter([s | e])) | e]` (no exit gate: the gate logit
  is 0, and the engine runs every token its loops);
- the coda is split: `coda_blocks` (ln_f, then the coda's attention blocks, which write their
  K/V) runs for every position once its last recurrence is done, `coda` (ln_f again and the tied
  head) only for the rows that sample.

KV: a KV block holds the K/V of the core's `L` layers. The core writes plane d at recurrence d;
the prelude's and coda's layers ("edge layers", prelude first) share `num_edge_planes` extra
planes, edge layer i living in layer slot i % L of edge plane i // L (2 + 2 edge layers fill the
release's single edge plane: 4 + 4 x 32 layer-slots per token, as the reference's cache).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from vllm_rlt.attention.backend import AttentionBackend, get_attention_backend
from vllm_rlt.attention.metadata import AttentionMetadata
from vllm_rlt.kernels.kv_format import KVLayer
from vllm_rlt.models.huginn_config import HuginnConfig
from vllm_rlt.models.layer_kernels import LayerKernels
from vllm_rlt.models.layers import RMSNorm
from vllm_rlt.models.looped_lm import LoopedCausalLM
from vllm_rlt.tensor_utils import counter_uniform

# fp32 tolerance of a checkpoint's `freqs_cis` against the recomputed table (the angles reach
# 4096 rad, where fp32 rounding of the angle alone is ~2e-4)
FREQS_ATOL = 1e-3


def rope_table(head_dim: int, num_positions: int, base: float) -> torch.Tensor:
    """[num_positions, head_dim / 2, 2] fp32 (cos, sin) of position x base^(-2i / head_dim)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(num_positions, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], -1)


def like_init_noise(
    seeds: torch.Tensor, positions: torch.Tensor, scales: torch.Tensor, config: HuginnConfig
) -> torch.Tensor:
    """[R, E] fp32 initial states: N(0, (std x scale)^2) truncated at 3 std, times sqrt(E), drawn
    by inverse CDF from `counter_uniform` keyed by (seed, position). seeds, positions: [R] int64;
    scales: [R] fp32 (0 gives zeros). The counters are -1 - position: negative, so the draws
    are independent of the sampler's (whose counters, output-token indices, are >= 0)."""
    dims = torch.arange(config.n_embd, device=seeds.device)
    u = counter_uniform(seeds, -1 - positions, dims).double()
    lo = 0.5 * math.erfc(3 / math.sqrt(2))  # Phi(-3)
    p = lo + u * (1 - 2 * lo)
    normal = math.sqrt(2) * torch.erfinv(2 * p - 1)
    return (normal * (config.init_std * config.embed_scale) * scales[:, None].double()).float()


class HuginnAttention(nn.Module):
    """Fused q/k/v projection with learned q/k biases, interleaved RoPE, output projection."""

    def __init__(self, config: HuginnConfig, backend: AttentionBackend):
        super().__init__()
        e, self.num_heads, self.head_dim = config.n_embd, config.n_heads, config.head_dim
        self.Wqkv = nn.Linear(e, 3 * e, bias=False)
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.num_heads, self.head_dim))
        self.proj = nn.Linear(e, e, bias=False)
        self.backend = backend

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        meta: AttentionMetadata,
        cache: KVLayer,
        kernels: LayerKernels,
    ) -> torch.Tensor:
        """x: [R, E] normed block input; rope: [R, 1, d/2, 2] this invocation's table rows."""
        qkv = kernels.linear(x, self.Wqkv.weight)
        heads = (self.num_heads, self.head_dim)
        q, k, v, written = kernels.bias_rope(qkv, self.qk_bias, rope, *heads,
                                             (cache, meta.slot_mapping))  # fmt: skip
        out = self.backend.forward(q, k, v, cache, meta, kv_stored=written)
        return kernels.linear(out.reshape(x.shape[0], -1), self.proj.weight)


class HuginnMLP(nn.Module):
    """proj(silu(gate) * up) with [gate; up] = fc(x)."""

    def __init__(self, config: HuginnConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 2 * config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, kernels: LayerKernels) -> torch.Tensor:
        return kernels.gated_mlp(x, self.fc.weight, self.proj.weight)


class HuginnBlock(nn.Module):
    """Sandwich block with post-residual norms: x = n2(attn(n1(x)) + x); x = n4(mlp(n3(x)) + x)."""

    def __init__(self, config: HuginnConfig, backend: AttentionBackend):
        super().__init__()
        e, eps = config.n_embd, config.norm_eps
        self.norm_1, self.norm_2 = RMSNorm(e, eps), RMSNorm(e, eps)
        self.norm_3, self.norm_4 = RMSNorm(e, eps), RMSNorm(e, eps)
        self.attn = HuginnAttention(config, backend)
        self.mlp = HuginnMLP(config)

    def forward(self, x, rope, meta, kv_layer: KVLayer, kernels: LayerKernels):
        attn = self.attn(kernels.norm(x, self.norm_1), rope, meta, kv_layer, kernels)
        x = kernels.norm(attn + x, self.norm_2)
        return kernels.norm(self.mlp(kernels.norm(x, self.norm_3), kernels) + x, self.norm_4)


class HuginnTransformer(nn.Module):
    def __init__(self, config: HuginnConfig, backend: AttentionBackend):
        super().__init__()
        e = config.n_embd
        self.wte = nn.Embedding(config.vocab_size, e)
        blocks = (HuginnBlock(config, backend) for _ in range(config.n_layers_in_prelude))
        self.prelude = nn.ModuleList(blocks)
        self.adapter = nn.Linear(2 * e, e, bias=False)
        blocks = (HuginnBlock(config, backend) for _ in range(config.n_layers_in_recurrent_block))
        self.core_block = nn.ModuleList(blocks)
        self.coda = nn.ModuleList(
            HuginnBlock(config, backend) for _ in range(config.n_layers_in_coda)
        )
        self.ln_f = RMSNorm(e, config.norm_eps)


class HuginnForCausalLM(LoopedCausalLM):
    """Huginn over packed rows; the KV cache and the hidden-state buffers live outside."""

    # capabilities the engine checks at startup
    requires_atomic_prefill = True  # a prompt chunk runs every recurrence and the coda at once
    supports_shared_kv = False  # one plane per recurrence, as the reference's cache
    has_exit_gate = False  # fixed depth: exit thresholds below 1 are refused
    random_initial_state = True  # prompt KV depends on the seed: no prefix caching
    prompt_runs_max_loops = True  # a request's recurrences (max_loops) apply to its prompt too

    def __init__(
        self,
        config: HuginnConfig,
        attention_backend: str | AttentionBackend = "torch",
        layer_kernels: str = "auto",
    ):
        super().__init__(config, layer_kernels)
        # the blocks call the strategy's norm, linear, logits, bias_rope and gated_mlp: skinny
        # (the CUDA default) runs the norms, the q/k step and the activation as Triton kernels
        # and projections of up to 16 rows on the few-row GEMM; invariant (batch_invariant) the
        # projections and the LM head on the invariant GEMM (docs/design/runner.md §4, §6)
        self.transformer = HuginnTransformer(config, get_attention_backend(attention_backend))
        self._add_lm_head(self.transformer.wte, config.tie_embeddings)
        table = rope_table(config.head_dim, config.block_size, config.rope_base)
        self.register_buffer("rope", table, persistent=False)

    def _apply(self, fn, recurse=True):
        rope = self.rope
        super()._apply(fn, recurse)
        self.rope = rope.to(self.rope.device)  # fp32 (the reference's) whatever the weights'
        return self

    @property
    def num_loops(self) -> int:
        return self.config.num_loops

    @property
    def state_size(self) -> int:
        """Width of a hidden-state row: the recurrent state and the prelude output."""
        return 2 * self.config.n_embd

    @property
    def num_edge_planes(self) -> int:
        """KV planes of the prelude's and coda's layers (beside one plane per recurrence)."""
        c = self.config
        return -(-(c.n_layers_in_prelude + c.n_layers_in_coda) // c.n_layers_in_recurrent_block)

    # ---- checkpoint tensors beyond the parameters ----------------------------------------
    @property
    def optional_checkpoint_tensors(self) -> tuple[str, ...]:
        """Tensors a checkpoint may hold that are no parameter: the tied head's duplicate and
        the RoPE table (`check_checkpoint_tensor` vets each)."""
        return ("lm_head.weight", "freqs_cis") if self.config.tie_embeddings else ("freqs_cis",)

    @torch.no_grad()
    def check_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> str | None:
        """Vet (and for `freqs_cis`, adopt) an optional tensor; returns a problem or None."""
        if name == "lm_head.weight":
            wte = self.transformer.wte.weight
            if tensor.shape != wte.shape or not torch.equal(tensor.to(wte), wte):
                return "lm_head.weight differs from transformer.wte.weight (the head is tied)"
            return None
        c = self.config
        want = (1, c.block_size, 1, c.head_dim // 2, 2)
        if tuple(tensor.shape) != want:
            return f"freqs_cis has shape {list(tensor.shape)}, expected {list(want)}"
        table = tensor.reshape(self.rope.shape).float()
        err = (table - self.rope.cpu()).abs().max().item()
        if err > FREQS_ATOL:
            return f"freqs_cis differs from the rope_base={c.rope_base} table by {err:.2e}"
        self.rope.copy_(table)
        return None

    # ---- stages ---------------------------------------------------------------------------
    def _edge(self, index: int, metas: Sequence[AttentionMetadata], kv: Any):
        """(metadata, KV layer) of edge layer `index` (prelude layers first, then the coda's)."""
        plane, slot = divmod(index, self.config.n_layers_in_recurrent_block)
        return metas[plane], kv.layer(slot)

    def prelude(
        self,
        token_ids: torch.Tensor,
        edge_metas: Sequence[AttentionMetadata],
        kv: Any,
        seeds: torch.Tensor,
        init_scales: torch.Tensor,
    ) -> torch.Tensor:
        """token_ids, seeds: [R] int64; init_scales: [R] fp32; edge_metas[k]: the rows in edge
        plane k -> state rows [s0 | e] [R, 2E]."""
        t, kernels = self.transformer, self._kernels(token_ids.device)
        positions = edge_metas[0].positions
        rope = self.rope[positions].unsqueeze(1)
        e = t.wte(token_ids) * self.config.embed_scale
        for i, block in enumerate(t.prelude):
            meta, layer = self._edge(i, edge_metas, kv)
            e = block(e, rope, meta, layer, kernels)
        s0 = like_init_noise(seeds, positions, init_scales, self.config).to(e.dtype)
        return torch.cat([s0, e], -1)

    def recurrent_core(
        self, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One recurrence for every row: [s | e] [R, 2E] -> ([s' | e] [R, 2E], zeros [R] fp32)."""
        t, kernels = self.transformer, self._kernels(hidden.device)
        rope = self.rope[attn_metadata.positions].unsqueeze(1)
        x = kernels.linear(hidden, t.adapter.weight)
        for j, block in enumerate(t.core_block):
            x = block(x, rope, attn_metadata, kv.layer(j), kernels)
        gate = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        return torch.cat([x, hidden[:, self.config.n_embd :]], -1), gate

    def coda_blocks(
        self, hidden: torch.Tensor, edge_metas: Sequence[AttentionMetadata], kv: Any
    ) -> torch.Tensor:
        """State rows [R, 2E] after their last recurrence -> coda output [R, E]; writes the
        coda's K/V of their positions."""
        t, kernels = self.transformer, self._kernels(hidden.device)
        rope = self.rope[edge_metas[0].positions].unsqueeze(1)
        z = kernels.norm(hidden[:, : self.config.n_embd], t.ln_f)
        for c, block in enumerate(t.coda):
            meta, layer = self._edge(len(t.prelude) + c, edge_metas, kv)
            z = block(z, rope, meta, layer, kernels)
        return z

    def coda(self, hidden: torch.Tensor) -> torch.Tensor:
        """Coda output [R, E] -> logits [R, V] (in the model dtype)."""
        kernels = self._kernels(hidden.device)
        return kernels.logits(kernels.norm(hidden, self.transformer.ln_f), self.lm_head.weight)
