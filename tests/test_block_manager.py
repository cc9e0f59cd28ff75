"""The paged KV block manager: pool, ref counts, prefix caching, copy-on-write."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from infer.core.block_manager import BlockManager, cdiv, hash_block_tokens, root_hash
from infer.core.request import Request

_ids = itertools.count()


def make(tokens, salt=None) -> Request:
    return Request(f"r{next(_ids)}", list(tokens), cache_salt=salt)


def admit(bm: BlockManager, req: Request, num_tokens: int | None = None) -> bool:
    """Take the prefix-cache hit and allocate; on success the tokens count as computed."""
    hit, num_hit = bm.get_computed_blocks(req)
    n = (req.num_tokens - num_hit) if num_tokens is None else num_tokens
    if not bm.allocate_slots(req, n, hit):
        return False
    req.num_computed_tokens = num_hit + n
    bm.cache_blocks(req)
    return True


def test_blocks_are_allocated_on_demand_as_a_request_grows():
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make(range(5))
    assert admit(bm, req, 3)
    assert len(bm.get_block_ids(req.request_id)) == 1
    assert bm.allocate_slots(req, 2)  # tokens 3..4 cross into a second block
    assert len(bm.get_block_ids(req.request_id)) == 2
    assert bm.num_used_blocks == 2 and bm.num_free_blocks == 6


def test_allocation_failure_returns_false_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    req = make(range(9))
    assert bm.allocate_slots(req, 9) is False
    assert bm.num_free_blocks == 2 and bm.get_block_ids(req.request_id) == []


def test_free_returns_every_block_to_the_pool():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    reqs = [make([i, i, i]) for i in range(2)]
    assert all(admit(bm, r) for r in reqs)
    for r in reqs:
        bm.free(r.request_id)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0


def test_identical_prompt_hits_the_cached_full_blocks():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = make(range(10))
    assert admit(bm, first)
    hit, num_hit = bm.get_computed_blocks(make(range(10)))
    assert num_hit == 8 and hit == bm.get_block_ids(first.request_id)[:2]


def test_last_prompt_token_is_never_a_cache_hit():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    assert admit(bm, make(range(8)))
    # Both blocks are cached, but taking both would leave nothing to compute.
    _, num_hit = bm.get_computed_blocks(make(range(8)))
    assert num_hit == 4


def test_partial_blocks_are_not_cached():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    assert admit(bm, make(range(7)))
    assert len(bm.cached_block_hash_to_block) == 1


def test_cache_salt_separates_prefixes():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    assert admit(bm, make(range(10), salt="tenant-a"))
    assert bm.get_computed_blocks(make(range(10), salt="tenant-b"))[1] == 0
    assert bm.get_computed_blocks(make(range(10), salt="tenant-a"))[1] == 8


def test_block_hash_chains_its_parent():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    assert admit(bm, make([1, 2, 5, 6, 0]))
    # Same second block, different first block: no hit for either.
    assert bm.get_computed_blocks(make([3, 4, 5, 6, 0]))[1] == 0
    h0 = hash_block_tokens(root_hash(None), [1, 2])
    assert hash_block_tokens(h0, [5, 6]) in bm.cached_block_hash_to_block


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2)
    assert admit(bm, make(range(6)))
    assert bm.get_computed_blocks(make(range(6))) == ([], 0)
    assert not bm.cached_block_hash_to_block


def test_freed_prefix_is_evicted_tail_first():
    bm = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    req = make([1, 2, 3, 4, 5, 6, 7])
    assert bm.allocate_slots(req, 6)
    req.num_computed_tokens = 6
    bm.cache_blocks(req)
    head, middle, tail = bm.get_block_ids(req.request_id)
    bm.free(req.request_id)
    # One new block evicts the prefix's last block; its first two still hit.
    newcomer = make([9])
    assert admit(bm, newcomer)
    assert bm.get_block_ids(newcomer.request_id) == [tail]
    assert bm.get_computed_blocks(make([1, 2, 3, 4, 5, 6, 7]))[0] == [head, middle]


def test_blocks_without_a_hash_are_reused_before_cached_ones():
    bm = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    cached, plain = make([1, 2, 3]), make([7])
    assert admit(bm, cached) and admit(bm, plain)
    plain_block = bm.get_block_ids(plain.request_id)[0]
    bm.free(cached.request_id)
    bm.free(plain.request_id)
    newcomer = make([8])
    assert admit(bm, newcomer)
    assert bm.get_block_ids(newcomer.request_id) == [plain_block]
    assert bm.get_computed_blocks(make([1, 2, 3]))[1] == 2


def test_hit_on_a_free_cached_block_counts_against_the_free_pool():
    bm = BlockManager(num_blocks=2, block_size=2, enable_prefix_caching=True)
    first = make([1, 2, 3])
    assert admit(bm, first)
    bm.free(first.request_id)
    # Hit of 1 block (free, cached) + 2 new blocks > 2 free blocks.
    again = make([1, 2, 3, 4, 5])
    hit, num_hit = bm.get_computed_blocks(again)
    assert num_hit == 2
    assert bm.allocate_slots(again, 3, hit) is False
    assert bm.num_free_blocks == 2 and bm.blocks[hit[0]].block_hash is not None


def test_fork_shares_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make(range(6))
    assert admit(bm, parent)
    bm.fork(parent.request_id, "child")
    assert bm.get_block_ids("child") == bm.get_block_ids(parent.request_id)
    assert all(bm.blocks[b].ref_cnt == 2 for b in bm.get_block_ids("child"))
    assert bm.num_used_blocks == 2


def test_write_into_a_shared_partial_block_copies_it_first():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make(range(6))
    assert admit(bm, parent)
    child = parent.fork("child")
    bm.fork(parent.request_id, child.request_id)
    full, partial = bm.get_block_ids(parent.request_id)
    assert bm.allocate_slots(child, 1)  # writes position 6, inside the shared partial block
    (src, dst), = bm.pop_block_copies()
    assert src == partial and bm.get_block_ids(child.request_id) == [full, dst]
    assert bm.blocks[partial].ref_cnt == 1 and bm.blocks[full].ref_cnt == 2
    # The parent now holds the partial block alone and writes in place.
    assert bm.allocate_slots(parent, 1) and bm.pop_block_copies() == []


def test_fork_at_a_block_boundary_needs_no_copy():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make(range(8))
    assert admit(bm, parent)
    child = parent.fork("child")
    bm.fork(parent.request_id, child.request_id)
    assert bm.allocate_slots(child, 1) and bm.allocate_slots(parent, 1)
    assert bm.pop_block_copies() == []


def test_copy_on_write_fails_cleanly_when_the_pool_is_empty():
    bm = BlockManager(num_blocks=2, block_size=4)
    parent = make(range(6))
    assert admit(bm, parent)
    bm.fork(parent.request_id, "child")
    assert bm.allocate_slots(parent.fork("child"), 1) is False
    assert bm.pop_block_copies() == [] and bm.num_free_blocks == 0


def test_copy_into_a_block_freed_in_the_same_step_is_dropped():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make(range(6))
    assert admit(bm, parent)
    child = parent.fork("child")
    bm.fork(parent.request_id, child.request_id)
    assert bm.allocate_slots(child, 1)
    bm.free(child.request_id)  # e.g. preempted later in the same schedule()
    assert bm.pop_block_copies() == []


def test_usage_and_prefix_cache_stats():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    assert admit(bm, make(range(10)))
    assert admit(bm, make(range(10)))
    assert bm.num_used_blocks == 4 and bm.usage == 0.4  # 3 + the second's 1 fresh block
    stats = bm.prefix_cache_stats
    assert (stats.queries, stats.hits) == (20, 8) and stats.hit_rate == 0.4


# -- invariants under random allocate / grow / fork / free -------------------------


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives the manager as a scheduler would, writing tokens into a fake KV cache
    (block_id, offset) -> token id, and checks that every request reads back
    exactly its own tokens through its block table."""

    @initialize(num_blocks=st.integers(1, 10), block_size=st.sampled_from([1, 2, 3]), caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.kv = np.full((num_blocks, block_size), -1)
        self.live: dict[str, Request] = {}
        self.pending: dict[str, int] = {}  # tokens allocated and written, not yet marked computed
        self.family: dict[str, int] = {}
        self.ids = itertools.count()  # per run: hypothesis replays must draw alike
        self.prompts: list[list[int]] = []  # every admitted prompt (later ones may start with one)

    def _allocate(self, req, n, hit=()) -> bool:
        if not self.bm.allocate_slots(req, n, hit):
            return False
        for src, dst in self.bm.pop_block_copies():
            self.kv[dst] = self.kv[src]
        bs, table = self.bm.block_size, self.bm.get_block_ids(req.request_id)
        start = req.num_computed_tokens + len(hit) * bs
        for pos in range(start, start + n):
            self.kv[table[pos // bs], pos % bs] = req.all_token_ids[pos]
        return True

    # Prompts over {0, 1} so prefixes repeat and the prefix cache hits.
    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=10), salt=st.sampled_from([None, "s"]), data=st.data())
    def admit(self, tokens, salt, data):
        self._admit(Request(f"q{next(self.ids)}", tokens, cache_salt=salt), data)

    def _admit(self, req, data):
        self.prompts.append(list(req.prompt_token_ids))
        hit, num_hit = self.bm.get_computed_blocks(req)
        assert num_hit < req.num_tokens
        n = data.draw(st.integers(1, req.num_tokens - num_hit))
        if self._allocate(req, n, hit):
            req.num_computed_tokens = num_hit
            self.live[req.request_id], self.pending[req.request_id] = req, n
            self.family[req.request_id] = len(self.family)
        else:
            assert req.request_id not in self.bm.req_to_blocks

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def grow(self, data):
        req = self.live[data.draw(st.sampled_from(list(self.live)))]
        req.num_computed_tokens += self.pending.pop(req.request_id)
        self.pending[req.request_id] = 0
        self.bm.cache_blocks(req)
        if req.num_uncomputed_tokens == 0:
            req.append_output_token(data.draw(st.integers(0, 4)))
        n = data.draw(st.integers(1, req.num_uncomputed_tokens))
        if self._allocate(req, n):
            self.pending[req.request_id] = n

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.live[data.draw(st.sampled_from(list(self.live)))]
        child = parent.fork(f"q{next(self.ids)}")
        self.bm.fork(parent.request_id, child.request_id)
        self.live[child.request_id] = child
        self.pending[child.request_id] = self.pending[parent.request_id]
        self.family[child.request_id] = self.family[parent.request_id]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(list(self.live)))
        self.bm.free(rid)
        del self.live[rid], self.pending[rid]

    @invariant()
    def ref_counts_are_exact_and_pool_adds_up(self):
        holders: dict[int, list[str]] = {}
        for rid in self.live:
            table = self.bm.get_block_ids(rid)
            assert len(table) == len(set(table)), "a block twice in one table"
            row = self.bm.block_table_row(rid)
            assert row.dtype == np.int32 and row.tolist() == table, "the int32 row the step copies lags the table"
            for b in table:
                holders.setdefault(b, []).append(rid)
        for block in self.bm.blocks:
            assert block.ref_cnt == len(holders.get(block.block_id, []))
            assert (block.ref_cnt == 0) == (block.block_id in self.bm.free_block_queue)
            owners = holders.get(block.block_id, [])
            if block.block_hash is None and len(owners) > 1:
                assert len({self.family[r] for r in owners}) == 1, "unrelated requests share a mutable block"
        assert self.bm.num_free_blocks + self.bm.num_used_blocks == self.bm.num_blocks
        assert set(self.bm.req_to_blocks) == set(self.live)

    @invariant()
    def cached_hashes_are_consistent(self):
        cached = self.bm.cached_block_hash_to_block
        for h, block in cached.items():
            assert block.block_hash == h
        assert sum(b.block_hash is not None for b in self.bm.blocks) == len(cached)
        if not self.bm.enable_prefix_caching:
            assert not cached
        for rid, req in self.live.items():
            for i, b in enumerate(self.bm.get_block_ids(rid)):
                h = self.bm.blocks[b].block_hash
                if h is not None:
                    assert h == self.bm.block_hashes(req, i + 1)[i], "cached block named by other tokens"

    @invariant()
    def every_request_reads_back_its_own_tokens(self):
        bs = self.bm.block_size
        for rid, req in self.live.items():
            table, n = self.bm.get_block_ids(rid), req.num_computed_tokens + self.pending[rid]
            assert len(table) == cdiv(n, bs)
            read = [int(self.kv[table[p // bs], p % bs]) for p in range(n)]
            assert read == req.all_token_ids[:n]

    @invariant()
    def shared_blocks_hold_the_same_tokens_for_every_holder(self):
        # Catches a write into a shared block even when the token written happens
        # to be the one a relative would read there.
        bs, seen = self.bm.block_size, {}
        for rid, req in self.live.items():
            n = req.num_computed_tokens + self.pending[rid]
            for i, b in enumerate(self.bm.get_block_ids(rid)):
                content = tuple(req.all_token_ids[i * bs : min(n, (i + 1) * bs)])
                assert seen.setdefault(b, content) == content


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
test_block_manager_invariants = BlockManagerMachine.TestCase


class MixedBlockSizesMachine(BlockManagerMachine):
    """The same scheduler-like drive with ``--block-size auto``: requests take blocks of
    1, 2 or 4 pages (by their length here), and the free-run bookkeeping and every
    request's aligned runs are checked after each step."""

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 3]), caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        super().setup(num_blocks, block_size, caching)
        self.bm = BlockManager(num_blocks, block_size, caching, block_multiples=(1, 2, 4))
        self.bm._wanted_pages = lambda req: (1, 2, 4)[req.num_tokens % 3]

        self.wants: dict[str, int] = {}  # pages per block a request asks for, where a rule chose
        self.bm._wanted_pages = lambda req: self.wants.get(req.request_id, (1, 2, 4)[req.num_tokens % 3])

    @precondition(lambda self: self.prompts and self.bm.enable_prefix_caching)
    @rule(data=st.data(), more=st.lists(st.integers(0, 1), min_size=1, max_size=8), pages=st.sampled_from([1, 2, 4]))
    def admit_on_an_earlier_prompt(self, data, more, pages):
        """A prompt that starts with an earlier one, asking for blocks of 1, 2 or 4 pages: its
        prefix hit is pages wherever the earlier request got them, consecutive or not,
        aligned to a run or not (a hit of consecutive pages off a run's start must fall
        back to one-page blocks, not read its neighbours)."""
        prefix = data.draw(st.sampled_from(self.prompts))
        req = Request(f"q{next(self.ids)}", prefix + more)
        self.wants[req.request_id] = pages
        self._admit(req, data)

    @precondition(lambda self: self.bm.enable_prefix_caching)
    @rule(data=st.data(), prompt=st.lists(st.integers(0, 1), min_size=2, max_size=10),
          more=st.lists(st.integers(0, 1), min_size=1, max_size=4), pages=st.sampled_from([2, 4]),
          shift=st.integers(0, 3))
    def hit_pages_that_one_page_blocks_wrote(self, data, prompt, more, pages, shift):
        """A request of one-page blocks computes a prompt in pages wherever the free queue
        puts them (consecutive, and after `shift` one-page requests not at a run's start),
        then a request wanting blocks of `pages` pages starts with that prompt and hits them."""
        for _ in range(shift):
            spacer = Request(f"q{next(self.ids)}", [2])  # a token no prompt shares: never a hit
            self.wants[spacer.request_id] = 1
            self._admit(spacer, data)
        first = Request(f"q{next(self.ids)}", prompt)
        self.wants[first.request_id] = 1
        self._admit(first, data)
        if first.request_id in self.live:
            first.num_computed_tokens += self.pending[first.request_id]
            self.pending[first.request_id] = 0
            self.bm.cache_blocks(first)
        second = Request(f"q{next(self.ids)}", prompt + more)
        self.wants[second.request_id] = pages
        self._admit(second, data)

    @invariant()
    def every_request_reads_back_its_own_tokens(self):
        self.bm.check_layout()
        bs = self.bm.block_size
        for rid, req in self.live.items():
            table, n, k = self.bm.get_block_ids(rid), req.num_computed_tokens + self.pending[rid], self.bm.pages_per_block(rid)
            assert len(table) >= cdiv(n, bs) and (k == 1 or len(table) == cdiv(n, bs * k) * k)
            assert [int(self.kv[table[p // bs], p % bs]) for p in range(n)] == req.all_token_ids[:n]


MixedBlockSizesMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=30, deadline=None)
test_mixed_block_size_invariants = MixedBlockSizesMachine.TestCase
