"""Train a small Ouro (looped LM) on the Python standard library and export an HF directory.

Run from anywhere (the repository root is put on sys.path):

    python tools/train_tiny_ouro.py --out DIR [--steps N] [--device cuda] ...

Corpus and split: `tools/stdlib_corpus.py` (the standard library's source, held-out and
validation files chosen by a hash of their path). Validation loss every `--eval-every` stage-1
steps selects the weights kept (the corpus is small: later steps overfit); the held-out files are
only used for the report. The tokenizer is a byte-level BPE trained on the training split only.

Shape (the defaults): one shared layer applied 4 times, hidden 384, vocab 8192 (8.2M
parameters). With 2-4 layers per loop, one pass already reached what this small corpus supports
and further loops did not lower held-out perplexity (docs/models.md §2).

Model and objectives: `tools/looped_lm.py`.

Training (the Ouro paper's two stages, docs/models.md §1.5; my own implementation):
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
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from tools.looped_lm import (
    TrainOuro,
    exit_steps,
    init_weights,
    per_loop_losses,
    stage1_loss,
    stage2_loss,
)
from tools.stdlib_corpus import EOS_ID, SPLITS, load_corpus, token_stream
from vllm_rlt.models.ouro import OuroConfig
from vllm_rlt.models.tiny import SPECIAL_TOKENS, save_checkpoint, train_tokenizer

THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
RECOMMEND_TOLERANCE = 0.01  # relative perplexity increase allowed for the recommended threshold
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


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


def run_stage(
    model: TrainOuro, stream: torch.Tensor, valid: torch.Tensor, args, stage: int
) -> list[dict]:
    """Stage 1 trains everything on the weighted objective and keeps the weights with the lowest
    validation loss (checked every `--eval-every` steps); stage 2 trains only the gate."""
    device = stream.device
    best = (math.inf, -1, None)  # (validation loss, step, state dict)
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
        last = step == steps - 1
        checked = stage == 1 and ((step + 1) % args.eval_every == 0 or last)
        if checked:
            loss_v = valid_loss(model, valid, args)
            if loss_v < best[0]:
                best = (loss_v, step, {k: v.clone() for k, v in model.state_dict().items()})
        if step % args.log_every == 0 or last or checked:
            row = {
                "stage": stage,
                "step": step,
                "loss": round(loss.item(), 4),
                "loop_losses": [round(v, 4) for v in losses.mean((1, 2)).tolist()],
                "entropy": round(entropy.item(), 4),
                "elapsed_s": round(time.time() - start, 1),
            }
            if checked:
                row["valid_loss"] = round(loss_v, 4)
            history.append(row)
            print(json.dumps(row), flush=True)
    model.requires_grad_(False)
    if best[2] is not None:
        model.load_state_dict(best[2])
        history.append({"stage": stage, "selected_step": best[1], "valid_loss": round(best[0], 4)})
        print(json.dumps(history[-1]), flush=True)
    return history


# ----------------------------------------------------------------------------- evaluation


def windows(stream: torch.Tensor, seq_len: int, max_tokens: int, batch_size: int):
    """Consecutive non-overlapping windows [b, seq_len + 1] covering up to `max_tokens`."""
    num = min((len(stream) - 1) // seq_len, max(1, max_tokens // seq_len))
    for first in range(0, num, batch_size):
        starts = torch.arange(first, min(first + batch_size, num)) * seq_len
        yield stream[(starts[:, None] + torch.arange(seq_len + 1)[None, :]).to(stream.device)]


@torch.no_grad()
def valid_loss(model: TrainOuro, stream: torch.Tensor, args) -> float:
    """Mean next-token loss after all loops on the validation windows."""
    total, count = 0.0, 0
    for window in windows(stream, args.seq_len, args.valid_tokens, args.batch_size):
        with autocast(stream.device):
            logits, _ = model(window[:, :-1])
            loss = per_loop_losses(logits[-1:], window[:, 1:])
        total, count = total + loss.sum().item(), count + loss.numel()
    return total / count


@torch.no_grad()
def evaluate(model: TrainOuro, stream: torch.Tensor, args) -> dict:
    """Held-out perplexity per loop and, per threshold, depth histogram / mean depth / ppl."""
    num_loops = model.config.num_loops
    losses, gates = [], []
    for window in windows(stream, args.seq_len, args.eval_tokens, args.batch_size):
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
    tok_config = tokenizer_config(raw_config["max_position_embeddings"])
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return (out / "model.safetensors").stat().st_size


def tokenizer_config(max_positions: int) -> dict:
    """tokenizer_config.json: special tokens and the ChatML chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "model_max_length": max_positions,
        "chat_template": CHAT_TEMPLATE,
    }


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
        f"- Corpus: `*.py` of the Python {corpus['python']} standard library without test, "
        f"`encodings` and `pydoc_data` directories and site-packages; "
        f"{corpus['num_train_files']} training files "
        f"({report['train_tokens']} tokens), {corpus['num_valid_files']} for validation, "
        f"{corpus['num_held_out_files']} held out ({report['held_out_tokens']} tokens). "
        f"Split: {corpus['split_rule']}.",
        f"- Tokenizer: byte-level BPE, vocab {cfg['vocab_size']}, trained on the training "
        "split; `<|endoftext|>` = 0 (document separator, bos/eos), `<|im_start|>` = 1, "
        "`<|im_end|>` = 2.",
        f"- Model: hidden {cfg['hidden_size']}, "
        f"shared layers per loop: {cfg['num_hidden_layers']}, "
        f"{cfg['num_attention_heads']} heads, intermediate {cfg['intermediate_size']}, "
        f"{cfg['total_ut_steps']} loops, {report['num_params']:,} parameters "
        f"({report['weights_bytes'] / 1e6:.1f} MB bf16).",
        f"- Training: {report['args']['steps']} steps of Σ_t p_t·L_t − {report['args']['beta']}"
        f"·H(p), then {report['args']['gate_steps']} gate-only steps; batch "
        f"{report['args']['batch_size']} × {report['args']['seq_len']} tokens, AdamW, peak lr "
        f"{report['args']['lr']}, seed {report['args']['seed']}, device {report['device']}, "
        f"{report['train_seconds']:.0f} s. Kept the stage-1 weights of step "
        f"{report['selected_step'] + 1} (lowest validation loss, checked every "
        f"{report['args']['eval_every']} steps).",
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
    p.add_argument("--steps", type=int, default=1000, help="stage-1 optimizer steps")
    p.add_argument("--gate-steps", type=int, default=300, help="stage-2 (gate only) steps")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence")
    p.add_argument("--hidden-size", type=int, default=384, help="model width")
    p.add_argument("--layers", type=int, default=1, help="shared layers per loop")
    p.add_argument("--heads", type=int, default=8, help="attention heads (MHA)")
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--beta", type=float, default=0.05, help="entropy weight in stage 1")
    p.add_argument(
        "--gate-bias",
        type=float,
        default=-3.0,
        help="initial exit-gate bias: -3 starts with most exit mass on the last loop",
    )
    p.add_argument("--gate-margin", type=float, default=0.01, help="stage-2 exit margin (nats)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0, help="seed for init and batches")
    p.add_argument("--max-train-files", type=int, default=None, help="cap (quick CPU runs)")
    p.add_argument("--eval-tokens", type=int, default=1 << 20, help="held-out tokens to score")
    p.add_argument("--log-every", type=int, default=50, help="log every N steps")
    p.add_argument("--eval-every", type=int, default=100, help="validate every N stage-1 steps")
    p.add_argument("--valid-tokens", type=int, default=1 << 17, help="validation tokens")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    texts, corpus = load_corpus(args.max_train_files)
    tokenizer = train_tokenizer(args.vocab_size, texts=texts["train"])
    train_stream, valid_stream, held_stream = (
        token_stream(tokenizer, texts[name]).to(device) for name in SPLITS
    )
    raw = hf_config(args, tokenizer.get_vocab_size())
    model = TrainOuro(OuroConfig.from_dict(raw))
    init_weights(model, args.seed, args.gate_bias)
    model.to(device)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{num_params:,} parameters; {len(train_stream):,} train tokens", flush=True)
    start = time.time()
    history = run_stage(model, train_stream, valid_stream, args, stage=1)
    if args.gate_steps > 0:
        history += run_stage(model, train_stream, valid_stream, args, stage=2)
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
        "selected_step": next(h["selected_step"] for h in history if "selected_step" in h),
        "eval": ev,
        "history": history,
    }
    (args.out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "README.md").write_text(model_card(report))
    print(json.dumps(ev, indent=2), flush=True)
    return report


if __name__ == "__main__":
    main()
