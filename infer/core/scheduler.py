"""Continuous batching, vLLM V1 style: one token budget per step, no phases.

Each step the scheduler fills `max_num_batched_tokens` in two passes:

1. Running requests, in admission order: each takes what it has left to
   compute, i.e. one token for a decode or the next chunk of a prompt. When the
   pool has no block for it, the scheduler preempts the newest running request
   ('fcfs') or the one ranked last ('priority'), by recompute: its blocks are
   freed, its computed tokens forgotten, and it goes back to the waiting queue,
   where its rank puts it ahead of later arrivals. If the request itself is the
   one ranked last, it is preempted and the pass stops.
2. Waiting requests, in policy order, while budget, `max_num_seqs` and blocks
   last, and only in a step that preempted nobody. A prefix-cache hit skips the
   prompt's cached blocks. A request that cannot get its blocks stays at the
   head of the queue (backpressure) until running ones finish.

Prompts longer than the remaining budget are chunked over steps
(`enable_chunked_prefill`), and `long_prefill_token_threshold` caps one
request's chunk so a long prompt cannot starve the decodes of others.

Priority with aging: the waiting queue is ordered by
``priority + arrival_time / priority_aging_s`` (ties by arrival, then by
add order). Waiting `priority_aging_s` seconds is thus worth one priority
level: a request of priority p is overtaken only by requests of priority q < p
that arrive less than ``(p - q) * priority_aging_s`` seconds after it, so it
cannot starve. The rank never changes once a request arrived, so the queue
stays a heap.

The engine drives it: `add_request`, then per step `schedule()`, the forward
pass on ``output.model_input()``, and `update_from_output` with the step's
`StepOutput`, which returns a `StepResult`. Token-level stops (EOS, stop
tokens, max_tokens, from each request's own `SamplingParams`, and
max_model_len) are the scheduler's; a stop string needs the text, so the
engine finds it and ends the request with `finish_requests`.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Iterable

from .block_manager import BlockManager, HybridBlockManager, PrefixCacheStats
from .kv_groups import blocks_for
from .config import CacheConfig, SchedulerConfig
from .request import Request, RequestId, RequestStatus
from .sampling_params import SamplingParams
from .speculative import SpecDecodeStats
from .scheduler_output import RequestProgress, ScheduledRequest, SchedulerOutput, StepOutput, StepResult


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_used_blocks: int
    num_blocks: int
    kv_cache_usage: float
    prefix_cache: PrefixCacheStats
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # the engine's, when it speculates
    num_swapped_out: int = 0  # preemptions by swapping to the host tier (of num_preemptions)
    num_swapped: int = 0  # requests waiting with their blocks in the tier
    tier_blocks: int = 0  # the host tier's size in blocks (0: no tier)
    tier_used_blocks: int = 0
    # Allocated but unused token slots over allocated slots, in the blocks running requests hold, percent.
    kv_cache_fragmentation_perc: float = 0.0
    # LoRA (max_loras 0: off): the adapters of running and of waiting requests.
    max_loras: int = 0
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()


class Scheduler:
    """Continuous-batching scheduler over one BlockManager (see the module doc)."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig):
        if not cache_config.is_resolved:
            raise ValueError(
                "Scheduler needs a resolved CacheConfig (block_size and num_blocks set): call CacheConfig.resolve"
            )
        self.config = scheduler_config
        self.block_size = bs = cache_config.block_size
        self.kv_group_windows = windows = cache_config.kv_group_windows
        if windows == (None,):
            self.block_manager = BlockManager(cache_config.num_blocks, bs, cache_config.enable_prefix_caching,
                                              cache_config.num_tier_blocks, cache_config.block_multiples)
        else:
            self.block_manager = HybridBlockManager(cache_config.num_blocks, bs, cache_config.enable_prefix_caching,
                                                    cache_config.num_tier_blocks, cache_config.block_multiples,
                                                    windows)
        chunk = scheduler_config.max_num_batched_tokens
        # Unset (no model to ask): the longest context the pool, and without
        # chunking one step's budget, can hold.
        self.max_model_len = scheduler_config.max_model_len or self._longest_context(cache_config.num_blocks)
        if not scheduler_config.max_model_len and not scheduler_config.enable_chunked_prefill:
            self.max_model_len = min(self.max_model_len, chunk)
        # So a lone request can always grow to max_model_len: without it,
        # preemption could not make room and the request would never finish.
        need = self.blocks_for(self.max_model_len)
        if need > cache_config.num_blocks:
            raise ValueError(
                f"max_model_len={self.max_model_len} needs {need} KV blocks of {bs} tokens "
                f"but the cache has {cache_config.num_blocks}; lower max_model_len or enlarge the KV cache"
            )
        scheduler_config.check_fits_unchunked(self.max_model_len)
        self.requests: dict[RequestId, Request] = {}
        self.running: list[Request] = []
        # Heap of (rank, arrival_time, add order, request).
        self.waiting: list[tuple[float, float, int, Request]] = []
        self._add_order: dict[RequestId, int] = {}
        self._counter = itertools.count()
        self._finished_ids: list[RequestId] = []
        # Outputs scheduled and not yet updated, oldest first. Usually one; a
        # pipeline keeps several in flight, and a request in one of them (busy)
        # is neither scheduled again nor preempted until its output comes back.
        self._pending: list[SchedulerOutput] = []
        self._busy: set[RequestId] = set()
        self.num_preemptions = 0
        self.num_swapped_out = 0  # of the preemptions, those by swapping

    def blocks_for(self, num_tokens: int) -> int:
        """Most blocks one request of `num_tokens` tokens holds at once."""
        return blocks_for(self.kv_group_windows, num_tokens, self.block_size, self.config.max_num_batched_tokens)

    def _longest_context(self, num_blocks: int) -> int:
        """The longest request the pool can hold alone (a hybrid cache: its full groups fill up)."""
        bs = self.block_size
        if self.blocks_for(num_blocks * bs) <= num_blocks:
            return num_blocks * bs
        lo, hi = bs, num_blocks * bs  # blocks_for grows with the length: bisect
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.blocks_for(mid) <= num_blocks else (lo, mid - 1)
        return lo

    # -- requests in and out ------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it could never be served."""
        rid, n = request.request_id, request.num_tokens
        if rid in self.requests:
            raise ValueError(f"request {rid!r} is already scheduled; request ids must be unique")
        if n == 0:
            raise ValueError(f"request {rid!r} has an empty prompt; give at least one token")
        # max_model_len fits the pool (checked at init), so this also rejects
        # every prompt needing more blocks than the pool has.
        if n > self.max_model_len:
            raise ValueError(
                f"request {rid!r}: {n} tokens exceed max_model_len={self.max_model_len} "
                f"({self.block_manager.num_blocks} KV blocks of {self.block_size}); shorten the prompt"
            )
        request.status, request.num_computed_tokens = RequestStatus.WAITING, 0
        self.requests[rid] = request
        self._add_order[rid] = next(self._counter)
        self._push_waiting(request)

    def fork_request(self, parent_id: RequestId, child_id: RequestId,
                     sampling_params: SamplingParams | None = None) -> Request:
        """A copy of a live request that shares its KV blocks (n > 1 sampling).

        Forked between `schedule()` and `update_from_output`, the child mirrors
        the parent's step: it takes its own sampled token from the same logits
        (a row of the `StepOutput` under `child_id`). Parent and child then write into shared
        blocks only after copy-on-write (see `SchedulerOutput.block_copies`).
        """
        parent = self.requests.get(parent_id)
        if parent is None:
            raise KeyError(f"cannot fork unknown or finished request {parent_id!r}")
        if child_id in self.requests:
            raise ValueError(f"request {child_id!r} is already scheduled; request ids must be unique")
        child = parent.fork(child_id, sampling_params)
        self.requests[child_id] = child
        self._add_order[child_id] = next(self._counter)
        if parent.status != RequestStatus.RUNNING:
            child.status, child.num_computed_tokens = RequestStatus.WAITING, 0
            self._push_waiting(child)
            return child
        self.block_manager.fork(parent_id, child_id)
        self.running.append(child)
        for output in self._pending:  # the step in flight with the parent: the child takes a token from it too
            for s in output.scheduled:
                if s.request is parent:
                    output.forks.append(ScheduledRequest(child_id, s.start, s.num_tokens, s.token_ids, s.block_ids,
                                                         s.do_sample, child))
                    self._busy.add(child_id)
        return child

    def abort_request(self, request_id: RequestId) -> bool:
        """Stop a request and free its blocks; False if it is not live."""
        return bool(self.finish_requests((request_id,), RequestStatus.FINISHED_ABORTED))

    def finish_requests(self, request_ids: Iterable[RequestId], status: RequestStatus) -> list[Request]:
        """End live requests with a FINISHED_* `status` (an abort, a stop string the
        engine found) and free their blocks; ids no longer live are skipped."""
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a FINISHED_* status, got {status!r}")
        done = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None:
                self._finish(request, status)
                done.append(request)
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            num_used_blocks=bm.num_used_blocks,
            num_blocks=bm.num_blocks,
            kv_cache_usage=bm.usage,
            prefix_cache=PrefixCacheStats(bm.prefix_cache_stats.queries, bm.prefix_cache_stats.hits,
                                          bm.prefix_cache_stats.tier_hits),
            num_swapped_out=self.num_swapped_out,
            num_swapped=len(bm.tier.owned) if bm.tier is not None else 0,
            tier_blocks=bm.tier.num_slots if bm.tier is not None else 0,
            tier_used_blocks=bm.tier.num_used if bm.tier is not None else 0,
            kv_cache_fragmentation_perc=self._fragmentation(),
            max_loras=self.config.max_loras,
            **self._lora_stats() if self.config.max_loras else {},
        )

    def _lora_stats(self) -> dict:
        """The adapters of running and of waiting requests (LoRA on only: it walks the queue)."""
        def names(reqs) -> tuple[str, ...]:
            return tuple(sorted({r.lora_request.lora_name for r in reqs if r.lora_request is not None}))

        return dict(running_loras=names(self.running), waiting_loras=names(e[-1] for e in self.waiting))

    def _fragmentation(self) -> float:
        """Percent of the token slots in running requests' blocks that hold no token
        (the tail of each request's last block, and blocks allocated ahead)."""
        bm, bs = self.block_manager, self.block_size
        allocated = used = 0
        for req in self.running:
            n = len(bm.req_to_blocks.get(req.request_id, ()))
            allocated += n * bs
            used += min(n * bs, req.num_tokens)
        return 100.0 * (allocated - used) / allocated if allocated else 0.0

    # -- the step ------------------------------------------------------------------
    def schedule(self, max_num_seqs: int | None = None) -> SchedulerOutput:
        """The next step. `max_num_seqs` caps this step's requests below the
        configured limit (a pipeline splits the requests into a step per stage)."""
        cfg, bm = self.config, self.block_manager
        budget = cfg.max_num_batched_tokens
        cap = cfg.max_num_seqs if max_num_seqs is None else max(1, min(cfg.max_num_seqs, max_num_seqs))
        num_new: dict[str, int] = {}  # request id -> tokens this step, in batch order
        preempted: list[str] = []

        blocked = False
        loras: set = set()  # LoRA adapters this step uses, at most cfg.max_loras
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING or req.request_id in self._busy:
                continue  # preempted as a victim earlier in this loop, or its last step is still in flight
            if budget == 0 or len(num_new) == cap:
                break
            if self._lora_full(req, loras):
                continue  # its adapter waits for a step with a free slot
            n = self._num_new_tokens(req, req.num_computed_tokens, budget)
            drafts = self._num_drafts(req, n, budget)
            if drafts and not bm.allocate_slots(req, n + drafts):
                drafts, req.spec_token_ids = 0, []  # no room for the drafts: a plain decode step
            n += drafts
            while not bm.allocate_slots(req, n):
                victim = self._preemption_victim()
                if victim is None:  # every other request is in flight: wait for one to come back
                    blocked = True
                    break
                budget += num_new.pop(victim.request_id, 0)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if blocked or req.status != RequestStatus.RUNNING:
                break  # it preempted itself: the pool is exhausted
            num_new[req.request_id] = n
            budget -= n
            if req.lora_request is not None:
                loras.add(req.lora_request)

        skipped = []  # waiting requests whose adapter finds no slot this step: back in the queue after
        while (self.waiting and not preempted and not blocked and budget > 0 and len(self.running) < cfg.max_num_seqs
               and len(num_new) < cap):
            req = self.waiting[0][-1]
            if self._lora_full(req, loras):
                skipped.append(heapq.heappop(self.waiting))
                continue
            if bm.is_swapped(req.request_id):  # preempted by swapping: its blocks come back, nothing recomputed
                num_hit = req.num_computed_tokens
                n = self._num_new_tokens(req, num_hit, budget)
                need = bm.resume_need(req, n)
                if need > bm.num_free_blocks:
                    break  # backpressure, as below
                bm.swap_in(req.request_id)
                allocated = bm.allocate_slots(req, n)
                assert allocated, "room was checked above"
            else:
                hit_block_ids, num_hit = bm.get_computed_blocks(req)
                n = self._num_new_tokens(req, num_hit, budget)
                if not cfg.enable_chunked_prefill and n < req.num_tokens - num_hit:
                    break  # the whole prompt must fit one step
                if not bm.allocate_slots(req, n, hit_block_ids):
                    break  # backpressure: it waits at the head until blocks free up
            heapq.heappop(self.waiting)
            req.status, req.num_computed_tokens = RequestStatus.RUNNING, num_hit
            self.running.append(req)
            num_new[req.request_id] = n
            budget -= n
            if req.lora_request is not None:
                loras.add(req.lora_request)
        for item in skipped:
            heapq.heappush(self.waiting, item)

        scheduled = [self._scheduled_request(self.requests[rid], n) for rid, n in num_new.items()]
        finished, self._finished_ids = self._finished_ids, []
        # Tier copies wait for a step that runs: a block brought back must be filled before any forward reads it.
        tier_ops = bm.pop_tier_ops() if scheduled else []
        output = SchedulerOutput(scheduled, bm.pop_block_copies(), preempted, finished, self.block_size, tier_ops)
        if scheduled:  # an empty step has nothing to come back
            self._pending.append(output)
            self._busy.update(num_new)
        return output

    @property
    def num_in_flight(self) -> int:
        """Scheduled outputs not yet given back to `update_from_output`."""
        return len(self._pending)

    def update_from_output(self, output: SchedulerOutput, step: StepOutput) -> StepResult:
        """Record a computed step: advance requests, append their sampled tokens,
        finish the ones that stop, cache newly full blocks. With several outputs in
        flight, they come back in the order they were scheduled."""
        if not output.scheduled and all(output is not p for p in self._pending):
            return StepResult([], [])
        if not self._pending or output is not self._pending[0]:
            raise ValueError("update_from_output takes the oldest output schedule() gave and not yet updated, once")
        entries = output.scheduled + output.forks
        rows: dict[RequestId, list[int]] = {}
        for i, rid in enumerate(step.request_ids):
            rows.setdefault(rid, []).append(i)
        # Requests aborted since schedule() are skipped and need no token.
        live = [s for s in entries if s.request.status == RequestStatus.RUNNING]
        missing = [s.request_id for s in live if s.do_sample and s.request_id not in rows]
        if missing:
            raise KeyError(f"no sampled token for requests {missing}, which this step samples")
        self._pending.pop(0)
        self._busy.difference_update(s.request_id for s in entries)
        progressed, finished = [], []
        for s in live:
            req = s.request
            status = None
            if not s.do_sample:
                req.num_computed_tokens = s.seq_len
            else:
                # Drafts past the accepted ones leave KV that the next step overwrites.
                taken = rows[s.request_id]
                if len(taken) > 1 + s.num_drafts:
                    raise ValueError(f"request {s.request_id!r} took {len(taken)} tokens from a step "
                                     f"that verified {s.num_drafts} drafts")
                req.num_computed_tokens = s.seq_len - s.num_drafts + len(taken) - 1
                req.spec_token_ids = []
                for row in taken:
                    req.append_output_token(int(step.token_ids[row]))
                    status = req.stop_status()
                    if status is None and req.num_tokens >= self.max_model_len:
                        status = RequestStatus.FINISHED_LENGTH_CAPPED
                    progressed.append(RequestProgress(req, row, status))
                    if status is not None:
                        break  # the accepted tokens after a stop are dropped
            self.block_manager.cache_blocks(req)
            if status is not None:
                self._finish(req, status)
                finished.append(req)
        progressed.sort(key=lambda p: p.row)
        return StepResult(progressed, finished)

    # -- helpers ---------------------------------------------------------------------
    def _num_new_tokens(self, req: Request, num_computed: int, budget: int) -> int:
        n = req.num_tokens - num_computed
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        return min(n, budget)

    def draft_room(self, req: Request) -> int:
        """The most drafts `req`'s next step could use: a step takes at most 1 + drafts
        tokens, within max_model_len and max_tokens."""
        room = self.max_model_len - req.num_tokens
        p = req.sampling_params
        if p is not None and p.max_tokens is not None:
            room = min(room, p.max_tokens - req.num_output_tokens)
        return max(0, room - 1)

    def _num_drafts(self, req: Request, n: int, budget: int) -> int:
        """Drafted tokens a decode step of `req` verifies: those that fit the budget and `draft_room`."""
        if not req.spec_token_ids or n != 1 or req.num_uncomputed_tokens != 1:
            return 0
        return max(0, min(len(req.spec_token_ids), budget - 1, self.draft_room(req)))

    def _rank(self, req: Request) -> float:
        cfg = self.config
        if cfg.policy == "fcfs":
            return 0.0
        return req.priority + (req.arrival_time / cfg.priority_aging_s if cfg.priority_aging_s else 0.0)

    def _push_waiting(self, req: Request) -> None:
        entry = (self._rank(req), req.arrival_time, self._add_order[req.request_id], req)
        heapq.heappush(self.waiting, entry)

    def _preemption_victim(self) -> Request | None:
        """The request to preempt (never one in flight), or None when every candidate is."""
        candidates = [r for r in self.running if r.request_id not in self._busy]
        if not candidates:
            return None
        if self.config.policy == "fcfs":
            return candidates[-1]  # the newest admitted
        return max(candidates, key=lambda r: (self._rank(r), r.arrival_time, self._add_order[r.request_id]))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        if not self._swap_out(req):
            self.block_manager.free(req.request_id)
            req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(req)

    def _swap_out(self, req: Request) -> bool:
        """Preempt by swapping where the mode asks for it and the tier has room: the
        request keeps its computed tokens, their KV waits in the tier."""
        mode = self.config.preemption_mode
        if mode == "recompute" or (mode == "auto" and req.num_computed_tokens < self.block_size):
            return False
        if self.block_manager.swap_out(req.request_id):
            self.num_swapped_out += 1
            return True
        return False

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting = [e for e in self.waiting if e[-1] is not req]
            heapq.heapify(self.waiting)
        self.block_manager.free(req.request_id)
        req.status = status
        del self.requests[req.request_id]
        del self._add_order[req.request_id]
        self._finished_ids.append(req.request_id)

    def _lora_full(self, req: Request, loras: set) -> bool:
        """Whether the step already uses max_loras adapters, none of them the request's."""
        lora = req.lora_request
        return lora is not None and 0 < self.config.max_loras <= len(loras) and lora not in loras

    def _scheduled_request(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        tokens = req.all_token_ids[start : start + n]
        drafts = n - len(tokens)
        if drafts:
            tokens = tokens + req.spec_token_ids[:drafts]
        bm = self.block_manager
        if isinstance(bm, HybridBlockManager):  # every group's table
            (block_ids, _), *groups = bm.block_table_rows(req.request_id)
        else:
            block_ids, groups = bm.block_table_row(req.request_id), ()
        return ScheduledRequest(req.request_id, start, n, tokens, block_ids, start + n - drafts == req.num_tokens, req,
                                drafts, bm.pages_per_block(req.request_id), tuple(groups))
