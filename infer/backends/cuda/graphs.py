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
key, so they write nothing and read nothing. They do pass through the MoE
router, so their expert counts, measured once per size at capture, are taken
off each step's counts.

``use_graphs=False`` keeps everything but the graph: the step goes through
the same static buffers and padding and the forward runs eagerly. That is
what the CPU tests run (there is no CUDA graph off a GPU), and on a GPU it
tells a broken capture from broken padding.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import numpy as np
import torch

from ...primitives.context import ForwardOutput
from ...primitives.types import AttentionMetadata

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], ForwardOutput]


class DecodeGraphs:
    """Replays a captured `forward` for decode-only steps of up to ``max(batch_sizes)`` requests."""

    def __init__(self, forward: Forward, device, max_model_len: int, block_size: int, batch_sizes: Iterable[int],
                 use_graphs: bool = True):
        """`forward`: the model's (`Backend.decode_graphs`); `batch_sizes`: the engine's
        are `core.config.graph_batch_sizes`."""
        self._forward, self.block_size, self.max_model_len = forward, block_size, max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.device = torch.device(str(device))
        if use_graphs and not (self.device.type == "cuda" and torch.cuda.is_available()):
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        self.use_graphs = use_graphs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._out: torch.Tensor | None = None  # the graphs' logits, rows [:bs] for size bs
        self.counts: dict[int, dict[int, torch.Tensor]] = {}  # each graph's expert counts (MoE layers)
        self.pad_counts: dict[int, dict[int, torch.Tensor]] = {}  # one padding row's expert counts, per size
        self.replays = 0  # steps served from the static buffers (a test and a log read it)
        self.pool = None
        with self._on_device():
            self._stage_buffers()

    # -- static buffers -----------------------------------------------------------
    def _stage_buffers(self) -> None:
        """Two device buffers (int64: ids, positions, slots; int32: seq_lens, block
        table) whose slices are the graphs' inputs, each filled from one host
        buffer (pinned on a GPU) by one copy per step."""
        n, w = self.batch_sizes[-1], self.max_blocks
        pin = self.device.type == "cuda"
        self._host64 = torch.zeros(3 * n, dtype=torch.int64, pin_memory=pin)
        self._host32 = torch.zeros(n + n * w, dtype=torch.int32, pin_memory=pin)
        on_host = self.device.type == "cpu"
        self._dev64 = self._host64 if on_host else torch.zeros_like(self._host64, device=self.device)
        self._dev32 = self._host32 if on_host else torch.zeros_like(self._host32, device=self.device)
        self._np64, self._np32 = self._host64.numpy(), self._host32.numpy()
        self._copied = torch.cuda.Event() if pin else None
        self._fill(*_padding_only())
        self._rows = torch.arange(n, dtype=torch.int64, device=self.device)
        self._query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=self.device)

    def _fill(self, ids, positions, seq_lens, slots, block_table, bs: int | None = None) -> None:
        """Write a step (b requests) into the host buffers, the rows up to `bs`
        (default: all) as padding, and copy what a graph of size `bs` reads."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the host buffers
        n, b, w = self.batch_sizes[-1], len(ids), self.max_blocks
        bs = n if bs is None else bs
        h64, h32 = self._np64, self._np32
        h64[:b], h64[n:n + b], h64[2 * n:2 * n + b] = ids, positions, slots
        h64[b:bs] = 0
        h64[n + b:n + bs] = 0
        h64[2 * n + b:2 * n + bs] = -1  # padding writes no slot
        h32[:b], h32[b:bs] = seq_lens, 0  # and sees no key
        # Table entries past a request's blocks are never read (keys stop at seq_len): no clearing.
        if b:
            h32[n:n + b * w].reshape(b, w)[:, :block_table.shape[1]] = block_table
        if self._dev64 is not self._host64:
            # The seq_lens and the real requests' table rows are a prefix of the int32 buffer
            # (padding rows read no block, so their rows stay as they were).
            self._dev64.copy_(self._host64, non_blocking=True)
            self._dev32[:n + b * w].copy_(self._host32[:n + b * w], non_blocking=True)
            self._copied.record()

    def _inputs(self, bs: int):
        """(ids, positions, rows, metadata) views of the static buffers for batch size `bs`."""
        n, d64, d32 = self.batch_sizes[-1], self._dev64, self._dev32
        # max_seq_len is the capacity, not this step's: the launch (split
        # count) is frozen into the graph and must fit every later step. A
        # shorter context keeps MIN_SPLIT_TOKENS per split: its spare splits exit at once.
        meta = AttentionMetadata(self._query_start_loc[:bs + 1], d32[:bs], d32[n:].view(n, self.max_blocks)[:bs],
                                 d64[2 * n:2 * n + bs], max_query_len=1, max_seq_len=self.max_model_len,
                                 block_size=self.block_size)
        return d64[:bs], d64[n:n + bs], self._rows[:bs], meta

    # -- capture ---------------------------------------------------------------------
    def capture(self, progress: Callable[[Iterable], Iterable] = iter) -> None:
        """Capture every batch size, largest first so smaller graphs reuse its memory pool.

        Call it once the KV caches are allocated: the graphs read the caches they saw here.
        """
        with self._on_device():
            for bs in progress(list(reversed(self.batch_sizes))):
                self._capture(bs)
            if self.use_graphs:
                torch.cuda.synchronize(self.device)

    def _on_device(self):
        """Make the graphs' device current (Triton, streams and events use the current device)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _capture(self, bs: int) -> None:
        self._fill(*_padding_only())
        ids, positions, rows, meta = self._inputs(bs)
        if not self.use_graphs:
            self.pad_counts[bs] = self._per_row(self._forward(ids, positions, rows, meta).expert_counts, bs)
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: compiles kernels, validates arguments
            logits = self._forward(ids, positions, rows, meta).logits
        torch.cuda.current_stream().wait_stream(stream)
        if self._out is None:  # every graph writes its logits here: one [largest size, vocab] buffer in all
            self._out = torch.empty(self.batch_sizes[-1], logits.shape[1], dtype=logits.dtype, device=self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(ids, positions, rows, meta)
            self._out[:bs].copy_(out.logits)
        self.pool = graph.pool()
        # The counts tensors were written by the captured kernels: each replay refreshes them.
        self.graphs[bs], self.counts[bs] = graph, dict(out.expert_counts)
        graph.replay()  # every row padding: what padding adds to the expert counts
        self.pad_counts[bs] = self._per_row(self.counts[bs], bs)

    @staticmethod
    def _per_row(counts: dict[int, torch.Tensor], bs: int) -> dict[int, torch.Tensor]:
        # Padding rows are identical (token 0 at position 0 attending to nothing), so each adds the same counts.
        return {layer: c // bs for layer, c in counts.items()}

    # -- steps -------------------------------------------------------------------------
    def can_replay(self, meta: AttentionMetadata) -> bool:
        """Whether a step is one query per request with a captured size and a context that fits."""
        b = meta.num_seqs
        return (0 < b <= self.batch_sizes[-1] and meta.max_query_len == 1 and meta.num_tokens == b
                and meta.max_seq_len <= self.max_model_len and meta.block_table.shape[1] <= self.max_blocks)

    def forward(self, ids: np.ndarray, positions: np.ndarray, meta: AttentionMetadata) -> ForwardOutput:
        """Logits [B, vocab] (float32) of every row of a step given as host arrays
        (`can_replay` must hold) and its expert counts; valid until the next call."""
        b = meta.num_seqs
        bs = next(n for n in self.batch_sizes if n >= b)
        with self._on_device():
            self._fill(ids, positions, meta.seq_lens, meta.slot_mapping, meta.block_table, bs)
            if self.use_graphs:
                self.graphs[bs].replay()
                logits, counts = self._out, self.counts[bs]
            else:
                out = self._forward(*self._inputs(bs))
                logits, counts = out.logits, out.expert_counts
            pad = self.pad_counts[bs]  # MoE: the step's counts without the padding's
            counts = {layer: c - (bs - b) * pad[layer] for layer, c in counts.items()}
        self.replays += 1
        return ForwardOutput(logits[:b], counts)


def _padding_only():
    """A step of no request: every row of the static buffers is padding."""
    i32, i64 = np.zeros(0, np.int32), np.zeros(0, np.int64)
    return i64, i64, i32, i64, np.zeros((0, 0), np.int32)
