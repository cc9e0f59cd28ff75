"""XY-Serve's dynamic task decomposition, hardware-neutral (plain NumPy).

A step's flattened batch (prefill chunks and decode tokens mixed) is cut into
fixed-shape work before it reaches a device (XY-Serve, arXiv 2412.18106):

* the **Token-Table** lists, per stage, entries ``(start, token_num, kv_len,
  tile_size)``: ``token_num`` real rows starting at flattened row ``start``,
  processed as one tile of the fixed shape ``tile_size`` (``token_num <=
  tile_size``; the rest is virtual padding, never read or written);
* attention entries come from each request's query rows cut into tiles of the
  sizes in ``q_tiles``; a tile's ``kv_len`` is the context its last query
  sees, so with a bottom-right causal mask every tile is a self-contained
  attention problem;
* the **Task-Table** deals tiles to ``num_cores`` cores: attention tiles
  sorted by ``tile_size * kv_len`` (the fixed-shape cost), largest first, then
  dealt in mirrored round-robin (0,1,..,N-1,N-1,..,1,0, ...), which pairs
  the big tiles of one round with the small ones of the next;
* linear ops (SmoothGEMM) cut M (the token count) into tiles of ``m_tile``
  rows and N into ``n_tile`` columns; the last M tile holds fewer real rows
  (virtual padding of M to a multiple of the tile, without copying rows).

Nothing here knows a backend: the ascend backend feeds attention tiles to its
fused kernel, `infer plan` prints the tables, any backend may use them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Query-tile shapes a fixed-shape attention kernel is built for (rows per tile).
DEFAULT_Q_TILES = (16, 32, 64, 128)
# 910B: 20-24 AI cores per chip; a plan for 20 is what `infer plan` shows by default.
DEFAULT_CORES = 20
DEFAULT_M_TILE = 128
DEFAULT_N_TILE = 256


@dataclass(frozen=True, slots=True)
class TokenTable:
    """One stage's entries, as parallel int64 arrays (one element per tile)."""

    stage: str
    start: np.ndarray  # first flattened token row of the tile
    token_num: np.ndarray  # real rows in the tile
    kv_len: np.ndarray  # context the tile's last row attends to (0 for linear)
    tile_size: np.ndarray  # rows of the fixed tile shape
    request: np.ndarray  # request index of the tile (-1 for linear)
    n_start: np.ndarray | None = None  # linear: first output column of the tile
    n_size: np.ndarray | None = None  # linear: output columns of the tile

    def __len__(self) -> int:
        return int(self.start.shape[0])

    @property
    def cost(self) -> np.ndarray:
        """Work of each tile as a fixed-shape kernel sees it (padded rows included)."""
        if self.stage == "attention":
            return self.tile_size * self.kv_len
        return self.tile_size * self.n_size


@dataclass(frozen=True, slots=True)
class TaskTable:
    """Which work units each core runs, in order.

    A unit is one tile for one of ``heads`` head groups (tiles are independent
    per KV head, so XY-Serve deals them separately): unit ``u`` is tile
    ``u // heads`` of the Token-Table, head group ``u % heads``.
    """

    tiles: tuple[np.ndarray, ...]  # tiles[c]: the units of core c, in run order
    load: np.ndarray  # [num_cores] summed unit cost per core
    heads: int = 1

    @property
    def num_cores(self) -> int:
        return len(self.tiles)

    @property
    def imbalance(self) -> float:
        """max / mean load (1.0 is perfect balance)."""
        mean = float(self.load.mean()) if len(self.load) else 0.0
        return float(self.load.max()) / mean if mean > 0 else 1.0


def _tile_for(rows: int, q_tiles: tuple[int, ...]) -> int:
    """The smallest tile shape holding `rows`, or the largest one."""
    for size in q_tiles:
        if rows <= size:
            return size
    return q_tiles[-1]


def attention_table(query_start_loc, seq_lens, q_tiles: tuple[int, ...] = DEFAULT_Q_TILES) -> TokenTable:
    """Attention tiles of a step, in flattened-row order.

    Request b's ``q_len`` rows are cut from its first row into tiles of the
    largest shape while more than that remain, the remainder in the smallest
    shape that holds it (a decode token lands in the smallest tile).
    """
    q_tiles = tuple(sorted(q_tiles))
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    seq = np.asarray(seq_lens, dtype=np.int64)
    cols: list[list[int]] = [[], [], [], [], []]
    for b in range(len(seq)):
        start, end = int(qsl[b]), int(qsl[b + 1])
        first_pos = int(seq[b]) - (end - start)
        row = start
        while row < end:
            size = _tile_for(end - row, q_tiles)
            n = min(size, end - row)
            for col, v in zip(cols, (row, n, first_pos + (row - start) + n, size, b)):
                col.append(v)
            row += n
    start, num, kv, size, req = (np.asarray(c, dtype=np.int64) for c in cols)
    return TokenTable("attention", start, num, kv, size, req)


