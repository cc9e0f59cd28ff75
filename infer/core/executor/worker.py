"""One rank's worker: whatever the job's shape, every rank runs one, in the engine's
process (uniproc, rank 0 of mp/Ray, each torchrun rank) or in a worker process.

It owns the rank's backend and `Ops`, its shard of the model (`ModelRunner`), the
KV pool and host-tier store, the LoRA slots, the captured decode graphs, the draft
model of speculative decoding and the sampler. The executor calls its methods on
every rank at once (`Executor.collective_rpc`); a worker process's loop is
``getattr(worker, method)(*args)`` (`core/worker.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from dataclasses import dataclass

import numpy as np

from ...dispatch import DispatchTrace, Ops
from ...primitives.types import AttentionMetadata, expand_block_table
from ..args import EngineArgs
from ..distributed import CollectiveError, DistributedState, StepInput, stage_layers
from ..expert_load import ExpertLoad
from ..lora import Adapter, write_slot
from ..parallel import max_kv_heads, shard_adapter
from .rank import build_model, execute_step, move_blocks, rank_path
from .sampler import ModelRunnerOutput, Sampler, SamplingInput


@dataclass(eq=False)
class Pending:
    """A step rank 0 of a pipeline started: its logits come from the last stage (`Worker.finish`)."""

    sampling: SamplingInput
    shape: tuple[int, int]


class Worker:
    def __init__(self, args: EngineArgs, backend, dist: DistributedState | None = None, load_tokenizer: bool = False):
        self.args, self.backend, self.dist = args, backend, dist
        self.dispatch_trace = DispatchTrace() if args.trace_dispatch else None
        self.ops = Ops(backend, trace=self.dispatch_trace)
        parts = build_model(args, backend, self.ops, dist, load_tokenizer=load_tokenizer)
        self.model, self.graph, self.runner = parts.loaded, parts.graph, parts.runner
        self.dtype, self.max_model_len, self.lora_targets = parts.dtype, parts.max_model_len, parts.lora_targets
        self.vocab_size = parts.graph.config.vocab_size
        self.pooling = parts.pooling  # a pooling model's settings (`core/pooling.py`); None: it generates
        # MoE models: tokens per expert per layer, accumulated over steps; None for dense models.
        self.expert_load = ExpertLoad.for_program(parts.program, backend.to_numpy)
        self.sampler = Sampler(backend, self.ops)
        self.decode_graphs = None
        self.num_blocks = self.block_size = 0  # the KV pool, once allocated

    # -- the KV pool ----------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token on the rank that holds the most (every rank gets as many blocks)."""
        per_token = self.runner.kv_cache_bytes_per_block(1)
        d = self.dist
        if d is None:
            return per_token
        cfg, c = self.runner.config, d.config
        most = max_kv_heads(cfg.num_heads, cfg.num_kv_heads, c.tensor_parallel_size)
        layers = max(b - a for a, b in (stage_layers(cfg.num_layers, s, c.pipeline_parallel_size)
                                        for s in range(c.pipeline_parallel_size)))
        return per_token * most * layers // (self.runner.num_kv_heads * len(self.runner.layers))

    def allocate_kv(self, num_blocks: int, block_size: int, tier_blocks: int = 0, tier_path: str | None = None) -> None:
        self.runner.allocate_kv_caches(num_blocks, block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        if tier_blocks:
            self.runner.allocate_kv_tier(tier_blocks, rank_path(tier_path, self.dist))

    def release_kv(self) -> None:
        self.runner.release_kv_caches()
        self.num_blocks = 0

    def profile_peak(self, n: int, block_size: int) -> int:
        """Peak device bytes of one forward over `n` prompt tokens (weights included)."""
        be, blocks = self.backend, -(-n // block_size)
        groups = self.runner.kv_groups.num_groups  # a hybrid cache: each group its own pages
        be.reset_peak_memory()
        self.allocate_kv(blocks * groups, block_size)
        metas = [AttentionMetadata(np.array([0, n], np.int32), np.array([n], np.int32),
                                   np.arange(g * blocks, (g + 1) * blocks, dtype=np.int32)[None],
                                   np.arange(n, dtype=np.int64) + g * blocks * block_size, n, n, block_size)
                 for g in range(groups)]
        meta = dataclasses.replace(metas[0], kv_groups=tuple(metas[1:]) or None)
        step = StepInput(np.zeros(n, np.int64), np.arange(n, dtype=np.int64), np.array([n - 1], np.int64), meta)
        out = self._step(step)
        if out.logits is None and self.dist is not None and self.dist.is_driver:
            self._recv_logits((1, self.vocab_size))
        be.synchronize()
        self.release_kv()
        return be.memory_info()[1]

    def capture_decode(self, sizes: tuple[int, ...], show: bool) -> None:
        """The backend's captured decode steps (none where it has none). A failed capture
        is reported and the rank runs eagerly."""

        def progress(items):
            from tqdm import tqdm

            return tqdm(items, desc="Capturing decode graphs", unit="graph", file=sys.stderr, disable=not show,
                        leave=False)

        log, start = logging.getLogger("infer"), time.perf_counter()
        try:
            self.decode_graphs = self.ops.decode_graphs(self.runner.forward, max_model_len=self.max_model_len,
                                                        block_size=self.block_size, batch_sizes=sizes,
                                                        progress=progress)
        except Exception as exc:  # noqa: BLE001  (any capture failure leaves eager decode working)
            log.warning("backend '%s' failed to capture decode graphs (%s: %s); every step runs eagerly "
                        "(--enforce-eager skips the attempt)", self.backend.name, type(exc).__name__, exc)
            return
        if self.decode_graphs is not None:
            log.info("captured decode graphs for batch sizes %s in %.1f s", list(sizes), time.perf_counter() - start)

    # -- LoRA ---------------------------------------------------------------------------
    def write_lora(self, slot: int, adapter: Adapter) -> None:
        """Put an adapter's weights (whole, as read) into a slot of this rank's stacks: its shard of them."""
        d = self.dist
        if d is not None and d.config.tensor_parallel_size > 1:
            adapter = shard_adapter(adapter, self.runner.config, d.tp_rank, d.config.tensor_parallel_size)
        write_slot(self.runner, self.graph, slot, adapter, self.args.max_lora_rank)

    # -- steps ------------------------------------------------------------------------------
    def execute_model(self, step: StepInput, sampling: SamplingInput | None = None):
        """One step's forward on this rank, sampled when `sampling` is given (the rank that
        samples). Rank 0 of an mp pipeline gets its logits later: a `Pending` for `finish`."""
        forward = self._replay(step) if self.decode_graphs is not None else None
        if forward is None:
            forward = execute_step(self.runner, step) if self.dist is None else self._step(step)
        if sampling is None:
            return None
        if self.expert_load is not None:
            self.expert_load.record(forward.expert_counts)
        if forward.logits is None:
            return Pending(sampling, (len(step.sample_rows), self.vocab_size))
        return self.sampler(forward.logits, sampling)

    def execute_pooling(self, inputs: dict) -> np.ndarray:
        """A pooling step's forward (`PoolingEngine._inputs`): its ``pooled`` rows, float32, on the host."""
        be, meta = self.backend, inputs["meta"]
        types = inputs["token_type_ids"]
        out = self.runner.forward(be.asarray(inputs["input_ids"]), be.asarray(inputs["positions"]),
                                  be.asarray(np.zeros(0, np.int64)), self.runner.prepare_metadata(meta),
                                  token_type_ids=None if types is None else be.asarray(types))
        return be.to_numpy(out.pooled)

    def finish(self, pending: Pending) -> ModelRunnerOutput:
        """Sample a started step of a pipeline once its logits arrive from the last stage."""
        return self.sampler(self._recv_logits(pending.shape), pending.sampling)

    def resample(self, rows: np.ndarray, tensors) -> ModelRunnerOutput:
        return self.sampler.resample(rows, tensors)

    def _step(self, step: StepInput):
        """The step's forward with the other ranks: a failed collective is a `CollectiveError`."""
        if self.dist is None:
            return execute_step(self.runner, step)
        try:
            return execute_step(self.runner, step, self.dist)
        except RuntimeError as exc:  # a collective whose peer died or timed out
            raise CollectiveError(str(exc)) from exc

    def _recv_logits(self, shape: tuple[int, int]):
        try:
            return self.dist.recv_logits(self.backend, shape)
        except RuntimeError as exc:
            raise CollectiveError(str(exc)) from exc

    def _replay(self, step: StepInput):
        """The step's forward by a captured decode graph, or None when none fits it."""
        graphs = self.decode_graphs
        if step.meta.kv_groups:
            return None  # captured steps read one block table; a hybrid cache has one per group
        meta = expand_block_table(step.meta) if step.meta.block_sizes is not None else step.meta
        if not graphs.can_replay(meta):  # captured steps read tables of pages
            return None
        move_blocks(self.runner, step.tier_ops, step.block_copies)
        out = graphs.forward(step.input_ids, step.positions, meta)  # every row's logits
        if len(step.sample_rows) != meta.num_seqs:  # a one-token prompt chunk samples nothing
            out = dataclasses.replace(out, logits=out.logits[self.backend.asarray(step.sample_rows)])
        return out
