"""Record which tasks ran in which invocation and draw the wavefront.

Runs a small workload (tiny model, CPU by default) with an engine configuration from the command
line, records the engine's task trace, writes it as JSON and renders a PNG: one lane per prompt
piece of each request (and one decode lane per request), one column per invocation; a filled
cell is a task, coloured by request and labelled with the depth it ran. A chunk that entered
in several pieces (the budget cut its entry) gets one lane per piece.

    python -m benchmarks.wavefront_trace --out docs/design/wcpb/wavefront-wcpb \
        --wavefront-chunked-prefill
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from vllm_rlt.config import EngineConfig
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.sampling_params import SamplingParams


def record(engine: LLMEngine, prompt_lens: list[int], arrivals: list[int], max_tokens: int):
    engine.stats.trace = []
    pending = sorted(zip(arrivals, range(len(prompt_lens)), prompt_lens, strict=True))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, i, n = pending.pop(0)
            engine.add_request(f"r{i}", [(7 * i + p) % 200 + 3 for p in range(n)], params)
        engine.step()
        step += 1
    return [dataclasses.asdict(r) for r in engine.stats.trace]


def render(trace: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    requests = sorted({r["request_id"] for r in trace})
    colors = plt.get_cmap("tab10")
    lanes: dict[tuple, int] = {}
    for rid in requests:
        own = [r for r in trace if r["request_id"] == rid and r["kind"] == "prefill"]
        for piece in sorted({(r["token_start"], r["num_tokens"]) for r in own}):
            lanes[(rid, "prefill", piece)] = len(lanes)
        lanes[(rid, "decode", None)] = len(lanes)
    width = max(r["invocation"] for r in trace) + 1
    fig, ax = plt.subplots(figsize=(max(6, width * 0.32), max(3, len(lanes) * 0.32)))
    for r in trace:
        prefill = r["kind"] == "prefill"
        piece = (r["token_start"], r["num_tokens"]) if prefill else None
        # a speculative window's rows share the request's decode lane
        y = lanes[(r["request_id"], "prefill" if prefill else "decode", piece)]
        color = colors(requests.index(r["request_id"]) % 10)
        alpha = 1.0 if r["kind"] == "prefill" else 0.45
        ax.add_patch(plt.Rectangle((r["invocation"], y), 0.95, 0.9, color=color, alpha=alpha))
        x = r["invocation"] + 0.47
        ax.text(x, y + 0.45, str(r["depth"]), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, width)
    ax.set_ylim(len(lanes), 0)
    ax.set_yticks([v + 0.45 for v in lanes.values()])
    labels = [
        f"{rid} [{p[0]},{p[0] + p[1]})" if kind == "prefill" else f"{rid} decode"
        for rid, kind, p in lanes
    ]
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("recurrent-core invocation (cell label: depth)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the tiny random Ouro)")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[26, 13, 18])
    p.add_argument("--arrivals", type=int, nargs="+", default=[0, 2, 5], help="arrival steps")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--prefill-chunk-size", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=24)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--wavefront-chunked-prefill", action="store_true")
    p.add_argument("--out", required=True, help="output path without extension (.json, .png)")
    args = p.parse_args()
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=args.model,
            device="cpu",
            prefill_chunk_size=args.prefill_chunk_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            wavefront_chunked_prefill=args.wavefront_chunked_prefill,
            exit_threshold=1.0,
        )
    )
    trace = record(engine, args.prompt_lens, args.arrivals, args.max_tokens)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "trace": trace}))
    mode = "WCPB" if args.wavefront_chunked_prefill else "Split"
    rows = engine.stats.as_dict()["rows_per_invocation"]
    title = (
        f"{mode}: chunk {args.prefill_chunk_size}, budget {args.max_num_batched_tokens} rows, "
        f"prompts {args.prompt_lens} arriving at steps {args.arrivals}; "
        f"{engine.stats.invocations} invocations, {rows:.1f} rows each"
    )
    render(trace, out.with_suffix(".png"), title)
    print(title)


if __name__ == "__main__":
    main()
