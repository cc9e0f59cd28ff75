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
