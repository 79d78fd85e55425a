"""Invocations of runs with lanes by K (docs/benchmarks/speculative.md §5): the packaged model,
concurrency 1, 2 requests with greedy forced outputs on the speculative benchmark's prompts
(seed 9), speculation off and K = 1..4 (d = 1) for each (exit threshold, prompt length, output
length); steps, invocations, loops per token and acceptance rate of one round each. Counts of
the schedule, not speed: runs on the CPU in fp32 (a few minutes).

    python -m benchmarks.probes.lanes_counts > lanes-counts.txt
"""

from __future__ import annotations

import types

from benchmarks.speculative import make_engines, stdlib_prompts, timed_run
from vllm_rlt.models.tiny import default_model_dir

WORKLOADS = ((0.6, 512, 256), (0.6, 256, 128), (0.9, 256, 128), (0.99, 256, 128))
REQUESTS, SEED = 2, 9


def main() -> None:
    print("# threshold, prompt length, output length, (d, K), steps, invocations, loops per "
          "token, acceptance rate")  # fmt: skip
    for threshold, prompt_len, output_len in WORKLOADS:
        args = types.SimpleNamespace(
            dtype="float32",
            exit_threshold=threshold,
            kv_cache_gb=1.0,
            async_scheduling=True,
            draft_loops=[1],
            drafts=[1, 2, 3, 4],
        )
        engines = make_engines(args, str(default_model_dir()), "auto", 1)
        tokenizer = next(iter(engines.values())).tokenizer
        prompts = stdlib_prompts(tokenizer, REQUESTS, prompt_len, seed=SEED)
        for key, engine in engines.items():
            counts = timed_run(engine, prompts, output_len)["engine"]
            print(threshold, prompt_len, output_len, key, counts["steps"], counts["invocations"],
                  round(counts["loops_per_token"], 3),
                  round(counts.get("spec_acceptance_rate", 0.0), 3), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
