"""How an engine is put together, in the order the parts depend on each other: the model, then
everything that stays on the device besides the KV cache (hidden-state ring, window tokens,
device-run state, CUDA-graph shapes), then the KV cache sized from what memory is left, then the
scheduler and the runner that share its numbers. Each part is built once; `LLMEngine` takes the
finished parts and only runs steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from vllm_rlt.attention.metadata import tile_rows_for
from vllm_rlt.config import EngineConfig, KVLayout
from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.core.sched.exit_policy import make_exit_policy
from vllm_rlt.core.sched.lane_rule import run_lanes
from vllm_rlt.core.sched.prefill_planner import make_planner
from vllm_rlt.core.sched.scheduler import Scheduler
from vllm_rlt.engine.kv_handoff import KVHandoff
from vllm_rlt.engine.kv_sizing import (
    KVBlocks,
    kv_cache_dtype,
    log_kv_cache,
    plan_kv_blocks,
    resolve_max_model_len,
)
from vllm_rlt.models import registry
from vllm_rlt.models.hub import resolve_model_dir
from vllm_rlt.models.loader import LoadedModel, load_model, read_config
from vllm_rlt.worker.cuda_graph import CudaGraphRunner, graphs_supported
from vllm_rlt.worker.device_runs import DeviceRunner
from vllm_rlt.worker.graph_tables import graph_specs
from vllm_rlt.worker.hidden_state import HiddenStateStore
from vllm_rlt.worker.kv_cache import DeviceKVCache
from vllm_rlt.worker.memory_profile import measure_device_memory
from vllm_rlt.worker.model_runner import ModelRunner
from vllm_rlt.worker.penalties import PenaltyState
from vllm_rlt.worker.run_state import RunState
from vllm_rlt.worker.spec_windows import WindowTokens

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    model_dir: str  # the model's directory (a hub id resolved): chat template, tokenizer files
    loaded: LoadedModel
    kv_manager: KVCacheManager  # host side of the KV cache: blocks, tables, prefix hashes
    scheduler: Scheduler
    runner: ModelRunner
    handoff: KVHandoff  # the prefill/decode roles' seam
    max_model_len: int  # the longest request (prompt + output positions) the engine accepts


def load(config: EngineConfig, loaded: LoadedModel | None) -> tuple[str, LoadedModel]:
    """The model directory and the model (`loaded`, when given, checked against the config)."""
    mc = config.model
    model_dir = resolve_model_dir(mc.model, mc.revision, mc.download_dir)
    if loaded is not None:
        config.check_model(type(loaded.model))
        return model_dir, loaded
    _, model_cls = registry.resolve(read_config(model_dir).model_type)
    config.check_model(model_cls)
    attention_backend, layer_kernels = mc.kernel_names()
    return model_dir, load_model(
        model_dir,
        dtype=mc.dtype,
        device=mc.device,
        load_format=mc.load_format,
        attention_backend=attention_backend,
        layer_kernels=layer_kernels,
        seed=mc.seed,
    )


def assemble(config: EngineConfig, loaded: LoadedModel | None = None) -> EngineParts:
    """Every part of an engine for `config` (`loaded`: a model already loaded)."""
    mc, cc, sc = config.model, config.cache, config.scheduler
    model_dir, loaded = load(config, loaded)
    model, c = loaded.model, loaded.config
    num_loops, weight = model.num_loops, model.lm_head.weight
    spec_runs = config.check_speculation(num_loops, c.early_exit_threshold)
    max_drafts = config.speculative.num_speculative_tokens
    max_context = mc.max_model_len or c.max_position_embeddings
    # the loops' planes, then the planes of layers outside the loop (Huginn's prelude, coda)
    num_planes = KVLayout(cc.kv_layout).num_planes(num_loops) + model.num_edge_planes

    # everything that stays on the device besides the KV cache exists before it is sized
    planner = make_planner(sc, cc.kv_layout, num_loops)
    # a speculative window's rows (or a run's lanes) use the ring once the prompt is done
    ring_rows = max(planner.ring_slots * planner.chunk_size, max_drafts + 1)
    states = HiddenStateStore(sc.max_num_seqs, ring_rows, model.state_size, weight.dtype,
                              weight.device)  # fmt: skip
    windows = WindowTokens(sc.max_num_seqs, max_drafts, weight.shape[0], weight.device)
    penalties = PenaltyState(sc.max_num_seqs, weight.shape[0], weight.device)
    run_state = None  # device runs: only for decode rows whose prelude and coda attend nothing
    if sc.run_loops > 1 and not model.num_edge_planes:
        # a run beside prefill takes the prefill batch's loops, up to the model's depth
        run_state = RunState(
            sc.max_num_seqs, max(sc.run_loops, num_loops), weight.shape[0], num_planes,
            -(-max_context // cc.block_size), model.state_size, weight.dtype, weight.device,
            lanes=run_lanes(max_drafts, num_loops) if spec_runs else 1,
        )  # fmt: skip
    tile_rows = tile_rows_for(planner.task_rows)
    specs = ()
    if not mc.enforce_eager and graphs_supported(model):
        segments = planner.expected_segments(sc.max_num_seqs)
        specs = graph_specs(sc.max_num_seqs, sc.max_num_batched_tokens, segments, tile_rows)

    # the KV cache: what memory the parts above and one invocation of each shape leave (graphs
    # sized for the longest context a request may get)
    kv_dtype = kv_cache_dtype(cc.kv_cache_dtype, weight.dtype, loaded.kv_scales)
    profile = (sc.max_num_batched_tokens, sc.max_num_seqs, cc.block_size, tile_rows, specs,
               max_context)  # fmt: skip
    blocks = plan_kv_blocks(cc, c, num_planes, kv_dtype, weight.device,
                            lambda: measure_device_memory(model, *profile))  # fmt: skip
    kv_manager = _kv_manager(config, model, blocks)
    per_plane = kv_manager.max_tokens_per_request()  # positions of one plane
    max_model_len = resolve_max_model_len(mc.max_model_len, c.max_position_embeddings, per_plane,
                                          blocks)  # fmt: skip
    log_kv_cache(blocks, per_plane, num_planes, max_model_len)
    kv_cache = DeviceKVCache.for_model(model, blocks.num_blocks, cc.block_size, kv_dtype,
                                       loaded.kv_scales)  # fmt: skip

    scheduler = Scheduler(
        sc,
        kv_manager,
        make_exit_policy(config.exit.exit_mode, config.exit.trace_seed),
        num_loops,
        atomic_prefill=model.requires_atomic_prefill,
        speculative=config.speculative,
        device_runs=run_state is not None,
        spec_runs=spec_runs,
        planner=planner,
    )
    graphs, runs = None, None
    longest = min(max_model_len, per_plane)
    if specs:
        graphs = CudaGraphRunner(model, kv_cache, specs, longest, tile_rows)
    loop_planes = kv_manager.num_loop_planes
    if run_state is not None:
        runs = DeviceRunner(model, kv_cache, states, windows, run_state, loop_planes, tile_rows,
                            longest, capture=bool(specs), penalties=penalties)  # fmt: skip
        if specs:  # captured now: a first use mid-serving would stall every row
            spec = config.speculative
            runs.warm_up(config.exit.exit_mode, spec.speculative_draft_loops,
                         spec.speculative_max_decode_rows)  # fmt: skip
    runner = ModelRunner(model, kv_cache, states, windows, loop_planes, graphs, tile_rows, runs,
                         penalties)  # fmt: skip
    handoff = KVHandoff(scheduler, kv_manager, kv_cache)
    return EngineParts(model_dir, loaded, kv_manager, scheduler, runner, handoff, max_model_len)


def _kv_manager(config: EngineConfig, model, blocks: KVBlocks) -> KVCacheManager:
    cc = config.cache
    # a random initial state makes prompt KV depend on the request's seed: nothing to share
    prefix_caching = cc.enable_prefix_caching and not model.random_initial_state
    if cc.enable_prefix_caching and not prefix_caching:
        logger.info(
            "prefix caching is off: %s draws a random initial state per request, so prompt KV "
            "depends on the request's seed",
            type(model).__name__,
        )
    return KVCacheManager(blocks.num_blocks, cc.block_size, cc.kv_layout, model.num_loops,
                          prefix_caching, model.num_edge_planes)  # fmt: skip
