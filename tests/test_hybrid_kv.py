"""The hybrid KV cache (core/kv_groups.py): sliding-window layers keep a block table
of their own and give back the blocks their window has passed, while generation
stays what transformers computes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from tiny_models import random_model

from infer.core.block_manager import HybridBlockManager, cdiv
from infer.core.kv_groups import blocks_for, plan_kv_groups
from infer.core.llm import LLM
from infer.core.request import Request
from infer.core.sampling_params import SamplingParams

WINDOW = 8


def test_layers_split_into_groups_of_the_smallest_kind():
    # Gemma 3 1B: 26 layers, every sixth full: 4 full, 22 windowed -> groups of 4 layers
    windows = {i: None if (i + 1) % 6 == 0 else 512 for i in range(26)}
    g = plan_kv_groups(windows)
    assert g.num_slots == 4 and g.windows == (None,) + (512,) * 6
    assert [i for i in range(26) if g.layer_group[i] == 0] == [5, 11, 17, 23]
    assert [g.layer_slot[i] for i in (5, 11, 17, 23)] == [0, 1, 2, 3]
    assert sorted(i for i in range(26) if g.layer_group[i] == 6) == [24, 25]  # the last windowed group holds 2
    for kind in range(7):  # no two layers of one group share a tensor
        slots = [g.layer_slot[i] for i in range(26) if g.layer_group[i] == kind]
        assert len(slots) == len(set(slots))
    assert g.is_hybrid and "1 full group, 6 window-512 groups of 4 layers" == g.describe()
    # alternating (Gemma 2, gpt-oss): two groups, each of half the layers
    alt = plan_kv_groups({i: 4096 if i % 2 == 0 else None for i in range(4)})
    assert alt.num_slots == 2 and alt.windows == (None, 4096)
    # one kind: full is the plain cache; a window everywhere is one group that frees blocks
    assert not plan_kv_groups(dict.fromkeys(range(3))).is_hybrid
    assert plan_kv_groups(dict.fromkeys(range(3), 7)).windows == (7,)
    plain = plan_kv_groups(windows, hybrid=False)
    assert plain.windows == (None,) and plain.num_slots == 26


def test_capacity_of_a_gemma3_shaped_cache_at_32k():
    """The issue's figure: 5 windowed layers to 1 full, window 1024, 32k contexts:
    requests one pool holds with per-group tables against every layer keeping
    every block (same bytes: a page is a group's layers, a plain block all of them)."""
    layers, window, context, bs, chunk = 48, 1024, 32768, 16, 2048
    groups = plan_kv_groups({i: None if (i + 1) % 6 == 0 else window for i in range(layers)})
    pool_layer_tokens = 200 * context * layers  # room for 200 plain contexts
    plain = pool_layer_tokens // (cdiv(context, bs) * bs * layers)
    pages = pool_layer_tokens // (bs * groups.num_slots)
    hybrid = pages // blocks_for(groups.windows, context, bs, chunk)
    assert plain == 200 and hybrid / plain >= 3, (plain, hybrid)


def _gemma3(**extra):
    """Gemma 3 with five windowed layers to one full, as the released models."""
    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    return random_model("Gemma3TextConfig", "Gemma3ForCausalLM", **{**dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW, layer_types=kinds, vocab_size=211,
        pad_token_id=0, max_position_embeddings=4096), **extra})[0]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    model = _gemma3()
    path = tmp_path_factory.mktemp("gemma3-5to1")
    model.save_pretrained(path)
    return model, str(path)


