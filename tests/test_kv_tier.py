"""The host KV tier: prefix-cache blocks the device pool evicts come back from it,
and preemption can swap a request's blocks there instead of recomputing them.
Outputs are compared with transformers' and with runs that never touch the tier."""

from __future__ import annotations

import numpy as np
import pytest
from test_engine import BACKENDS, PROMPTS, VOCAB, generate, make_llm, tiny  # noqa: F401  (fixtures)

from infer.core.block_manager import BlockManager
from infer.core.kv_tier import TierIndex, TierOp, TierStore
from infer.core.request import Request
from infer.core.sampling_params import SamplingParams

TIER = 1 << 22  # bytes: room for every block these tests make

_rng = np.random.default_rng(5)
SHARED = _rng.integers(3, VOCAB, 40).tolist()  # a 10-block system prompt (block size 4)
OTHERS = [_rng.integers(3, VOCAB, 30).tolist() for _ in range(4)]


def _prefix_workload(llm):
    """The shared prompt, then unrelated ones that push its blocks out of a small pool, then it again."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = generate(llm, [SHARED + [5]], params)
    for other in OTHERS:
        generate(llm, [other], params)
    stats = llm.engine.scheduler.block_manager.prefix_cache_stats
    before = (stats.hits, stats.tier_hits)
    again = generate(llm, [SHARED + [9, 11]], params)
    return first + again, stats.hits - before[0], stats.tier_hits - before[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_evicted_prefix_blocks_come_back_from_the_host_tier(make_llm, tiny, backend):
    small = dict(backend=backend, block_size=4, max_model_len=48, num_gpu_blocks_override=14)
    with_tier = make_llm(**small, kv_offload_bytes=TIER)
    without = make_llm(**small)
    big = make_llm(backend=backend, block_size=4, max_model_len=48, num_gpu_blocks_override=200)
    got, hits, tier_hits = _prefix_workload(with_tier)
    ref, ref_hits, _ = _prefix_workload(without)
    large, large_hits, _ = _prefix_workload(big)
    assert got == ref == large == [tiny.greedy(SHARED + [5], 6), tiny.greedy(SHARED + [9, 11], 6)]
    assert large_hits == 40  # a pool that keeps the prefix: all 10 blocks hit on the device
    assert ref_hits == 0  # the small pool alone lost them
    assert tier_hits == hits == 40  # with the tier every one came back from the host
    stats = with_tier.engine.scheduler.get_stats()
    assert stats.prefix_cache.tier_hits == 40 and stats.tier_blocks > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_swap_preemption_gives_the_tokens_of_an_unconstrained_run(make_llm, tiny, backend):
    # 16 blocks of 4 tokens: one request fits, all of them together do not (as the recompute test).
    tight = dict(backend=backend, block_size=4, max_model_len=64, num_gpu_blocks_override=16)
    swap = make_llm(**tight, kv_offload_bytes=TIER, preemption_mode="swap")
    roomy = make_llm(backend=backend, block_size=4, max_model_len=64, num_gpu_blocks_override=400)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert generate(swap, PROMPTS, greedy) == [tiny.greedy(p, 16) for p in PROMPTS]
    stats = swap.engine.scheduler.get_stats()
    assert stats.num_preemptions > 0 and stats.num_swapped_out == stats.num_preemptions
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    assert generate(swap, PROMPTS, seeded) == generate(roomy, PROMPTS, seeded)
    assert stats.num_swapped == 0 and not swap.engine.scheduler.block_manager.tier.owned


def test_a_full_tier_falls_back_to_recompute(make_llm, tiny):
    tight = dict(block_size=4, max_model_len=64, num_gpu_blocks_override=16)
    per_block = make_llm(**tight).engine.worker.runner.kv_cache_bytes_per_block(4)
    llm = make_llm(**tight, kv_offload_bytes=2 * per_block, preemption_mode="swap")  # two blocks: too few
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert generate(llm, PROMPTS, greedy) == [tiny.greedy(p, 16) for p in PROMPTS]
    stats = llm.engine.scheduler.get_stats()
    assert stats.num_preemptions > stats.num_swapped_out


def test_recompute_mode_never_swaps_and_auto_swaps(make_llm, tiny):
    tight = dict(block_size=4, max_model_len=64, num_gpu_blocks_override=16, kv_offload_bytes=TIER)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for mode, swaps in (("recompute", False), ("auto", True)):
        llm = make_llm(**tight, preemption_mode=mode)
        assert generate(llm, PROMPTS, greedy) == [tiny.greedy(p, 16) for p in PROMPTS]
        stats = llm.engine.scheduler.get_stats()
        assert stats.num_preemptions > 0 and (stats.num_swapped_out > 0) == swaps, mode


def test_bad_tier_settings_are_refused(make_llm):
    with pytest.raises(ValueError, match="kv_offload_bytes=10 holds no KV block"):
        make_llm(block_size=4, kv_offload_bytes=10)
    with pytest.raises(ValueError, match="preemption_mode must be one of"):
        make_llm(preemption_mode="drop")


def test_the_tier_file_is_a_memory_map_of_every_layers_blocks(make_llm, tmp_path):
    path = tmp_path / "tier.bin"
    llm = make_llm(block_size=4, max_model_len=48, num_gpu_blocks_override=14, kv_offload_bytes=TIER,
                   kv_offload_path=str(path))
    runner = llm.engine.worker.runner
    store = runner.kv_tier
    slots = llm.engine.cache_config.num_tier_blocks
    assert isinstance(store.data, np.memmap) and path.stat().st_size == store.nbytes
    assert store.data.shape[:2] == (len(runner.kv_caches), slots)
    assert store.nbytes == slots * runner.kv_cache_bytes_per_block(4)


# -- the bookkeeping alone ----------------------------------------------------------------------

def test_ops_in_decision_order_keep_every_block_readable():
    """A pool of 3 blocks and a tier of 2 under a stream of prefix lookups: replaying the
    recorded ops on fake KV (each block holds the hash it claims) never reads a stale block."""
    bm = BlockManager(3, 2, enable_prefix_caching=True, num_tier_blocks=2)
    device = {}  # block -> the hash its KV belongs to
    tier = {}  # slot -> hash
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 3, 5)] for _ in range(40)]
    for i, prompt in enumerate(prompts):
        req = Request(str(i), prompt, SamplingParams(max_tokens=1))
        hit, num_hit = bm.get_computed_blocks(req)
        ok = bm.allocate_slots(req, req.num_tokens - num_hit, hit)
        for op in bm.pop_tier_ops():  # the engine's order
            if op.kind == "out":
                tier[op.slot] = device.get(op.block)
            else:
                device[op.block] = tier.get(op.slot)
        for b, h in zip(bm.get_block_ids(req.request_id) if ok else hit, bm.block_hashes(req, len(hit))):
            assert device.get(b) == h, f"block {b} claims {h.hex()[:8]} but holds another"
        if ok:
            req.num_computed_tokens = req.num_tokens
            hashes = bm.block_hashes(req, req.num_tokens // 2)
            for b, h in zip(bm.get_block_ids(req.request_id), hashes):
                device[b] = h  # what the forward writes
            bm.cache_blocks(req)
            bm.free(req.request_id)
    assert bm.prefix_cache_stats.tier_hits > 0


def test_tier_index_lru_and_owned_slots():
    t = TierIndex(3)
    assert t.put_hash(b"a") == 0 and t.put_hash(b"b") == 1 and t.put_hash(b"a") is None  # already held
    assert t.lookup(b"a") == 0  # now the most recently used
    assert t.take("r", 2) == [2, 1]  # the free slot, then the LRU prefix block (b)
    assert b"b" not in t.by_hash and t.num_free == 1 and t.take("s", 2) is None
    assert t.put_hash(b"c", keep=frozenset((b"a",))) is None  # only owned slots and a kept one are left
    assert t.release("r") == [2, 1] and t.num_used == 1


def test_store_batches_ops_in_order_without_repeating_a_block_or_slot():
    class Fake:  # a backend whose cache is a NumPy array of per-block bytes
        def read_blocks(self, cache, ids):
            return cache[ids].copy()

        def write_blocks(self, cache, ids, data):
            cache[ids] = data

    store = TierStore(1, 2, 4)
    cache = np.arange(3 * 4, dtype=np.uint8).reshape(3, 4)
    want = cache.copy()
    # out: block -> slot, in: slot -> block. Slot 1 is read back before block 2 overwrites it.
    ops = [TierOp("out", 0, 0), TierOp("out", 1, 1), TierOp("in", 0, 1), TierOp("out", 2, 1), TierOp("in", 2, 0)]
    store.apply(Fake(), [cache], ops)
    assert [bytes(r) for r in cache] == [bytes(want[1]), bytes(want[1]), bytes(want[0])]
    assert [bytes(r) for r in store.data[0]] == [bytes(want[0]), bytes(want[2])]


def _fill(bm, rid, tokens, computed=None):
    req = Request(rid, tokens, SamplingParams(max_tokens=1))
    hit, n = bm.get_computed_blocks(req)
    assert bm.allocate_slots(req, len(tokens) - n, hit)
    req.num_computed_tokens = len(tokens) if computed is None else computed
    bm.cache_blocks(req)
    return req


def test_a_lookup_never_evicts_a_free_block_it_already_hit_to_bring_one_back():
    """h1 still on the device (at the front of the free queue), h2 only in the tier: bringing
    h2 back must take another block, not h1's."""
    bm = BlockManager(6, 2, enable_prefix_caching=True, num_tier_blocks=8)
    a = _fill(bm, "a", [1, 2, 3, 4])  # h1 -> block 0, h2 -> block 1
    bm.free("a")
    _fill(bm, "b", list(range(10, 20)))  # five blocks: h2's block among those taken, h2 to the tier
    bm.free("b")
    bm.pop_tier_ops()
    c = Request("c", [1, 2, 3, 4, 7], SamplingParams(max_tokens=1))
    hit, n = bm.get_computed_blocks(c)
    assert n == 4 and len(set(hit)) == 2
    assert bm.blocks[hit[0]].block_hash == bm.block_hashes(a, 1)[0]
    assert bm.blocks[hit[1]].block_hash == bm.block_hashes(a, 2)[1]
    ins = [op for op in bm.pop_tier_ops() if op.kind == "in"]
    assert [op.block for op in ins] == [hit[1]]


