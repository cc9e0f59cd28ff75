"""A second KV tier under the device pool: host memory (a memory-mapped file on
the CPU backend) holding whole blocks the device pool let go.

Two things live there:

* prefix-cache blocks evicted from the device pool, still named by their
  prefix hash: a later request whose prefix continues past the device hits
  finds them here and they are copied back instead of recomputed (LRU within
  the tier);
* the blocks of a request preempted by swapping, owned by it until it resumes
  and they are copied back (never evicted while it waits).

The split follows the rest of the engine: `TierIndex` is bookkeeping on the
scheduling rank (which slot holds what), and the block manager records each
copy it decides as a `TierOp` in decision order; every rank then performs the
step's ops on its own KV shard with its `TierStore` before the forward pass
(`apply`), as it does with copy-on-write block copies. Performed in order, a
block's old contents leave before new ones arrive and a slot is read before it
is reused.
"""

from __future__ import annotations

import os
import tempfile
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

SHM = "/dev/shm"


@dataclass(frozen=True, slots=True)
class TierOp:
    """One block copy: ``out`` device block -> tier slot, or ``in`` tier slot -> device block."""

    kind: str  # "out" | "in"
    block: int
    slot: int


class TierIndex:
    """Which of `num_slots` tier slots hold a prefix block (by hash, LRU) or a swapped request's block."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"a KV tier needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.by_hash: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.owned: dict[str, list[int]] = {}  # request id -> its swapped-out blocks' slots, in order

    @property
    def num_free(self) -> int:
        """Slots a swap could take now: free ones and those holding evictable prefix blocks."""
        return len(self._free) + len(self.by_hash)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot holding this prefix block (now the most recently used), or None."""
        slot = self.by_hash.get(block_hash)
        if slot is not None:
            self.by_hash.move_to_end(block_hash)
        return slot

    def _take_one(self, keep: frozenset = frozenset()) -> int | None:
        if self._free:
            return self._free.pop()
        for h in self.by_hash:  # the least recently used prefix block not to be kept
            if h not in keep:
                return self.by_hash.pop(h)
        return None

    def put_hash(self, block_hash: bytes, keep: frozenset = frozenset()) -> int | None:
        """A slot for a prefix block leaving the device (evicting the least recently used
        other than `keep`), or None when every slot is owned by swapped requests."""
        if block_hash in self.by_hash:
            return None  # already here: nothing to copy
        slot = self._take_one(keep)
        if slot is not None:
            self.by_hash[block_hash] = slot
        return slot

    def take(self, request_id: str, n: int) -> list[int] | None:
        """`n` slots for a swapped-out request (prefix blocks evicted for them), or None
        (nothing taken) when the tier cannot hold them."""
        if n > self.num_free or request_id in self.owned:
            return None
        slots = [self._take_one() for _ in range(n)]
        self.owned[request_id] = slots
        return slots

    def release(self, request_id: str) -> list[int]:
        """Give back a swapped request's slots (copied in, or the request is gone)."""
        slots = self.owned.pop(request_id, [])
        self._free.extend(reversed(slots))
        return slots


class TierStore:
    """The tier's bytes on one rank: ``[layers, slots, block_bytes]`` uint8, each
    slot one block of one layer as the backend's `read_blocks` gives it.

    `path` (a file, created or truncated, e.g. on a fast disk) makes it a
    memory-mapped file: the operating system pages it as memory runs short
    instead of the process holding it all. The CPU backend gets a temporary
    file in /dev/shm (RAM-backed; elsewhere the system's temporary directory)
    when no path is given, unlinked at once so nothing is left behind; other
    backends keep it in host memory. Files are allocated up front.
    """

    def __init__(self, num_layers: int, num_slots: int, block_bytes: int, path: str | None = None,
                 mapped: bool = False):
        shape = (num_layers, num_slots, block_bytes)
        self.path = path
        if path is None and not mapped:
            self.data = np.zeros(shape, dtype=np.uint8)
            return
        size = int(np.prod(shape))
        if path is not None:
            fd, name = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600), path
            _allocate(fd, size)
        else:  # RAM-backed where the system has a tmpfs with room (first writes to a disk file stall)
            for folder in ([SHM] if os.path.isdir(SHM) else []) + [None]:
                fd, name = tempfile.mkstemp(prefix="infer-kv-tier-", dir=folder)
                try:
                    _allocate(fd, size)
                    break
                except OSError:
                    os.unlink(name)  # e.g. a container's 64 MiB /dev/shm: the temporary directory then
                    if folder is None:
                        raise
        self.data = np.memmap(name, dtype=np.uint8, mode="r+", shape=shape)
        if path is None:
            os.unlink(name)  # the mapping keeps the pages; the name goes now

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def apply(self, backend, kv_caches: list, ops) -> None:
        """Perform the step's tier ops, in order, in every layer's cache. Consecutive ops
        of one kind go as one batched copy per layer while no block or slot repeats."""
        for kind, blocks, slots in _batches(ops):
            ids, at = np.asarray(blocks, dtype=np.int64), np.asarray(slots, dtype=np.int64)
            for layer, cache in enumerate(kv_caches):
                if kind == "out":
                    self.data[layer, at] = backend.read_blocks(cache, ids)
                else:
                    backend.write_blocks(cache, ids, np.ascontiguousarray(self.data[layer, at]))


def _allocate(fd: int, size: int) -> None:
    """Allocate a file's blocks up front (and close it): writing first into a sparse file's
    holes cost up to 25x (1.8 s against 0.07 s for 48 MB of blocks on this machine's disk)."""
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def _batches(ops):
    """(kind, blocks, slots) runs of `ops` in order: one kind, no block or slot twice."""
    kind, blocks, slots, seen = None, [], [], set()
    for op in ops:
        if op.kind != kind or ("b", op.block) in seen or ("s", op.slot) in seen:
            if blocks:
                yield kind, blocks, slots
            kind, blocks, slots, seen = op.kind, [], [], set()
        blocks.append(op.block)
        slots.append(op.slot)
        seen.update((("b", op.block), ("s", op.slot)))
    if blocks:
        yield kind, blocks, slots
