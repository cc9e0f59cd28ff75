"""LLMEngine: admission, scheduling, the executor's step, outputs.

One `step`: schedule, build the step's model and sampling inputs, `executor.execute_model`
(every rank's worker runs the forward, the sampling rank samples and verifies drafts),
`scheduler.update_from_output`, then the new tokens through the output processor.
"""

from __future__ import annotations

import logging
import sys
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..openmp import release_pool
from ..registry import get_reasoning_parser, get_spec_proposer
from .args import EngineArgs
from .config import SchedulerConfig, graph_batch_sizes
from .distributed import StepInput
from .executor import executor as executors
from .executor.sampler import ModelRunnerOutput, SamplingInput
from .lora import LoRAManager, LoRARequest, parse_lora_modules
from .multimodal import MultiModalProcessor, step_images
from .outputs import RequestOutput
from .processor import InputProcessor, OutputProcessor, compile_failure
from .request import Request, RequestStatus, SeqId
from .request_state import CompletionState, RequestState
from .sampling_batch import build_sampling_tensors, deferrable
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .scheduler_output import SchedulerOutput, StepOutput
from .speculative import DraftBudget, SpecDecodeStats, SpeculativeConfig
from .structured import StructuredOutputs

log = logging.getLogger("infer")


@dataclass
class _Plan:
    """Who samples from a step's logits: `comps[i]` takes sampled row i."""

    comps: list[CompletionState]
    sampling: SamplingInput
    deferred: frozenset[int]  # grammar rows sampled without their mask first


