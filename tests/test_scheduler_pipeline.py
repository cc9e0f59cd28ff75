"""The scheduler with several steps in flight (pipeline stages): a request in a
step not yet reported back is neither scheduled again nor preempted, steps come
back oldest first, and a per-step cap splits the requests into shares."""

from __future__ import annotations

import pytest

from infer.core.config import CacheConfig, SchedulerConfig
from infer.core.request import Request, RequestStatus
from infer.core.sampling_params import SamplingParams
from infer.core.scheduler import Scheduler
from infer.core.scheduler_output import StepOutput

BLOCK = 4


def make_scheduler(num_blocks: int = 32, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    cache = CacheConfig(block_size=BLOCK, num_blocks=num_blocks, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs), cache)


def request(rid: str, n: int, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(1, n + 1)), sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def ids(out) -> list[str]:
    return [s.request_id for s in out.scheduled]


def report(sched, out, token: int = 5):
    return sched.update_from_output(out, StepOutput.of_tokens({s.request_id: token for s in out.scheduled
                                                               if s.do_sample}))


def test_requests_in_flight_are_not_scheduled_again_and_steps_come_back_oldest_first():
    sched = make_scheduler()
    for r in "abcd":
        sched.add_request(request(r, 3))
    first = sched.schedule(max_num_seqs=2)
    second = sched.schedule(max_num_seqs=2)
    assert ids(first) == ["a", "b"] and ids(second) == ["c", "d"]  # shares, disjoint
    assert sched.schedule().is_empty and sched.num_in_flight == 2  # everyone is in flight
    with pytest.raises(ValueError, match="oldest output"):
        report(sched, second)
    report(sched, first)
    third = sched.schedule()
    assert ids(third) == ["a", "b"] and [s.start for s in third.scheduled] == [3, 3]  # their decode steps
    report(sched, second)
    report(sched, third)
    assert sched.num_in_flight == 0
    assert [len(sched.requests[r].output_token_ids) for r in "abcd"] == [2, 2, 1, 1]


def test_a_request_in_flight_is_never_preempted():
    # 5 blocks of 4 tokens: a and b (8 tokens each) hold 2 blocks each. a's next token
    # takes the last free block; then b's needs one, and the only candidate that is
    # not in flight is b itself: b steps back, a keeps its blocks.
    sched = make_scheduler(num_blocks=5)
    sched.add_request(request("a", 8))
    sched.add_request(request("b", 8))
    report(sched, sched.schedule())
    a_step = sched.schedule(max_num_seqs=1)
    assert ids(a_step) == ["a"] and sched.block_manager.num_free_blocks == 0
    blocked = sched.schedule()
    assert blocked.is_empty and blocked.preempted_request_ids == ["b"]
    assert sched.requests["a"].status == RequestStatus.RUNNING
    assert sched.requests["b"].status == RequestStatus.PREEMPTED
    report(sched, a_step)
    assert sched.requests["a"].num_computed_tokens == 9


def test_an_empty_step_needs_no_report():
    sched = make_scheduler()
    empty = sched.schedule()
    assert empty.is_empty and sched.num_in_flight == 0
    assert report(sched, empty).progressed == []


def test_a_fork_takes_its_token_from_the_step_its_parent_is_in_and_waits_for_it():
    """n > 1: the engine forks when it launches the step that completes the prompt. With
    two steps in flight that step need not be the oldest; the child mirrors its parent in
    that step (a token from its logits) and, like the parent, is not scheduled before the
    step comes back."""
    sched = make_scheduler()
    sched.add_request(request("a", 3))
    sched.add_request(request("b", 3))
    first = sched.schedule(max_num_seqs=1)
    second = sched.schedule(max_num_seqs=1)
    assert ids(first) == ["a"] and ids(second) == ["b"]
    child = sched.fork_request("b", "b1")
    assert [s.request_id for s in second.forks] == ["b1"] and not first.forks
    assert sched.schedule().is_empty  # b and its child wait for the second step
    report(sched, first)
    result = sched.update_from_output(second, StepOutput.of_tokens({"b": 5, "b1": 7}))
    assert [p.request.request_id for p in result.progressed] == ["b", "b1"]
    assert child.output_token_ids == [7] and child.num_computed_tokens == 3
    assert sorted(ids(sched.schedule())) == ["a", "b", "b1"]
