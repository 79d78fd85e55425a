"""`vllm-rlt inspect`: what a looped model thinks at each depth for a prompt's last position.

Per depth it prints the top next tokens with probabilities and, for a model with an exit gate,
the gate's exit probability sigmoid(g_t) and the exit distribution p_t with its CDF
(docs/models.md §1.5), computed by the engine's model runner (`worker/plan_driver.py`);
`--check` recomputes with the dense reference and compares. Huginn's predictions at a depth run
the coda over that recurrence's state (the zero initial state), as the reference's
`predict_from_latents`.
"""

from __future__ import annotations

import argparse

from vllm_rlt.config import CacheConfig, ModelConfig
from vllm_rlt.entrypoints import cli_args

CHECK_TOL = {"float32": 1e-5, "bfloat16": 5e-2, "float16": 1e-2}  # by the model's dtype
MODEL_FLAGS = ("dtype", "device", "load_format", "attention_backend", "layer_kernels")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="per-depth predictions and exit gate for a prompt")
    cli_args.add_model_arg(p)
    p.add_argument("--prompt", default="def fibonacci(n):", help="text to inspect")
    p.add_argument("--top-k", type=int, default=5, help="tokens shown per depth")
    p.add_argument("--check", action="store_true", help="compare with the dense reference")
    cli_args.add_config_args(p, ModelConfig, names=(*MODEL_FLAGS, "revision", "download_dir"))
    cli_args.add_config_args(p, CacheConfig, names=("block_size",))
    p.set_defaults(func=run, parser=p)


def exit_distribution(gate_logits):
    """gate_logits [D] -> (p_t, CDF_t): p_t = l_t prod_{j<t}(1 - l_j), the last loop takes the
    remaining mass."""
    import torch

    lam = torch.sigmoid(gate_logits.double())
    survive = torch.cumprod(torch.cat([lam.new_ones(1), 1 - lam[:-1]]), 0)
    p = lam * survive
    p[-1] = survive[-1]
    return p, p.cumsum(0)


def run(args: argparse.Namespace) -> int:
    from vllm_rlt.models.hub import resolve_model_dir
    from vllm_rlt.models.loader import load_model

    try:  # bad settings or model files: one line, no traceback
        settings = ModelConfig(**cli_args.config_kwargs(args, [ModelConfig]))
        block_size = CacheConfig(**cli_args.config_kwargs(args, [CacheConfig])).block_size
        loaded = load_model(
            resolve_model_dir(args.model, settings.revision, settings.download_dir),
            **{name: getattr(settings, name) for name in MODEL_FLAGS},
        )
    except ValueError as err:
        raise cli_args.error_exit(err) from None
    return report(loaded, args, block_size)


def report(loaded, args: argparse.Namespace, block_size: int) -> int:
    import torch

    from vllm_rlt.worker.plan_driver import PlanDriver

    model, tok = loaded.model, loaded.tokenizer
    ids = tok.encode(args.prompt).ids if tok is not None else [int(x) for x in args.prompt.split()]
    if not ids:
        raise cli_args.error_exit(f"prompt {args.prompt!r} encodes to no tokens")
    blocks = -(-len(ids) // block_size) * (model.num_loops + model.num_edge_planes)
    driver = PlanDriver(model, blocks, block_size, max_num_seqs=1)
    states, gates = driver.prefill_all_depths("inspect", ids)
    last_states, last_gates = states[:, -1], gates[:, -1]
    probs = driver.logits("inspect", last_states, len(ids) - 1).float().softmax(-1)
    p_exit, cdf = exit_distribution(last_gates)
    dtype = model.lm_head.weight.dtype
    print(
        f"model: {loaded.model_dir} ({loaded.config.model_type}, {model.num_loops} loops, {dtype})"
    )
    print(f"prompt: {args.prompt!r} ({len(ids)} tokens); predictions for the next token")
    for depth in range(model.num_loops):
        top = probs[depth].topk(min(args.top_k, probs.shape[-1]))
        words = ", ".join(
            f"{_show(tok, int(i))} {float(pr):.3f}"
            for pr, i in zip(top.values, top.indices, strict=True)
        )
        lam = float(torch.sigmoid(last_gates[depth].double()))
        gate = (
            f"exit gate {lam:.3f}  p(exit here) {float(p_exit[depth]):.3f}  "
            f"cdf {float(cdf[depth]):.3f} | "
        )
        print(f"loop {depth + 1}: {gate if model.has_exit_gate else ''}{words}")
    if args.check:
        if model.has_exit_gate:
            return check(model, ids, states, gates, dtype)
        return check_huginn(model, ids, states, driver, dtype)
    return 0


def check(model, ids, states, gates, dtype) -> int:
    import torch

    from vllm_rlt.models.reference import DenseOuroReference

    with torch.inference_mode():
        ref = DenseOuroReference.from_model(model).run(ids)
        logits = model.coda(states)

    errors = {
        "hidden": _rel_err(states, ref.hidden),
        "gate": _rel_err(gates, ref.gate_logits),
        "logits": _rel_err(logits, ref.logits),
    }
    return _report(errors, dtype)


def check_huginn(model, ids, states, driver, dtype) -> int:
    """Huginn: the state after every recurrence and the full-depth logits of every position."""
    import torch

    from vllm_rlt.models.huginn_reference import DenseHuginnReference

    ref = DenseHuginnReference.from_model(model).run(ids)
    last = states[-1]
    logits = torch.cat([driver.logits("inspect", last[p : p + 1], p) for p in range(len(ids))])
    errors = {
        "states": _rel_err(states[..., : model.config.n_embd], ref.states),
        "logits": _rel_err(logits, ref.logits),
    }
    return _report(errors, dtype)


def _rel_err(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _report(errors: dict[str, float], dtype) -> int:
    tol = CHECK_TOL[str(dtype).removeprefix("torch.")]
    ok = all(e <= tol for e in errors.values())
    shown = ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
    print(
        f"check vs dense reference (max relative error, all depths): {shown} -> "
        f"{'OK' if ok else 'MISMATCH'} (tolerance {tol:g})"
    )
    return 0 if ok else 1


def _show(tok, token_id: int) -> str:
    return repr(tok.decode([token_id])) if tok is not None else str(token_id)
