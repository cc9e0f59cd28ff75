"""CUDA graphs for decode-only steps: one captured forward per batch size.

A decode step launches a few kernels per layer, each doing microseconds of
work at small batch; replaying a captured graph removes the per-launch CPU
cost. Every kernel of the forward is shape-static for a fixed batch size
(the attention grid comes from shapes, never from device values), so one graph
per padded batch size serves every step of that size: the step's ids,
positions and metadata are copied into the graph's static buffers and the
graph is replayed.

Padding rows (batch rounded up to a captured size) are requests with one
query, ``seq_len`` 0 and slot -1: kv_write skips them and attention sees no
key, so they write nothing and read nothing.

Only taken on a CUDA device (`enabled`); elsewhere `forward` runs the model
runner eagerly, which is all the CPU tests can check.
"""

from __future__ import annotations

import numpy as np
import torch

from ...primitives.types import AttentionMetadata

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


class DecodeGraphs:
    """Wraps a `ModelRunner` whose backend's device is CUDA."""

    def __init__(self, runner, max_model_len: int, max_blocks_per_seq: int, block_size: int,
                 batch_sizes=BATCH_SIZES):
        self.runner, self.block_size = runner, block_size
        self.max_model_len, self.max_blocks = max_model_len, max_blocks_per_seq
        self.batch_sizes = tuple(sorted(batch_sizes))
        device = str(runner.backend.device)
        self.enabled = device.startswith("cuda") and torch.cuda.is_available()
        self.device = device
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict, torch.Tensor]] = {}
        self.pool = None

    def _static(self, bs: int) -> dict:
        dev, i32, i64 = self.device, torch.int32, torch.int64
        return {
            "ids": torch.zeros(bs, dtype=i64, device=dev),
            "positions": torch.zeros(bs, dtype=i64, device=dev),
            "rows": torch.arange(bs, dtype=i64, device=dev),
            "query_start_loc": torch.arange(bs + 1, dtype=i32, device=dev),
            "seq_lens": torch.zeros(bs, dtype=i32, device=dev),
            "block_table": torch.zeros(bs, self.max_blocks, dtype=i32, device=dev),
            "slot_mapping": torch.full((bs,), -1, dtype=i64, device=dev),
        }

    def _meta(self, s: dict) -> AttentionMetadata:
        # max_seq_len is the capacity, not this step's: the launch (split
        # count) is frozen into the graph and must fit every later step.
        return AttentionMetadata(s["query_start_loc"], s["seq_lens"], s["block_table"], s["slot_mapping"],
                                 max_query_len=1, max_seq_len=self.max_model_len, block_size=self.block_size)

    def capture(self) -> None:
        """Capture every batch size, largest first so smaller graphs share its memory pool."""
        if not self.enabled:
            return
        for bs in reversed(self.batch_sizes):
            s = self._static(bs)
            meta = self._meta(s)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: compiles kernels, validates arguments
                self.runner.forward(s["ids"], s["positions"], s["rows"], meta)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.runner.forward(s["ids"], s["positions"], s["rows"], meta)
            self.pool = graph.pool()
            self.graphs[bs] = (graph, s, logits)

    def can_replay(self, meta: AttentionMetadata) -> bool:
        b = meta.num_seqs
        return (self.enabled and meta.max_query_len == 1 and meta.num_tokens == b and b <= self.batch_sizes[-1]
                and meta.max_seq_len <= self.max_model_len and meta.block_table.shape[1] <= self.max_blocks)

    def forward(self, ids: np.ndarray, positions: np.ndarray, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [B, vocab] of a step given as host arrays; replayed when it is a decode step that fits."""
        backend = self.runner.backend
        if not self.can_replay(meta) or not self.graphs:
            rows = backend.asarray(np.arange(len(ids), dtype=np.int64))
            return self.runner.forward(backend.asarray(ids), backend.asarray(positions), rows,
                                       backend.prepare_metadata(meta))
        b = meta.num_seqs
        bs = next(n for n in self.batch_sizes if n >= b)
        graph, s, logits = self.graphs[bs]
        width = meta.block_table.shape[1]
        s["ids"][:b].copy_(torch.from_numpy(np.asarray(ids, np.int64)), non_blocking=True)
        s["positions"][:b].copy_(torch.from_numpy(np.asarray(positions, np.int64)), non_blocking=True)
        s["seq_lens"].zero_()[:b].copy_(torch.from_numpy(np.asarray(meta.seq_lens, np.int32)), non_blocking=True)
        s["slot_mapping"].fill_(-1)[:b].copy_(torch.from_numpy(np.asarray(meta.slot_mapping, np.int64)),
                                              non_blocking=True)
        s["block_table"][:b, :width].copy_(torch.from_numpy(np.asarray(meta.block_table, np.int32)), non_blocking=True)
        graph.replay()
        return logits[:b]
