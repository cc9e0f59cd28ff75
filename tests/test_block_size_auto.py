"""``--block-size auto``: each request uses blocks of 1, 2 or 4 pages, chosen by its
expected length, in one batch. Attention and kv_write with mixed block sizes are in
the conformance suite (cases ``mixed_block_sizes_*`` on every backend); here the
allocator, the step's tables, and greedy tokens equal to fixed block sizes and to
transformers."""

from __future__ import annotations

import numpy as np
import pytest
from test_engine import BACKENDS, VOCAB, generate, make_llm, tiny  # noqa: F401  (fixtures)

from infer.core.block_manager import BlockManager
from infer.core.engine import EngineArgs, LLMEngine
from infer.core.request import Request
from infer.core.sampling_params import SamplingParams
from infer.core.scheduler_output import ScheduledRequest, SchedulerOutput
from infer.primitives.types import expand_block_table

TIER = 1 << 22


def _request(rid: str, n: int, max_tokens: int) -> Request:
    return Request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens))


def _auto(num_blocks=64, block_size=4, caching=False) -> BlockManager:
    bm = BlockManager(num_blocks, block_size, caching, block_multiples=(1, 2, 4))
    bm.TOKENS_PER_BLOCK_TOKEN = 2  # 4-token pages: blocks of 16 from 32 expected tokens, of 8 from 16
    return bm


def test_block_size_follows_the_expected_length_in_aligned_runs():
    bm = _auto()
    short, mid, long = _request("s", 3, 4), _request("m", 5, 12), _request("l", 9, 40)
    for req in (short, mid, long):
        assert bm.allocate_slots(req, req.num_tokens)
    assert [bm.pages_per_block(r) for r in "sml"] == [1, 2, 4]
    assert len(bm.get_block_ids("s")) == 1 and len(bm.get_block_ids("m")) == 2 and len(bm.get_block_ids("l")) == 4
    bm.check_layout()
    long.num_computed_tokens = 9
    assert bm.allocate_slots(long, 8)  # 17 tokens: a second block of 16
    ids = bm.get_block_ids("l")
    assert len(ids) == 8 and ids[4] % 4 == 0 and ids[4:] == list(range(ids[4], ids[4] + 4))
    bm.check_layout()
    for r in "sml":
        bm.free(r)
    assert bm.num_free_blocks == 64 and not bm._pages
    bm.check_layout()


def test_a_request_without_a_free_run_falls_back_to_one_page_blocks():
    bm = _auto(num_blocks=8)
    # One page held in each group of four: 6 pages free, but no run of 4 and no run of 2 left whole.
    holders = [_request(f"h{i}", 1, 1) for i in range(8)]
    for h in holders:
        assert bm.allocate_slots(h, 1)
    for i in (0, 2, 3, 4, 6, 7):
        bm.free(f"h{i}")
    assert not bm._free_groups[4] and len(bm._free_groups[2]) == 2
    long = _request("l", 9, 40)
    assert bm.allocate_slots(long, 9)  # three pages, as with one-page blocks
    assert bm.pages_per_block("l") == 1 and len(bm.get_block_ids("l")) == 3 and bm.num_run_fallbacks == 1
    bm.check_layout()
    # A pool too full even for one-page blocks refuses, leaving everything as it was.
    big = _request("b", 16, 40)
    before = (bm.num_free_blocks, bm.num_run_fallbacks, dict(bm._free_groups[2]))
    assert not bm.allocate_slots(big, 16)
    assert (bm.num_free_blocks, bm.num_run_fallbacks, dict(bm._free_groups[2])) == before and "b" not in bm._pages


