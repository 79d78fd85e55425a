"""`vllm-rlt calibrate-kv-scales`: FP8 KV scales measured on text, written into a copy of the
checkpoint.

The model runs every window of the given text files (`--window` tokens each, at full depth, with
a KV cache in the model's dtype); each KV layer's scales are the largest |K| and |V| its cache
then holds, times `--headroom`, over e4m3's largest value 448. The output directory is the model
directory with `model.layers.{i}.self_attn.k_scale` / `v_scale` added to its checkpoint (single
file or sharded), which `--kv-cache-dtype fp8` then reads (docs/design/kv-cache.md §6). The
scales are fixed before serving: what a request computes never depends on what ran before it.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from vllm_rlt.config import CacheConfig, ModelConfig
from vllm_rlt.entrypoints import cli_args

SCALES_SHARD = "kv-scales.safetensors"  # the shard a sharded checkpoint's scales are added in


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate-kv-scales", help="measure FP8 KV scales on text and write them into a copy "
        "of the checkpoint", description=__doc__,
    )  # fmt: skip
    cli_args.add_model_arg(p)
    p.add_argument(
        "--text", type=Path, action="append", required=True,
        help="a text file to calibrate on (repeatable)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, required=True, help="the new model directory")
    p.add_argument("--window", type=int, default=1024, help="tokens per calibration prompt")
    p.add_argument(
        "--headroom", type=float, default=2.0,
        help="factor over the largest value measured (larger ones are clamped)",
    )  # fmt: skip
    cli_args.add_config_args(p, ModelConfig, names=("dtype", "device", "revision", "download_dir"))
    cli_args.add_config_args(p, CacheConfig, names=("num_kv_blocks", "kv_cache_memory_gb"))
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    from vllm_rlt.entrypoints.llm import LLM
    from vllm_rlt.models.loader import kv_scale_names

    try:
        if args.headroom < 1.0 or args.window < 2:
            raise ValueError("--headroom must be at least 1 and --window at least 2")
        if args.out.exists():
            raise ValueError(f"{args.out} exists: give a new directory")
        texts = [path.read_text(encoding="utf-8", errors="replace") for path in args.text]
        given = cli_args.config_kwargs(args, [ModelConfig, CacheConfig])
        llm = LLM(args.model, kv_cache_dtype="auto", **given)
        names = kv_scale_names(llm.engine.model)
        if not names:
            raise ValueError(f"{type(llm.engine.model).__name__} reads no KV scales")
        scales = measure(llm, texts, args.window, args.headroom)
    except (OSError, ValueError) as err:
        raise cli_args.error_exit(err) from None
    write_scaled_copy(llm.engine.model_dir, args.out, names, scales)
    for (k_name, v_name), (k, v) in zip(names, scales, strict=True):
        print(f"{k_name} = {k:.6g}  {v_name} = {v:.6g}")
    print(f"wrote {args.out}")
    return 0


def measure(llm, texts: list[str], window: int, headroom: float) -> list[tuple[float, float]]:
    """(k_scale, v_scale) per KV layer after `llm` has run every window of `texts`."""
    from vllm_rlt.kernels.kv_format import FP8_MAX
    from vllm_rlt.sampling_params import SamplingParams

    window = min(window, llm.engine.max_model_len)
    prompts = []
    for text in texts:
        ids = llm.get_tokenizer().encode(text).ids
        prompts += [ids[i : i + window] for i in range(0, len(ids) - 1, window)]
    prompts = [p for p in prompts if len(p) > 1]
    if not prompts:
        raise ValueError("the calibration text has no two tokens")
    params = SamplingParams(max_tokens=1, exit_threshold=1.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        tuple((amax * headroom / FP8_MAX) if amax > 0 else 1.0 for amax in pair)
        for pair in llm.engine.kv_amax()
    ]


def write_scaled_copy(model_dir: Path, out: Path, names, scales) -> None:
    """`model_dir` copied to `out` with the scale tensors in its checkpoint."""
    import torch
    from safetensors.torch import load_file, save_file

    from vllm_rlt.models.loader import checkpoint_files

    files = checkpoint_files(model_dir)
    shutil.copytree(model_dir, out)
    tensors = {
        name: torch.tensor(value, dtype=torch.float32)
        for pair, values in zip(names, scales, strict=True)
        for name, value in zip(pair, values, strict=True)
    }
    index = out / "model.safetensors.index.json"
    if not index.is_file():  # one file: rewritten with the scales (replacing any it had)
        save_file(load_file(model_dir / "model.safetensors") | tensors, out / "model.safetensors")
        return
    for shard in {files[name].name for name in tensors if name in files}:  # earlier scales
        kept = {k: v for k, v in load_file(model_dir / shard).items() if k not in tensors}
        save_file(kept, out / shard)
    save_file(tensors, out / SCALES_SHARD)
    content = json.loads(index.read_text())
    content["weight_map"] |= dict.fromkeys(tensors, SCALES_SHARD)
    index.write_text(json.dumps(content, indent=2))
