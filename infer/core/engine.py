"""LLMEngine: the step loop that ties scheduler, model runner and sampler."""

from __future__ import annotations

import dataclasses
import logging
from concurrent import futures
from concurrent.futures import Future
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dispatch import DispatchTrace, Ops
from ..registry import get_reasoning_parser, get_spec_proposer
from ..openmp import release_pool
from ..primitives.types import AttentionMetadata, expand_block_table
from . import distributed
from .args import MAX_DEFAULT_KV_BYTES, PER_RANK_ARGS, EngineArgs
from .config import POLICIES, CacheConfig, SchedulerConfig, graph_batch_sizes
from .distributed import DistributedState, StepInput
from .executor import launch
from .executor.rank import build_model, execute_step, move_blocks, rank_backend, rank_path
from .expert_load import ExpertLoad
from .lora import LoRAManager, LoRARequest, parse_lora_modules
from .parallel import max_kv_heads
from .quant_params import QUANTIZATIONS
from .outputs import RequestOutput
from .request import Request, RequestStatus, SeqId
from .request_state import CompletionState, RequestState
from .sampling_batch import build_sampling_tensors, deferrable
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .scheduler_output import SchedulerOutput, StepOutput, StepResult
from .detokenizer import IncrementalDetokenizer
from .speculative import DraftBudget, SpecDecodeStats, SpeculativeConfig
from .structured import StructuredOutputs

