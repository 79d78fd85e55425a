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
from vllm_rlt.config_sched import SERVER_RUN_LOOPS, ExitConfig, SchedulerConfig, SpeculativeConfig


class KVLayout(str, Enum):
    LAST_EXITED = "last_exited"  # one plane per depth; exits copy KV into skipped planes
    SHARED = "shared"  # one plane, overwritten at every loop

    def num_planes(self, num_loops: int) -> int:
        """KV planes the layout keeps for a depth-`num_loops` loop: one per depth or one."""
        return num_loops if self is KVLayout.LAST_EXITED else 1


KV_LAYOUTS = tuple(layout.value for layout in KVLayout)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8 is e4m3 (vLLM's names)
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# "triton_invariant" is what batch_invariant runs
ATTENTION_BACKENDS = ("auto", "torch", "triton", "triton_invariant")
# "auto": skinny on CUDA, torch elsewhere; "invariant" is what batch_invariant runs
LAYER_KERNELS = ("auto", "torch", "fused", "skinny", "invariant")


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