def test_a_prefix_hit_of_consecutive_pages_off_a_run_start_takes_one_page_blocks():
    """Pages 1 and 2 are consecutive but no run of 2 (runs start at even pages): a request
    hitting them that wants blocks of 2 pages must use one-page blocks, not treat page 1
    as the start of a run (which would read page 0, another request's)."""
    bm = _auto(num_blocks=16, caching=True)
    holder = _request("h", 1, 1)
    assert bm.allocate_slots(holder, 1)
    first = _request("a", 8, 1)  # expects 9 tokens: one-page blocks
    assert bm.allocate_slots(first, 8)
    assert bm.pages_per_block("a") == 1 and bm.get_block_ids("a") == [1, 2]
    first.num_computed_tokens = 8
    bm.cache_blocks(first)
    bm.free("a")
    again = _request("b", 12, 12)  # the same 8 tokens first; 24 expected tokens want blocks of 2 pages
    assert bm._wanted_pages(again) == 2
    hit, n = bm.get_computed_blocks(again)
    assert hit == [1, 2] and n == 8
    assert bm.allocate_slots(again, 4, hit)
    assert bm.pages_per_block("b") == 1 and bm.get_block_ids("b")[:2] == [1, 2] and 0 not in bm.get_block_ids("b")
    assert bm.num_run_fallbacks == 1
    bm.check_layout()


def test_prefix_hits_keep_big_blocks_when_they_are_whole_runs():
    bm = _auto(caching=True)
    first = _request("a", 33, 40)
    assert bm.allocate_slots(first, 33)
    first.num_computed_tokens = 33
    bm.cache_blocks(first)
    bm.free("a")
    again = _request("b", 40, 40)  # same 33 first tokens and more: 8 full pages hit, two runs of 4
    hit, n = bm.get_computed_blocks(again)
    assert n == 32
    assert bm.allocate_slots(again, 40 - n, hit)
    assert bm.pages_per_block("b") == 4 and bm.get_block_ids("b")[:8] == hit
    bm.check_layout()
    # A hit of 3 pages cannot be blocks of 2 or 4 pages: one-page blocks keep the hit.
    third = Request("c", list(range(3, 3 + 12)) + [1] * 30, SamplingParams(max_tokens=40))
    hit, n = bm.get_computed_blocks(third)
    assert n == 12 and bm.allocate_slots(third, third.num_tokens - n, hit)
    assert bm.pages_per_block("c") == 1 and bm.get_block_ids("c")[:3] == hit
    bm.check_layout()


