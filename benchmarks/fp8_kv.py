"""What an FP8 KV cache costs in accuracy on the packaged model (`docs/benchmarks/fp8-kv.md`).

    python -m benchmarks.fp8_kv --out docs/benchmarks/fp8-kv/accuracy.json

Two engines over the packaged tiny Ouro, the same settings but `kv_cache_dtype` (`auto`: the
model's dtype; `fp8`), and the same requests in the same order:

- **perplexity** over windows of the trainer's held-out text (`tools/stdlib_corpus.py`; window i
  takes `--window` tokens of held-out file i from its start), from the prompt logprobs at full
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
from pathlib import Path

from benchmarks.provenance import run_meta
from tools.eval_tiny_ouro import compare, held_out_prompts, run_mode
from tools.stdlib_corpus import held_out_files
from vllm_rlt.entrypoints.llm import LLM
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
    kv = llm.engine.runner.kv_cache.kv.float()  # [L, 2, blocks, block_size, Hkv, d]
    return {"k": float(kv[:, 0].abs().amax()), "v": float(kv[:, 1].abs().amax())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--window", type=int, default=1024, help="tokens per perplexity window")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--thresholds", type=float, nargs="+", default=[1.0, 0.6])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    report: dict = {"meta": run_meta(args), "engines": {}}
    results = {}
    for kv_dtype in ("auto", "fp8"):
        llm = LLM(device=args.device, dtype=args.dtype, kv_cache_dtype=kv_dtype,
                  kv_cache_memory_gb=4.0, max_num_seqs=32)  # fmt: skip
        tokenizer = llm.engine.tokenizer
        windows = text_windows(tokenizer, args.windows, args.window)
        prompts = held_out_prompts(tokenizer, args.num_prompts)
        entry = {"perplexity": perplexity(llm, windows)}
        results[kv_dtype] = {q: run_mode(llm, prompts, q, args.max_tokens) for q in args.thresholds}
        if kv_dtype == "auto":
            entry["cache_amax"] = cache_amax(llm)
        report["engines"][kv_dtype] = entry
        del llm
    report["agreement"] = {
        str(q): compare(results["fp8"][q], results["auto"][q]) for q in args.thresholds
    }
    ppl = [report["engines"][d]["perplexity"]["perplexity"] for d in ("auto", "fp8")]
    report["perplexity_change"] = ppl[1] / ppl[0] - 1
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "meta"}, indent=2))


if __name__ == "__main__":
    main()
