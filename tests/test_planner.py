"""The XY-Serve planner (infer.core.xy_plan): coverage, tile bounds, Task-Table, load balance, `infer plan`."""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from infer.core import xy_plan

Q_TILES = (16, 32, 64, 128)

# (q_len, cached) per request, mixed prefill chunks and decodes.
requests = st.lists(st.tuples(st.integers(0, 700), st.integers(0, 3000)), min_size=0, max_size=24)


def _batch(reqs):
    q = np.array([r[0] for r in reqs], np.int64)
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int64)
    return qsl, q + np.array([r[1] for r in reqs], np.int64)


@settings(max_examples=60, deadline=None)
@given(requests)
def test_every_token_is_covered_exactly_once(reqs):
    qsl, seq = _batch(reqs)
    table = xy_plan.attention_table(qsl, seq, Q_TILES)
    covered = np.zeros(int(qsl[-1]), np.int64)
    for s, n in zip(table.start, table.token_num):
        covered[s:s + n] += 1
    assert (covered == 1).all()


@settings(max_examples=60, deadline=None)
@given(requests)
def test_no_tile_exceeds_its_size_and_each_sees_its_last_rows_context(reqs):
    qsl, seq = _batch(reqs)
    table = xy_plan.attention_table(qsl, seq, Q_TILES)
    assert (table.token_num >= 1).all() and (table.token_num <= table.tile_size).all()
    assert set(table.tile_size.tolist()) <= set(Q_TILES)
    for s, n, kv, b in zip(table.start, table.token_num, table.kv_len, table.request):
        # the last row of the tile sits at position seq - q_len + (row - first row of the request)
        assert kv == seq[b] - (qsl[b + 1] - qsl[b]) + (s + n - qsl[b])
        assert qsl[b] <= s and s + n <= qsl[b + 1]


def test_decode_tokens_take_the_smallest_tile_and_prefills_the_largest_first():
    table = xy_plan.attention_table([0, 1, 301], [50, 300], Q_TILES)
    assert table.tile_size.tolist() == [16, 128, 128, 64]
    assert table.token_num.tolist() == [1, 128, 128, 44]
    assert table.kv_len.tolist() == [50, 128, 256, 300]


def test_mirrored_round_robin_deals_in_a_snake():
    assert xy_plan.mirrored_order(10, 4).tolist() == [0, 1, 2, 3, 3, 2, 1, 0, 0, 1]


@settings(max_examples=40, deadline=None)
@given(requests, st.integers(1, 24), st.integers(1, 4))
def test_task_table_assigns_every_unit_to_exactly_one_core(reqs, cores, heads):
    qsl, seq = _batch(reqs)
    table = xy_plan.attention_table(qsl, seq, Q_TILES)
    tasks = xy_plan.assign(table, cores, heads)
    units = np.concatenate(tasks.tiles) if tasks.tiles else np.array([], np.int64)
    assert sorted(units.tolist()) == list(range(len(table) * heads))
    np.testing.assert_allclose(tasks.load.sum(), table.cost.sum() * heads)


def _filled_step(rng, budget):
    """A step as continuous batching fills a token budget: many decodes plus prefill chunks."""
    reqs = [(1, int(c)) for c in rng.integers(16, 4000, int(rng.integers(16, 192)))]
    left = budget - len(reqs)
    while left > 0:
        n = int(min(left, rng.integers(32, 2048)))
        reqs.append((n, int(rng.integers(0, 4000))))
        left -= n
    return [reqs[i] for i in rng.permutation(len(reqs))]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1024, 4096))
def test_load_balance_within_5_percent_where_a_contiguous_split_is_off_by_30(seed, budget):
    qsl, seq = _batch(_filled_step(np.random.default_rng(seed), budget))
    table = xy_plan.attention_table(qsl, seq, Q_TILES)
    naive = xy_plan.contiguous_split(table, 20, heads=8)
    assume(naive.imbalance > 1.3)
    assert xy_plan.assign(table, 20, heads=8).imbalance <= 1.05


def test_smoothgemm_pads_m_virtually_and_covers_every_row_and_column_once():
    table = xy_plan.linear_table("qkv_proj", 300, 600, m_tile=128, n_tile=256)
    assert (table.tile_size == 128).all() and (table.token_num <= 128).all()
    assert sorted(set(table.token_num.tolist())) == [44, 128]  # 300 = 128 + 128 + 44 real rows
    grid = np.zeros((300, 600), np.int64)
    for s, n, c0, nc in zip(table.start, table.token_num, table.n_start, table.n_size):
        grid[s:s + n, c0:c0 + nc] += 1
    assert (grid == 1).all()


