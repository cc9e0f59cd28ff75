"""The continuous-batching scheduler, driven by a fake model over a fake KV cache.

The fake model writes each scheduled token id into its KV slot and samples
``next_token(context)`` from the context it reads back through the block
table, so a wrong block table, slot mapping, block copy or prefix hit shows up
as a wrong token.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infer.core.block_manager import cdiv
from infer.core.config import CacheConfig, SchedulerConfig
from infer.core.request import Request, RequestStatus
from infer.core.sampling_params import SamplingParams
from infer.core.scheduler import Scheduler
from infer.core.scheduler_output import StepOutput

VOCAB = 97


def next_token(context) -> int:
    return (sum((i + 1) * t for i, t in enumerate(context)) * 31 + len(context)) % VOCAB


def reference(prompt, max_tokens, forced=()) -> list[int]:
    """Outputs of a request run alone; `forced` replaces its first sampled tokens."""
    tokens = list(prompt)
    for i in range(max_tokens):
        tokens.append(forced[i] if i < len(forced) else next_token(tokens))
    return tokens[len(prompt) :]


def update(sched: Scheduler, out, sampled: dict) -> list[Request]:
    """Hand the scheduler a step's sampled tokens; the requests that finished."""
    return sched.update_from_output(out, StepOutput.of_tokens(sampled)).finished


def make_scheduler(num_blocks=64, block_size=4, caching=False, **sched) -> Scheduler:
    sched.setdefault("max_num_batched_tokens", 64)
    sched.setdefault("max_num_seqs", 8)
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(**sched), cache)


def req(rid, prompt, max_tokens=4, **kw) -> Request:
    kw.setdefault("arrival_time", 0.0)
    return Request(rid, list(prompt), sampling_params=SamplingParams(max_tokens=max_tokens), **kw)


class FakeEngine:
    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.kv = np.full(sched.block_manager.num_blocks * sched.block_size, -1)
        self.outputs = []

    def forward(self, out) -> dict[str, int]:
        bs = out.block_size
        for src, dst in out.block_copies:
            self.kv[dst * bs : (dst + 1) * bs] = self.kv[src * bs : (src + 1) * bs]
        mi = out.model_input()
        meta = mi.attn_metadata
        self.kv[meta.slot_mapping] = mi.input_ids
        sampled = {}
        for b, s in enumerate(out.scheduled):
            table = meta.block_table[b]
            slots = [table[p // bs] * bs + p % bs for p in range(int(meta.seq_lens[b]))]
            context = self.kv[slots].tolist()
            assert context == s.request.all_token_ids[: s.seq_len], f"{s.request_id} reads a corrupt context"
            if s.do_sample:
                sampled[s.request_id] = next_token(context)
        assert list(sampled) == mi.sample_request_ids
        return sampled

    def step(self, overrides=None):
        out = self.sched.schedule()
        cfg = self.sched.config
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs
        self.outputs.append(out)
        sampled = self.forward(out)
        sampled.update(overrides or {})
        return out, update(self.sched, out, sampled)

    def run(self, max_steps=500) -> dict[str, list[int]]:
        done = {}
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return done
            for r in self.step()[1]:
                done[r.request_id] = r.output_token_ids
        raise AssertionError("requests did not finish")


def test_chunked_prefill_splits_a_long_prompt_across_steps():
    eng = FakeEngine(make_scheduler(max_num_batched_tokens=8))
    eng.sched.add_request(req("a", range(20), max_tokens=2))
    chunks = [(s.start, s.num_tokens, s.do_sample) for s in (eng.step()[0].scheduled[0] for _ in range(3))]
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert eng.run() == {"a": reference(range(20), 2)}


def test_long_prefill_token_threshold_caps_one_requests_chunk():
    eng = FakeEngine(make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=6))
    eng.sched.add_request(req("a", range(20)))
    eng.sched.add_request(req("b", range(5)))
    out, _ = eng.step()
    assert out.num_scheduled_tokens == {"a": 6, "b": 5}


def test_decode_and_prefill_mix_in_one_step():
    eng = FakeEngine(make_scheduler())
    eng.sched.add_request(req("a", range(5)))
    eng.step()
    eng.sched.add_request(req("b", range(10)))
    out, _ = eng.step()
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 10)]
    assert out.model_input().attn_metadata.query_start_loc.tolist() == [0, 1, 11]


def test_token_budget_is_never_exceeded():
    eng = FakeEngine(make_scheduler(max_num_batched_tokens=10, max_num_seqs=10))
    for i in range(6):
        eng.sched.add_request(req(f"r{i}", range(i, i + 7), max_tokens=3))
    eng.run()  # FakeEngine.step asserts the budget every step
    assert max(o.total_num_scheduled_tokens for o in eng.outputs) == 10