@dataclass(slots=True)
class _Launched:
    """A step whose forward has been started: rank 0 of a pipeline has run its stage
    and takes the logits (of `logits_shape`) from the last stage when the step completes."""

    out: SchedulerOutput
    mi: Any
    forward: Any
    logits_shape: tuple[int, int] | None = None


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, **kwargs: Any):
        a = args or EngineArgs(**kwargs)
        _check_args(a)
        self.args = a
        self.parallel = a.parallel_config()
        self.dist: DistributedState | None = None
        local_rank = int(os.environ.get("LOCAL_RANK", 0)) if self.parallel.executor == "external_launcher" else 0
        self.backend = rank_backend(a, local_rank)
        if self.parallel.executor is not None:
            fields = dataclasses.asdict(a)
            self.dist = launch.start(self.parallel, self.backend.dist_backend, fields)
            try:
                self.dist.check_agreement({k: v for k, v in fields.items() if k not in PER_RANK_ARGS})
            except BaseException:
                self.shutdown()
                raise
        try:
            self._init_model(a)
        except BaseException:
            self.shutdown()
            raise
        release_pool()  # the loading thread's OpenMP workers: whichever thread steps the engine owns the only pool

    def _init_model(self, a: EngineArgs) -> None:
        self.dispatch_trace = DispatchTrace() if a.trace_dispatch else None
        self.ops = Ops(self.backend, trace=self.dispatch_trace)
        self._sample = self.ops.bind("sample", "sampler")
        parts = build_model(a, self.backend, self.ops, self.dist, load_tokenizer=not a.skip_tokenizer_init)
        m, graph, program = parts.loaded, parts.graph, parts.program
        self.model_config, self.tokenizer, self.chat_template = m.config, m.tokenizer, m.chat_template
        # Why there is no tokenizer, for the errors of what needs one; None when there is one.
        self.no_tokenizer = None if self.tokenizer is not None else (
            "the engine was built with skip_tokenizer_init=True" if a.skip_tokenizer_init else
            f"{a.model} ships no tokenizer (none of tokenizer.json, tokenizer.model, vocab.json or "
            "tokenizer_config.json beside its weights)")
        self.generation_config = m.generation_config
        self.dtype, self.max_model_len, self.runner = parts.dtype, parts.max_model_len, parts.runner
        # MoE models: tokens per expert per layer, accumulated over steps; None for dense models.
        self.expert_load = ExpertLoad.for_program(program, self.backend.to_numpy)
        del m, parts
        cache = self._cache_config(a)
        self.cache_config = cache
        sched = SchedulerConfig(
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens or max(2048, a.max_num_seqs),
            max_model_len=self.max_model_len,
            enable_chunked_prefill=a.enable_chunked_prefill,
            long_prefill_token_threshold=a.long_prefill_token_threshold,
            policy=a.scheduling_policy,
            preemption_mode=a.preemption_mode,
            max_loras=a.max_loras if a.enable_lora else 0,
        )
        self.scheduler = Scheduler(sched, cache)
        self.lora = None
        self._lora_of: dict[str, LoRARequest] = {}  # request id -> its adapter, while it lives
        if a.enable_lora:
            self.lora = LoRAManager(self.runner, graph, a.max_loras, a.max_lora_rank, a.max_cpu_loras)
            for req in parse_lora_modules(a.lora_modules):
                self.lora.register(req)
        self._allocate_kv_caches(cache.num_blocks, cache.block_size, cache.num_tier_blocks, a.kv_offload_path)
        tokens = cache.num_blocks * cache.block_size
        sizes = "/".join(str(k * cache.block_size) for k in cache.block_multiples)
        logging.getLogger("infer").info(
            "KV cache: %d blocks of %s tokens = %d tokens (%.1f MiB); maximum concurrency for %d-token requests: "
            "%.2fx", cache.num_blocks, sizes if len(cache.block_multiples) == 1 else
            f"{cache.block_size} (requests use blocks of {sizes} by expected length)", tokens,
            cache.num_blocks * self.runner.kv_cache_bytes_per_block(cache.block_size) / 2**20, self.max_model_len,
            tokens / self.max_model_len)
        if cache.num_tier_blocks:
            store = self.runner.kv_tier
            logging.getLogger("infer").info(
                "KV host tier: %d blocks = %d tokens (%.1f MiB, %s); preemption mode %s", cache.num_tier_blocks,
                cache.num_tier_blocks * cache.block_size, store.nbytes / 2**20,
                f"memory-mapped file {store.path}" if store.path else "memory-mapped temporary file"
                if isinstance(store.data, np.memmap) else "host memory", a.preemption_mode)
        if self.dist is not None and not a.enforce_eager:
            logging.getLogger("infer").info("decode graphs are not captured with tensor parallelism yet; "
                                            "every step runs eagerly")
        # Captured decode graphs take no LoRA indices: with adapters every step runs eagerly.
        eager = a.enforce_eager or self.dist is not None or a.enable_lora
        self.decode_graphs = None if eager else self._capture_decode(a, cache.block_size)
        eos = self.generation_config.get("eos_token_id", graph.config.eos_token_ids)
        self.eos_token_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        self.vocab_size = graph.config.vocab_size
        self._rng = np.random.default_rng(a.seed)
        self._states: dict[str, RequestState] = {}
        self._in_flight: list[_Launched] = []  # pipeline: steps started, logits not yet taken
        self._completions: dict[SeqId, CompletionState] = {}
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        self._decode_token = (lambda t: decode([t])) if decode is not None else (lambda t: None)
        self.structured = StructuredOutputs(a.structured_outputs_backend, self.tokenizer, self.vocab_size,
                                            self.eos_token_ids)
        self.reasoning = get_reasoning_parser(a.reasoning_parser)() if a.reasoning_parser else None
        # Requests whose grammar is still compiling: (state, first request, compile future).
        self._awaiting_grammar: list[tuple[RequestState, Request, Future]] = []
        self._finished_unscheduled: set[str] = set()  # aborted while awaiting their grammar
        self.grammar_masks_skipped = 0  # grammar rows whose unmasked choice the grammar allowed
        self.speculative_config = spec = SpeculativeConfig.parse(a.speculative_config)
        self.proposer = get_spec_proposer(spec.method)(spec, self) if spec is not None else None
        self.spec_stats = SpecDecodeStats()
        self.draft_budget = DraftBudget(spec.num_speculative_tokens) if spec is not None and spec.adaptive else None

    # -- distributed ---------------------------------------------------------------
    def _to_workers(self, message: tuple) -> None:
        """mp driver: hand a message to every worker rank (a no-op in one process or under torchrun)."""
        d = self.dist
        if d is None or not d.is_driver:
            return
        if d.aborted or d.failed:
            raise RuntimeError(d.aborted or f"distributed worker {d.failed}; the engine cannot continue")
        try:
            d.broadcast(message)
        except Exception as exc:
            raise d.lost(exc) from exc

    def _allocate_kv_caches(self, num_blocks: int, block_size: int, tier_blocks: int = 0,
                            tier_path: str | None = None) -> None:
        self._to_workers(("kv", num_blocks, block_size, tier_blocks, tier_path))
        self.runner.allocate_kv_caches(num_blocks, block_size)
        if tier_blocks:
            self.runner.allocate_kv_tier(tier_blocks, rank_path(tier_path, self.dist))

    def _release_kv_caches(self) -> None:
        self._to_workers(("release",))
        self.runner.release_kv_caches()

    def _execute(self, step: StepInput, wait_logits: bool = True):
        """One step's forward on every rank. The logits end up on this rank, except
        with ``wait_logits=False`` on rank 0 of an mp pipeline, where they are None
        until `_recv_logits` takes them from the last stage."""
        self._to_workers(("step", step))
        if self.dist is None:
            return execute_step(self.runner, step)
        try:
            out = execute_step(self.runner, step, self.dist)
        except RuntimeError as exc:  # a collective whose peer died or timed out
            raise self.dist.lost(exc) from exc
        if out.logits is None and wait_logits:
            out = dataclasses.replace(out, logits=self._recv_logits((len(step.sample_rows), self.vocab_size)))
        return out

    def _recv_logits(self, shape: tuple[int, int]):
        try:
            return self.dist.recv_logits(self.backend, shape)
        except RuntimeError as exc:
            raise self.dist.lost(exc) from exc

    def shutdown(self) -> None:
        """Stop the worker ranks and leave the process group (nothing to do in one process)."""
        if getattr(self, "structured", None) is not None:
            self.structured.shutdown()
        d, self.dist = getattr(self, "dist", None), None
        if d is None:
            return
        for launched in getattr(self, "_in_flight", ()):  # take what the last stage still sends
            if d.failed is None and d.aborted is None and launched.logits_shape is not None:
                try:
                    d.recv_logits(self.backend, launched.logits_shape)
                except Exception:  # noqa: BLE001 (a dead stage: nothing will come)
                    break
        self._in_flight = []
        d.close()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass

    # -- set-up helpers ---------------------------------------------------------

    def _cache_config(self, a: EngineArgs) -> CacheConfig:
        multiples = (1,)
        if a.block_size == "auto":
            sizes = self.backend.auto_block_sizes
            block_size, multiples = sizes[0], tuple(s // sizes[0] for s in sizes)
        else:
            block_size = a.block_size or self.backend.preferred_block_size
        per_token = self.runner.kv_cache_bytes_per_block(1)
        if self.dist is not None:  # every rank gets the same number of blocks: size them for the rank with most KV heads
            cfg = self.runner.config
            most = max_kv_heads(cfg.num_heads, cfg.num_kv_heads, self.parallel.tensor_parallel_size)
            layers = max(b - a for a, b in (distributed.stage_layers(cfg.num_layers, s, self.parallel.pipeline_parallel_size)
                                            for s in range(self.parallel.pipeline_parallel_size)))
            per_token = per_token * most * layers // (self.runner.num_kv_heads * len(self.runner.layers))
        if a.kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_bytes must be >= 0, got {a.kv_offload_bytes}")
        tier = a.kv_offload_bytes // (per_token * block_size)
        if a.kv_offload_bytes and not tier:
            raise ValueError(f"kv_offload_bytes={a.kv_offload_bytes} holds no KV block of {block_size} tokens "
                             f"({per_token * block_size} bytes); raise it or pass 0 for no host tier")
        if a.num_gpu_blocks_override:
            return CacheConfig(block_size, num_blocks=a.num_gpu_blocks_override, enable_prefix_caching=a.enable_prefix_caching,
                               num_tier_blocks=tier, block_multiples=multiples).resolve(block_size)
        kv_bytes = a.kv_cache_memory or self._kv_budget(a, per_token, block_size)
        # At least one full context, or the scheduler could never finish a long request.
        floor = per_token * (self.max_model_len + block_size)
        if a.kv_cache_memory and a.kv_cache_memory < floor:
            logging.getLogger("infer").warning(
                "kv_cache_memory=%.1f MiB is less than one full context (max_model_len=%d tokens at %d bytes per "
                "token); the KV cache is %.1f MiB instead. Lower max_model_len for a smaller cache",
                a.kv_cache_memory / 2**20, self.max_model_len, per_token, floor / 2**20)
        kv_bytes = max(kv_bytes, floor)
        return CacheConfig(block_size, kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=a.enable_prefix_caching,
                           num_tier_blocks=tier, block_multiples=multiples).resolve(block_size, per_token)

    def _kv_budget(self, a: EngineArgs, per_token: int, block_size: int) -> int:
        """KV pool bytes when the user gave none: on host memory, enough for
        max_num_seqs full contexts (capped); on an accelerator, what
        gpu_memory_utilization leaves after profiling one full-budget forward."""
        mem = self.backend.memory_info()
        if mem is None:
            return min(MAX_DEFAULT_KV_BYTES, per_token * a.max_num_seqs * self.max_model_len)
        if not 0 < a.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {a.gpu_memory_utilization}")
        peak = self._profile_peak(min(a.max_num_batched_tokens or 2048, self.max_model_len), block_size)
        budget = int(mem[0] * a.gpu_memory_utilization) - peak
        if budget < per_token * block_size:
            raise ValueError(f"gpu_memory_utilization={a.gpu_memory_utilization} of {mem[0] / 2**30:.1f} GiB leaves no "
                             f"room for the KV cache after weights and activations ({peak / 2**30:.2f} GiB); raise it")
        return budget

    def _profile_peak(self, n: int, block_size: int) -> int:
        """Peak device bytes of one forward over `n` prompt tokens (weights included)."""
        be, blocks = self.backend, -(-n // block_size)
        be.reset_peak_memory()
        self._allocate_kv_caches(blocks, block_size)
        meta = AttentionMetadata(np.array([0, n], np.int32), np.array([n], np.int32),
                                 np.arange(blocks, dtype=np.int32)[None], np.arange(n, dtype=np.int64), n, n, block_size)
        self._execute(StepInput(np.zeros(n, np.int64), np.arange(n, dtype=np.int64), np.array([n - 1], np.int64), meta))
        be.synchronize()
        self._release_kv_caches()
        return be.memory_info()[1]

    def _capture_decode(self, a: EngineArgs, block_size: int):
        """The backend's captured decode steps (None where it has none). A failed
        capture is reported and the engine runs eagerly."""
        sizes = graph_batch_sizes(a.max_num_seqs, a.cuda_graph_sizes)
        show = sys.stderr.isatty() if a.show_progress is None else a.show_progress

        def progress(items):
            from tqdm import tqdm

            return tqdm(items, desc="Capturing decode graphs", unit="graph", file=sys.stderr, disable=not show,
                        leave=False)

        log = logging.getLogger("infer")
        start = time.perf_counter()
        try:
            graphs = self.ops.decode_graphs(self.runner.forward, max_model_len=self.max_model_len,
                                            block_size=block_size, batch_sizes=sizes, progress=progress)
        except Exception as exc:  # noqa: BLE001  (any capture failure leaves eager decode working)
            log.warning("backend '%s' failed to capture decode graphs (%s: %s); every step runs eagerly "
                        "(--enforce-eager skips the attempt)", self.backend.name, type(exc).__name__, exc)
            return None
        if graphs is not None:
            log.info("captured decode graphs for batch sizes %s in %.1f s", list(sizes), time.perf_counter() - start)
        return graphs

    # -- requests ---------------------------------------------------------------
    def tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt.get("prompt", "")
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError(f"a text prompt needs the tokenizer, but {self.no_tokenizer}: pass "
                             "{'prompt_token_ids': [...]} instead")
        return prompt, list(self.tokenizer(prompt).input_ids)

    def add_request(self, request_id: str, prompt: str | dict, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request; ValueError (naming the problem) if it cannot be served.
        `lora_request`: run it with that PEFT adapter (needs enable_lora)."""
        params = params or SamplingParams()
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_request is not None:
            if self.lora is None:
                raise ValueError(f"request {request_id!r} asks for LoRA adapter {lora_request.lora_name!r} but the "
                                 "engine runs without LoRA; start it with enable_lora=True (--enable-lora)")
            self.lora.register(lora_request)  # read and checked now: a bad adapter fails this request
        text, ids = self.tokenize(prompt)
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {request_id!r}: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"request {request_id!r}: the prompt has {len(ids)} tokens but max_model_len is "
                             f"{self.max_model_len}, which leaves no room to generate; shorten the prompt")
        self._check_params(request_id, params)
        room = self.max_model_len - len(ids)
        if params.max_tokens is None or params.max_tokens > room:
            params = dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        grammar = self.structured.compile(params.structured_outputs) if params.structured_outputs else None
        failure = _compile_failure(grammar) if grammar is not None and grammar.done() else None
        if failure is not None:
            raise ValueError(f"request {request_id!r}: {failure}")
        state = RequestState(request_id, text, ids, params, pending_forks=params.n - 1,
                             arrival_time=arrival_time or time.time())
        req = Request(SeqId(request_id, 0), ids, params, state.arrival_time, priority, cache_salt,
                      eos_token_ids=self.eos_token_ids,
                      lora_request=lora_request)
        self._states[request_id] = state
        if lora_request is not None:  # held in host memory until the request ends
            self.lora.acquire(lora_request)
            self._lora_of[request_id] = lora_request
        if grammar is not None and not grammar.done():
            self._awaiting_grammar.append((state, req, grammar))  # scheduled once it compiles
            return
        if grammar is not None:
            state.grammar = grammar.result()
        self.scheduler.add_request(req)
        self._track(state, req, 0)

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
            elif _compile_failure(fut) is not None:
                logging.getLogger("infer").error("request %r: %s", state.request_id, _compile_failure(fut))
                req.status = RequestStatus.FINISHED_ABORTED
                state.pending_forks = 0
                self._track(state, req, 0)
                ended.add(state.request_id)
            else:
                state.grammar = fut.result()
                self.scheduler.add_request(req)
                self._track(state, req, 0)
        self._awaiting_grammar = waiting
        return ended

    def _check_params(self, request_id: str, p: SamplingParams) -> None:
        # Checked here, not in the sampler: an out-of-vocabulary id would fail the
        # whole step, and every later one, for all requests in the batch.
        for name, ids in (("logit_bias", p.logit_bias or {}), ("stop_token_ids", p.stop_token_ids)):
            bad = [t for t in ids if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(f"request {request_id!r}: SamplingParams.{name} has token ids {bad[:5]} outside "
                                 f"the vocabulary [0, {self.vocab_size})")
        if p.stop_strings and (self.tokenizer is None or not p.detokenize):
            why = f"there is no tokenizer ({self.no_tokenizer})" if self.tokenizer is None else \
                "detokenize=False turns it off"
            raise ValueError(f"request {request_id!r}: SamplingParams.stop needs the generated text, and "
                             f"{why}; use stop_token_ids instead")

    def _track(self, state: RequestState, req: Request, index: int) -> None:
        p = state.params
        seed = p.seed + index if p.seed is not None else int(self._rng.integers(0, 2**62))
        detok = None
        if self.tokenizer is not None and p.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids, p.skip_special_tokens)
        comp = CompletionState(index, req, p, seed, detok)
        if state.grammar is not None and not req.is_finished:
            comp.matcher = state.grammar.matcher()  # compiled at admission: the step never waits for one
            if self.reasoning is not None and detok is not None and state.completions:
                comp.reasoning = state.completions[0].reasoning  # a fork, made before its parent's first token
            elif self.reasoning is not None and detok is not None:
                # The grammar waits for the end of the reasoning, unless the prompt already closed it.
                tail = self.tokenizer.decode(state.prompt_token_ids[-64:])
                comp.reasoning = None if _closed(tail, self.reasoning) else self.reasoning
        state.completions.append(comp)
        self._completions[req.request_id] = comp

    def abort_request(self, request_id: str) -> bool:
        state = self._states.get(request_id)
        if state is None:
            return False
        state.pending_forks = 0
        for c in state.completions:
            self.scheduler.abort_request(c.request.request_id)
        for i, (s, req, _) in enumerate(self._awaiting_grammar):
            if s is state:  # never scheduled: it ends with no completion
                del self._awaiting_grammar[i]
                req.status = RequestStatus.FINISHED_ABORTED
                self._track(state, req, 0)
                self._finished_unscheduled.add(request_id)
                break
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

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
        if self._pipelined:
            depth = self.parallel.pipeline_parallel_size
            while len(self._in_flight) < depth:
                # A share of the requests per step, so the next stage has the other shares to work on.
                share = -(-len(self.scheduler.requests) // depth)
                out = self.scheduler.schedule(max_num_seqs=share)
                touched |= {rid.request_id for rid in out.finished_request_ids}
                if out.is_empty:
                    break
                self._in_flight.append(self._launch(out))
            if self._in_flight:
                launched = self._in_flight.pop(0)
                self._process(*self._complete(launched))
                touched |= {s.request_id.request_id for s in launched.out.scheduled}
        else:
            if self.proposer is not None:
                self._propose()
            out = self.scheduler.schedule()
            touched |= {rid.request_id for rid in out.finished_request_ids}
            if not out.is_empty:
                start = time.perf_counter()
                self._process(*self._complete(self._launch(out)))
                touched |= {s.request_id.request_id for s in out.scheduled}
                if self.draft_budget is not None and all(s.do_sample and s.num_tokens == 1 + s.num_drafts
                                                         for s in out.scheduled):
                    self.draft_budget.observe_step(len(out.scheduled), sum(s.num_drafts for s in out.scheduled),
                                                   time.perf_counter() - start)
        results = []
        for rid in touched:
            state = self._states.get(rid)
            if state is None:
                continue
            results.append(self._output(state))
            if state.finished:
                del self._states[rid]
                if rid in self._lora_of:
                    self.lora.release(self._lora_of.pop(rid))
                for c in state.completions:
                    self._completions.pop(c.request.request_id, None)
                    if self.draft_budget is not None:
                        self.draft_budget.forget(c.request.request_id)
                    if self.proposer is not None:
                        self.proposer.forget(c.request.request_id)
        return results

    @property
    def _pipelined(self) -> bool:
        d = self.dist
        return d is not None and d.is_driver and self.parallel.pipeline_parallel_size > 1

    def _launch(self, out: SchedulerOutput) -> _Launched:
        """Start one scheduled step's forward (and finish it, unless this rank is the
        first stage of a pipeline, whose logits come later from the last stage)."""
        be = self.backend
        mi = out.model_input()
        graphs, meta = self.decode_graphs, mi.attn_metadata
        copies, tier_ops = tuple(out.block_copies), tuple(out.tier_ops)
        if graphs is not None and meta.block_sizes is not None:  # captured steps read tables of pages
            meta = expand_block_table(meta)
        if graphs is not None and graphs.can_replay(meta):
            move_blocks(self.runner, tier_ops, copies)
            forward = graphs.forward(mi.input_ids, mi.positions, meta)  # every row's logits
            if len(mi.logits_indices) != meta.num_seqs:  # a one-token prompt chunk samples nothing
                forward = dataclasses.replace(forward, logits=forward.logits[be.asarray(mi.logits_indices)])
            return _Launched(out, mi, forward)
        step = StepInput(mi.input_ids, mi.positions, mi.logits_indices, meta, copies, tier_ops, self._lora_indices(out))
        if not self._pipelined:
            return _Launched(out, mi, self._execute(step))
        return _Launched(out, mi, self._execute(step, wait_logits=False), (len(mi.logits_indices), self.vocab_size))

    def _lora_indices(self, out: SchedulerOutput) -> np.ndarray | None:
        """[T] each scheduled token's LoRA slot (0: none), the step's adapters put in slots first;
        None when no request of the step has an adapter."""
        loras = {s.request.lora_request for s in out.scheduled if s.request.lora_request is not None}
        if self.lora is None or not loras:
            return None  # the step's lora calls pass their input through
        slots = self.lora.activate(loras)
        per_request = np.array([slots.get(s.request.lora_request, 0) for s in out.scheduled], dtype=np.int64)
        return np.repeat(per_request, [s.num_tokens for s in out.scheduled])

    def _complete(self, launched: _Launched) -> tuple[StepOutput, StepResult]:
        """Sampling of a launched step, handed to the scheduler."""
        be, out, mi, forward = self.backend, launched.out, launched.mi, launched.forward
        logits = forward.logits if launched.logits_shape is None else self._recv_logits(launched.logits_shape)
        if self.expert_load is not None:
            self.expert_load.record(forward.expert_counts)
        rows, comps, spec = [], [], []  # spec: per row, (drafts before it, its draft or -1)
        groups = []  # (first entry in comps, drafts) of each request that verifies drafts
        drafts_of = {s.request_id: s.token_ids[len(s.token_ids) - s.num_drafts:] for s in out.scheduled if s.num_drafts}
        first = 0
        for i, rid in enumerate(mi.sample_request_ids):
            row, first = first, first + (1 if mi.sample_num_rows is None else int(mi.sample_num_rows[i]))
            comp = self._completions.get(rid)
            if comp is None or comp.request.status.is_finished:
                continue  # aborted while its step was in flight
            drafts = drafts_of.get(rid, [])
            if drafts:
                groups.append((len(comps), len(drafts)))
            for j in range(len(drafts) + 1):
                rows.append(row + j)
                comps.append(comp)
                spec.append((drafts[:j], drafts[j] if j < len(drafts) else -1))
            state = self._states[rid.request_id]
            # n > 1: the children fork when the prompt is computed, sharing its
            # blocks copy-on-write, and each samples its own token from this row.
            while state.pending_forks and comp.index == 0 and comp.request.num_output_tokens == 0:
                index = len(state.completions)
                child = self.scheduler.fork_request(rid, SeqId(state.request_id, index))
                state.pending_forks -= 1
                self._track(state, child, index)
                rows.append(row)
                comps.append(state.completions[-1])
                spec.append(((), -1))
        if not comps:
            step = StepOutput([], np.zeros(0, np.int64), np.zeros(0, np.float32))
            return step, self.scheduler.update_from_output(out, step)
        if len(rows) != logits.shape[0] or rows != list(range(len(rows))):
            logits = logits[be.asarray(np.array(rows, dtype=np.int64))]
        deferred = frozenset(i for i, c in enumerate(comps) if deferrable(c))
        for c in comps:
            c.mask_next = False  # masked first this step if it was set: unmasked first again next step
        tensors = build_sampling_tensors(comps, self.vocab_size, deferred, spec if groups else None)
        sampled = self._sample(logits, be.prepare_sampling(tensors))
        host = (lambda x: be.to_numpy(x) if x is not None else None)
        step = StepOutput([c.request.request_id for c in comps], host(sampled.token_ids), host(sampled.logprobs),
                          host(sampled.ranks), host(sampled.top_token_ids), host(sampled.top_logprobs))
        if deferred:
            self._resample_refused(logits, comps, deferred, step)
        self._fail_non_finite(comps, step)
        if groups:
            step = self._taken(step, groups, host(sampled.accepted))
        return step, self.scheduler.update_from_output(out, step)

    def _taken(self, step: StepOutput, groups: list[tuple[int, int]], accepted: np.ndarray) -> StepOutput:
        """The rows requests take from a step that verified drafts: each one's accepted
        drafts (the leading accepted rows) and the token after them."""
        keep = np.ones(len(step.request_ids), dtype=bool)
        for first, k in groups:
            a = 0
            while a < k and accepted[first + a]:
                a += 1
            keep[first + a + 1 : first + k + 1] = False
            self.spec_stats.record(k, a)
            if self.draft_budget is not None:
                self.draft_budget.record(step.request_ids[first], k, a)
        idx = np.flatnonzero(keep)
        pick = (lambda x: None if x is None else np.asarray(x)[idx])  # noqa: E731
        return StepOutput([step.request_ids[i] for i in idx], pick(step.token_ids), pick(step.logprobs),
                          pick(step.ranks), pick(step.top_token_ids), pick(step.top_logprobs))

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
            comp = self._completions.get(r.request_id)
            room = min(room, sched.draft_room(r))
            if comp is None or comp.matcher is not None or room <= 0:
                r.spec_token_ids = []
                continue
            reqs.append(r)
            budgets.append(room)
        if reqs:
            for r, drafts in zip(reqs, self.proposer.propose(reqs, budgets)):
                r.spec_token_ids = [int(t) for t in drafts]

    def _fail_non_finite(self, comps: list[CompletionState], step: StepOutput) -> None:
        """End with finish_reason 'error' the requests whose logits held nan or inf (their
        sampled logprob is nan): a token sampled from them would be garbage (token 0)."""
        bad = np.flatnonzero(np.isnan(np.asarray(step.logprobs, dtype=np.float64)))
        if not bad.size:
            return
        ids = list(dict.fromkeys(comps[i].request.request_id for i in bad))
        for rid in ids:
            logging.getLogger("infer").error("request %r: the model's logits hold nan or inf; the request ends with "
                                             "finish_reason 'error'", rid.request_id)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)

    def _resample_refused(self, logits, comps: list[CompletionState], deferred: frozenset, step: StepOutput) -> None:
        """Grammar rows sampled unmasked (`deferrable`): those whose token the grammar
        refuses are sampled again under their masks (only their rows), into `step`."""
        refused = []
        for i in sorted(deferred):
            ok = comps[i].matcher.allows(int(step.token_ids[i]))
            comps[i].mask_next = not ok
            if not ok:
                refused.append(i)
        self.grammar_masks_skipped += len(deferred) - len(refused)
        if not refused:
            return
        be, idx = self.backend, np.array(refused, dtype=np.int64)
        again = self._sample(logits[be.asarray(idx)],
                             be.prepare_sampling(build_sampling_tensors([comps[i] for i in refused], self.vocab_size)))
        step.token_ids = np.array(step.token_ids)  # a backend's host view may be read-only
        step.token_ids[idx] = be.to_numpy(again.token_ids)
        step.logprobs = np.array(step.logprobs)
        step.logprobs[idx] = be.to_numpy(again.logprobs)
        if step.ranks is not None and again.ranks is not None:
            step.ranks = np.array(step.ranks)
            step.ranks[idx] = be.to_numpy(again.ranks)

    def _process(self, step: StepOutput, result: StepResult) -> None:
        """Per new token: grammar, logprobs and text; a stop string or the grammar's end finishes its request
        (and drops the tokens a speculative step accepted after that one)."""
        stopped: dict[Any, int] = {}  # request id -> its output tokens to keep
        left = {}  # tokens of this step each request has still to process
        for p in result.progressed:
            left[p.request.request_id] = left.get(p.request.request_id, 0) + 1
        for p in result.progressed:
            rid = p.request.request_id
            left[rid] -= 1
            if rid in stopped:
                continue
            if self._completions[rid].on_token(step, p.row, self._decode_token, left[rid]) and p.status is None:
                stopped[rid] = p.request.num_output_tokens - left[rid]
        for rid, keep in stopped.items():
            self._completions[rid].request.truncate_output(keep)
        if stopped:
            self.scheduler.finish_requests(list(stopped), RequestStatus.FINISHED_STOPPED)

    def _output(self, state: RequestState) -> RequestOutput:
        finished = state.finished
        metrics = {"arrival_time": state.arrival_time}
        first = [c.first_token_time for c in state.completions if c.first_token_time]
        if first:
            metrics["first_token_time"] = min(first)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids,
                             [c.output() for c in state.completions], finished, metrics)


def _compile_failure(fut: Future) -> BaseException | None:
    """Why a finished compile gave no grammar (a cancelled one counts), or None."""
    if fut.cancelled():
        return ValueError("its grammar's compilation was cancelled")
    return fut.exception()


def _closed(text: str, parser) -> bool:
    """The text's last reasoning block is closed (its end marker follows its last start marker)."""
    end = text.rfind(parser.end_marker)
    return end != -1 and end > text.rfind(parser.start_marker)


def _check_args(a: EngineArgs) -> None:
    """Reject what the engine would otherwise silently replace (0 read as 'unset'), before loading anything."""
    if a.enable_lora:
        if a.max_loras < 1 or a.max_lora_rank < 1 or (a.max_cpu_loras is not None and a.max_cpu_loras < 1):
            raise ValueError(f"max_loras ({a.max_loras}), max_lora_rank ({a.max_lora_rank}) and max_cpu_loras "
                             f"({a.max_cpu_loras}) must be >= 1")
        if a.tensor_parallel_size > 1 or a.pipeline_parallel_size > 1:
            raise ValueError("enable_lora does not run with tensor or pipeline parallelism yet "
                             "(data parallel replicas are fine)")
    elif a.lora_modules:
        raise ValueError("lora_modules needs enable_lora=True (--enable-lora)")
    for name in ("max_model_len", "block_size", "num_gpu_blocks_override", "kv_cache_memory"):
        value = getattr(a, name)
        if name == "block_size" and value == "auto":
            continue
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"{name} must be a positive integer, or None for the default"
                             f"{' (or auto)' if name == 'block_size' else ''}; got {value!r}")
    if a.cuda_graph_sizes is not None:
        graph_batch_sizes(a.max_num_seqs, a.cuda_graph_sizes)  # raises on a bad size
    if a.kv_cache_dtype not in ("auto", "fp8"):
        raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8'; got {a.kv_cache_dtype!r}")
    if a.reasoning_parser is not None:
        get_reasoning_parser(a.reasoning_parser)  # raises, naming the known parsers
    spec = SpeculativeConfig.parse(a.speculative_config)
    if spec is not None and a.pipeline_parallel_size > 1:
        raise ValueError("speculative decoding does not run with pipeline_parallel_size > 1 yet")
    if a.quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {a.quantization!r}")
    if a.scheduling_policy not in POLICIES:
        raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}; got {a.scheduling_policy!r}")
