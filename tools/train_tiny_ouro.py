"""Train a small Ouro (looped LM) on the Python standard library and export an HF directory.

Run from anywhere (the repository root is put on sys.path):

    python tools/train_tiny_ouro.py --out DIR [--steps N] [--device cuda] ...

Corpus: the `*.py` files of the running interpreter's standard library
(`sysconfig.get_paths()["stdlib"]`), without site-packages and without any directory named
`test*`/`idle_test`. A file is held out when `crc32(relative path) % 100 < 5` (~5%), so the split
does not depend on the machine or on the order files are listed. Documents are joined with
`<|endoftext|>` (id 0). The tokenizer is a byte-level BPE trained on the training split only.

Model: the Ouro architecture of docs MODELS.md §1.3 (sandwich RMSNorms with fp32 statistics,
split-half RoPE, SwiGLU, `model.norm` after every loop, the exit gate on the normed state) as a
dense batched causal forward, with parameters under the HF checkpoint names so the engine's loader
reads the export. The test suite checks it against `DenseOuroReference` per loop.

Objective (the Ouro paper's two stages, MODELS.md §1.5; my own implementation):
- Stage 1 (`--steps`): with λ_t = σ(g_t), the exit distribution p_t = λ_t Π_{j<t}(1-λ_j) and
  p_D = Π_{j<D}(1-λ_j); loss = mean over tokens of Σ_t p_t·L_t − β·H(p), L_t the next-token
  cross-entropy of loop t. The entropy term keeps the gate from collapsing onto one loop early.
- Stage 2 (`--gate-steps`): everything but `model.early_exit_gate` is frozen. For each token and
  each loop t < D, the improvement I_t = L_t − L_{t+1} defines a soft exit target
  y_t = 1 − σ(k·(I_t − margin)) (k = 100): exit when one more loop stops lowering the loss by
  `--gate-margin` nats. The gate is trained with binary cross-entropy of λ_t against y_t. Only the
  next loop is looked at, as in the paper's stage 2; λ_D is never used.

Evaluation on the held-out split: perplexity after 1..D loops, and for each threshold q the Ouro
exit rule (exit at the first loop whose CDF ≥ q, else the last), its depth histogram, mean depth and
perplexity. Every token sees all D loops of its context (the HF reference semantics); the engine's
real early exit also skips deeper loops of earlier tokens. The recommended threshold is the lowest
q whose perplexity is within `RECOMMEND_TOLERANCE` of the full-depth one (1.0 if none).

Export: config.json, model.safetensors (bf16), tokenizer.json, tokenizer_config.json (ChatML
template), eval.json and a README.md model card. Seeds are fixed; on CUDA, kernels may still
differ in the last bits from run to run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import sysconfig
import time
import zlib
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn

from vllm_rlt.models.layers import RMSNorm, SwiGLUMLP
from vllm_rlt.models.ouro import OuroConfig
from vllm_rlt.models.tiny import SPECIAL_TOKENS, save_checkpoint, train_tokenizer

EOS_ID = 0  # <|endoftext|>, also the document separator
HELD_OUT_PERCENT = 5
THRESHOLDS = (0.3, 0.5, 0.7, 0.9)
RECOMMEND_TOLERANCE = 0.02  # relative perplexity increase allowed for the recommended threshold
GATE_SHARPNESS = 100.0  # k in the stage-2 target σ(k·(I_t − margin))
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# ----------------------------------------------------------------------------- corpus


def stdlib_files() -> tuple[Path, list[str]]:
    """The stdlib root and the sorted relative paths of its non-test *.py files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        dirs = parts[:-1]
        if any(d == "site-packages" or d.startswith("test") or d == "idle_test" for d in dirs):
            continue
        rel.append("/".join(parts))
    return root, sorted(rel)


def is_held_out(rel_path: str) -> bool:
    return zlib.crc32(rel_path.encode()) % 100 < HELD_OUT_PERCENT