def test_max_num_seqs_caps_the_batch():
    eng = FakeEngine(make_scheduler(max_num_seqs=2))
    for i in range(4):
        eng.sched.add_request(req(f"r{i}", [i]))
    out, _ = eng.step()
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert len(eng.sched.waiting) == 2


def test_fcfs_admits_in_arrival_order():
    eng = FakeEngine(make_scheduler(max_num_seqs=1))
    for rid, t in [("late", 3.0), ("early", 1.0), ("middle", 2.0)]:
        eng.sched.add_request(req(rid, [1, 2], max_tokens=1, arrival_time=t))
    order = [eng.step()[0].scheduled[0].request_id for _ in range(3)]
    assert order == ["early", "middle", "late"]


def test_priority_admits_lower_value_first_and_ties_by_arrival():
    eng = FakeEngine(make_scheduler(max_num_seqs=1, policy="priority", priority_aging_s=None))
    for rid, prio, t in [("low", 5, 0.0), ("high-late", 0, 2.0), ("high-early", 0, 1.0)]:
        eng.sched.add_request(req(rid, [1], max_tokens=1, priority=prio, arrival_time=t))
    order = [eng.step()[0].scheduled[0].request_id for _ in range(3)]
    assert order == ["high-early", "high-late", "low"]


def test_priority_aging_serves_a_long_waiting_low_priority_request():
    # Aging 10 s per level: waiting 100 s outweighs a priority gap of 5.
    eng = FakeEngine(make_scheduler(max_num_seqs=1, policy="priority", priority_aging_s=10.0))
    eng.sched.add_request(req("old-low", [1], max_tokens=1, priority=5, arrival_time=0.0))
    eng.sched.add_request(req("new-high", [1], max_tokens=1, priority=0, arrival_time=100.0))
    eng.sched.add_request(req("newer-high", [1], max_tokens=1, priority=0, arrival_time=40.0))
    order = [eng.step()[0].scheduled[0].request_id for _ in range(3)]
    assert order == ["newer-high", "old-low", "new-high"]


def test_preemption_when_the_pool_runs_out_and_the_victim_finishes_with_the_same_tokens():
    # 4 blocks of 4 tokens; two requests growing to 3 blocks each cannot both stay.
    eng = FakeEngine(make_scheduler(num_blocks=4, block_size=4))
    assert eng.sched.num_preemptions == 0
    eng.sched.add_request(req("a", range(6), max_tokens=6, arrival_time=0.0))
    eng.sched.add_request(req("b", range(10, 16), max_tokens=6, arrival_time=1.0))
    done = eng.run()
    # the count is the preemptions the steps reported, one per preempted request
    assert eng.sched.num_preemptions == sum(len(o.preempted_request_ids) for o in eng.outputs) > 0
    assert any("b" in o.preempted_request_ids for o in eng.outputs)  # the newest goes first
    assert done == {"a": reference(range(6), 6), "b": reference(range(10, 16), 6)}
    assert eng.sched.block_manager.num_free_blocks == 4


def test_preempted_request_returns_to_the_front_of_the_queue():
    eng = FakeEngine(make_scheduler(num_blocks=4, block_size=4))
    eng.sched.add_request(req("a", range(6), max_tokens=6, arrival_time=0.0))
    eng.sched.add_request(req("b", range(10, 16), max_tokens=6, arrival_time=1.0))
    while not any(o.preempted_request_ids for o in eng.outputs):
        eng.step()
    eng.sched.add_request(req("c", [1], arrival_time=2.0))
    assert [e[-1].request_id for e in sorted(eng.sched.waiting)] == ["b", "c"]
    assert eng.sched.requests["b"].status == RequestStatus.PREEMPTED


def test_priority_preempts_the_lowest_priority_running_request():
    eng = FakeEngine(make_scheduler(num_blocks=4, block_size=4, policy="priority", priority_aging_s=None))
    eng.sched.add_request(req("low", range(6), max_tokens=6, priority=9, arrival_time=0.0))
    eng.sched.add_request(req("high", range(10, 16), max_tokens=6, priority=0, arrival_time=1.0))
    done = eng.run()
    preempted = [rid for o in eng.outputs for rid in o.preempted_request_ids]
    assert preempted and set(preempted) == {"low"}
    assert done["low"] == reference(range(6), 6)