@dataclass
class _Launched:
    out: SchedulerOutput
    plan: _Plan
    result: Any  # ModelRunnerOutput, or the executor's Pending of a pipeline step


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, **kwargs: Any):
        a = args or EngineArgs(**kwargs)
        a.check()
        spec = SpeculativeConfig.parse(a.speculative_config)
        if spec is not None and a.pipeline_parallel_size > 1:
            raise ValueError("speculative decoding does not run with pipeline_parallel_size > 1 yet")
        self.reasoning = get_reasoning_parser(a.reasoning_parser)() if a.reasoning_parser else None
        self.args, self.parallel, self.speculative_config = a, a.parallel_config(), spec
        self.executor = executors.create(a, load_tokenizer=not a.skip_tokenizer_init)
        try:
            self._init(a)
        except BaseException:
            self.shutdown()
            raise
        release_pool()  # the loading thread's OpenMP workers: whichever thread steps the engine owns the only pool

    def _init(self, a: EngineArgs) -> None:
        w = self.worker = self.executor.worker  # this process's rank: it samples
        if w.pooling is not None:
            raise ValueError(f"{a.model} is a pooling model ({w.graph.architecture}): serve it with PoolingEngine "
                             "(LLM(...).embed / score / classify, or infer serve)")
        m = w.model
        self.backend, self.dtype, self.vocab_size = w.backend, w.dtype, w.vocab_size
        self.max_model_len = w.max_model_len
        self.dispatch_trace, self.expert_load = w.dispatch_trace, w.expert_load
        self.model_config, self.tokenizer, self.chat_template = m.config, m.tokenizer, m.chat_template
        self.generation_config = m.generation_config
        # Why there is no tokenizer, for the errors of what needs one; None when there is one.
        self.no_tokenizer = None if self.tokenizer is not None else (
            "the engine was built with skip_tokenizer_init=True" if a.skip_tokenizer_init else
            f"{a.model} ships no tokenizer (none of tokenizer.json, tokenizer.model, vocab.json or "
            "tokenizer_config.json beside its weights)")
        rpc = self.executor.collective_rpc
        self.cache_config = cache = a.cache_config(w.backend, w.kv_bytes_per_token(), self.max_model_len,
                                                   lambda n, block_size: rpc("profile_peak", n, block_size),
                                                   w.runner.kv_groups.windows)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.batched_tokens(),
            max_model_len=self.max_model_len, enable_chunked_prefill=a.enable_chunked_prefill,
            long_prefill_token_threshold=a.long_prefill_token_threshold, policy=a.scheduling_policy,
            preemption_mode=a.preemption_mode, max_loras=a.max_loras if a.enable_lora else 0), cache)
        self.lora = None
        self._lora_of: dict[str, LoRARequest] = {}  # request id -> its adapter, while it lives
        if a.enable_lora:
            self.lora = LoRAManager(w.lora_targets, w.runner.config.num_layers, a.max_loras, a.max_lora_rank,
                                    a.max_cpu_loras, lambda slot, adapter: rpc("write_lora", slot, adapter))
            for req in parse_lora_modules(a.lora_modules):
                self.lora.register(req)
        rpc("allocate_kv", cache.num_blocks, cache.block_size, cache.num_tier_blocks, a.kv_offload_path)
        _log_cache(cache, w, self.scheduler, self.max_model_len, a.preemption_mode)
        if self.executor.dist is not None and not a.enforce_eager:
            log.info("decode graphs are not captured with tensor parallelism yet; every step runs eagerly")
        if w.runner.kv_groups.num_groups > 1 and not a.enforce_eager:
            log.info("decode graphs are not captured with a hybrid KV cache yet (%s); every step runs eagerly",
                     w.runner.kv_groups.describe())
        # Captured decode graphs take no LoRA indices: with adapters every step runs eagerly.
        if not (a.enforce_eager or self.executor.dist is not None or a.enable_lora
                or w.runner.kv_groups.num_groups > 1):
            show = sys.stderr.isatty() if a.show_progress is None else a.show_progress
            rpc("capture_decode", graph_batch_sizes(a.max_num_seqs, a.cuda_graph_sizes), show)
        eos = self.generation_config.get("eos_token_id", w.graph.config.eos_token_ids)
        self.eos_token_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        self.structured = StructuredOutputs(a.structured_outputs_backend, self.tokenizer, self.vocab_size,
                                            self.eos_token_ids)
        self.input = InputProcessor(self.tokenizer, self.no_tokenizer, self.vocab_size, self.max_model_len,
                                    self.structured)
        if w.graph.encoder is not None:  # a VLM: images in prompts, by the checkpoint's processor
            spec = w.graph.encoder.encoder_inputs
            self.input.mm = MultiModalProcessor(m.source, w.graph.image_token_id,
                                                spec["rows_per_image"] - spec["drop_class"],
                                                (a.limit_mm_per_prompt or {}).get("image"))
        self.output = OutputProcessor(self.tokenizer, self.reasoning, a.seed)
        self._in_flight: list[_Launched] = []  # pipeline: steps started, not yet sampled
        # Requests whose grammar is still compiling: (state, first request, compile future).
        self._awaiting_grammar: list[tuple[RequestState, Request, futures.Future]] = []
        self._finished_unscheduled: set[str] = set()  # aborted while awaiting their grammar
        self.grammar_masks_skipped = 0  # grammar rows whose unmasked choice the grammar allowed
        spec = self.speculative_config
        self.proposer = get_spec_proposer(spec.method)(spec, w) if spec is not None else None
        self.spec_stats = SpecDecodeStats()
        self.draft_budget = DraftBudget(spec.num_speculative_tokens) if spec is not None and spec.adaptive else None

    def shutdown(self) -> None:
        """Stop the worker ranks and leave the process group (nothing to do in one process)."""
        if getattr(self, "structured", None) is not None:
            self.structured.shutdown()
        if getattr(self, "executor", None) is not None:
            self.executor.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass

    # -- requests ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | dict, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request; ValueError (naming the problem) if it cannot be served.
        `lora_request`: run it with that PEFT adapter (needs enable_lora)."""
        if request_id in self.output.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_request is not None:
            if self.lora is None:
                raise ValueError(f"request {request_id!r} asks for LoRA adapter {lora_request.lora_name!r} but the "
                                 "engine runs without LoRA; start it with enable_lora=True (--enable-lora)")
            self.lora.register(lora_request)  # read and checked now: a bad adapter fails this request
        text, ids, items, params, grammar = self.input.process(request_id, prompt, params or SamplingParams())
        state = RequestState(request_id, text, ids, params, pending_forks=params.n - 1,
                             arrival_time=arrival_time or time.time())
        req = Request(SeqId(request_id, 0), ids, params, state.arrival_time, priority, cache_salt,
                      eos_token_ids=self.eos_token_ids, lora_request=lora_request, mm_items=tuple(items))
        self.output.states[request_id] = state
        if lora_request is not None:  # held in host memory until the request ends
            self.lora.acquire(lora_request)
            self._lora_of[request_id] = lora_request
        if grammar is not None and not grammar.done():
            self._awaiting_grammar.append((state, req, grammar))  # scheduled once it compiles
            return
        if grammar is not None:
            state.grammar = grammar.result()
        self.scheduler.add_request(req)
        self.output.track(state, req, 0)

    def _admit_compiled(self) -> set[str]:
        """Schedule the requests whose grammar finished compiling; a grammar that
        failed ends its request ('abort', logged). Returns the ids that ended."""
        if not self.scheduler.requests and not any(f.done() for _, _, f in self._awaiting_grammar):
            # Nothing else to run: wait for a compile instead of spinning.
            futures.wait([f for _, _, f in self._awaiting_grammar], timeout=0.5, return_when=futures.FIRST_COMPLETED)
        waiting, ended = [], set()
        for state, req, fut in self._awaiting_grammar:
            if not fut.done():
                waiting.append((state, req, fut))
                continue
            if compile_failure(fut) is not None:
                log.error("request %r: %s", state.request_id, compile_failure(fut))
                req.status = RequestStatus.FINISHED_ABORTED
                state.pending_forks = 0
                ended.add(state.request_id)
            else:
                state.grammar = fut.result()
                self.scheduler.add_request(req)
            self.output.track(state, req, 0)
        self._awaiting_grammar = waiting
        return ended

    def abort_request(self, request_id: str) -> bool:
        state = self.output.states.get(request_id)
        if state is None:
            return False
        state.pending_forks = 0
        for c in state.completions:
            self.scheduler.abort_request(c.request.request_id)
        for i, (s, req, _) in enumerate(self._awaiting_grammar):
            if s is state:  # never scheduled: it ends with no completion
                del self._awaiting_grammar[i]
                req.status = RequestStatus.FINISHED_ABORTED
                self.output.track(state, req, 0)
                self._finished_unscheduled.add(request_id)
                break
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.output.states)

    def get_stats(self):
        """The scheduler's snapshot (`SchedulerStats`) with the speculative decoding counters."""
        stats = self.scheduler.get_stats()
        s = self.spec_stats
        stats.spec_decode = SpecDecodeStats(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
                                            list(s.accepted_per_position))
        return stats

    # -- the step -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; return outputs of requests that progressed.

        With pipeline stages (mp), up to `pipeline_parallel_size` steps are in
        flight: each call starts new steps on requests not already in one while
        there is room, then completes the oldest, so every stage has work."""
        touched: set[str] = self._admit_compiled() if self._awaiting_grammar else set()
        touched |= self._finished_unscheduled
        self._finished_unscheduled = set()
        if self.executor.pipelined:
            depth = self.parallel.pipeline_parallel_size
            while len(self._in_flight) < depth:
                # A share of the requests per step, so the next stage has the other shares to work on.
                out = self.scheduler.schedule(max_num_seqs=-(-len(self.scheduler.requests) // depth))
                touched |= {rid.request_id for rid in out.finished_request_ids}
                if out.is_empty:
                    break
                self._in_flight.append(self._launch(out, non_block=True))
            if self._in_flight:
                touched |= self._complete(self._in_flight.pop(0))
        else:
            if self.proposer is not None:
                self._propose()
            out = self.scheduler.schedule()
            touched |= {rid.request_id for rid in out.finished_request_ids}
            if not out.is_empty:
                start = time.perf_counter()
                touched |= self._complete(self._launch(out))
                if self.draft_budget is not None and all(s.do_sample and s.num_tokens == 1 + s.num_drafts
                                                         for s in out.scheduled):
                    self.draft_budget.observe_step(len(out.scheduled), sum(s.num_drafts for s in out.scheduled),
                                                   time.perf_counter() - start)
        results, done = self.output.outputs(touched)
        for state in done:
            if state.request_id in self._lora_of:
                self.lora.release(self._lora_of.pop(state.request_id))
            for c in state.completions:
                if self.draft_budget is not None:
                    self.draft_budget.forget(c.request.request_id)
                if self.proposer is not None:
                    self.proposer.forget(c.request.request_id)
        return results

    def _launch(self, out: SchedulerOutput, non_block: bool = False) -> _Launched:
        mi = out.model_input()
        plan = self._plan(out, mi)
        step = StepInput(mi.input_ids, mi.positions, mi.logits_indices, mi.attn_metadata, tuple(out.block_copies),
                         tuple(out.tier_ops), self._lora_indices(out),
                         step_images(out.scheduled) if self.input.mm is not None else ())
        return _Launched(out, plan, self.executor.execute_model(step, plan.sampling, non_block))

    def _plan(self, out: SchedulerOutput, mi) -> _Plan:
        """The sampled rows of a step: each sampling request's row (with drafts, one per
        draft and one after them), the forks of an n > 1 request whose prompt this step
        completes (each samples its own token from the parent's row), their tensors."""
        rows, comps, spec = [], [], []  # spec: per row, (drafts before it, its draft or -1)
        groups = []  # (first row, drafts) of each request that verifies drafts
        drafts_of = {s.request_id: s.token_ids[len(s.token_ids) - s.num_drafts:] for s in out.scheduled if s.num_drafts}
        first = 0
        for i, rid in enumerate(mi.sample_request_ids):
            row, first = first, first + (1 if mi.sample_num_rows is None else int(mi.sample_num_rows[i]))
            comp = self.output.completions[rid]
            drafts = drafts_of.get(rid, [])
            if drafts:
                groups.append((len(comps), len(drafts)))
            for j in range(len(drafts) + 1):
                rows.append(row + j)
                comps.append(comp)
                spec.append((drafts[:j], drafts[j] if j < len(drafts) else -1))
            state = self.output.states[rid.request_id]
            while state.pending_forks and comp.index == 0 and comp.request.num_output_tokens == 0:
                child = self.scheduler.fork_request(rid, SeqId(state.request_id, len(state.completions)))
                state.pending_forks -= 1
                self.output.track(state, child, len(state.completions))
                rows.append(row)
                comps.append(state.completions[-1])
                spec.append(((), -1))
        deferred = frozenset(i for i, c in enumerate(comps) if deferrable(c))
        for c in comps:
            c.mask_next = False  # masked first this step if it was set: unmasked first again next step
        tensors = build_sampling_tensors(comps, self.vocab_size, deferred, spec if groups else None)
        identity = len(rows) == len(mi.logits_indices) and rows == list(range(len(rows)))
        sampling = SamplingInput(tensors, None if identity else np.array(rows, dtype=np.int64), tuple(groups),
                                 keep_logits=bool(deferred))
        return _Plan(comps, sampling, deferred)

    def _lora_indices(self, out: SchedulerOutput) -> np.ndarray | None:
        """[T] each scheduled token's LoRA slot (0: none), the step's adapters put in slots first;
        None when no request of the step has an adapter."""
        loras = {s.request.lora_request for s in out.scheduled if s.request.lora_request is not None}
        if self.lora is None or not loras:
            return None  # the step's lora calls pass their input through
        slots = self.lora.activate(loras)
        per_request = np.array([slots.get(s.request.lora_request, 0) for s in out.scheduled], dtype=np.int64)
        return np.repeat(per_request, [s.num_tokens for s in out.scheduled])

    def _complete(self, launched: _Launched) -> set[str]:
        """A launched step's sampled tokens into the scheduler and the output processor;
        the ids of the requests it touched."""
        out, plan, res = launched.out, launched.plan, launched.result
        if not isinstance(res, ModelRunnerOutput):
            res = self.executor.finish(res)
        comps = plan.comps if res.kept is None else [plan.comps[i] for i in res.kept]
        step = StepOutput([c.request.request_id for c in comps], res.token_ids, res.logprobs, res.ranks,
                          res.top_token_ids, res.top_logprobs)
        if plan.deferred:
            self._resample_refused(plan, res.kept, step)
        failed = self.output.fail_non_finite([plan.comps[i] for i in res.non_finite]) if res.non_finite is not None \
            else []
        if failed:
            self.scheduler.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        for (first, k), accepted in zip(plan.sampling.groups, res.accepted):
            self.spec_stats.record(k, accepted)
            if self.draft_budget is not None:
                self.draft_budget.record(plan.comps[first].request.request_id, k, accepted)
        stopped = self.output.process(step, self.scheduler.update_from_output(out, step))
        if stopped:
            self.scheduler.finish_requests(list(stopped), RequestStatus.FINISHED_STOPPED)
        return {s.request_id.request_id for s in out.scheduled}

    def _resample_refused(self, plan: _Plan, kept: np.ndarray | None, step: StepOutput) -> None:
        """Grammar rows sampled unmasked (`deferrable`): those whose token the grammar
        refuses are sampled again under their masks (only their rows), into `step`."""
        refused, checked = [], 0  # refused: (sampled row, its row in `step`)
        for i in sorted(plan.deferred):
            j = i if kept is None else int(np.searchsorted(kept, i))
            c = plan.comps[i]
            if c.request.is_finished:  # aborted while its step was in flight (a pipeline's)
                continue
            checked += 1
            c.mask_next = not c.matcher.allows(int(step.token_ids[j]))
            if c.mask_next:
                refused.append((i, j))
        self.grammar_masks_skipped += checked - len(refused)
        if not refused:
            return
        again = self.worker.resample(np.array([i for i, _ in refused], dtype=np.int64),
                                     build_sampling_tensors([plan.comps[i] for i, _ in refused], self.vocab_size))
        idx = np.array([j for _, j in refused], dtype=np.int64)
        step.token_ids = np.array(step.token_ids)  # a backend's host view may be read-only
        step.token_ids[idx] = again.token_ids
        step.logprobs = np.array(step.logprobs)
        step.logprobs[idx] = again.logprobs
        if step.ranks is not None and again.ranks is not None:
            step.ranks = np.array(step.ranks)
            step.ranks[idx] = again.ranks

    def _propose(self) -> None:
        """Drafts for the next step of each decoding request: as many as `DraftBudget`
        plans (all of num_speculative_tokens when not adaptive), none for a grammar row
        or while `disable_by_batch_size` requests or more run."""
        spec, sched = self.speculative_config, self.scheduler
        running = [r for r in sched.running if r.status == RequestStatus.RUNNING and r.num_uncomputed_tokens == 1]
        limit = spec.disable_by_batch_size
        if limit is not None and len(sched.running) >= limit:
            for r in running:
                r.spec_token_ids = []
            return
        budget = self.draft_budget
        want = (budget.plan([r.request_id for r in running], len(sched.running)) if budget is not None
                else [spec.num_speculative_tokens] * len(running))
        reqs, budgets = [], []
        for r, room in zip(running, want):
            comp = self.output.completions.get(r.request_id)
            room = min(room, sched.draft_room(r))
            if comp is None or comp.matcher is not None or room <= 0:
                r.spec_token_ids = []
                continue
            reqs.append(r)
            budgets.append(room)
        if reqs:
            for r, drafts in zip(reqs, self.proposer.propose(reqs, budgets)):
                r.spec_token_ids = [int(t) for t in drafts]


def kv_concurrency(cache, scheduler, num_tokens: int) -> float:
    """Requests of `num_tokens` tokens the pool holds at once (a hybrid cache's windowed
    groups hold only their window)."""
    return cache.num_blocks / scheduler.blocks_for(num_tokens)


def _log_cache(cache, worker, scheduler, max_model_len: int, preemption_mode: str) -> None:
    tokens = cache.num_blocks * cache.block_size
    sizes = "/".join(str(k * cache.block_size) for k in cache.block_multiples)
    groups = worker.runner.kv_groups
    log.info("KV cache: %d blocks of %s tokens = %d tokens (%.1f MiB)%s; maximum concurrency for %d-token requests: "
             "%.2fx", cache.num_blocks, sizes if len(cache.block_multiples) == 1 else
             f"{cache.block_size} (requests use blocks of {sizes} by expected length)", tokens,
             cache.num_blocks * worker.runner.kv_cache_bytes_per_block(cache.block_size) / 2**20,
             f", hybrid: {groups.describe()} (a block holds one group's layers)" if groups.is_hybrid else "",
             max_model_len, kv_concurrency(cache, scheduler, max_model_len))
    if cache.num_tier_blocks:
        store = worker.runner.kv_tier
        log.info("KV host tier: %d blocks = %d tokens (%.1f MiB, %s); preemption mode %s", cache.num_tier_blocks,
                 cache.num_tier_blocks * cache.block_size, store.nbytes / 2**20,
                 f"memory-mapped file {store.path}" if store.path else "memory-mapped temporary file"
                 if isinstance(store.data, np.memmap) else "host memory", preemption_mode)