def linear_table(stage: str, num_tokens: int, out_features: int, m_tile: int = DEFAULT_M_TILE,
                 n_tile: int = DEFAULT_N_TILE) -> TokenTable:
    """SmoothGEMM tiles of one linear op: M virtually padded to a multiple of
    `m_tile` (the last tile's ``token_num`` counts only its real rows), N cut
    into `n_tile` columns (the last one may be narrower)."""
    m_starts = np.arange(0, num_tokens, m_tile, dtype=np.int64)
    n_starts = np.arange(0, out_features, n_tile, dtype=np.int64)
    m, n = np.meshgrid(m_starts, n_starts, indexing="ij")
    m, n = m.ravel(), n.ravel()
    rows = np.minimum(m_tile, num_tokens - m)
    cols = np.minimum(n_tile, out_features - n)
    full = np.full_like(m, m_tile)
    return TokenTable(stage, m, rows, np.zeros_like(m), full, np.full_like(m, -1), n, cols)


def mirrored_order(num_tiles: int, num_cores: int) -> np.ndarray:
    """Core of the i-th tile dealt: 0,1,..,N-1, N-1,..,1,0, 0,1,.. (a snake)."""
    i = np.arange(num_tiles)
    pos, rnd = i % num_cores, (i // num_cores) % 2
    return np.where(rnd == 0, pos, num_cores - 1 - pos)


def _task_table(core_of: np.ndarray, run_order: np.ndarray, cost: np.ndarray, num_cores: int, heads: int) -> TaskTable:
    tiles = tuple(run_order[core_of[run_order] == c] for c in range(num_cores))
    load = np.bincount(core_of, weights=cost, minlength=num_cores).astype(np.float64)
    return TaskTable(tiles, load, heads)


def assign(table: TokenTable, num_cores: int = DEFAULT_CORES, heads: int = 1, refine: bool = True) -> TaskTable:
    """The Task-Table: units sorted by cost (largest first, stable) dealt in
    mirrored round-robin, then (with `refine`) a few swaps between the most
    and the least loaded core."""
    cost = np.repeat(table.cost, heads)
    order = np.argsort(-cost, kind="stable")
    core_of = np.empty(len(cost), dtype=np.int64)
    core_of[order] = mirrored_order(len(cost), num_cores)
    if refine:
        _rebalance(core_of, cost, num_cores)
    return _task_table(core_of, order, cost, num_cores, heads)


def _rebalance(core_of: np.ndarray, cost: np.ndarray, num_cores: int, max_rounds: int = 200) -> None:
    """Swap (or move) units between the most and least loaded cores while that lowers the maximum.

    The mirrored deal leaves the error of its last rounds on a few cores;
    with a few large prefill tiles among many small decode tiles that is
    5-10%. A swap of u (busiest core) with v (idlest core, or nothing) helps
    when 0 < cost[u] - cost[v] < gap; the best is closest to gap / 2.
    """
    load = np.bincount(core_of, weights=cost, minlength=num_cores).astype(np.float64)
    for _ in range(max_rounds):
        hi, lo = int(np.argmax(load)), int(np.argmin(load))
        gap = load[hi] - load[lo]
        if gap <= 0:
            return
        us = np.nonzero(core_of == hi)[0]
        vs = np.append(np.nonzero(core_of == lo)[0], -1)  # -1: move without a swap partner
        delta = cost[us][:, None] - np.where(vs >= 0, cost[vs], 0)[None, :]
        score = np.where((delta > 0) & (delta < gap), np.abs(delta - gap / 2), np.inf)
        if not np.isfinite(score).any():
            return
        i, j = np.unravel_index(int(np.argmin(score)), score.shape)
        u, v, d = us[i], vs[j], delta[i, j]
        core_of[u] = lo
        if v >= 0:
            core_of[v] = hi
        load[hi] -= d
        load[lo] += d


def contiguous_split(table: TokenTable, num_cores: int = DEFAULT_CORES, heads: int = 1) -> TaskTable:
    """The naive baseline: units in flattened-row order cut into `num_cores`
    runs of (nearly) equal unit count, as a static split of the batch would."""
    cost = np.repeat(table.cost, heads)
    core_of = (np.arange(len(cost)) * num_cores) // max(len(cost), 1)
    return _task_table(core_of, np.arange(len(cost)), cost, num_cores, heads)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """A step's decomposition: the attention Token-Table and its Task-Table."""

    attention: TokenTable
    tasks: TaskTable


def plan_step(query_start_loc, seq_lens, num_cores: int = DEFAULT_CORES, heads: int = 1,
              q_tiles: tuple[int, ...] = DEFAULT_Q_TILES) -> StepPlan:
    table = attention_table(query_start_loc, seq_lens, q_tiles)
    return StepPlan(table, assign(table, num_cores, heads))
