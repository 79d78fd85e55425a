"""What an FP8 KV cache costs in accuracy on the packaged model (`docs/benchmarks/fp8-kv.md`).

    python -m benchmarks.fp8_kv --out benchmarks/results/fp8-kv/accuracy.json

Three engines over the packaged tiny Ouro with the same settings, running the same requests in
the same order: `kv_cache_dtype` `auto` (the model's dtype), `fp8` at scale 1.0 (the checkpoint
has no scales), and `fp8` over a copy calibrated by `vllm-rlt calibrate-kv-scales` on the first
`--calibration-files` files of the trainer's validation split (`tools/stdlib_corpus.py`). Each
FP8 engine against `auto`:

- **perplexity** over windows of the trainer's held-out text (window i takes the first
  `--window` tokens of the i-th held-out file that has them), from the prompt logprobs at full
  depth;
- **greedy agreement**: the held-out prompts of `tools/eval_tiny_ouro.py`, generated greedily at
  each exit threshold; per request, whether tokens and exit depths are identical, and the tokens
  before the first difference;
- the largest |K| and |V| the `auto` cache holds after the run (against e4m3's 448 at scale 1).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

from benchmarks.provenance import run_meta
from tools.eval_tiny_ouro import compare, held_out_prompts, run_mode
from tools.stdlib_corpus import held_out_files, split_of, stdlib_files
from vllm_rlt.entrypoints import calibrate_cmd
from vllm_rlt.entrypoints.llm import LLM
from vllm_rlt.models.loader import kv_scale_names
from vllm_rlt.sampling_params import SamplingParams


def text_windows(tokenizer, num: int, length: int) -> list[list[int]]:
    """The first `length` tokens of each of the first `num` held-out files that have them."""
    root, files = held_out_files()
    windows = []
    for f in files:
        ids = tokenizer.encode((root / f).read_text(encoding="utf-8", errors="replace")).ids
        if len(ids) >= length:
            windows.append(ids[:length])
        if len(windows) == num:
            break
    return windows


def perplexity(llm: LLM, windows: list[list[int]]) -> dict:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, exit_threshold=1.0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    nll, count = 0.0, 0
    for window, out in zip(windows, outs, strict=True):
        for token, scores in zip(window[1:], out.prompt_logprobs[1:], strict=True):
            nll -= scores[token]
            count += 1
    return {"tokens": count, "nll_per_token": nll / count, "perplexity": math.exp(nll / count)}


def cache_amax(llm: LLM) -> dict:
    peaks = llm.engine.runner.kv_cache.amax()  # (|K|, |V|) per layer
    return {"k": max(k for k, _ in peaks), "v": max(v for _, v in peaks)}


def calibrated_copy(args, tmp: Path) -> Path:
    """The packaged model with KV scales measured on the validation split, under `tmp`."""
    root, files = stdlib_files()
    valid = [f for f in files if split_of(f) == "valid"][: args.calibration_files]
    texts = [(root / f).read_text(encoding="utf-8", errors="replace") for f in valid]
    llm = LLM(device=args.device, dtype=args.dtype, kv_cache_memory_gb=1.0)
    scales = calibrate_cmd.measure(llm, texts, args.window, args.headroom)
    names = kv_scale_names(llm.engine.model)
    calibrate_cmd.write_scaled_copy(llm.engine.model_dir, tmp / "calibrated", names, scales)
    return tmp / "calibrated"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--window", type=int, default=1024, help="tokens per perplexity window")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--thresholds", type=float, nargs="+", default=[1.0, 0.6])
    p.add_argument("--calibration-files", type=int, default=16)
    p.add_argument("--headroom", type=float, default=2.0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    report: dict = {"meta": run_meta(args), "engines": {}, "agreement": {}}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        engines = {"auto": (None, "auto"), "fp8": (None, "fp8"),
                   "fp8_calibrated": (calibrated_copy(args, Path(tmp)), "fp8")}  # fmt: skip
        for name, (model, kv_dtype) in engines.items():
            llm = LLM(model and str(model), device=args.device, dtype=args.dtype,
                      kv_cache_dtype=kv_dtype, kv_cache_memory_gb=4.0, max_num_seqs=32)  # fmt: skip
            tokenizer = llm.engine.tokenizer
            windows = text_windows(tokenizer, args.windows, args.window)
            prompts = held_out_prompts(tokenizer, args.num_prompts)
            entry = {
                "perplexity": perplexity(llm, windows),
                "scales": llm.engine.runner.kv_cache.scales,
            }
            results[name] = {q: run_mode(llm, prompts, q, args.max_tokens) for q in args.thresholds}
            if name == "auto":
                entry["cache_amax"] = cache_amax(llm)
            report["engines"][name] = entry
            del llm
    base = report["engines"]["auto"]["perplexity"]["perplexity"]
    for name in ("fp8", "fp8_calibrated"):
        report["agreement"][name] = {
            str(q): compare(results[name][q], results["auto"][q]) for q in args.thresholds
        }
        report["engines"][name]["perplexity_change"] = (
            report["engines"][name]["perplexity"]["perplexity"] / base - 1
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "meta"}, indent=2))


if __name__ == "__main__":
    main()