def test_infer_plan_prints_the_tables(capsys):
    from infer.cli import main

    assert main(["plan", "--reqs", "300:0,1:700,64:1200", "--cores", "4", "--heads", "2", "--linear", "o_proj:512"]) == 0
    out = capsys.readouterr().out
    for text in ("Token-Table: attention (3 requests, 365 tokens", "Task-Table: 4 cores", "load balance (max/mean)",
                 "Token-Table: o_proj (SmoothGEMM, M=365 padded to 384"):
        assert text in out


def test_imbalance_is_max_over_mean_load_and_one_for_an_idle_step():
    table = lambda load: xy_plan.TaskTable(tuple(np.arange(0) for _ in load), np.asarray(load, np.float64))  # noqa: E731
    assert table([0, 1]).imbalance == 2.0  # a mean below 1 is still a mean
    assert table([3, 1]).imbalance == 1.5
    assert table([0.25, 0.75, 0.5]).imbalance == 1.5
    assert table([2, 2]).imbalance == 1.0
    assert table([0, 0]).imbalance == 1.0  # nothing to run: balanced, not 0/0
    assert table([]).imbalance == 1.0


def _loads(core_of, cost, cores):
    return np.bincount(core_of, weights=cost, minlength=cores)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=30), st.integers(2, 5), st.data())
def test_rebalance_never_raises_the_maximum_and_stops_only_when_no_swap_or_move_helps(costs, cores, data):
    """The docstring's rule, checked on the real loads afterwards: no unit u of the busiest core and
    v of the idlest (or no v: a move) with 0 < cost[u] - cost[v] < gap is left, and the maximum
    never went up. Integer costs keep the arithmetic exact."""
    cost = np.asarray(costs, np.float64)
    core_of = np.asarray(data.draw(st.lists(st.integers(0, cores - 1), min_size=len(costs), max_size=len(costs))))
    before = _loads(core_of, cost, cores).max()
    xy_plan._rebalance(core_of, cost, cores, max_rounds=100_000)  # it ends well before: each step lowers sum(load**2)
    load = _loads(core_of, cost, cores)
    assert load.max() <= before
    hi, lo = int(np.argmax(load)), int(np.argmin(load))
    gap = load[hi] - load[lo]
    partners = np.append(cost[core_of == lo], 0.0)
    delta = cost[core_of == hi][:, None] - partners[None, :]
    assert not ((delta > 0) & (delta < gap)).any(), (load, core_of)


def test_rebalance_takes_the_swap_closest_to_half_the_gap():
    # core 0 holds a 1, core 1 a 4 and a 2 (gap 5): swapping the 4 with the 1 moves 3, closest to 2.5.
    core_of = np.array([0, 1, 1])
    xy_plan._rebalance(core_of, np.array([1.0, 4.0, 2.0]), 2)
    assert core_of.tolist() == [1, 0, 1]


def test_rebalance_moves_a_unit_when_the_idlest_core_has_none_to_swap():
    core_of = np.array([0, 0, 0])
    xy_plan._rebalance(core_of, np.array([1.0, 1.0, 1.0]), 3)
    assert sorted(core_of.tolist()) == [0, 1, 2]


def test_rebalance_makes_at_most_200_swaps_by_default():
    """The round cap bounds planning time: 400 equal units on one of two cores need exactly 200 moves
    to balance; 402 would need 201 and stop one short."""
    core_of = np.zeros(400, np.int64)
    xy_plan._rebalance(core_of, np.ones(400), 2)
    assert _loads(core_of, np.ones(400), 2).tolist() == [200, 200]
    core_of = np.zeros(402, np.int64)
    xy_plan._rebalance(core_of, np.ones(402), 2)
    assert _loads(core_of, np.ones(402), 2).tolist() == [202, 200]
    core_of = np.zeros(10, np.int64)
    xy_plan._rebalance(core_of, np.ones(10), 2, max_rounds=3)
    assert _loads(core_of, np.ones(10), 2).tolist() == [7, 3]


def test_rebalance_handles_fractional_costs():
    core_of = np.array([0, 0])
    xy_plan._rebalance(core_of, np.array([0.5, 0.5]), 2)  # gap 1.0, a move of 0.5 halves it
    assert sorted(core_of.tolist()) == [0, 1]


def test_rebalance_never_swaps_units_of_equal_cost():
    """Such a swap changes no load: the plan stays as dealt."""
    core_of = np.array([0, 1, 1])
    xy_plan._rebalance(core_of, np.array([2.0, 2.0, 2.0]), 2, max_rounds=1)
    assert core_of.tolist() == [0, 1, 1]
