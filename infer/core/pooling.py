"""Pooling models: embeddings, classification and cross-encoder scores (`LLM.embed`,
`LLM.classify`, `LLM.score`, the server's /v1/embeddings, /v1/rerank, /v1/score).

A pooling request is prefill only: its whole input runs in one step (no chunked
prefill: a request longer than a step's token budget is refused, naming the
limit), the model's ``pooled`` row comes back, and the request is done. It keeps
no KV blocks after its step. An encoder allocates none at all (its attention is
`encoder_attention`, within the step); a decoder's paged attention writes into a
scratch pool of one step's blocks, handed out afresh every step.

After the forward, on the host, in float32: embeddings are cut to ``dimensions``
(Matryoshka models only) and L2-normalised when the model's sentence-transformers
pipeline ends in Normalize (or ``normalize`` asks); classifier scores go through
the sigmoid (one label, as sentence-transformers' CrossEncoder) or the softmax.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..primitives.types import AttentionMetadata
from .args import EngineArgs
from .block_manager import PrefixCacheStats
from .executor import executor as executors
from .models.pooling import is_classifier
from .scheduler import SchedulerStats

TASKS = ("embed", "classify")


@dataclass
class PoolingParams:
    """What to return for a pooling request (vLLM's PoolingParams).

    task        'embed' (an embedding model) or 'classify' (a classifier's scores).
    dimensions  keep the first n embedding dims (Matryoshka models), then normalise.
    normalize   L2-normalise the embedding; None: the model's own pipeline decides.
    activation  sigmoid/softmax on classifier outputs; False returns the raw logits.
    truncate_prompt_tokens  keep only the last k tokens of a longer input (-1: the
                model's limit); None: a longer input is refused.
    """

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool = True
    truncate_prompt_tokens: int | None = None


@dataclass
class PoolingOutput:
    """A request's pooled result (float32)."""

    data: np.ndarray

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    @property
    def probs(self) -> list[float]:
        return self.data.tolist()

    @property
    def score(self) -> float:
        return float(self.data[0])


@dataclass
class PoolingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput | None
    finished: bool = True
    prompt: str | None = None
    error: str | None = None  # why the engine refused it (LLM.embed keeps going with the others)


@dataclass
class _Request:
    request_id: str
    ids: list[int]
    token_types: list[int] | None
    params: PoolingParams
    prompt: str | None
    arrival: float = field(default_factory=time.time)


class PoolingEngine:
    """The step loop of a pooling model: `add_request`, `step`, `abort_request` (what AsyncLLM drives)."""

    def __init__(self, args: EngineArgs | None = None, **kwargs: Any):
        a = args or EngineArgs(**kwargs)
        a.check()
        self.args = a
        self.executor = executors.create(a, load_tokenizer=not a.skip_tokenizer_init)
        try:
            self._init(a)
        except BaseException:
            self.shutdown()
            raise

    def _init(self, a: EngineArgs) -> None:
        w = self.worker = self.executor.worker
        if w.pooling is None:
            raise ValueError(f"{a.model} is a generating model ({w.graph.architecture}); PoolingEngine serves pooling "
                             "models (runner='pooling')")
        self.pooling = w.pooling
        self.backend, self.dtype, self.max_model_len = w.backend, w.dtype, w.max_model_len
        self.tokenizer = w.model.tokenizer
        self.architecture = w.graph.architecture
        self.classifier = is_classifier(self.architecture)
        self.hidden_size = w.graph.config.hidden_size
        raw = w.model.config
        decoder = bool(w.runner.layers)
        self.strip_pad = raw.get("pad_token_id") if self.classifier and decoder else None
        self.token_types = any(n.inputs == ("token_type_ids",) for n in w.graph.nodes)
        self.matryoshka = raw.get("matryoshka_dimensions") or ([] if raw.get("is_matryoshka") else None)
        self.max_num_seqs, self.token_budget = a.max_num_seqs, a.batched_tokens()
        # A decoder's attention is paged: a scratch pool of one step's tokens, each request its own
        # blocks from the start of it every step (nothing is kept between steps).
        self.block_size = a.block_size if isinstance(a.block_size, int) else w.backend.preferred_block_size
        self.num_blocks = -(-self.token_budget // self.block_size) + self.max_num_seqs if w.runner.layers else 0
        self.executor.collective_rpc("allocate_kv", self.num_blocks, self.block_size)
        # What the server reads of any engine (`server/models.py`): a pooling model has no chat
        # template, adapters, sampling defaults or experts.
        self.vocab_size, self.chat_template, self.generation_config = w.vocab_size, None, {}
        self.lora = self.expert_load = None
        self.dispatch_trace = w.dispatch_trace
        self.waiting: collections.deque[_Request] = collections.deque()

    @property
    def task(self) -> str:
        return "classify" if self.classifier else "embed"

    def shutdown(self) -> None:
        if getattr(self, "executor", None) is not None:
            self.executor.shutdown()

    # -- requests -------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | dict, params: PoolingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, lora_request: Any = None, **_: Any) -> None:
        """Queue one input: a string, ``{"prompt_token_ids": [...]}``, or for a cross-encoder
        ``{"text": query, "text_pair": document}``. ValueError (naming the field) when it cannot run."""
        if lora_request is not None:
            raise ValueError("pooling models run without LoRA adapters")
        if any(r.request_id == request_id for r in self.waiting):
            raise ValueError(f"request id {request_id!r} is already in use")
        p = params or PoolingParams(task=self.task)
        self._check_params(p)
        text, ids, types = self._tokenize(prompt)
        if not ids:
            raise ValueError("the input is empty: it has no tokens")
        limit = min(self.max_model_len, self.token_budget)
        if p.truncate_prompt_tokens is not None:
            keep = limit if p.truncate_prompt_tokens == -1 else p.truncate_prompt_tokens
            if not 1 <= keep <= limit:
                raise ValueError(f"truncate_prompt_tokens must be -1 or in [1, {limit}], got {p.truncate_prompt_tokens}")
            ids, types = ids[-keep:], None if types is None else types[-keep:]
        if len(ids) > limit:
            which = ("the model's maximum context length" if limit == self.max_model_len else
                     "the tokens of one step (max_num_batched_tokens; a pooling input is not split over steps)")
            raise ValueError(f"the input has {len(ids)} tokens, more than {limit}, {which}; shorten it or pass "
                             "truncate_prompt_tokens")
        if self.strip_pad is not None:  # transformers' decoder classifiers score the last token that is not pad
            while len(ids) > 1 and ids[-1] == self.strip_pad:
                ids, types = ids[:-1], None if types is None else types[:-1]
        vocab = self.worker.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt_token_ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
        self.waiting.append(_Request(request_id, ids, types, p, text, arrival_time or time.time()))

    def _check_params(self, p: PoolingParams) -> None:
        if p.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {p.task!r}")
        if p.task != self.task:
            raise ValueError(f"{self.architecture} is {'a classifier' if self.classifier else 'an embedding model'}: "
                             f"it serves task {self.task!r}, not {p.task!r}")
        if p.dimensions is not None:
            if self.matryoshka is None:
                raise ValueError(f"dimensions: {self.architecture} is not a Matryoshka model (its config.json has no "
                                 "matryoshka_dimensions); it returns all its dimensions")
            if not 1 <= p.dimensions <= self.hidden_size or (self.matryoshka and p.dimensions not in self.matryoshka):
                allowed = self.matryoshka or f"1..{self.hidden_size}"
                raise ValueError(f"dimensions must be one of {allowed}, got {p.dimensions}")

    def _tokenize(self, prompt: str | dict) -> tuple[str | None, list[int], list[int] | None]:
        tok = self.tokenizer
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = [int(i) for i in prompt["prompt_token_ids"]]
            types = prompt.get("token_type_ids")
            return prompt.get("prompt"), ids, None if types is None else [int(t) for t in types]
        if tok is None:
            raise ValueError(f"{self.args.model} has no tokenizer; pass prompt_token_ids")
        if isinstance(prompt, dict) and "text" in prompt:
            enc = tok(prompt["text"], prompt.get("text_pair"), add_special_tokens=True)
            text = prompt["text"]
        elif isinstance(prompt, str):
            enc, text = tok(prompt, add_special_tokens=True), prompt
        else:
            raise TypeError(f"a pooling input is a string or a dict with 'prompt_token_ids' or 'text', got "
                            f"{type(prompt).__name__}")
        types = enc.get("token_type_ids")
        return text, list(enc["input_ids"]), list(types) if types is not None else None

    def abort_request(self, request_id: str) -> bool:
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                return True
        return False

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=0, num_waiting=len(self.waiting), num_preemptions=0, num_used_blocks=0,
                              num_blocks=self.num_blocks, kv_cache_usage=0.0, prefix_cache=PrefixCacheStats())

    # -- the step ---------------------------------------------------------------------
    def step(self) -> list[PoolingRequestOutput]:
        """Pool the waiting requests that fit one step (first come, first served)."""
        batch, tokens = [], 0
        while self.waiting and len(batch) < self.max_num_seqs and tokens + len(self.waiting[0].ids) <= self.token_budget:
            r = self.waiting.popleft()
            batch.append(r)
            tokens += len(r.ids)
        if not batch:
            return []
        pooled = self.executor.collective_rpc("execute_pooling", self._inputs(batch))
        return [PoolingRequestOutput(r.request_id, r.ids, PoolingOutput(self._finish(row, r.params)), True, r.prompt)
                for r, row in zip(batch, np.asarray(pooled, dtype=np.float32))]

    def _inputs(self, batch: list[_Request]) -> dict[str, Any]:
        lens = np.array([len(r.ids) for r in batch], np.int32)
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        t, bs = int(qsl[-1]), self.block_size
        positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int64)
        if self.num_blocks:  # each request's blocks follow the previous request's in the scratch pool
            blocks = -(-lens // bs)
            first = np.concatenate([[0], np.cumsum(blocks)[:-1]])
            table = np.zeros((len(batch), int(blocks.max())), np.int32)
            for b, (f, k) in enumerate(zip(first, blocks)):
                table[b, :k] = np.arange(f, f + k)
            slots = np.concatenate([f * bs + np.arange(n) for f, n in zip(first, lens)]).astype(np.int64)
        else:
            table, slots = np.zeros((len(batch), 1), np.int32), np.full(t, -1, np.int64)
        meta = AttentionMetadata(qsl, lens.copy(), table, slots, int(lens.max()), int(lens.max()), bs)
        types = None
        if self.token_types:  # BERT's segment embeddings: 0 where the input gave none
            types = np.concatenate([r.token_types if r.token_types is not None else [0] * len(r.ids)
                                    for r in batch]).astype(np.int64)
        ids = np.concatenate([r.ids for r in batch]).astype(np.int64)
        return {"input_ids": ids, "positions": positions, "meta": meta, "token_type_ids": types}

    def _finish(self, row: np.ndarray, p: PoolingParams) -> np.ndarray:
        row = row.astype(np.float32)
        if self.classifier:
            if not p.activation:
                return row
            if len(row) == 1:
                return (1.0 / (1.0 + np.exp(-row.astype(np.float64)))).astype(np.float32)
            e = np.exp(row.astype(np.float64) - row.max())
            return (e / e.sum()).astype(np.float32)
        if p.dimensions is not None:
            row = row[: p.dimensions]
        normalize = self.pooling.normalize if p.normalize is None else p.normalize
        if normalize:
            norm = np.linalg.norm(row.astype(np.float64))
            row = (row / max(norm, 1e-12)).astype(np.float32)
        return row


def is_pooling(a: EngineArgs) -> bool:
    """Whether `a` describes a pooling model (its runner, or for 'auto' its architecture), read from
    the checkpoint's config alone."""
    if a.runner != "auto":
        return a.runner == "pooling"
    from .executor.rank import pooling_runner
    from .loader.load import open_checkpoint

    ckpt = open_checkpoint(a.model)
    names = ckpt.config.get("architectures") or []
    return any(pooling_runner("auto", n, ckpt.path) for n in names)
