"""Frozen, validated engine configuration, one dataclass per concern.

Every field's `help` metadata is its single description, and its `choices` metadata (for an
enumerated setting) its single list of valid values: `--help` of the CLI, the CLI's `choices` and
the docs are generated from them, and construction checks them. Values measured at startup (the
number of KV blocks) live in resolved objects, never back in these configs. Unsupported
combinations fail here with a message naming both settings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any

from vllm_rlt.config_fields import ConfigError, check, check_choices_and_types, field_help

SCHEDULING_MODES = ("refill", "no_refill", "mixed")
EXIT_MODES = ("ouro", "ouro_delayed", "trace")


class KVLayout(str, Enum):
    LAST_EXITED = "last_exited"  # one plane per depth; exits copy KV into skipped planes
    SHARED = "shared"  # one plane, overwritten at every loop

    def num_planes(self, num_loops: int) -> int:
        """KV planes the layout keeps for a depth-`num_loops` loop: one per depth or one."""
        return num_loops if self is KVLayout.LAST_EXITED else 1


KV_LAYOUTS = tuple(layout.value for layout in KVLayout)
QUEUE_POLICIES = ("fcfs", "priority")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8 is e4m3 (vLLM's names)
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# "triton_invariant" is what batch_invariant runs
ATTENTION_BACKENDS = ("auto", "torch", "triton", "triton_invariant")
# "auto": skinny on CUDA, torch elsewhere; "invariant" is what batch_invariant runs
LAYER_KERNELS = ("auto", "torch", "fused", "skinny", "invariant")
# device runs' length by default (`SchedulerConfig.device_decode_loops`): offline, where every
# request is there from the start, and in the server (one Ouro token's loops at full depth)
OFFLINE_RUN_LOOPS = 16
SERVER_RUN_LOOPS = 4


def check_layer_kernels(name: str) -> None:
    """ConfigError unless `name` is one of LAYER_KERNELS (models and kernels check it again:
    tests build them without an EngineConfig)."""
    check(name in LAYER_KERNELS, "layer_kernels", name, f"one of {LAYER_KERNELS}")


@dataclass(frozen=True)
class ModelConfig:
    model: str | os.PathLike | None = field_help(
        "HF model directory (config.json, safetensors, tokenizer.json) or Hugging Face hub id "
        "(org/name: the hub's local cache, else downloaded; HF_TOKEN, HF_HUB_OFFLINE apply)",
        default=None,
    )
    revision: str | None = field_help(
        "hub id: the branch, tag or commit to load (default: main)", default=None
    )
    download_dir: str | None = field_help(
        "hub id: the cache directory to look in and download to (default: the hub's cache)",
        default=None,
    )
    dtype: str = field_help(
        "auto (bf16 on GPU, fp32 on CPU), float32, bfloat16 or float16",
        choices=DTYPE_NAMES,
        default="auto",
    )
    load_format: str = field_help(
        "auto/safetensors: read the weights; dummy: seeded random weights",
        choices=LOAD_FORMATS,
        default="auto",
    )
    device: str | None = field_help("cpu or cuda (default: cuda when available)", default=None)
    attention_backend: str = field_help(
        "attention implementation: auto (triton on CUDA, torch on CPU), torch (the reference), "
        "triton, or triton_invariant (batch_invariant's)",
        choices=ATTENTION_BACKENDS,
        default="auto",
    )
    layer_kernels: str = field_help(
        "how a layer's projections and element-wise steps run: auto (skinny on CUDA, torch on "
        "CPU), torch (the reference), fused or skinny (docs/design/runner.md §4), or invariant "
        "(batch_invariant's)",
        choices=LAYER_KERNELS,
        default="auto",
    )
    batch_invariant: bool = field_help(
        "make every row's result bitwise independent of the other rows of its invocation and of "
        "the invocation's size, so that scheduling (WCPB, chunk size, budget, other requests) "
        "never changes a token: Triton kernels with tiles fixed per weight shape, attention "
        "without KV splits (docs/design/runner.md §6; it costs throughput)",
        default=False,
    )
    seed: int = field_help(
        "seed for dummy weights and for the seeds drawn for requests that give none", default=0
    )
    enforce_eager: bool = field_help(
        "run every recurrent-core invocation eagerly: no CUDA graphs (by default invocations of "
        "up to 2048 rows replay graphs captured at start on CUDA with the triton backend)",
        default=False,
    )
    init_scale: float = field_help(
        "Huginn: scale of the random initial recurrent state each request draws from its seed "
        "(0: the zero state, deterministic); a request's init_scale overrides it",
        default=1.0,
    )
    max_model_len: int | None = field_help(
        "most positions of one request (prompt + output); default: the model's "
        "max_position_embeddings, capped by what the KV cache holds for one request",
        default=None,
    )

    def __post_init__(self) -> None:
        check_choices_and_types(self)
        n = self.max_model_len
        check(n is None or n >= 2, "max_model_len", n, ">= 2 (one prompt and one output token)")
        check(self.init_scale >= 0, "init_scale", self.init_scale, ">= 0")
        if self.batch_invariant:
            for name, ok in (
                ("attention_backend", ("auto", "triton", "triton_invariant")),
                ("layer_kernels", ("auto", "invariant")),
            ):
                value = getattr(self, name)
                check(value in ok, name, value, f"one of {ok} with batch_invariant (its kernels)")

    def kernel_names(self) -> tuple[str, str]:
        """(attention backend, layer kernels) the model is built with: batch_invariant's own,
        or the chosen ones ("auto" is resolved by the loader)."""
        if self.batch_invariant:
            return "triton_invariant", "invariant"
        return self.attention_backend, self.layer_kernels


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field_help("KV positions per block", default=16)
    kv_layout: str = field_help(
        "last_exited: one KV plane per depth, exits copy into skipped planes; shared: one plane",
        choices=KV_LAYOUTS,
        default="last_exited",
    )
    kv_cache_dtype: str = field_help(
        "what the KV cache stores: auto (the model's dtype) or fp8 (e4m3 with a K and a V scale "
        "per layer, from the checkpoint's k_scale / v_scale tensors, else 1.0): half the bytes "
        "of bf16 per position; see docs/design/kv-cache.md",
        choices=KV_CACHE_DTYPES,
        default="auto",
    )
    num_kv_blocks: int | None = field_help(
        "KV blocks (all planes share them); default: from kv_cache_memory_gb", default=None
    )
    kv_cache_memory_gb: float | None = field_help(
        "memory for the KV cache when num_kv_blocks is unset; default: on CUDA what "
        "gpu_memory_utilization leaves, on the CPU a tenth of the available host memory "
        "(MemAvailable), at most 1 GiB",
        default=None,
    )
    gpu_memory_utilization: float = field_help(
        "fraction of the GPU's memory this engine may use (weights, activations, CUDA graphs, "
        "the KV cache; memory other processes hold counts against it): the KV cache gets what "
        "the rest leaves, measured at start (unless num_kv_blocks or kv_cache_memory_gb is set)",
        default=0.9,
    )
    enable_prefix_caching: bool = field_help(
        "reuse the KV of full prompt blocks that earlier requests computed (blocks stay cached "
        "after their request ends until the memory is needed)",
        default=True,
    )

    def __post_init__(self) -> None:
        check_choices_and_types(self)
        check(self.block_size >= 1, "block_size", self.block_size, ">= 1")
        check(
            self.num_kv_blocks is None or self.num_kv_blocks >= 1,
            "num_kv_blocks",
            self.num_kv_blocks,
            ">= 1",
        )
        gb = self.kv_cache_memory_gb
        check(gb is None or gb > 0, "kv_cache_memory_gb", gb, "> 0")
        util = self.gpu_memory_utilization
        check(0 < util <= 1, "gpu_memory_utilization", util, "in (0, 1]")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field_help("most requests running at once (and so per batch)", default=8)
    max_num_batched_tokens: int = field_help(
        "most rows in one recurrent-core invocation", default=1024
    )
    prefill_chunk_size: int | None = field_help(
        "prompt positions per prefill chunk (default: max_num_batched_tokens)", default=None
    )
    scheduling_mode: str = field_help(
        "refill: prefill and decode in separate batches; no_refill: decode cohorts; "
        "mixed: prefill rows fill the budget beside decode rows",
        choices=SCHEDULING_MODES,
        default="mixed",
    )
    queue_policy: str = field_help(
        "fcfs or priority (lower value first, then arrival)",
        choices=QUEUE_POLICIES,
        default="fcfs",
    )
    wavefront_chunked_prefill: bool = field_help(
        "WCPB: batch ready (prompt chunk, depth) tasks of all requests into each invocation",
        default=False,
    )
    max_prefill_stall_loops: int | None = field_help(
        "latency rule: a batch (prefill-only, or decode rows with no exit decision due) runs at "
        "most this many loops before the scheduler decides again, so arrivals wait at most that "
        "long (default: no limit)",
        default=None,
    )
    device_decode_loops: int | None = field_help(
        "a decode-only step whose tokens exit early (gate or trace) runs up to this many "
        "invocations with exit decisions, sampling and the next token's entry on the device, "
        "with no host work between them (beside a prefill batch: that batch's loops); its "
        "tokens come back together after the step "
        "(0 or 1: the host decides after every loop that reads a gate; default: "
        f"{OFFLINE_RUN_LOOPS} offline, {SERVER_RUN_LOOPS} in the server, where requests arrive "
        "while a run goes on: streams get their tokens and arrivals their turn about as often "
        "as at fixed depth)",
        default=None,
    )
    async_scheduling: bool = field_help(
        "schedule and queue each step before the tokens of the one before are read back, so "
        "the GPU does not idle while the host prepares a step (a step's outputs come with the "
        "next step)",
        default=True,
    )
    max_prefill_rows_with_decode: int | None = field_help(
        "latency rule: an invocation that carries decode rows takes at most this many prefill "
        "rows (default: half of max_num_batched_tokens with WCPB, otherwise whatever budget the "
        "decode rows leave)",
        default=None,
    )
    max_prefill_rows_per_decode_token: int | None = field_help(
        "latency rule: a decode token rides at most this many prefill rows summed over the "
        "invocations of its loops, while the engine holds fewer requests than max_num_seqs; "
        "its other loops run in decode-only invocations, so fewer, shorter gaps between tokens "
        "wait for prefill (default: half of max_num_batched_tokens with WCPB, one capped "
        "invocation, otherwise no limit; max_num_batched_tokens x loops or more: no limit)",
        default=None,
    )
    max_context_with_decode: int = field_help(
        "decode rows share invocations with prefill rows only while no prompt in prefill is "
        "longer than this and no decoding request is past this position; otherwise decode "
        "steps (all their loops) and prefill batches of the whole budget alternate "
        "(fixed-depth decoding only). A mixed invocation lasts as long as its longest-context "
        "row, so past some context a riding decode row costs more than a decode invocation of "
        "its own (docs/design/scheduler.md R7; 0: always apart; max_model_len or more: never)",
        default=2048,
    )

    @property
    def run_loops(self) -> int:
        """`device_decode_loops`, its offline default if unset."""
        runs = self.device_decode_loops
        return OFFLINE_RUN_LOOPS if runs is None else runs

    def __post_init__(self) -> None:
        check_choices_and_types(self)
        check(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, ">= 1")
        check(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            ">= 1",
        )
        chunk = self.prefill_chunk_size
        check(chunk is None or chunk >= 1, "prefill_chunk_size", chunk, ">= 1")
        stall = self.max_prefill_stall_loops
        check(stall is None or stall >= 1, "max_prefill_stall_loops", stall, ">= 1")
        runs = self.device_decode_loops
        check(runs is None or runs >= 0, "device_decode_loops", runs, ">= 0")
        cap = self.max_prefill_rows_with_decode
        check(cap is None or cap >= 1, "max_prefill_rows_with_decode", cap, ">= 1")
        ride = self.max_prefill_rows_per_decode_token
        check(ride is None or ride >= 1, "max_prefill_rows_per_decode_token", ride, ">= 1")
        apart = self.max_context_with_decode
        check(apart >= 0, "max_context_with_decode", apart, ">= 0")

    @property
    def prefill_rows_with_decode(self) -> int | None:
        """The cap `max_prefill_rows_with_decode` puts in force (None: no cap). WCPB fills its
        invocations with ready tasks of every depth, so decode rows beside them would ride
        invocations up to the whole budget; half of it keeps their ITL tail at Split's
        (docs/benchmarks/wcpb-matrix.md §4)."""
        return self._wcpb_half_budget(self.max_prefill_rows_with_decode)

    @property
    def prefill_rows_per_decode_token(self) -> int | None:
        """The ride limit `max_prefill_rows_per_decode_token` puts in force (None: none). WCPB's
        default lets a token ride one invocation's cap of prefill rows: in the matrix's arrival
        cells that keeps its ITL tail at Split's (docs/benchmarks/wcpb-matrix.md §3)."""
        return self._wcpb_half_budget(self.max_prefill_rows_per_decode_token)

    def _wcpb_half_budget(self, value: int | None) -> int | None:
        """A latency rule's value in force: the user's, else half the budget with WCPB (None:
        no limit)."""
        if value is not None:
            return value
        return max(1, self.max_num_batched_tokens // 2) if self.wavefront_chunked_prefill else None

    @property
    def chunk_size(self) -> int:
        return self.prefill_chunk_size or self.max_num_batched_tokens


@dataclass(frozen=True)
class ExitConfig:
    exit_mode: str = field_help(
        "ouro: exit when the gate's exit CDF reaches the threshold; ouro_delayed: one loop "
        "later; trace: replay given exit depths",
        choices=EXIT_MODES,
        default="ouro",
    )
    exit_threshold: float | None = field_help(
        "default CDF threshold in [0, 1] (1 = fixed depth); default: the model config's",
        default=None,
    )
    trace_seed: int | None = field_help(
        "trace mode: draw each decode token's loops from this seed when a request gives no "
        "trace (default: such tokens run max_loops)",
        default=None,
    )

    def __post_init__(self) -> None:
        check_choices_and_types(self)
        t = self.exit_threshold
        check(t is None or 0.0 <= t <= 1.0, "exit_threshold", t, "in [0, 1]")


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int = field_help(
        "self-speculative decoding: tokens a decoding request drafts with fewer loops before "
        "the full-depth model checks them (0: off). At fixed depth in windows; with the exit "
        "gate in device runs, greedy requests only, at most loops - 1 drafts in flight "
        "(docs/design/speculative.md)",
        default=0,
    )
    speculative_draft_loops: int = field_help(
        "loops a draft token runs (1 <= loops < the model's depth)", default=1
    )
    speculative_max_decode_rows: int = field_help(
        "speculation is off for a window or device run that starts while more requests than "
        "this decode (verify rows multiply the rows per invocation, which stops paying once "
        "invocations leave the weight-bound regime)",
        default=8,
    )
    speculative_fallback: bool = field_help(
        "measure output tokens/s with speculation and without it at the current load (phases "
        "of steps, on the engine's clock) and speculate only while it measures faster "
        "(docs/design/speculative.md §5); outputs are the same either way",
        default=True,
    )
    speculative_invocation_costs: str | None = field_help(
        "adaptive rule: measured cost of one recurrent-core invocation by rows, as "
        "'rows:cost,rows:cost,...' (any unit, interpolated linearly); with it each window takes "
        "the number of drafts the cost model predicts fastest, 0 (off) included (default: "
        "none, the row limit alone decides)",
        default=None,
    )

    def __post_init__(self) -> None:
        check_choices_and_types(self)
        k = self.num_speculative_tokens
        check(k >= 0, "num_speculative_tokens", k, ">= 0")
        d = self.speculative_draft_loops
        check(d >= 1, "speculative_draft_loops", d, ">= 1")
        rows = self.speculative_max_decode_rows
        check(rows >= 0, "speculative_max_decode_rows", rows, ">= 0")
        if self.speculative_invocation_costs is not None:
            self.invocation_costs()

    def invocation_costs(self) -> tuple[tuple[int, float], ...]:
        """`speculative_invocation_costs` as (rows, cost) points, rows ascending."""
        text = self.speculative_invocation_costs or ""
        want = "'rows:cost,...' with rows >= 1 ascending and costs > 0"
        try:
            points = tuple(
                (int(r), float(c)) for r, c in (p.split(":") for p in text.split(",") if p)
            )
        except ValueError:
            points = ()
        ok = bool(points) and all(r >= 1 and c > 0 for r, c in points)
        ok = ok and all(a[0] < b[0] for a, b in zip(points, points[1:], strict=False))
        check(ok, "speculative_invocation_costs", text, want)
        return points


@dataclass(frozen=True)
class EngineConfig:
    """Every setting of one engine. `for_server()`: the same with the server's defaults where
    they differ from offline use."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    exit: ExitConfig = field(default_factory=ExitConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def for_server(self) -> EngineConfig:
        """The settings an engine serving arriving requests runs with: `device_decode_loops`,
        if unset, at its server default."""
        if self.scheduler.device_decode_loops is not None:
            return self
        scheduler = replace(self.scheduler, device_decode_loops=SERVER_RUN_LOOPS)
        return replace(self, scheduler=scheduler)

    def __post_init__(self) -> None:
        if self.scheduler.wavefront_chunked_prefill and self.cache.kv_layout == "shared":
            raise ConfigError(
                "wavefront_chunked_prefill=True cannot run with kv_layout='shared': the shared "
                "layout needs atomic position-wave prefill; use kv_layout='last_exited'"
            )

    def check_model(self, model_cls: type) -> None:
        """Capability check against the model class (its `requires_atomic_prefill`,
        `supports_shared_kv` and `has_exit_gate` attributes)."""
        name = model_cls.__name__
        if model_cls.requires_atomic_prefill and self.scheduler.wavefront_chunked_prefill:
            raise ConfigError(
                f"wavefront_chunked_prefill=True cannot run with {name}, which requires "
                "atomic prefill; turn wavefront_chunked_prefill off"
            )
        if model_cls.requires_atomic_prefill and self.scheduler.max_prefill_stall_loops:
            raise ConfigError(
                f"max_prefill_stall_loops={self.scheduler.max_prefill_stall_loops} would split "
                f"prefill batches of {name}, which requires atomic prefill; leave it unset"
            )
        if not model_cls.supports_shared_kv and self.cache.kv_layout == KVLayout.SHARED.value:
            raise ConfigError(
                f"kv_layout='shared' cannot run with {name}: its recurrences keep one KV plane "
                "each (as its reference cache); use kv_layout='last_exited'"
            )
        threshold = self.exit.exit_threshold
        if not model_cls.has_exit_gate and threshold is not None and threshold < 1:
            raise ConfigError(
                f"exit_threshold={threshold} needs an exit gate, which {name} does not have "
                "(every token runs max_loops loops); leave exit_threshold unset or 1"
            )
        if model_cls.requires_atomic_prefill and self.speculative.num_speculative_tokens:
            raise ConfigError(
                f"num_speculative_tokens={self.speculative.num_speculative_tokens} cannot run "
                f"with {name}, which requires atomic prefill (a verify pass runs a window's "
                "positions as a task from the draft depth on); set num_speculative_tokens=0"
            )

    def check_speculation(self, num_loops: int, default_threshold: float | None) -> bool:
        """Whether speculation runs in device runs, with lanes (the exit gate is on: a draft's
        first loops are the target's only up to its exit), rather than in windows (fixed depth:
        every token runs all `num_loops` loops); refuses what neither covers
        (docs/design/speculative.md §3). `default_threshold`: the model config's exit
        threshold."""
        spec = self.speculative
        if not spec.num_speculative_tokens:
            return False
        d = spec.speculative_draft_loops
        check(d < num_loops, "speculative_draft_loops", d, f"< the model's depth ({num_loops})")
        if self.cache.kv_layout == KVLayout.SHARED.value:
            raise ConfigError(
                f"num_speculative_tokens={spec.num_speculative_tokens} cannot run with "
                "kv_layout='shared': a verify pass runs the window's positions together, so "
                "each would read the one before at its own depth, not at full depth; use "
                "kv_layout='last_exited' or num_speculative_tokens=0"
            )
        if self.exit.exit_mode == "trace":
            raise ConfigError(
                f"num_speculative_tokens={spec.num_speculative_tokens} cannot run with "
                "exit_mode='trace' (traced exit depths are given per output token, not decided "
                "by the model); use exit_mode 'ouro' or 'ouro_delayed', or "
                "num_speculative_tokens=0"
            )
        threshold = self.exit.exit_threshold
        threshold = default_threshold if threshold is None else threshold
        if threshold is None or threshold >= 1.0:
            return False
        sc = self.scheduler
        if sc.run_loops < 2 or sc.scheduling_mode == "no_refill":
            raise ConfigError(
                f"num_speculative_tokens={spec.num_speculative_tokens} with the exit gate "
                f"(exit_threshold={threshold}) speculates in device runs, which "
                f"device_decode_loops={sc.run_loops} with scheduling_mode="
                f"{sc.scheduling_mode!r} turns off; set device_decode_loops >= 2 and "
                "scheduling_mode 'refill' or 'mixed', exit_threshold=1, or "
                "num_speculative_tokens=0"
            )
        return True

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat field names (`LLM(model, max_num_seqs=4, ...)`, CLI flags)."""
        parts = {}
        for name, sub in SECTIONS.items():
            own = {f.name for f in fields(sub)}
            parts[name] = sub(**{k: kwargs.pop(k) for k in list(kwargs) if k in own})
        if kwargs:
            raise ConfigError(f"unknown engine arguments: {sorted(kwargs)}")
        return cls(**parts)


SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "exit": ExitConfig,
    "speculative": SpeculativeConfig,
}
