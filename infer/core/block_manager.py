"""Paged KV blocks: the pool, per-request block tables, ref counts, prefix
caching by hash chains, and copy-on-write for forked requests.

The manager owns block ids only; the KV itself lives in the backend's cache,
which the engine indexes with the tables and slot mappings built from here.
Every allocating call answers False (or an empty hit) when the pool cannot
serve it, leaving the state as it was, so the scheduler can preempt instead of
crashing.

Prefix caching: the KV of a FULL block depends only on the tokens up to its
end, so each full block is named by ``sha256(parent_hash + its token ids)``,
a chain rooted at the request's cache salt. Blocks whose owners all finished
stay in the free queue with their hash until evicted, least recently used
first, and a later request with the same prefix takes them instead of
recomputing.

Mixed block sizes (``--block-size auto``): the pool's blocks are pages, and a
request may use blocks of k pages (k in `block_multiples`), chosen by its
expected length (prompt + max_tokens): a block is then k consecutive pages
starting at a multiple of k, so its id in units of its own size is
``first_page // k``. Short requests keep one-page blocks (little room left
unused in their last block), long ones get big blocks. Everything else (hashes,
the prefix cache, the host tier, copy-on-write) works on pages; a request that
cannot get a whole free run, hits a prefix not laid out in its runs, or copies
a shared page falls back to one-page blocks, which is always valid.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .kv_tier import TierIndex, TierOp
from .request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def root_hash(cache_salt: str | None, lora_key: str | None = None) -> bytes:
    """Parent hash of a request's first block: the salt and the LoRA adapter
    (`LoRARequest.cache_key`), so neither different salts nor different adapters
    ever share blocks."""
    if lora_key is not None:  # another prefix, and JSON: no salt can spell an adapter's root
        return hashlib.sha256(b"infer-kv-root-lora:" + json.dumps([cache_salt or "", lora_key]).encode()).digest()
    return hashlib.sha256(b"infer-kv-root:" + (cache_salt or "").encode()).digest()


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of a full block: its tokens chained to its parent's 32-byte hash.

    sha256 rather than Python's 64-bit `hash`: a collision would hand one
    request another's KV (wrong output, or a leak between tenants), and
    sha256 collisions cannot be found, let alone crafted. Fixed-width int64
    tokens after a fixed-width parent make the encoding unambiguous.
    """
    return hashlib.sha256(parent_hash + np.asarray(token_ids, dtype="<i8").tobytes()).digest()


@dataclass(slots=True)
class Block:
    block_id: int
    # Number of requests whose block table holds this block.
    ref_cnt: int = 0
    # Set once the block is full and registered in the prefix cache.
    block_hash: bytes | None = None
    # Copied back from the host tier and not yet hit: its first hit counts as the tier's.
    from_tier: bool = False


