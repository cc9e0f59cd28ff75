"""The planner's default attention tiles: the shapes the fixed-shape kernel is built for."""

from __future__ import annotations

from infer.core import xy_plan


def test_default_tiles_put_a_decode_row_in_16_and_cut_a_long_prefill_by_the_largest():
    table = xy_plan.attention_table([0, 1, 301], [50, 300])  # a decode row, then a 300-row prefill
    assert table.tile_size.tolist() == [16, 128, 128, 64]
    assert table.token_num.tolist() == [1, 128, 128, 44]


def test_the_naive_split_deals_each_tile_once_by_default():
    table = xy_plan.attention_table([0, 1, 301], [50, 300])
    split = xy_plan.contiguous_split(table, num_cores=2)
    assert split.heads == 1 and sorted(u for core in split.tiles for u in core.tolist()) == [0, 1, 2, 3]
    assert split.load.sum() == table.cost.sum()


def test_default_tiles_hold_each_size_exactly_and_the_next_row_takes_the_next_size():
    # q_len 16, 17, 32, 33, 64, 65 (each request's context is its own rows)
    q = [16, 17, 32, 33, 64, 65]
    qsl = [0]
    for n in q:
        qsl.append(qsl[-1] + n)
    table = xy_plan.attention_table(qsl, q)
    assert table.tile_size.tolist() == [16, 32, 32, 64, 64, 128]
    assert table.token_num.tolist() == q
    assert table.request.tolist() == list(range(len(q)))


def test_a_tiles_cost_is_its_fixed_shape_times_its_context_or_its_columns():
    attn = xy_plan.attention_table([0, 1, 21], [50, 30])  # a decode row with 50 of context, a 20-row prefill
    assert attn.cost.tolist() == [16 * 50, 32 * 30]
    lin = xy_plan.linear_table("qkv", 200, 600)  # default tiles: 128 rows (padded) x 256 columns
    assert lin.n_start.tolist() == [0, 256, 512, 0, 256, 512]
    assert lin.n_size.tolist() == [256, 256, 88, 256, 256, 88]
    assert lin.token_num.tolist() == [128, 128, 128, 72, 72, 72]
    assert lin.cost.tolist() == [128 * 256, 128 * 256, 128 * 88] * 2
    assert lin.request.tolist() == [-1] * 6 and lin.kv_len.tolist() == [0] * 6


def test_default_plan_deals_one_unit_per_tile_to_20_cores():
    """One head group unless asked (a TaskTable, assign and plan_step alike), 20 cores (a 910B's)."""
    table = xy_plan.attention_table([0, 1, 301], [50, 300])
    for tasks in (xy_plan.assign(table), xy_plan.plan_step([0, 1, 301], [50, 300]).tasks):
        assert tasks.num_cores == 20 and tasks.heads == 1
        assert sorted(u for core in tasks.tiles for u in core.tolist()) == [0, 1, 2, 3]
    assert xy_plan.TaskTable((), xy_plan.np.zeros(0)).heads == 1