def load_corpus(max_train_files: int | None) -> tuple[list[str], list[str], dict]:
    """(train texts, held-out texts, a description for the card)."""
    root, files = stdlib_files()
    train = [f for f in files if not is_held_out(f)]
    held = [f for f in files if is_held_out(f)]
    if max_train_files is not None:
        train = train[:max_train_files]
        held = held[: max(2, max_train_files // 10)]

    def read(rel: str) -> str:
        return (root / rel).read_text(encoding="utf-8", errors="replace")

    info = {
        "stdlib": str(root),
        "python": sys.version.split()[0],
        "num_train_files": len(train),
        "num_held_out_files": len(held),
        "split_rule": f"crc32(relative path) % 100 < {HELD_OUT_PERCENT} -> held out",
    }
    return [read(f) for f in train], [read(f) for f in held], info


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents as one int64 stream, each preceded by <|endoftext|>."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids.append(EOS_ID)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------- model


def rope_tables(config: OuroConfig, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, head_dim] fp32 for positions 0..T-1 (split-half layout)."""
    d = config.head_dim
    inv_freq = config.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
    ang = (torch.arange(seq_len, dtype=torch.float64, device=device)[:, None] * inv_freq).float()
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, d]; the tables are cast to x's dtype, as in the HF reference."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: OuroConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H] -> [B, T, H], causal."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: OuroConfig):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config)
        self.mlp = SwiGLUMLP(h, config.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps)
        self.input_layernorm_2 = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm_2 = RMSNorm(h, eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.input_layernorm_2(self.self_attn(self.input_layernorm(h), cos, sin))
        return h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))


class Backbone(nn.Module):
    def __init__(self, config: OuroConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1, bias=True)


class TrainOuro(nn.Module):
    """Dense batched Ouro for training; `named_parameters()` are the HF checkpoint names."""

    def __init__(self, config: OuroConfig):
        super().__init__()
        if config.tie_word_embeddings:
            raise ValueError("the trainer writes an untied lm_head")
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def states(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """ids: [B, T] -> the normed state after each loop, D tensors of [B, T, H]."""
        cos, sin = rope_tables(self.config, ids.shape[1], ids.device)
        h, out = self.model.embed_tokens(ids), []
        for _ in range(self.config.num_loops):
            for layer in self.model.layers:
                h = layer(h, cos, sin)
            h = self.model.norm(h)
            out.append(h)
        return out

    def gate_logits(self, state: torch.Tensor) -> torch.Tensor:
        """state: [..., H] -> exit-gate logit [...] in fp32 (also under autocast)."""
        gate = self.model.early_exit_gate
        with torch.autocast(state.device.type, enabled=False):
            return F.linear(state.float(), gate.weight.float(), gate.bias.float()).squeeze(-1)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids: [B, T] -> (logits [D, B, T, V], gate logits [D, B, T] fp32)."""
        states = self.states(ids)
        logits = torch.stack([self.lm_head(s) for s in states])
        return logits, torch.stack([self.gate_logits(s) for s in states])


@torch.no_grad()
def init_weights(model: TrainOuro, seed: int) -> None:
    """N(0, 0.02) matrices, unit norms, gate bias -1 (λ ≈ 0.27: mass spread over all loops)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name == "model.early_exit_gate.bias":
            p.fill_(-1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


# ----------------------------------------------------------------------------- objective


def log_exit_distribution(gate_logits: torch.Tensor) -> torch.Tensor:
    """gate_logits: [D, ...] -> log p_t [D, ...], p_t = λ_t Π_{j<t}(1-λ_j), last = remainder."""
    log_exit = F.logsigmoid(gate_logits[:-1].float())
    log_stay = F.logsigmoid(-gate_logits[:-1].float())
    zero = torch.zeros_like(log_stay[:1])
    log_survive = torch.cat([zero, log_stay.cumsum(0)])  # log Π_{j<t}(1-λ_j), t = 0..D-1
    return torch.cat([log_exit + log_survive[:-1], log_survive[-1:]])


def per_loop_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [D, B, T, V], targets [B, T] -> next-token cross-entropy L_t [D, B, T] fp32."""
    num_loops = logits.shape[0]
    flat = logits.reshape(-1, logits.shape[-1]).float()
    ce = F.cross_entropy(flat, targets.reshape(-1).repeat(num_loops), reduction="none")
    return ce.view(num_loops, *targets.shape)


def stage1_loss(losses: torch.Tensor, gate_logits: torch.Tensor, beta: float):
    """losses, gate_logits: [D, ...] -> (mean Σ_t p_t L_t − β H(p), mean entropy)."""
    log_p = log_exit_distribution(gate_logits)
    p = log_p.exp()
    entropy = -(p * log_p).sum(0)
    return (p * losses).sum(0).mean() - beta * entropy.mean(), entropy.mean()


def stage2_loss(losses: torch.Tensor, gate_logits: torch.Tensor, margin: float) -> torch.Tensor:
    """BCE of λ_t against the soft target 'loop t+1 improves the loss by less than margin'."""
    improvement = losses[:-1] - losses[1:]
    exit_target = 1.0 - torch.sigmoid(GATE_SHARPNESS * (improvement - margin))
    return F.binary_cross_entropy_with_logits(gate_logits[:-1].float(), exit_target.detach())


def exit_steps(gate_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """The Ouro rule: the first loop (0-based) whose CDF ≥ threshold, else the last -> [...]."""
    cdf = log_exit_distribution(gate_logits).exp().cumsum(0)
    reached = cdf >= threshold
    last = torch.full_like(reached[0], gate_logits.shape[0] - 1, dtype=torch.long)
    return torch.where(reached.any(0), reached.long().argmax(0), last)


# ----------------------------------------------------------------------------- training


def sample_batch(stream: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator):
    """Random windows of the stream -> (inputs [B, T], targets [B, T]) on the stream's device."""
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    window = stream[idx.to(stream.device)]
    return window[:, :-1], window[:, 1:]


def lr_at(step: int, total: int, peak: float) -> float:
    """Linear warmup over min(100, total/10) steps, then cosine down to 10% of the peak."""
    warmup = max(1, min(100, total // 10))
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def make_optimizer(params: list[tuple[str, nn.Parameter]], lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay 0.1 on matrices only (not norms, biases or the embedding)."""
    decay = [p for n, p in params if p.dim() >= 2 and "embed_tokens" not in n]
    rest = [p for n, p in params if not (p.dim() >= 2 and "embed_tokens" not in n)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def run_stage(model: TrainOuro, stream: torch.Tensor, args, stage: int) -> list[dict]:
    """Stage 1 trains everything on the weighted objective; stage 2 only the gate."""
    device = stream.device
    steps = args.steps if stage == 1 else args.gate_steps
    named = [(n, p) for n, p in model.named_parameters() if stage == 1 or "early_exit_gate" in n]
    model.requires_grad_(stage == 1)
    model.model.early_exit_gate.requires_grad_(True)
    opt = make_optimizer(named, args.lr)
    gen = torch.Generator().manual_seed(args.seed + stage)
    history, start = [], time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, args.lr)
        inputs, targets = sample_batch(stream, args.batch_size, args.seq_len, gen)
        with autocast(device):
            if stage == 1:
                logits, gates = model(inputs)
                losses = per_loop_losses(logits, targets)
                loss, entropy = stage1_loss(losses, gates, args.beta)
            else:
                with torch.no_grad():
                    states = model.states(inputs)
                    logits = torch.stack([model.lm_head(s) for s in states])
                    losses = per_loop_losses(logits, targets)
                gates = torch.stack([model.gate_logits(s) for s in states])
                loss = stage2_loss(losses, gates, args.gate_margin)
                entropy = torch.zeros(())
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in named], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == steps - 1:
            row = {
                "stage": stage,
                "step": step,
                "loss": round(loss.item(), 4),
                "loop_losses": [round(v, 4) for v in losses.mean((1, 2)).tolist()],
                "entropy": round(entropy.item(), 4),
                "elapsed_s": round(time.time() - start, 1),
            }
            history.append(row)
            print(json.dumps(row), flush=True)
    model.requires_grad_(False)
    return history


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model: TrainOuro, stream: torch.Tensor, args) -> dict:
    """Held-out perplexity per loop and, per threshold, depth histogram / mean depth / ppl."""
    seq, num_loops = args.seq_len, model.config.num_loops
    num_windows = min((len(stream) - 1) // seq, max(1, args.eval_tokens // seq))
    losses, gates = [], []
    for first in range(0, num_windows, args.batch_size):
        rows = range(first, min(first + args.batch_size, num_windows))
        idx = torch.tensor([r * seq for r in rows])[:, None] + torch.arange(seq + 1)[None, :]
        window = stream[idx.to(stream.device)]
        with autocast(stream.device):
            logits, g = model(window[:, :-1])
            losses.append(per_loop_losses(logits, window[:, 1:]).flatten(1))
        gates.append(g.float().flatten(1))
    losses, gates = torch.cat(losses, 1), torch.cat(gates, 1)  # [D, N]
    result = {
        "num_tokens": losses.shape[1],
        "ppl_per_loop": [round(math.exp(v), 3) for v in losses.mean(1).tolist()],
        "thresholds": {},
    }
    for q in (*THRESHOLDS, 1.0):
        step = exit_steps(gates, q)
        chosen = losses.gather(0, step[None])[0]
        hist = torch.bincount(step, minlength=num_loops).float() / step.numel()
        result["thresholds"][str(q)] = {
            "depth_histogram": [round(v, 4) for v in hist.tolist()],  # loops 1..D
            "mean_depth": round(step.float().mean().item() + 1, 3),
            "ppl": round(math.exp(chosen.mean().item()), 3),
        }
    full = result["ppl_per_loop"][-1]
    ok = [
        q
        for q in THRESHOLDS
        if result["thresholds"][str(q)]["ppl"] <= full * (1 + RECOMMEND_TOLERANCE)
    ]
    result["recommended_threshold"] = ok[0] if ok else 1.0
    return result


# ----------------------------------------------------------------------------- export


def hf_config(args, vocab_size: int, threshold: float = 1.0) -> dict:
    """The config.json written next to the weights (model_type ouro, 4 loops)."""
    if args.hidden_size % args.heads:
        raise ValueError(f"--hidden-size {args.hidden_size} is not a multiple of --heads")
    return {
        "architectures": ["OuroForCausalLM"],
        "model_type": "ouro",
        "vocab_size": vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": 3 * args.hidden_size,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.heads,
        "head_dim": args.hidden_size // args.heads,
        "max_position_embeddings": max(2048, args.seq_len),
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "total_ut_steps": 4,
        "early_exit_threshold": threshold,
        "use_sliding_window": False,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "bfloat16",
    }


def export(model: TrainOuro, tokenizer, raw_config: dict, out: Path) -> int:
    """Write weights (bf16), config and tokenizer files; returns the weight file size."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: p.detach().to("cpu", torch.bfloat16).contiguous()
        for name, p in model.named_parameters()
    }
    save_checkpoint(tensors, out)
    (out / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "model_max_length": raw_config["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return (out / "model.safetensors").stat().st_size


def model_card(report: dict) -> str:
    """A short README.md: corpus, split, sizes, training, the evaluation tables."""
    ev, corpus, cfg = report["eval"], report["corpus"], report["config"]
    lines = [
        "# tiny-ouro-stdlib",
        "",
        "A small Ouro-architecture looped LM (4 loops over shared layers, learned exit gate) "
        "trained by `tools/train_tiny_ouro.py` of vllm_rlt on the Python standard library. "
        "It writes Python-looking text; it is a test and demo model, not a useful assistant.",
        "",
        f"- Corpus: `*.py` of the Python {corpus['python']} standard library without test "
        f"directories and site-packages; {corpus['num_train_files']} training files "
        f"({report['train_tokens']} tokens), {corpus['num_held_out_files']} held out "
        f"({report['held_out_tokens']} tokens). Split: {corpus['split_rule']}.",
        f"- Tokenizer: byte-level BPE, vocab {cfg['vocab_size']}, trained on the training "
        "split; `<|endoftext|>` = 0 (document separator, bos/eos), `<|im_start|>` = 1, "
        "`<|im_end|>` = 2.",
        f"- Model: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"{cfg['num_attention_heads']} heads, intermediate {cfg['intermediate_size']}, "
        f"{cfg['total_ut_steps']} loops, {report['num_params']:,} parameters "
        f"({report['weights_bytes'] / 1e6:.1f} MB bf16).",
        f"- Training: {report['args']['steps']} steps of Σ_t p_t·L_t − {report['args']['beta']}"
        f"·H(p), then {report['args']['gate_steps']} gate-only steps; batch "
        f"{report['args']['batch_size']} × {report['args']['seq_len']} tokens, AdamW, peak lr "
        f"{report['args']['lr']}, seed {report['args']['seed']}, device {report['device']}, "
        f"{report['train_seconds']:.0f} s.",
        f"- Command: `{report['command']}`",
        "",
        f"Held-out perplexity after each loop ({ev['num_tokens']} tokens):",
        "",
        "| loops | 1 | 2 | 3 | 4 |",
        "|---|---|---|---|---|",
        "| ppl | " + " | ".join(f"{v:.2f}" for v in ev["ppl_per_loop"]) + " |",
        "",
        "Early exit (first loop whose exit CDF ≥ q; context tokens run all loops):",
        "",
        "| q | mean depth | ppl | share exiting at loop 1 / 2 / 3 / 4 |",
        "|---|---|---|---|",
    ]
    for q, row in ev["thresholds"].items():
        hist = " / ".join(f"{v:.2f}" for v in row["depth_histogram"])
        lines.append(f"| {q} | {row['mean_depth']:.2f} | {row['ppl']:.2f} | {hist} |")
    lines += [
        "",
        f"Recommended threshold (config `early_exit_threshold`): {ev['recommended_threshold']} "
        f"(the lowest q within {RECOMMEND_TOLERANCE:.0%} of the 4-loop perplexity).",
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="output model directory")
    p.add_argument("--steps", type=int, default=2000, help="stage-1 optimizer steps")
    p.add_argument("--gate-steps", type=int, default=200, help="stage-2 (gate only) steps")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence")
    p.add_argument("--hidden-size", type=int, default=256, help="model width")
    p.add_argument("--layers", type=int, default=4, help="shared layers per loop")
    p.add_argument("--heads", type=int, default=8, help="attention heads (MHA)")
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--beta", type=float, default=0.05, help="entropy weight in stage 1")
    p.add_argument("--gate-margin", type=float, default=0.01, help="stage-2 exit margin (nats)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0, help="seed for init and batches")
    p.add_argument("--max-train-files", type=int, default=None, help="cap (quick CPU runs)")
    p.add_argument("--eval-tokens", type=int, default=1 << 20, help="held-out tokens to score")
    p.add_argument("--log-every", type=int, default=50, help="log every N steps")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    train_texts, held_texts, corpus = load_corpus(args.max_train_files)
    tokenizer = train_tokenizer(args.vocab_size, texts=train_texts)
    train_stream = token_stream(tokenizer, train_texts).to(device)
    held_stream = token_stream(tokenizer, held_texts).to(device)
    raw = hf_config(args, tokenizer.get_vocab_size())
    model = TrainOuro(OuroConfig.from_dict(raw))
    init_weights(model, args.seed)
    model.to(device)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{num_params:,} parameters; {len(train_stream):,} train tokens", flush=True)
    start = time.time()
    history = run_stage(model, train_stream, args, stage=1)
    if args.gate_steps > 0:
        history += run_stage(model, train_stream, args, stage=2)
    train_seconds = time.time() - start
    model.eval()
    ev = evaluate(model, held_stream, args)
    raw["early_exit_threshold"] = ev["recommended_threshold"]
    weights_bytes = export(model, tokenizer, raw, args.out)
    report = {
        "command": "python tools/train_tiny_ouro.py " + " ".join(argv or sys.argv[1:]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "device": str(device),
        "corpus": corpus,
        "config": raw,
        "num_params": num_params,
        "weights_bytes": weights_bytes,
        "train_tokens": len(train_stream),
        "held_out_tokens": len(held_stream),
        "train_seconds": round(train_seconds, 1),
        "eval": ev,
        "history": history,
    }
    (args.out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "README.md").write_text(model_card(report))
    print(json.dumps(ev, indent=2), flush=True)
    return report


if __name__ == "__main__":
    main()