def _reference(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


PROMPTS = [np.random.default_rng(5).integers(3, 211, n).tolist() for n in (45, 9, 30)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_a_context_far_past_the_window_holds_fewer_blocks_and_equals_transformers(gemma3, leak_check):
    model, path = gemma3
    llm = LLM(path, skip_tokenizer_init=True, backend="torch", dtype="float32", block_size=4, max_model_len=128)
    leak_check.append(llm.engine)
    engine, bm = llm.engine, llm.engine.scheduler.block_manager
    assert isinstance(bm, HybridBlockManager) and bm.windows == (None,) + (WINDOW,) * 5
    assert engine.worker.runner.kv_groups.num_slots == 1
    engine.add_request("r", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    held, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
        for rid, req in engine.scheduler.requests.items():  # the request's sequence
            held.append((bm.blocks_held(rid), req.num_computed_tokens))
    assert tokens == _reference(model, PROMPTS[0], 24)
    blocks, computed = held[-1]
    n = computed + 1  # the table also covers the token the last step computes
    # the full group keeps every block; each windowed group its window's blocks (at most three of 4 tokens)
    assert blocks <= cdiv(n, 4) + 5 * 3, held
    # every layer keeping every block: six layers' pages for each of cdiv(n, 4) blocks
    assert 6 * cdiv(n, 4) >= 2.5 * blocks, (blocks, n)


@pytest.mark.parametrize("backend", ["torch", "cpu_ref"])
@pytest.mark.parametrize("case", ["prefix-hit", "swap", "block-size-auto", "fork", "plain"])
def test_features_keep_working_on_the_hybrid_cache(gemma3, leak_check, backend, case):
    model, path = gemma3
    kw = dict(skip_tokenizer_init=True, backend=backend, dtype="float32", max_model_len=128, max_num_seqs=4)
    if case == "swap":  # a pool too small for the three at once: requests swap to the host tier and back
        kw.update(block_size=4, num_gpu_blocks_override=70, max_num_batched_tokens=16, kv_offload_bytes=1 << 22,
                  preemption_mode="swap")
    elif case == "block-size-auto":
        kw.update(block_size="auto")
    elif case == "plain":
        kw.update(block_size=4, disable_hybrid_kv_cache_manager=True)
    else:
        kw.update(block_size=4)
    llm = LLM(path, **kw)
    leak_check.append(llm.engine)
    bm = llm.engine.scheduler.block_manager
    assert isinstance(bm, HybridBlockManager) != (case == "plain")
    expect = [_reference(model, p, 24) for p in PROMPTS]
    if case == "fork":  # n=2 greedy children share their prompt's blocks, then copy on write
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2), use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[e, e] for e in expect]
        return
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expect
    if case == "prefix-hit":
        # the first prompt again, then longer: the full group hits its blocks, windowed groups the window's
        longer = PROMPTS[0] + PROMPTS[2]
        before = bm.prefix_cache_stats.hits
        outs = llm.generate([{"prompt_token_ids": longer}], GREEDY, use_tqdm=False)
        assert bm.prefix_cache_stats.hits - before >= 40
        assert outs[0].outputs[0].token_ids == _reference(model, longer, 24)
    if case == "swap":
        assert llm.engine.scheduler.num_swapped_out > 0


# -- the per-group tables under random admissions, growth, forks, swaps and frees ---------


class HybridMachine(RuleBasedStateMachine):
    """Drives a hybrid manager as a scheduler would, writing (group, token) into a fake
    cache of pages, and checks that each group reads back its request's tokens where
    its layers can still look: every position for a full group, the window for a
    windowed one; blocks behind a window are given back."""

    @initialize(num_blocks=st.integers(2, 24), block_size=st.sampled_from([1, 2, 3]), caching=st.booleans(),
                windows=st.sampled_from([(None, 3), (None, 2, 2), (4,), (None, 5, 1)]),
                multiples=st.sampled_from([(1,), (1, 2)]), tier=st.sampled_from([0, 6]))
    def setup(self, num_blocks, block_size, caching, windows, multiples, tier):
        self.bm = HybridBlockManager(num_blocks, block_size, caching, tier, multiples, windows)
        self.kv = np.full((num_blocks, block_size, 2), -1)
        self.tier = {}  # tier slot -> page contents
        self.live: dict[str, Request] = {}
        self.swapped: set[str] = set()
        self.pending: dict[str, int] = {}
        self.ids = itertools.count()

    def _apply_moves(self):
        for op in self.bm.pop_tier_ops():
            if op.kind == "out":
                self.tier[op.slot] = self.kv[op.block].copy()
            else:
                self.kv[op.block] = self.tier[op.slot]
        for src, dst in self.bm.pop_block_copies():
            self.kv[dst] = self.kv[src]

    def _allocate(self, req, n, hit=None) -> bool:
        if not self.bm.allocate_slots(req, n, hit):
            return False
        self._apply_moves()
        bs = self.bm.block_size
        start = req.num_computed_tokens + (len(hit[0]) * bs if hit else 0)
        for g in self.bm.groups:
            table, k = g.get_block_ids(req.request_id), g.pages_per_block(req.request_id)
            first = g.first_needed_block(req.num_computed_tokens + (len(hit[0]) * bs if hit else 0))
            assert all(b is None for b in g.req_to_blocks[req.request_id][: first // k * k]), \
                "a block behind the window is kept"
            for pos in range(start, start + n):
                self.kv[table[pos // bs], pos % bs] = (g.group, req.all_token_ids[pos])
        return True

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=12), data=st.data())
    def admit(self, tokens, data):
        req = Request(f"q{next(self.ids)}", tokens)
        hit, num_hit = self.bm.get_computed_blocks(req)
        self._apply_moves()
        n = data.draw(st.integers(1, req.num_tokens - num_hit))
        if self._allocate(req, n, hit):
            req.num_computed_tokens = num_hit
            self.live[req.request_id], self.pending[req.request_id] = req, n
        else:
            assert req.request_id not in self.bm.req_to_blocks

    @precondition(lambda self: set(self.live) - self.swapped)
    @rule(data=st.data())
    def grow(self, data):
        req = self.live[data.draw(st.sampled_from(sorted(set(self.live) - self.swapped)))]
        req.num_computed_tokens += self.pending.pop(req.request_id)
        self.pending[req.request_id] = 0
        self.bm.cache_blocks(req)
        if req.num_uncomputed_tokens == 0:
            req.append_output_token(data.draw(st.integers(0, 1)))
        n = data.draw(st.integers(1, req.num_uncomputed_tokens))
        if self._allocate(req, n):
            self.pending[req.request_id] = n

    @precondition(lambda self: set(self.live) - self.swapped)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.live[data.draw(st.sampled_from(sorted(set(self.live) - self.swapped)))]
        child = parent.fork(f"q{next(self.ids)}")
        self.bm.fork(parent.request_id, child.request_id)
        self.live[child.request_id] = child
        self.pending[child.request_id] = self.pending[parent.request_id]

    @precondition(lambda self: set(self.live) - self.swapped)
    @rule(data=st.data())
    def swap_out(self, data):
        rid = data.draw(st.sampled_from(sorted(set(self.live) - self.swapped)))
        req = self.live[rid]
        req.num_computed_tokens += self.pending[rid]  # a swapped request's tokens are all computed
        self.pending[rid] = 0
        self.bm.cache_blocks(req)
        if self.bm.swap_out(rid):
            self._apply_moves()
            self.swapped.add(rid)
            assert rid not in self.bm.req_to_blocks and self.bm.is_swapped(rid)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        need = self.bm.resume_need(self.live[rid], 0)
        if need > self.bm.num_free_blocks:
            return
        assert self.bm.swap_in(rid)
        self._apply_moves()
        self.swapped.discard(rid)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.bm.free(rid)
        self.swapped.discard(rid)
        del self.live[rid], self.pending[rid]
        assert not self.bm.is_swapped(rid)

    @invariant()
    def ref_counts_are_exact_and_pool_adds_up(self):
        holders: dict[int, int] = {}
        for g in self.bm.groups:
            for rid in self.live:
                for b in g.req_to_blocks.get(rid, ()):
                    if b is not None:
                        holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for block in self.bm.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0)
            assert (block.ref_cnt == 0) == (block.block_id in self.bm.free_block_queue)
        assert set(self.bm.req_to_blocks) == set(self.live) - self.swapped
        self.bm.check_layout()

    @invariant()
    def each_group_reads_its_tokens_where_it_can_look(self):
        bs = self.bm.block_size
        for rid, req in self.live.items():
            if rid in self.swapped:
                continue
            n = req.num_computed_tokens + self.pending[rid]
            for g in self.bm.groups:
                table, row = g.get_block_ids(rid), g.block_table_row(rid).tolist()
                assert row == table and len(table) >= cdiv(n, bs)
                first = g.first_needed_block(req.num_computed_tokens)
                blocks = g.req_to_blocks[rid]
                assert all(b is not None for b in blocks[first:]), "a block the window reads was dropped"
                for p in range(first * bs, n):
                    assert tuple(self.kv[table[p // bs], p % bs]) == (g.group, req.all_token_ids[p])


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_infer_backends_reports_the_hybrid_capacity(gemma3, capsys, monkeypatch):
    from infer.cli import main

    monkeypatch.setenv("COLUMNS", "400")
    rows = {}
    for flags in ([], ["--disable-hybrid-kv-cache-manager"]):
        assert main(["backends", "--model", gemma3[1], "--kv-cache-memory", str(8 << 20), "--max-model-len", "4096",
                     "--block-size", "16", *flags]) == 0
        out = capsys.readouterr().out.split("KV capacity")[1]
        rows[bool(flags)] = next(line for line in out.splitlines() if line.startswith("│ torch "))
    assert "hybrid: 1 full group, 5 window-8 groups of 1 layer" in rows[False] and "hybrid" not in rows[True]
    hybrid, plain = (float(rows[k].rstrip(" │").rsplit("│", 1)[1]) for k in (False, True))
    # float32 KV of one 32-dim head: 256 bytes a layer-token. Every layer keeping every block: 8 MiB hold
    # 341 blocks of 16 tokens of 6 layers, 1.33 contexts of 4096; the hybrid cache 2048 one-layer pages, a
    # context needing 256 for the full layer and, for each windowed one, its window and a step of 2048
    # tokens (the default budget) in 130
    assert plain == pytest.approx((8 << 20) // (256 * 6 * 16) * 16 / 4096, abs=0.006)
    assert hybrid == pytest.approx(2048 / (256 + 5 * 130), abs=0.006)


def test_a_hit_stops_where_a_windowed_group_lost_a_block_its_window_needs():
    """The full group still holds a whole prefix while the windowed group's copy of a
    block inside the window was evicted: the hit is the longest prefix both can take."""
    bm = HybridBlockManager(16, 2, enable_prefix_caching=True, windows=(None, 2))
    first = Request("a", list(range(9)))
    assert bm.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    bm.cache_blocks(first)
    bm.free("a")
    windowed = bm.groups[1]
    evicted = windowed.cached_block_hash_to_block.pop(windowed._key(first.block_hashes[3]))
    evicted.block_hash = None  # as if its page was taken for other tokens
    again = Request("b", list(range(9)) + [50, 51])
    hits, num_hit = bm.get_computed_blocks(again)
    # The full group has blocks 0-3 cached; a hit of all 4 (8 tokens) needs the windowed group's block 3,
    # gone; a hit of 3 (6 tokens) needs only its block 2
    assert num_hit == 6 and len(hits[0]) == 3 and hits[1][:2] == [None, None] and hits[1][2] is not None
    assert bm.allocate_slots(again, len(again.all_token_ids) - num_hit, hits)
    bm.free("b")
    assert bm.num_free_blocks == bm.num_blocks
