"""Evaluate a trained tiny Ouro in the engine: exit depths and agreement across prefill modes.

    python tools/eval_tiny_ouro.py [--model DIR] [--device cuda] [--dtype bfloat16] --out F.json
    python tools/eval_tiny_ouro.py --report F.json --card DIR/README.md   # card section only

Prompts come from the trainer's held-out files (`stdlib_corpus.held_out_files`): prompt i is a
window of 24 + (37 i mod 97) tokens of held-out file i mod n, starting at a line boundary chosen
by i. For each exit threshold, every prompt is generated greedily (`--max-tokens`, EOS ignored) in
three modes (atomic, split, WCPB) with small chunks, and once more one request at a time
(serial, on the atomic engine), and the script reports:

- the exit-depth histogram of the generated tokens (the first token of a request is excluded: it
  comes from the prompt's last position, which always runs every loop);
- per pair of modes, how many requests give identical tokens and exit depths, how many tokens
  agree before the first difference, and the mean position of the first difference.

In fp32 the modes must agree exactly (tests assert it); in bf16 on a GPU, batch composition
changes rounding (different row counts pick different GEMM kernels), so this script measures how
often that flips a greedy token, and with `--batch-invariant` that it never does. `--card` writes
the results into the model card, one subsection per device, dtype and setting under
"## Engine evaluation".
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.stdlib_corpus import held_out_files
from vllm_rlt.entrypoints.llm import LLM
from vllm_rlt.sampling_params import SamplingParams

ENGINE_SECTION = "## Engine evaluation"
ENGINE_INTRO = (
    "Greedy generation in vllm_rlt on held-out prompts (`tools/eval_tiny_ouro.py`): exit depths "
    "chosen by the engine (earlier tokens keep the KV of their own exit depth, LAST_EXITED), and "
    "agreement of the three prefill modes."
)
MODES = {  # engine settings of each prefill mode
    "atomic": {"scheduling_mode": "refill"},
    "split": {"scheduling_mode": "mixed"},
    "wavefront": {"scheduling_mode": "mixed", "wavefront_chunked_prefill": True},
}


def held_out_prompts(tokenizer, num_prompts: int) -> list[list[int]]:
    """Deterministic token windows of the held-out files, each starting at a line start."""
    root, files = held_out_files()
    texts = [(root / f).read_text(encoding="utf-8", errors="replace") for f in files]
    prompts = []
    for i in range(num_prompts):
        lines = texts[i % len(texts)].splitlines(keepends=True)
        first = (i * 7919) % max(1, len(lines) - 40)
        ids = tokenizer.encode("".join(lines[first:]), add_special_tokens=False).ids
        prompts.append(ids[: 24 + (37 * i) % 97])
    return prompts


def run_mode(llm: LLM, prompts, threshold: float, max_tokens: int) -> list[tuple]:
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, exit_threshold=threshold
    )
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(tuple(o.outputs[0].token_ids), tuple(o.outputs[0].exit_depths)) for o in outs]


def run_serial(llm: LLM, prompts, threshold: float, max_tokens: int) -> list[tuple]:
    """The same requests one at a time: nothing shares their invocations."""
    return [run_mode(llm, [p], threshold, max_tokens)[0] for p in prompts]


def compare(a: list[tuple], b: list[tuple]) -> dict:
    """Agreement of two modes' (tokens, depths) per request."""
    firsts = []
    for (ta, da), (tb, db) in zip(a, b, strict=True):
        pairs = zip(zip(ta, da, strict=True), zip(tb, db, strict=True), strict=True)
        diff = [i for i, (x, y) in enumerate(pairs) if x != y]
        firsts.append(diff[0] if diff else len(ta))
    same = sum(f == len(t) for f, (t, _) in zip(firsts, a, strict=True))
    return {
        "identical_requests": same,
        "requests": len(a),
        "tokens_before_first_difference": sum(firsts),
        "tokens": sum(len(t) for t, _ in a),
        "mean_first_difference": round(sum(firsts) / len(firsts), 2),
    }


def depth_histogram(results: list[tuple], num_loops: int) -> list[float]:
    counts = [0] * num_loops
    for _, depths in results:
        for d in depths[1:]:
            counts[d - 1] += 1
    total = max(1, sum(counts))
    return [round(c / total, 4) for c in counts]