def test_swapping_out_a_request_mid_copy_on_write_saves_the_copy_source():
    """A fork's writer moved off a shared partial block this step (copy pending) and is then
    swapped out: the tier must get the source block's contents, not the unfilled copy."""
    from infer.core.request import Request as R

    bm = BlockManager(8, 4, enable_prefix_caching=True, num_tier_blocks=8)
    parent = _fill(bm, "p", [1, 2, 3, 4, 5, 6])  # blocks 0 (full) and 1 (partial, shared below)
    bm.fork("p", "c")
    child = R("c", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=2))
    child.num_computed_tokens = 6
    assert bm.allocate_slots(child, 1)  # writes into the shared partial block: copy (1 -> new)
    [(src, dst)] = bm._block_copies
    assert bm.swap_out("c")
    outs = [op for op in bm.pop_tier_ops() if op.kind == "out"]
    assert [op.block for op in outs] == [bm.get_block_ids("p")[0], src]
    bm.free("p")
    bm.free("c")
    assert bm.num_free_blocks == bm.num_blocks and not bm.tier.owned
    del parent


def test_a_tier_that_does_not_fit_in_dev_shm_goes_to_the_temporary_directory(monkeypatch, tmp_path):
    import infer.core.kv_tier as kv_tier

    small = tmp_path / "shm"
    small.mkdir()
    monkeypatch.setattr(kv_tier, "SHM", str(small))
    calls = []
    real = kv_tier._allocate

    def allocate(fd, size):
        calls.append(size)
        if len(calls) == 1:  # the tmpfs is full
            real(fd, 0)
            raise OSError(28, "No space left on device")
        real(fd, size)

    monkeypatch.setattr(kv_tier, "_allocate", allocate)
    store = TierStore(2, 3, 8, mapped=True)
    assert isinstance(store.data, np.memmap) and store.data.shape == (2, 3, 8) and len(calls) == 2
    assert not list(small.iterdir())  # the failed file was removed


def test_infer_backends_reports_kv_capacity_per_tier(make_llm, tiny, capsys, monkeypatch):
    from infer.cli import main

    monkeypatch.setenv("COLUMNS", "400")
    llm = make_llm(kv_cache_memory=1 << 21, kv_offload_bytes=1 << 22)
    cache, per_block = llm.engine.cache_config, llm.engine.worker.runner.kv_cache_bytes_per_block(16)
    assert main(["backends", "--model", str(tiny.path), "--kv-cache-memory", str(1 << 21),
                 "--kv-offload-bytes", str(1 << 22)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.split("KV capacity")[1].splitlines() if line.startswith("│ torch "))
    assert f"{cache.num_blocks * 16:,} tokens ({cache.num_blocks * per_block / 2**20:,.0f} MiB)" in row
    assert f"{cache.num_tier_blocks * 16:,} tokens" in row and cache.num_tier_blocks > cache.num_blocks
    assert "│ cpu_ref " in out.split("KV capacity")[1]