@dataclass(slots=True)
class AllocationPlan:
    """What one allocation takes (`BlockManager.plan`): `need` free blocks in all."""

    hit: list  # prefix-hit blocks taken on a first allocation (None: behind the window)
    num_tokens: int  # tokens the table covers afterwards
    pages: int  # pages per block
    wanted_pages: int
    num_fresh: int
    shared: list[int]  # entries moved to private copies
    need: int
    first_changed: int = 0


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups in tokens, counted once per admission of a request."""

    queries: int = 0
    hits: int = 0  # all tiers
    tier_hits: int = 0  # of `hits`, those copied back from the host tier

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    """A pool of `num_blocks` KV blocks of `block_size` tokens each."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 num_tier_blocks: int = 0, block_multiples: Sequence[int] = (1,), window: int | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"BlockManager needs positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks nobody holds, least recently used first; cached ones among
        # them keep their hash until they are taken for new tokens.
        self.free_block_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_block_hash_to_block: dict[bytes, Block] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self._block_copies: list[tuple[int, int]] = []
        # The host tier (`kv_tier`): evicted prefix blocks and swapped-out requests.
        self.tier = TierIndex(num_tier_blocks) if num_tier_blocks > 0 else None
        self._tier_ops: list[TierOp] = []
        # Mixed block sizes: per multiple k > 1 the free pages of each aligned group of k pages and the
        # groups that are wholly free (in the order they became so).
        self.block_multiples = tuple(sorted({1, *block_multiples}))
        if any(k <= 0 for k in self.block_multiples):
            raise ValueError(f"block_multiples must be positive, got {block_multiples}")
        self._group_free = {k: np.full(num_blocks // k, k, np.int32) for k in self.block_multiples if k > 1}
        self._free_groups = {k: dict.fromkeys(range(num_blocks // k)) for k in self._group_free}
        self._init_group(0, window)

    # Pool state: what every group of a hybrid cache (`HybridBlockManager`) shares, by
    # reference, so it is only ever changed in place.
    POOL = ("num_blocks", "block_size", "enable_prefix_caching", "blocks", "free_block_queue",
            "cached_block_hash_to_block", "prefix_cache_stats", "_block_copies", "tier", "_tier_ops",
            "block_multiples", "_group_free", "_free_groups")

    def _init_group(self, group: int, window: int | None) -> None:
        """This manager's own state: its group (salting its prefix hashes and tier owners),
        the sliding window of its layers (None: full attention) and its requests' tables."""
        if window is not None and window <= 0:
            raise ValueError(f"a sliding window must be positive, got {window}")
        self.group, self.window = group, window
        # Each request's blocks in order; None where a windowed group dropped one.
        self.req_to_blocks: dict[str, list[Block | None]] = {}
        # Each request's block ids as int32, kept in step with req_to_blocks (capacity
        # doubles): a step's block table is copied from these rows, not rebuilt from
        # Python lists (10 ms at 128 requests x 2048 blocks). A dropped block reads 0.
        self._rows: dict[str, np.ndarray] = {}
        # Leading blocks of each request already registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Pages per block of each request with blocks of several pages (absent: 1).
        self._pages: dict[str, int] = {}
        self.num_run_fallbacks = 0  # requests that wanted blocks of several pages and fell back to one
        # Leading entries of each request's table dropped behind its window (None in the list).
        self._dropped: dict[str, int] = {}
        self._swapped_dropped: dict[str, int] = {}

    @classmethod
    def sharing(cls, pool: BlockManager, group: int, window: int | None) -> BlockManager:
        """A manager of another group over `pool`'s blocks."""
        self = cls.__new__(cls)
        for name in cls.POOL:
            setattr(self, name, getattr(pool, name))
        self._init_group(group, window)
        return self

    def _key(self, block_hash: bytes) -> bytes:
        """A block's prefix-cache name in this group: group 0 uses the chain hash itself."""
        return block_hash if self.group == 0 else block_hash + self.group.to_bytes(2, "little")

    def _owner(self, request_id: str) -> str:
        """The request's owner name in the host tier (one per group)."""
        return request_id if self.group == 0 else f"{request_id}\x00{self.group}"

    # -- usage ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (evictable cached ones included)."""
        return len(self.free_block_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """KV cache usage in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def pages_per_block(self, request_id: str) -> int:
        """Pages in each block of the request (1 unless `block_multiples` gave it more)."""
        return self._pages.get(request_id, 1)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids; a block dropped behind the window reads 0 (never read)."""
        return [0 if b is None else b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def block_table_row(self, request_id: str) -> np.ndarray:
        """The request's block ids as a new int32 array (a copy: later steps may change the row)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return np.zeros(0, np.int32)
        return self._rows[request_id][: len(blocks)].copy()

    def _write_row(self, request_id: str, start: int) -> None:
        """Bring the request's int32 row up to date from block `start` on."""
        blocks = self.req_to_blocks[request_id]
        row = self._rows.get(request_id)
        if row is None or row.shape[0] < len(blocks):
            grown = np.zeros(max(16, 2 * len(blocks)), np.int32)
            if row is not None:
                grown[:start] = row[:start]
            row = self._rows[request_id] = grown
        row[start : len(blocks)] = [0 if b is None else b.block_id for b in blocks[start:]]

    # -- prefix cache ----------------------------------------------------------
    def block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """Hashes of the request's first `num_full_blocks` blocks, extending its cache."""
        hashes, bs, tokens = request.block_hashes, self.block_size, request.all_token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            lora = getattr(request, "lora_request", None)
            parent = hashes[-1] if hashes else root_hash(request.cache_salt, lora.cache_key if lora else None)
            # The images whose placeholders this block holds: equal tokens, different pictures.
            images = [it.hash for it in getattr(request, "mm_items", ()) if it.offset < (i + 1) * bs and it.end > i * bs]
            if images:
                parent = hashlib.sha256(b"infer-kv-images:" + parent + b"".join(images)).digest()
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes[:num_full_blocks]

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request with no blocks: (block ids, tokens).

        The last token is never a hit: a step must compute at least one token
        to produce the logits the next token is sampled from.
        """
        if not self.enable_prefix_caching or request.request_id in self.req_to_blocks:
            return [], 0
        num = (request.num_tokens - 1) // self.block_size
        if self.window is not None:
            num = self.window_hit_blocks(request, num)
            hit = self.lookup(request, num, set(), self.first_needed_block(num * self.block_size))
            return (hit, num * self.block_size) if len(hit) == num else ([], 0)
        hit = self.lookup(request, num, set())
        return hit, len(hit) * self.block_size

    def lookup(self, request: Request, num: int, held: set[int], start: int = 0) -> list[int | None]:
        """The cached blocks `start` .. `num` - 1 of the request's prefix, up to the first
        missing one (copied back from the tier where it holds them), after `start` Nones.
        `held`: free blocks this admission hit, which a copy back must not take."""
        hit: list[int | None] = [None] * start
        for h in self.block_hashes(request, num)[start:]:
            key = self._key(h)
            block = self.cached_block_hash_to_block.get(key)
            if block is None:
                block = self._from_tier(key, held)
            elif block.ref_cnt == 0 and self.tier is not None:
                self.free_block_queue.move_to_end(block.block_id)  # used now: last in line for eviction
                held.add(block.block_id)
            if block is None:
                break
            hit.append(block.block_id)
        return hit

    def first_needed_block(self, num_computed: int) -> int:
        """The first block the next query after `num_computed` tokens reads (0 without a window)."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // self.block_size

    def window_hit_blocks(self, request: Request, num: int) -> int:
        """The most blocks, at most `num`, a windowed group can take from the cache: the
        blocks its window needs after them are all cached (checked without side effects)."""
        hashes = self.block_hashes(request, num)
        present = [self._key(h) in self.cached_block_hash_to_block or
                   (self.tier is not None and self._key(h) in self.tier.by_hash) for h in hashes]
        for n in range(num, 0, -1):
            if all(present[self.first_needed_block(n * self.block_size) : n]):
                return n
        return 0

    def _from_tier(self, block_hash: bytes, held: set[int]) -> Block | None:
        """Copy a prefix block back from the host tier into a free device block, cached
        and free (a plain device hit from here on), or None if the tier lacks it or
        the free blocks are all ones this lookup holds (hit or brought back: they sit
        at the queue's recently used end, so the front is one of them only then)."""
        if self.tier is None or block_hash not in self.tier.by_hash or not self.free_block_queue:
            return None
        if next(iter(self.free_block_queue)) in held:
            return None  # taking one more would evict a block this lookup needs
        block = self._pop_free_block(keep=frozenset((block_hash,)))
        slot = self.tier.lookup(block_hash)
        self._tier_ops.append(TierOp("in", block.block_id, slot))
        block.ref_cnt, block.block_hash, block.from_tier = 0, block_hash, True
        self.cached_block_hash_to_block[block_hash] = block
        self._put_free(block.block_id)  # most recently used end
        held.add(block.block_id)
        return block

    def cache_blocks(self, request: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching or request.request_id not in self.req_to_blocks:
            return
        rid, blocks = request.request_id, self.req_to_blocks[request.request_id]
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        hashes = self.block_hashes(request, num_full)
        for i in range(self.num_cached_blocks[rid], num_full):
            block, h = blocks[i], self._key(hashes[i])
            # A block already named (shared from a fork parent) keeps its name; a
            # duplicate of content cached elsewhere stays unnamed, freed as plain.
            if block is not None and block.block_hash is None and h not in self.cached_block_hash_to_block:
                block.block_hash = h
                self.cached_block_hash_to_block[h] = block
        self.num_cached_blocks[rid] = num_full

    # -- allocation --------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_block_ids: Sequence[int | None] = ()) -> bool:
        """Give the request room for `num_new_tokens` more tokens; False if the pool can't.

        `new_computed_block_ids` is a hit from `get_computed_blocks`, taken on the
        request's first allocation. Writing into a block shared with a fork
        relative first moves the writer to a private copy (see `pop_block_copies`).
        A windowed group first gives back the blocks its window has left behind.
        """
        if not new_computed_block_ids and self.settled(request, num_new_tokens):
            return True
        self.drop_behind_window(request)
        plan = self.plan(request, num_new_tokens, new_computed_block_ids)
        if plan.need > self.num_free_blocks:
            return False
        self.take_hits(request, plan)
        self.fill(request, plan)
        return True

    def settled(self, request: Request, num_new_tokens: int) -> bool:
        """Whether an allocation of `num_new_tokens` would change nothing: the request's
        blocks cover them, none is shared, no block fell behind the window (most
        decode steps; checked first, as it is cheaper than a plan)."""
        blocks = self.req_to_blocks.get(request.request_id)
        computed, bs = request.num_computed_tokens, self.block_size
        if blocks is None or computed + num_new_tokens > len(blocks) * bs:
            return False
        k = self._pages.get(request.request_id, 1)
        if self.window is not None and self.first_needed_block(computed) // k * k > self._dropped.get(request.request_id, 0):
            return False
        return all(blocks[i].ref_cnt == 1 for i in range(computed // bs, len(blocks)))

    def plan(self, request: Request, num_new_tokens: int, hit_ids: Sequence[int | None] = ()) -> AllocationPlan:
        """What `allocate_slots` would take, changing nothing."""
        rid, bs = request.request_id, self.block_size
        blocks = self.req_to_blocks.get(rid, [])
        hit = [None if i is None else self.blocks[i] for i in hit_ids]
        num_computed = request.num_computed_tokens + len(hit) * bs
        # A hit resting in the free queue leaves it, so it costs a free block too.
        evictable_hits = [b.block_id for b in hit if b is not None and b.ref_cnt == 0]
        # Existing blocks this step writes into that another request also holds.
        shared = [i for i in range(num_computed // bs, len(blocks)) if blocks[i].ref_cnt > 1]
        if rid in self.req_to_blocks:
            k = want = self._pages.get(rid, 1)
        else:
            want = self._wanted_pages(request)
            k = self._hit_pages(want, hit)
        while True:
            num_required = cdiv(num_computed + num_new_tokens, bs * k) * k
            num_fresh = max(0, num_required - len(blocks) - len(hit))
            if k == 1 or (not shared and self._free_runs(k, evictable_hits) >= num_fresh // k
                          and num_fresh + len(evictable_hits) <= self.num_free_blocks):
                break
            k = 1  # no room for whole runs (or a page is copied): one-page blocks from here on
        return AllocationPlan(hit, num_computed + num_new_tokens, k, want, num_fresh, shared,
                              num_fresh + len(shared) + len(evictable_hits))

    def take_hits(self, request: Request, plan: AllocationPlan) -> None:
        """The first half of an allocation: a new request's table, holding its prefix hit.
        (Every group of a hybrid cache holds its hits before any takes fresh blocks, which
        could otherwise evict another group's hit.)"""
        rid, bs, hit = request.request_id, self.block_size, plan.hit
        if rid not in self.req_to_blocks:
            self.req_to_blocks[rid] = []
            self.num_cached_blocks[rid] = len(hit)
            self._dropped[rid] = sum(b is None for b in hit)
            if self.enable_prefix_caching and self.group == 0:
                self.prefix_cache_stats.queries += request.num_tokens
                self.prefix_cache_stats.hits += len(hit) * bs
        for block in hit:
            if block is not None and block.from_tier:
                block.from_tier = False
                if self.group == 0:
                    self.prefix_cache_stats.tier_hits += bs
        for block in hit:
            if block is not None:
                if block.ref_cnt == 0:
                    self._take_free(block.block_id)
                block.ref_cnt += 1
        plan.first_changed = len(self.req_to_blocks[rid])
        self.req_to_blocks[rid].extend(hit)

    def fill(self, request: Request, plan: AllocationPlan) -> None:
        """The second half: private copies of shared blocks written now, then fresh blocks."""
        rid, k = request.request_id, plan.pages
        blocks = self.req_to_blocks[rid]
        if k > 1 and self._free_runs(k) < plan.num_fresh // k:  # another group took the runs: pages
            k = 1
            plan.num_fresh = max(0, cdiv(plan.num_tokens, self.block_size) - len(blocks))
        self.num_run_fallbacks += k < plan.wanted_pages
        if k > 1:
            self._pages[rid] = k
        else:
            self._pages.pop(rid, None)
        for i in plan.shared:
            copy = self._pop_free_block()
            self._block_copies.append((blocks[i].block_id, copy.block_id))
            blocks[i].ref_cnt -= 1  # still >= 1: the relatives keep it
            blocks[i] = copy
        if k > 1:
            for _ in range(plan.num_fresh // k):
                blocks.extend(self._pop_free_run(k))
        else:
            blocks.extend(self._pop_free_block() for _ in range(plan.num_fresh))
        self._write_row(rid, min([plan.first_changed, *plan.shared]))

    def drop_behind_window(self, request: Request) -> None:
        """A windowed group: release the request's blocks that no query can read again
        (wholly before the window of its next token), leaving None in its table. A named
        block stays in the prefix cache, free, until evicted."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if self.window is None or not blocks:
            return
        k = self._pages.get(rid, 1)
        upto = min(self.first_needed_block(request.num_computed_tokens) // k * k, len(blocks))
        start = self._dropped.get(rid, 0)
        if upto <= start:
            return
        for i in range(start, upto):
            block = blocks[i]
            if block is not None:
                blocks[i] = None
                block.ref_cnt -= 1
                if block.ref_cnt == 0:
                    self._put_free(block.block_id, first=block.block_hash is None)
        self._dropped[rid] = upto
        self._write_row(rid, start)

    # -- mixed block sizes ---------------------------------------------------------
    # Expected tokens per page of block: a request expecting L tokens takes the largest
    # block of at most L / this many tokens (its last block then wastes ~1.5% of L).
    TOKENS_PER_BLOCK_TOKEN = 32

    def _wanted_pages(self, request: Request) -> int:
        """Pages per block a new request asks for, by its expected length."""
        if len(self.block_multiples) == 1:
            return 1
        params = getattr(request, "sampling_params", None)
        max_tokens = getattr(params, "max_tokens", None)
        expected = request.num_tokens + (max_tokens if max_tokens is not None else self.num_blocks * self.block_size)
        fits = [k for k in self.block_multiples if k * self.block_size * self.TOKENS_PER_BLOCK_TOKEN <= expected]
        return max(fits, default=1)

    def _hit_pages(self, want: int, hit: list[Block]) -> int:
        """The most pages per block, at most `want`, whose aligned runs the hit's pages form."""
        if any(b is None for b in hit):
            return 1  # a windowed hit starting after its dropped blocks: pages
        ids = [b.block_id for b in hit]
        for k in reversed(self.block_multiples):
            if k <= want and len(ids) % k == 0 and all(
                    ids[i] % k == 0 and ids[i : i + k] == list(range(ids[i], ids[i] + k)) for i in range(0, len(ids), k)):
                return k
        return 1

    def check_layout(self) -> None:
        """AssertionError unless the free-group counts match the free queue and every
        request with blocks of k > 1 pages holds whole aligned runs (tests call this)."""
        free = set(self.free_block_queue)
        for k, counts in self._group_free.items():
            expect = [sum(p in free for p in range(g * k, g * k + k)) for g in range(len(counts))]
            assert counts.tolist() == expect, f"free pages per group of {k} drifted"
            assert set(self._free_groups[k]) == {g for g, n in enumerate(expect) if n == k}, f"free runs of {k} drifted"
        for rid, k in self._pages.items():
            if rid not in self.req_to_blocks:
                assert self.is_swapped(rid), f"{rid} has a block size but no blocks"
                continue
            ids, dropped = self.get_block_ids(rid), self._dropped.get(rid, 0)
            assert dropped % k == 0 and len(ids) % k == 0 and all(
                ids[i] % k == 0 and ids[i : i + k] == list(range(ids[i], ids[i] + k))
                for i in range(dropped, len(ids), k)), f"{rid}'s blocks of {k} pages broke: {ids}"

    def _free_runs(self, k: int, taken: Sequence[int] = ()) -> int:
        """Wholly free aligned groups of k pages, not counting those holding a page in `taken`."""
        free = self._free_groups[k]
        return len(free) - len({p // k for p in taken if p // k in free})

    def _take_free(self, block_id: int) -> None:
        del self.free_block_queue[block_id]
        for k, counts in self._group_free.items():
            g = block_id // k
            if g < len(counts):
                if counts[g] == k:
                    del self._free_groups[k][g]
                counts[g] -= 1

    def _put_free(self, block_id: int, first: bool = False) -> None:
        self.free_block_queue[block_id] = None
        if first:
            self.free_block_queue.move_to_end(block_id, last=False)
        for k, counts in self._group_free.items():
            g = block_id // k
            if g < len(counts):
                counts[g] += 1
                if counts[g] == k:
                    self._free_groups[k][g] = None

    def _pop_free_run(self, k: int) -> list[Block]:
        """The k pages of the wholly free aligned group that became free first."""
        g = next(iter(self._free_groups[k]))
        pages = []
        for page in range(g * k, g * k + k):
            self._take_free(page)
            pages.append(self._claim(self.blocks[page]))
        return pages

    def pop_tier_ops(self) -> list[TierOp]:
        """Copies between the device pool and the host tier decided since the last call,
        in order; the engine performs them before the step's block copies and forward."""
        ops = self._tier_ops.copy()
        self._tier_ops.clear()  # in place: the groups of a hybrid cache share the list
        return ops

    # -- swap preemption -----------------------------------------------------------
    def is_swapped(self, request_id: str) -> bool:
        return self.tier is not None and self._owner(request_id) in self.tier.owned

    def num_swapped_blocks(self, request_id: str) -> int:
        return len(self.tier.owned.get(self._owner(request_id), ())) if self.tier is not None else 0

    def resume_need(self, request: Request, num_new_tokens: int) -> int:
        """Free blocks a swapped request needs to come back and compute `num_new_tokens`."""
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(self.num_swapped_blocks(request.request_id),
                   total - self._swapped_dropped.get(request.request_id, 0))

    def swap_out(self, request_id: str) -> bool:
        """Copy every block of the request to the tier and free them on the device;
        False (nothing done) when the tier cannot hold them."""
        blocks = self.req_to_blocks.get(request_id)
        if self.tier is None or not blocks:
            return False
        dropped = self._dropped.get(request_id, 0)
        blocks = blocks[dropped:]
        slots = self.tier.take(self._owner(request_id), len(blocks))
        if slots is None:
            return False
        self._swapped_dropped[request_id] = dropped
        # A block this step moved the request to by copy-on-write is not filled yet (tier ops run
        # before block copies, and freeing it drops the copy): its source holds the contents.
        source = {dst: src for src, dst in self._block_copies}
        self._tier_ops.extend(TierOp("out", source.get(b.block_id, b.block_id), s) for b, s in zip(blocks, slots))
        self._free_blocks(request_id)
        return True

    def swap_in(self, request_id: str) -> bool:
        """Copy a swapped request's blocks back into free device blocks; False (nothing
        done) when the pool has too few free blocks."""
        slots = self.tier.owned[self._owner(request_id)]
        if len(slots) > self.num_free_blocks:
            return False
        dropped = self._swapped_dropped.pop(request_id, 0)
        k = self._pages.get(request_id, 1)
        if k > 1 and self._free_runs(k) >= len(slots) // k:
            blocks = [page for _ in range(len(slots) // k) for page in self._pop_free_run(k)]
        else:
            self._pages.pop(request_id, None)
            blocks = [self._pop_free_block() for _ in slots]
        self._tier_ops.extend(TierOp("in", b.block_id, s) for b, s in zip(blocks, slots))
        self.tier.release(self._owner(request_id))
        self.req_to_blocks[request_id] = [None] * dropped + blocks
        self._dropped[request_id] = dropped
        self.num_cached_blocks[request_id] = 0  # registered again (as duplicates stay unnamed) as it goes on
        self._write_row(request_id, 0)
        return True

    def pop_block_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies pending since the last call.

        The engine applies them in order, before the step's forward pass, so the
        copy holds the shared block's content from before this step's writes.
        """
        copies = self._block_copies.copy()
        self._block_copies.clear()  # in place: shared by the groups of a hybrid cache
        return copies

    def fork(self, parent_id: str, child_id: str) -> None:
        """Let `child_id` share every block of `parent_id` (copy-on-write later)."""
        if child_id in self.req_to_blocks:
            raise ValueError(f"request {child_id!r} already holds blocks")
        blocks = self.req_to_blocks[parent_id]
        for block in blocks:
            if block is not None:
                block.ref_cnt += 1
        self.req_to_blocks[child_id] = list(blocks)
        self._dropped[child_id] = self._dropped.get(parent_id, 0)
        self._rows[child_id] = self._rows[parent_id].copy()
        self.num_cached_blocks[child_id] = self.num_cached_blocks[parent_id]
        if parent_id in self._pages:
            self._pages[child_id] = self._pages[parent_id]

    def free(self, request_id: str) -> None:
        """Release a request's blocks, on the device and in the tier (no-op if it holds none)."""
        if self.tier is not None:
            self.tier.release(self._owner(request_id))
        self._pages.pop(request_id, None)
        self._swapped_dropped.pop(request_id, None)
        self._free_blocks(request_id)

    def _free_blocks(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        self._rows.pop(request_id, None)
        self._dropped.pop(request_id, None)
        if blocks is None:
            return
        freed = set()
        # Reverse order: a prefix's tail sits nearer the eviction end than its
        # head, so the blocks most requests share survive longest.
        for block in reversed(blocks):
            if block is None:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.add(block.block_id)
                # Nothing reusable in an unnamed block: first in line for eviction.
                self._put_free(block.block_id, first=block.block_hash is None)
        if freed and self._block_copies:
            # A copy into a block that is free again is wasted work, and the
            # block may be reused before the engine would perform it.
            self._block_copies[:] = [(s, d) for s, d in self._block_copies if d not in freed]

    def _pop_free_block(self, keep: frozenset = frozenset()) -> Block:
        """The least recently used free block, claimed (`_claim`)."""
        block_id = next(iter(self.free_block_queue))
        self._take_free(block_id)
        return self._claim(self.blocks[block_id], keep)

    def _claim(self, block: Block, keep: frozenset = frozenset()) -> Block:
        """A block just taken from the free queue, held once. A cached one leaves the
        prefix cache; with a tier its contents go there first (the tier's LRU prefix
        blocks make room, but not those in `keep`)."""
        if block.block_hash is not None:  # evict it from the prefix cache
            if self.tier is not None:
                slot = self.tier.put_hash(block.block_hash, keep)
                if slot is not None:
                    self._tier_ops.append(TierOp("out", block.block_id, slot))
            del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash, block.from_tier = None, False
        block.ref_cnt = 1
        return block


class HybridBlockManager:
    """The block tables of a hybrid KV cache (`kv_groups`): one `BlockManager` per
    group, all over one pool of pages, allocating for a request together or not
    at all. Windowed groups hold only the blocks their window still reads.

    A prefix hit is the longest prefix every group can take: full groups need all
    its blocks cached, windowed groups only those their window reads after it. The
    scheduler sees the `BlockManager` interface; a request's table is group 0's
    and `block_table_rows` gives every group's."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 num_tier_blocks: int = 0, block_multiples: Sequence[int] = (1,),
                 windows: Sequence[int | None] = (None,)):
        if not windows:
            raise ValueError("a hybrid KV cache needs at least one group")
        first = BlockManager(num_blocks, block_size, enable_prefix_caching, num_tier_blocks, block_multiples,
                             windows[0])
        self.groups = [first, *(BlockManager.sharing(first, g, w) for g, w in enumerate(windows) if g)]
        self.windows = tuple(windows)

    def __getattr__(self, name: str):
        # Pool state and usage (num_blocks, tier, prefix_cache_stats, free_block_queue, ...): group 0's,
        # shared by every group.
        if name in BlockManager.POOL:
            return getattr(self.groups[0], name)
        raise AttributeError(name)

    @property
    def num_free_blocks(self) -> int:
        return self.groups[0].num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.groups[0].num_used_blocks

    @property
    def usage(self) -> float:
        return self.groups[0].usage

    @property
    def req_to_blocks(self) -> dict:
        return self.groups[0].req_to_blocks

    @property
    def num_run_fallbacks(self) -> int:
        return sum(g.num_run_fallbacks for g in self.groups)

    def blocks_held(self, request_id: str) -> int:
        """Blocks the request holds in all groups (not counting dropped ones)."""
        return sum(sum(b is not None for b in g.req_to_blocks.get(request_id, ())) for g in self.groups)

    # -- the BlockManager interface, over every group --------------------------------
    def pages_per_block(self, request_id: str) -> int:
        return self.groups[0].pages_per_block(request_id)

    def block_table_row(self, request_id: str) -> np.ndarray:
        return self.groups[0].block_table_row(request_id)

    def block_table_rows(self, request_id: str) -> tuple[tuple[np.ndarray, int], ...]:
        """(block ids, pages per block) of the request in each group."""
        return tuple((g.block_table_row(request_id), g.pages_per_block(request_id)) for g in self.groups)

    def get_computed_blocks(self, request: Request) -> tuple[list[list[int | None]], int]:
        first = self.groups[0]
        if not first.enable_prefix_caching or request.request_id in first.req_to_blocks:
            return [[] for _ in self.groups], 0
        num, held = (request.num_tokens - 1) // self.block_size, set()
        hits: dict[int, list[int | None]] = {}
        for g in self.groups:
            if g.window is None:
                hits[g.group] = g.lookup(request, num, held)
                num = len(hits[g.group])
        for g in self.groups:
            if g.window is not None:
                num = g.window_hit_blocks(request, num)
        for g in self.groups:
            if g.window is None:
                hits[g.group] = hits[g.group][:num]
            else:
                hits[g.group] = g.lookup(request, num, held, g.first_needed_block(num * self.block_size))
                if len(hits[g.group]) < num:  # the tier could not bring one back: no hit at all
                    return [[] for _ in self.groups], 0
        hits = [hits[g.group] for g in self.groups]
        return hits, num * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_block_ids: Sequence[Sequence[int | None]] | None = None) -> bool:
        if not new_computed_block_ids and all(g.settled(request, num_new_tokens) for g in self.groups):
            return True
        hits = new_computed_block_ids or [()] * len(self.groups)
        for g in self.groups:
            g.drop_behind_window(request)
        plans = [g.plan(request, num_new_tokens, hit) for g, hit in zip(self.groups, hits)]
        if sum(p.need for p in plans) > self.num_free_blocks:
            return False
        for g, plan in zip(self.groups, plans):
            g.take_hits(request, plan)
        for g, plan in zip(self.groups, plans):
            g.fill(request, plan)
        return True

    def cache_blocks(self, request: Request) -> None:
        for g in self.groups:
            g.cache_blocks(request)

    def fork(self, parent_id: str, child_id: str) -> None:
        for g in self.groups:
            g.fork(parent_id, child_id)

    def free(self, request_id: str) -> None:
        for g in self.groups:
            g.free(request_id)

    def is_swapped(self, request_id: str) -> bool:
        return self.groups[0].is_swapped(request_id)

    def num_swapped_blocks(self, request_id: str) -> int:
        return sum(g.num_swapped_blocks(request_id) for g in self.groups)

    def resume_need(self, request: Request, num_new_tokens: int) -> int:
        return sum(g.resume_need(request, num_new_tokens) for g in self.groups)

    def swap_out(self, request_id: str) -> bool:
        tier = self.tier
        if tier is None or request_id not in self.req_to_blocks:
            return False
        if self.blocks_held(request_id) > tier.num_free:
            return False
        for g in self.groups:
            if g.req_to_blocks.get(request_id) and not g.swap_out(request_id):
                raise AssertionError("the tier's room was checked for every group")
        return True

    def swap_in(self, request_id: str) -> bool:
        if self.num_swapped_blocks(request_id) > self.num_free_blocks:
            return False
        for g in self.groups:
            if g.is_swapped(request_id):
                g.swap_in(request_id)
        return True

    def pop_tier_ops(self) -> list[TierOp]:
        return self.groups[0].pop_tier_ops()

    def pop_block_copies(self) -> list[tuple[int, int]]:
        return self.groups[0].pop_block_copies()

    def check_layout(self) -> None:
        for g in self.groups:
            g.check_layout()