def test_the_step_table_counts_each_request_in_its_own_blocks():
    bm = _auto()
    reqs = [_request("s", 3, 4), _request("m", 7, 12), _request("l", 21, 40)]
    scheduled = []
    for r in reqs:
        assert bm.allocate_slots(r, r.num_tokens)
        scheduled.append(ScheduledRequest(r.request_id, 0, r.num_tokens, r.all_token_ids, bm.block_table_row(r.request_id),
                                          True, r, 0, bm.pages_per_block(r.request_id)))
    meta = SchedulerOutput(scheduled, [], [], [], 4).model_input().attn_metadata
    assert meta.block_sizes.tolist() == [4, 8, 16]
    pages = expand_block_table(meta)
    assert pages.block_sizes is None
    for b, r in enumerate(reqs):
        ids = bm.get_block_ids(r.request_id)
        k = bm.pages_per_block(r.request_id)
        assert meta.block_table[b, : len(ids) // k].tolist() == [i // k for i in ids[::k]]
        need = -(-r.num_tokens // 4)  # the pages its context covers: what an expanded row holds
        assert pages.block_table[b, :need].tolist() == ids[:need]
    # Slots stay in pages: token p of a request sits in its page p // 4.
    starts = meta.query_start_loc
    for b, r in enumerate(reqs):
        ids = bm.get_block_ids(r.request_id)
        want = [ids[p // 4] * 4 + p % 4 for p in range(r.num_tokens)]
        assert meta.slot_mapping[starts[b] : starts[b + 1]].tolist() == want


def _mixed_prompts():
    rng = np.random.default_rng(11)
    lengths = [(5, 4), (40, 24), (9, 30), (70, 8), (3, 60), (25, 12)]  # (prompt, max_tokens)
    return [(rng.integers(3, VOCAB, n).tolist(), m) for n, m in lengths]


@pytest.fixture
def block_sizes_seen(monkeypatch):
    """The set of block sizes of every step that mixed them (8/16/32-token blocks from
    16/32/64 expected tokens, so the tiny model's short requests take all three)."""
    monkeypatch.setattr(BlockManager, "TOKENS_PER_BLOCK_TOKEN", 2)
    seen = []
    model_input = SchedulerOutput.model_input

    def recording(self):
        mi = model_input(self)
        if mi.attn_metadata.block_sizes is not None:
            seen.append(set(mi.attn_metadata.block_sizes.tolist()))
        return mi

    monkeypatch.setattr(SchedulerOutput, "model_input", recording)
    return seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_block_sizes_give_the_tokens_of_fixed_sizes_and_transformers(make_llm, tiny, backend, block_sizes_seen):
    seen = block_sizes_seen
    prompts = _mixed_prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in prompts]
    auto = make_llm(backend=backend, block_size="auto", max_model_len=160)
    got = generate(auto, [p for p, _ in prompts], params)
    assert any(s >= {8, 16, 32} for s in seen), "no step mixed all three block sizes"
    fixed = make_llm(backend=backend, block_size=16, max_model_len=160)
    assert got == generate(fixed, [p for p, _ in prompts], params)
    assert got == [tiny.greedy(p, m) for p, m in prompts]
    assert auto.engine.cache_config.block_size == 8 and auto.engine.cache_config.block_multiples == (1, 2, 4)


def test_auto_block_sizes_under_swap_preemption_and_prefix_hits(make_llm, tiny, block_sizes_seen):
    prompts = _mixed_prompts()
    shared = prompts[3][0][:48]
    texts = [p for p, _ in prompts] + [shared + [7, 9], shared + [5]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in prompts] + \
        [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 2
    # 22 pages of 8 tokens: the batch does not fit at once, so requests are swapped out and back.
    tight = make_llm(block_size="auto", max_model_len=160, num_gpu_blocks_override=22, kv_offload_bytes=TIER,
                     preemption_mode="swap")
    got = generate(tight, texts, params)
    assert got == [tiny.greedy(p, sp.max_tokens) for p, sp in zip(texts, params)]
    stats = tight.engine.scheduler.get_stats()
    assert stats.num_swapped_out > 0 and stats.prefix_cache.hits > 0
    assert any(len(s) > 1 for s in block_sizes_seen)


def test_block_size_auto_is_a_flag_and_other_words_are_refused(tiny):
    from infer.cli import build_parser

    args = build_parser().parse_args(["run", "--block-size", "auto", "x"])
    assert args.block_size == "auto" and build_parser().parse_args(["run", "--block-size", "32", "x"]).block_size == 32
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--block-size", "big", "x"])
    with pytest.raises(ValueError, match="block_size must be a positive integer.*or auto"):
        LLMEngine(EngineArgs(model=str(tiny.path), block_size="big", skip_tokenizer_init=True))


@pytest.mark.slow
def test_smollm2_greedy_with_auto_block_sizes_equals_block_size_16(block_sizes_seen, leak_check):
    from infer.core.llm import LLM

    texts = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea, "
             "there lived an old fisherman who", "Water boils at", "The three primary colors are red,"]
    max_tokens = [6, 64, 12, 36, 20]  # expected lengths across the 16/32/64-token thresholds
    outs = {}
    for size in ("auto", 16):
        llm = LLM("smollm2", backend="torch", dtype="float32", max_model_len=256, block_size=size)
        leak_check.append(llm.engine)
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        outs[size] = [o.outputs[0].token_ids for o in llm.generate(texts, params, use_tqdm=False)]
    assert outs["auto"] == outs[16]
    assert any(s >= {8, 16, 32} for s in block_sizes_seen), block_sizes_seen[:3]
