"""Scheduler edge cases, each set up exactly rather than found by a random run:
a step whose running requests (or a fork behind its parent) use the token
budget to the last token, a block that is full of tokens but not yet full of
KV, and a prompt that fills its last block exactly."""

from __future__ import annotations

from infer.core.config import CacheConfig, SchedulerConfig
from infer.core.request import Request, RequestStatus
from infer.core.sampling_params import SamplingParams
from infer.core.scheduler import Scheduler
from infer.core.scheduler_output import SchedulerOutput, StepOutput

BLOCK = 4


def finish_step(sched: Scheduler, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
    """Report a computed step to the scheduler; the requests that finished.
    The one call of `update_from_output` in this file."""
    return sched.update_from_output(out, StepOutput.of_tokens(sampled)).finished


def make_scheduler(budget: int, max_num_seqs: int = 4, caching: bool = False, num_blocks: int = 32) -> Scheduler:
    cache = CacheConfig(block_size=BLOCK, num_blocks=num_blocks, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs), cache)


def request(rid: str, prompt, max_tokens: int = 4, arrival: float = 0.0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(prompt), sampling_params=params, arrival_time=arrival)


def step(sched: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[Request]]:
    """One step in which every request that samples gets `token`."""
    out = sched.schedule()
    return out, finish_step(sched, out, {s.request_id: token for s in out.scheduled if s.do_sample})


def scheduled(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.request_id, s.start, s.num_tokens) for s in out.scheduled]


# -- a budget used to the last token --------------------------------------------------------------

def test_waiting_request_is_not_admitted_when_running_ones_use_the_whole_budget():
    sched = make_scheduler(budget=8)
    sched.add_request(request("a", range(8)))
    sched.add_request(request("b", range(20, 25)))
    out, _ = step(sched)
    assert scheduled(out) == [("a", 0, 8)]
    assert sched.requests["b"].status == RequestStatus.WAITING and len(sched.waiting) == 1
    assert len(sched.running) == 1
    out, _ = step(sched)
    assert scheduled(out) == [("a", 8, 1), ("b", 0, 5)]


def test_a_decode_and_a_chunked_prefill_using_the_whole_budget_leave_the_queue_waiting():
    sched = make_scheduler(budget=8, max_num_seqs=4)
    sched.add_request(request("a", [1], max_tokens=5))
    sched.add_request(request("b", range(100, 120), max_tokens=1, arrival=1.0))
    sched.add_request(request("c", [2, 3], arrival=2.0))
    out, _ = step(sched)
    assert scheduled(out) == [("a", 0, 1), ("b", 0, 7)]
    out, _ = step(sched)
    assert scheduled(out) == [("a", 1, 1), ("b", 7, 7)]
    assert sched.requests["c"].status == RequestStatus.WAITING and [r.request_id for r in sched.running] == ["a", "b"]
    out, _ = step(sched)
    assert scheduled(out) == [("a", 2, 1), ("b", 14, 6), ("c", 0, 1)]


def test_request_admitted_after_a_full_budget_step_takes_the_prefix_cached_meanwhile():
    """The prefix-cache lookup happens when a request is admitted: admitted one
    step early with no tokens, it would miss the blocks its predecessor cached."""
    sched = make_scheduler(budget=8, caching=True)
    sched.add_request(request("a", range(8), max_tokens=2))
    sched.add_request(request("b", [*range(8), 50, 51], max_tokens=1, arrival=1.0))
    out, _ = step(sched)
    assert scheduled(out) == [("a", 0, 8)]
    out, _ = step(sched)
    assert scheduled(out) == [("a", 8, 1), ("b", 8, 2)]  # b starts after a's two cached blocks
    assert sched.get_stats().prefix_cache.hits == 8


def test_fork_behind_a_parent_that_uses_the_whole_budget_is_not_scheduled_for_zero_tokens():
    """A fork joins the running list behind its parent: when the parent's chunk
    takes the whole budget, the running pass must stop before the child."""
    sched = make_scheduler(budget=4)
    sched.add_request(request("p", range(10)))
    out = sched.schedule()
    sched.fork_request("p", "c")  # mid-prefill: the child mirrors this step, no token to sample
    finish_step(sched, out, {})
    out, _ = step(sched)
    assert scheduled(out) == [("p", 4, 4)]
    out, _ = step(sched)
    assert scheduled(out) == [("p", 8, 2), ("c", 4, 2)]


def test_no_step_ever_schedules_a_request_for_zero_tokens():
    sched = make_scheduler(budget=6, max_num_seqs=3)
    for i, n in enumerate([6, 3, 3, 5, 1, 6]):
        sched.add_request(request(f"r{i}", range(10 * i, 10 * i + n), max_tokens=3, arrival=float(i)))
    for _ in range(50):
        if not sched.has_unfinished_requests():
            break
        out, _ = step(sched)
        assert all(s.num_tokens > 0 for s in out.scheduled), scheduled(out)
        assert len(sched.running) <= 3
    assert not sched.has_unfinished_requests()


# -- only computed tokens are cached --------------------------------------------------------------

def test_block_filled_by_a_sampled_token_is_not_cached_before_its_kv_is_computed():
    """A 3-token prompt plus its first sampled token fills block 0, but that
    token's KV is computed only by the next step: until then the block may not
    be offered to other requests."""
    sched = make_scheduler(budget=16, caching=True)
    sched.add_request(request("a", [1, 2, 3], max_tokens=1))
    _, finished = step(sched, token=4)  # a finishes: token 4 is never computed
    assert [r.request_id for r in finished] == ["a"] and finished[0].all_token_ids == [1, 2, 3, 4]
    assert not sched.block_manager.cached_block_hash_to_block
    sched.add_request(request("b", [1, 2, 3, 4, 5]))
    out, _ = step(sched)
    assert scheduled(out) == [("b", 0, 5)]  # no hit: slot 3 of a's block holds no KV for token 4


def test_block_is_cached_once_the_step_computing_its_last_token_ran():
    sched = make_scheduler(budget=16, caching=True)
    sched.add_request(request("a", [1, 2, 3], max_tokens=2))
    step(sched, token=4)
    step(sched, token=5)  # computes token 4: block 0 is now full of KV
    assert len(sched.block_manager.cached_block_hash_to_block) == 1
    sched.add_request(request("b", [1, 2, 3, 4, 5]))
    out, _ = step(sched)
    assert scheduled(out) == [("b", 4, 1)]


def test_chunk_ending_mid_block_caches_only_the_blocks_it_completed():
    sched = make_scheduler(budget=6, caching=True)
    sched.add_request(request("a", range(11), max_tokens=1))
    step(sched)  # tokens 0..5 computed: block 0 full, block 1 half
    assert len(sched.block_manager.cached_block_hash_to_block) == 1
    step(sched)  # tokens 6..10: block 1 full, block 2 holds 3 computed tokens and the sampled one
    bm = sched.block_manager
    assert not sched.has_unfinished_requests()
    assert len(bm.cached_block_hash_to_block) == 2


# -- blocks allocated -------------------------------------------------------------------------------

def test_a_prompt_that_fills_its_last_block_exactly_takes_no_extra_block():
    sched = make_scheduler(budget=16)
    sched.add_request(request("a", range(2 * BLOCK)))
    sched.schedule()
    assert len(sched.block_manager.get_block_ids("a")) == 2