def test_waiting_requests_stay_waiting_while_the_pool_is_full():
    eng = FakeEngine(make_scheduler(num_blocks=4, block_size=4))
    eng.sched.add_request(req("big", range(13), max_tokens=2))
    eng.sched.add_request(req("small", [1, 2]))
    for _ in range(2):  # "big" holds all 4 blocks until it finishes
        out, finished = eng.step()
        assert [s.request_id for s in out.scheduled] == ["big"] and not out.preempted_request_ids
    assert [r.request_id for r in finished] == ["big"]
    assert eng.sched.requests["small"].status == RequestStatus.WAITING
    out, _ = eng.step()
    assert [s.request_id for s in out.scheduled] == ["small"]


def test_prefix_cache_hit_skips_computed_tokens():
    eng = FakeEngine(make_scheduler(caching=True))
    eng.sched.add_request(req("a", range(10), max_tokens=1))
    eng.run()
    eng.sched.add_request(req("b", [*range(8), 50, 51], max_tokens=3))
    out, _ = eng.step()
    assert (out.scheduled[0].start, out.scheduled[0].num_tokens) == (8, 2)
    assert eng.run() == {"b": reference([*range(8), 50, 51], 3)}
    assert eng.sched.get_stats().prefix_cache.hits == 8


def test_prefix_cache_hit_never_covers_the_last_prompt_token():
    eng = FakeEngine(make_scheduler(caching=True))
    eng.sched.add_request(req("a", range(8), max_tokens=1))
    eng.run()
    eng.sched.add_request(req("b", range(8), max_tokens=1))
    out, _ = eng.step()
    assert (out.scheduled[0].start, out.scheduled[0].num_tokens, out.scheduled[0].do_sample) == (4, 4, True)


def test_fork_shares_blocks_and_copies_on_write():
    eng = FakeEngine(make_scheduler())
    eng.sched.add_request(req("p", range(6), max_tokens=5))
    out = eng.sched.schedule()
    sampled = eng.forward(out)
    eng.sched.fork_request("p", "c")  # n = 2: the child takes the second sample
    update(eng.sched, out, {**sampled, "c": 42})
    assert eng.sched.block_manager.get_block_ids("c") == eng.sched.block_manager.get_block_ids("p")
    eng.outputs.append(out)
    done = eng.run()
    assert sum(len(o.block_copies) for o in eng.outputs) == 1
    assert done == {"p": reference(range(6), 5), "c": reference(range(6), 5, forced=[42])}
    assert eng.sched.block_manager.num_free_blocks == 64


def test_abort_frees_blocks_of_running_and_waiting_requests():
    eng = FakeEngine(make_scheduler(max_num_seqs=1))
    eng.sched.add_request(req("run", range(9), max_tokens=50))
    eng.sched.add_request(req("wait", range(3)))
    eng.step()
    assert eng.sched.abort_request("run") and eng.sched.abort_request("wait")
    assert not eng.sched.abort_request("run")
    assert eng.sched.block_manager.num_free_blocks == 64 and not eng.sched.has_unfinished_requests()
    out, _ = eng.step()
    assert out.is_empty and out.finished_request_ids == ["run", "wait"]


def test_request_aborted_mid_step_is_skipped_by_update():
    eng = FakeEngine(make_scheduler())
    eng.sched.add_request(req("a", range(5)))
    out = eng.sched.schedule()
    eng.forward(out)
    eng.sched.abort_request("a")
    assert update(eng.sched, out, {}) == []  # no token needed for it
    assert eng.sched.block_manager.num_free_blocks == 64


def test_all_requests_finish_with_every_block_free():
    eng = FakeEngine(make_scheduler(num_blocks=12, max_num_batched_tokens=16, caching=True))
    prompts = {f"r{i}": [i % 3] * (3 + 2 * i) for i in range(8)}
    for rid, prompt in prompts.items():
        eng.sched.add_request(req(rid, prompt, max_tokens=5))
    assert eng.run() == {rid: reference(p, 5) for rid, p in prompts.items()}
    assert eng.sched.block_manager.num_free_blocks == 12


def test_request_stops_at_max_model_len():
    eng = FakeEngine(make_scheduler(max_model_len=8))
    eng.sched.add_request(req("a", range(6), max_tokens=100))
    done = eng.run()
    assert done == {"a": reference(range(6), 2)}  # 6 + 2 tokens = max_model_len


def test_without_chunked_prefill_a_prompt_is_admitted_whole():
    eng = FakeEngine(make_scheduler(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False))
    eng.sched.add_request(req("a", range(10)))
    eng.sched.add_request(req("b", range(10)))
    out, _ = eng.step()
    assert out.num_scheduled_tokens == {"a": 10}