def evaluate(args) -> dict:
    engines = {
        name: LLM(
            args.model,
            device=args.device,
            dtype=args.dtype,
            attention_backend=args.attention_backend,
            max_num_seqs=args.max_num_seqs,
            prefill_chunk_size=args.chunk_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            batch_invariant=args.batch_invariant,
            kv_cache_memory_gb=args.kv_cache_gb,
            **settings,
        )
        for name, settings in MODES.items()
    }
    first = next(iter(engines.values())).engine
    prompts = held_out_prompts(first.tokenizer, args.num_prompts)
    num_loops = first.model.num_loops
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report = {"settings": settings}
    report["python"] = sys.version.split()[0]  # the stdlib the held-out prompts come from
    report["num_prompt_tokens"] = sum(len(p) for p in prompts)
    report["thresholds"] = {}
    for q in args.thresholds:
        start = time.time()
        results = {
            name: run_mode(llm, prompts, q, args.max_tokens) for name, llm in engines.items()
        }
        results["serial"] = run_serial(engines["atomic"], prompts, q, args.max_tokens)
        report["thresholds"][str(q)] = {
            "depth_histogram": {n: depth_histogram(r, num_loops) for n, r in results.items()},
            "agreement": {
                f"{a}/{b}": compare(results[a], results[b])
                for a, b in itertools.combinations(results, 2)
            },
            "seconds": round(time.time() - start, 1),
        }
        print(json.dumps({q: report["thresholds"][str(q)]}), flush=True)
    return report


def card_section(report: dict) -> str:
    """The model-card subsection for one report (a device and dtype)."""
    st = report["settings"]
    lines = [
        f"### {st['device']}, {st['dtype']}, {st['attention_backend']} attention"
        + (", batch-invariant" if st.get("batch_invariant") else ""),
        "",
        f"{st['num_prompts']} held-out prompts of the Python {report['python']} stdlib "
        f"({report['num_prompt_tokens']} tokens) x "
        f"{st['max_tokens']} greedy tokens per mode; chunk {st['chunk_size']}, "
        f"{st['max_num_seqs']} requests at once, {st['max_num_batched_tokens']} rows per "
        "invocation. Depth shares count generated tokens after the first.",
        "",
        "| q | mode | share at loop 1 / 2 / 3 / 4 | identical requests vs atomic |",
        "|---|---|---|---|",
    ]
    for q, row in report["thresholds"].items():
        for mode, hist in row["depth_histogram"].items():
            pair = row["agreement"].get(f"atomic/{mode}")
            same = f"{pair['identical_requests']} / {pair['requests']}" if pair else "-"
            shares = " / ".join(f"{v:.2f}" for v in hist)
            lines.append(f"| {q} | {mode} | {shares} | {same} |")
    return "\n".join(lines) + "\n"


def write_card(card: Path, report: dict) -> None:
    """Put the report's subsection under "## Engine evaluation", replacing an older one for the
    same device and dtype."""
    text = card.read_text()
    if ENGINE_SECTION not in text:
        text = text.rstrip("\n") + f"\n\n{ENGINE_SECTION}\n\n{ENGINE_INTRO}\n"
    section = card_section(report)
    head = section.split("\n", 1)[0]
    if head in text:
        start = text.index(head)
        end = text.find("\n### ", start + len(head))
        text = text[:start] + section + (text[end + 1 :] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    card.write_text(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF directory (default: the packaged model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--num-prompts", type=int, default=87)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.6, 1.0])
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=32, help="prefill chunk (small: many tasks)")
    p.add_argument("--batch-invariant", action="store_true", help="the engine's batch_invariant")
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument(
        "--kv-cache-gb", type=float, default=0.5, help="KV cache of each engine (one per mode)"
    )
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--report", type=Path, default=None, help="use this report, do not evaluate")
    p.add_argument("--card", type=Path, default=None, help="model card to write the results to")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = json.loads(args.report.read_text()) if args.report else evaluate(args)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.card:
        write_card(args.card, report)
    return report


if __name__ == "__main__":
    main()
