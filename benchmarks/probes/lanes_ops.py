"""Torch ops per engine step of runs with lanes against plain runs (docs/benchmarks/speculative.md
§5): the packaged model at its default threshold, concurrency 1, the lanes-counts workload (2
requests of 512 prompt tokens, 256 greedy forced outputs), speculation off and K = 1. Counts
the aten ops the host issues outside the run functions that CUDA graphs replay
(`DeviceRunner._call`: on a GPU each such op is a launch or a host-side view; prefill
invocations included) per step, and
those inside them per invocation, after a warm-up round. Runs on the CPU, where the runs'
bookkeeping runs in its torch form (one Triton kernel each on CUDA), so the second count
overstates the GPU's; the first is the same code on both.

    python -m benchmarks.probes.lanes_ops > lanes-ops.txt
"""

from __future__ import annotations

import collections
import types

from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.speculative import make_engines, stdlib_prompts, timed_run
from vllm_rlt.models.tiny import default_model_dir
from vllm_rlt.worker.device_runs import DeviceRunner


class OpCounter(TorchDispatchMode):
    """Counts aten ops, those inside `DeviceRunner._call` apart, eager ones by name."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = 0
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside:
            self.counts["(replayed)"] += 1
        else:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    counter = OpCounter()
    call = DeviceRunner._call

    def counted_call(self, key, fn):
        counter.inside += 1
        try:
            call(self, key, fn)
        finally:
            counter.inside -= 1

    DeviceRunner._call = counted_call
    args = types.SimpleNamespace(dtype="float32", exit_threshold=0.6, kv_cache_gb=1.0,
                                 async_scheduling=True, draft_loops=[1], drafts=[1])  # fmt: skip
    engines = make_engines(args, str(default_model_dir()), "auto", 1)
    tokenizer = next(iter(engines.values())).tokenizer
    prompts = stdlib_prompts(tokenizer, 2, 512, seed=9)
    print("# (d, K), steps, invocations, eager ops per step, replayed ops per invocation, "
          "eager ops per step by name (top 12)")  # fmt: skip
    for key, engine in engines.items():
        timed_run(engine, prompts, 256)  # warm-up
        counter.counts.clear()
        with counter:
            counts = timed_run(engine, prompts, 256)["engine"]
        steps, invocations = counts["steps"], counts["invocations"]
        replayed = counter.counts.pop("(replayed)")
        eager = sum(counter.counts.values())
        top = [(name, round(n / steps, 1)) for name, n in counter.counts.most_common(12)]
        print(key, steps, invocations, round(eager / steps, 1), round(replayed / invocations, 1),
              top, flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