def test_model_input_maps_each_token_to_its_slot():
    eng = FakeEngine(make_scheduler(block_size=4))
    eng.sched.add_request(req("a", range(6)))
    eng.step()
    eng.sched.add_request(req("b", range(3)))
    mi = eng.sched.schedule().model_input()
    meta = mi.attn_metadata
    ta, tb = meta.block_table.tolist()
    assert mi.positions.tolist() == [6, 0, 1, 2]
    assert meta.slot_mapping.tolist() == [ta[1] * 4 + 2, tb[0] * 4, tb[0] * 4 + 1, tb[0] * 4 + 2]
    assert meta.seq_lens.tolist() == [7, 3] and (meta.max_query_len, meta.max_seq_len) == (3, 7)
    assert mi.logits_indices.tolist() == [0, 3] and mi.sample_request_ids == ["a", "b"]


def test_requests_that_can_never_fit_are_rejected_when_added():
    sched = make_scheduler(num_blocks=4, block_size=4)  # max_model_len defaults to the pool: 16
    with pytest.raises(ValueError, match="exceed max_model_len=16"):
        sched.add_request(req("long", range(17)))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(req("empty", []))
    sched.add_request(req("a", [1]))
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add_request(req("a", [1]))


def test_max_model_len_larger_than_the_pool_is_rejected():
    with pytest.raises(ValueError, match="needs 5 KV blocks"):
        make_scheduler(num_blocks=4, block_size=4, max_model_len=17)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
        ({"max_num_batched_tokens": 4, "max_num_seqs": 8}, "must be >= max_num_seqs"),
        ({"policy": "lifo"}, "policy must be one of"),
        ({"long_prefill_token_threshold": 4, "enable_chunked_prefill": False}, "needs enable_chunked_prefill"),
        (
            {"enable_chunked_prefill": False, "max_num_batched_tokens": 64, "max_num_seqs": 8, "max_model_len": 128},
            "could never be scheduled",
        ),
    ],
)
def test_bad_scheduler_config_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)


def test_cache_config_resolves_blocks_from_bytes_and_backend_block_size():
    cfg = CacheConfig(kv_cache_memory_bytes=1 << 20).resolve(preferred_block_size=128, kv_bytes_per_token=1024)
    assert (cfg.block_size, cfg.num_blocks) == (128, 8)
    with pytest.raises(ValueError, match="not both"):
        CacheConfig(num_blocks=4, kv_cache_memory_bytes=1024)
    with pytest.raises(ValueError, match="resolved CacheConfig"):
        Scheduler(SchedulerConfig(), CacheConfig())


# -- property: random workloads always drain -----------------------------------------

workload = st.lists(
    st.tuples(st.integers(1, 20), st.integers(1, 6), st.integers(0, 3), st.integers(0, 3), st.integers(0, 6)),
    min_size=1,
    max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(
    jobs=workload,
    block_size=st.sampled_from([1, 2, 4]),
    spare_blocks=st.integers(0, 8),
    budget=st.integers(4, 24),
    max_num_seqs=st.integers(1, 4),
    caching=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
    threshold=st.sampled_from([0, 3]),
    # (what, which request, at which step)
    actions=st.lists(st.tuples(st.sampled_from(["fork", "fork", "abort"]), st.integers(0, 7), st.integers(1, 12)), max_size=4),
)
def test_random_workloads_finish_with_every_block_free(
    jobs, block_size, spare_blocks, budget, max_num_seqs, caching, policy, threshold, actions
):
    max_model_len = 26
    num_blocks = cdiv(max_model_len, block_size) + spare_blocks
    sched = make_scheduler(
        num_blocks, block_size, caching, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
        max_model_len=max_model_len, policy=policy, long_prefill_token_threshold=threshold,
    )  # fmt: skip
    eng = FakeEngine(sched)
    expected, aborted, forced_at = {}, set(), {}
    for i, (plen, max_tokens, prio, seed, arrive) in enumerate(jobs):
        # Few distinct prompt tokens, so prefixes repeat and caching gets hits.
        prompt = [(seed + j // 3) % 2 for j in range(plen)]
        sched.add_request(req(f"r{i}", prompt, max_tokens, priority=prio, arrival_time=float(arrive)))
        expected[f"r{i}"] = reference(prompt, min(max_tokens, max(1, max_model_len - plen)))
    done, step = {}, 0
    while sched.has_unfinished_requests():
        step += 1
        assert step < 1000, "scheduler made no progress"
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= budget and len(out.scheduled) <= max_num_seqs
        sampled = eng.forward(out)
        for a, (kind, idx, at) in enumerate(actions):
            rid = f"r{idx % len(jobs)}"
            if at == step and rid in sched.requests:
                if kind == "abort":
                    sched.abort_request(rid)
                    aborted.add(rid)
                else:
                    child = sched.fork_request(rid, f"{rid}-fork{a}")
                    expected[child.request_id] = None  # its own continuation; checked for consistency
                    # A different token than the parent's, so a missed copy-on-write shows.
                    sampled[child.request_id] = (sampled.get(rid, 0) + 1) % VOCAB
                    forced_at[child.request_id] = child.num_tokens
        for r in update(sched, out, sampled):
            done[r.request_id] = r
        bm = sched.block_manager
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    assert sched.block_manager.num_free_blocks == num_blocks
    for rid, want in expected.items():
        if rid in aborted or rid not in done:
            continue
        r = done[rid]
        if want is not None:
            assert r.output_token_ids == want
        else:  # a fork: every output but the forced one follows from its own context
            toks = r.all_token_ids
            for k in range(r.num_prompt_tokens, len(toks)):
                assert k == forced_at[rid] or toks[k] == next_token(toks[:k])


def _one_step(sched: Scheduler, token: int) -> list:
    out = sched.schedule()
    return sched.update_from_output(out, StepOutput.of_tokens({s.request_id: token for s in out.scheduled})).progressed


def test_the_scheduler_stops_on_stop_tokens_and_eos_only_after_min_tokens():
    sched = make_scheduler()
    params = SamplingParams(max_tokens=10, stop_token_ids=[50], min_tokens=2)
    sched.add_request(Request("r", [1, 2, 3], sampling_params=params, eos_token_ids=(60,), arrival_time=0.0))
    assert [p.status for p in _one_step(sched, 50)] == [None]  # before min_tokens: a stop token is just a token
    (p,) = _one_step(sched, 50)
    assert p.status == RequestStatus.FINISHED_STOPPED and p.request.stop_reason == 50
    assert not sched.has_unfinished_requests() and sched.block_manager.num_free_blocks == 64
    sched.add_request(Request("e", [1, 2, 3], sampling_params=SamplingParams(max_tokens=10), eos_token_ids=(60,)))
    (p,) = _one_step(sched, 60)
    assert p.status == RequestStatus.FINISHED_STOPPED and p.request.stop_reason is None


def test_ignore_eos_runs_to_max_tokens_and_max_model_len_caps_without_params():
    sched = make_scheduler(max_model_len=6)
    sched.add_request(Request("i", [1, 2], sampling_params=SamplingParams(max_tokens=2, ignore_eos=True),
                              eos_token_ids=(60,)))
    sched.add_request(Request("n", [1, 2, 3, 4]))  # no SamplingParams: only max_model_len stops it
    first = _one_step(sched, 60)
    assert [p.status for p in first] == [None, None]
    second = {p.request.request_id: p.status for p in _one_step(sched, 60)}
    assert second == {"i": RequestStatus.FINISHED_LENGTH_CAPPED, "n": RequestStatus.FINISHED_LENGTH_CAPPED}
    assert sched.block_manager.num_free_blocks == 64


def test_finish_requests_ends_live_requests_and_skips_the_rest():
    sched = make_scheduler()
    sched.add_request(req("a", range(5)))
    sched.add_request(req("b", range(5)))
    _one_step(sched, 7)
    done = sched.finish_requests(["a", "gone"], RequestStatus.FINISHED_STOPPED)
    assert [r.request_id for r in done] == ["a"] and done[0].status == RequestStatus.FINISHED_STOPPED
    assert list(sched.requests) == ["b"]
    with pytest.raises(ValueError, match="FINISHED"):
        sched.finish_requests(["b"], RequestStatus.RUNNING)


def test_without_chunked_prefill_the_context_limit_is_the_step_budget_unless_set():
    """Unset, max_model_len becomes what one unchunked step can hold (and the pool); set larger than
    the budget, it is refused rather than quietly lowered."""
    assert make_scheduler(max_num_batched_tokens=24, enable_chunked_prefill=False).max_model_len == 24
    assert make_scheduler(max_num_batched_tokens=24).max_model_len == 64 * 4  # chunked: the pool
    assert make_scheduler(max_num_batched_tokens=24, max_model_len=16, enable_chunked_prefill=False).max_model_len == 16
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(max_num_batched_tokens=24, max_model_len=32, enable_chunked_prefill=False)
