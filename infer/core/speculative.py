"""Speculative decoding: a proposer drafts the next tokens of each decoding request,
and one step of the target model verifies them all.

The engine asks the proposer for drafts before it schedules a step; the
scheduler gives a request with k drafts a query of 1 + k tokens (its last token
and the drafts) with KV slots for all of them; `sample` verifies every draft
position (step 6 of `SamplingTensors`: accept with min(1, p/q), else a token of
the residual distribution), and the request takes the accepted drafts plus the
token after them. KV written for rejected drafts lies past the request's
computed tokens, so the next step overwrites it; prefix-cache hashes cover only
computed tokens. Proposers register through the pluggy hook
`infer_register_spec_proposers` under their ``method``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields

import numpy as np

from ..primitives.hookspecs import hookimpl


@dataclass
class SpeculativeConfig:
    """``--speculative-config`` / ``LLM(speculative_config=...)``, with vLLM's keys.

    method                  a registered proposer: "ngram" (prompt lookup).
    num_speculative_tokens  drafts per step and request (k).
    prompt_lookup_max/min   n-gram: the longest and shortest suffix looked up
                            in the request's own tokens (longest first).
    disable_by_batch_size   no drafts while this many requests or more are
                            running; None: no such limit (the engine's
                            `DraftBudget` drafts only what its measured step
                            costs and acceptance say pays off).
    model                   the draft model of "draft_model".
    adaptive                True: draft only what `DraftBudget` says pays off;
                            False: always num_speculative_tokens (as vLLM).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int | None = None
    model: str | None = None
    adaptive: bool = True
    extra: dict = field(default_factory=dict, repr=False)  # keys a plugin's proposer reads

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """A config from a dict or its JSON text (None stays None); ValueError names the bad key."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or JSON object, got {type(value).__name__}")
        from ..registry import get_spec_proposer

        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        proposer = get_spec_proposer(value["method"])  # raises, naming the known methods
        known = {f.name for f in fields(cls)} - {"extra"}
        unknown = sorted(set(value) - known - set(getattr(proposer, "extra_keys", ())))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        cfg = cls(**{k: v for k, v in value.items() if k in known},
                  extra={k: v for k, v in value.items() if k not in known})
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(cfg, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {v!r}")
        if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min={cfg.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max={cfg.prompt_lookup_max}")
        if not isinstance(cfg.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {cfg.adaptive!r}")
        d = cfg.disable_by_batch_size
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size must be an integer >= 1, got {d!r}")
        return cfg


class Proposer:
    """Drafts tokens for requests. `method` is the name it registers under;
    `extra_keys` the config keys beyond SpeculativeConfig's it reads (from `extra`).
    It is built with the worker of the rank that samples (`core/executor/worker.py`):
    its backend, ops, model and KV pool's size, for a proposer that runs a model."""

    method = ""
    extra_keys: tuple[str, ...] = ()

    def __init__(self, config: SpeculativeConfig, worker):
        self.config = config

    def propose(self, requests: list, max_drafts: list[int]) -> list[list[int]]:
        """Up to max_drafts[i] tokens to follow requests[i]'s tokens (its
        `all_token_ids`: prompt and output so far); [] where there is nothing to propose."""
        raise NotImplementedError

    def forget(self, request_id) -> None:
        """The request finished: drop what is kept for it."""


class NgramProposer(Proposer):
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of
    the request's last n tokens (n from prompt_lookup_max down to prompt_lookup_min)."""

    method = "ngram"

    def propose(self, requests: list, max_drafts: list[int]) -> list[list[int]]:
        return [self._lookup(r.all_token_ids, k) if k > 0 else [] for r, k in zip(requests, max_drafts)]

    def _lookup(self, ids: list[int], k: int) -> list[int]:
        c = self.config
        tokens = np.asarray(ids, dtype=np.int64)
        total = len(tokens)
        for n in range(min(c.prompt_lookup_max, total - 1), c.prompt_lookup_min - 1, -1):
            # Windows ending before the last token: each has a continuation, and the
            # suffix itself is not among them.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: total - 1], n)
            hits = np.flatnonzero((windows == tokens[total - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []


def _bucket(n: int) -> int:
    """n itself up to 8, then the power of two at or above it."""
    return n if n <= 8 else 1 << (n - 1).bit_length()


class DraftBudget:
    """How many drafts pay off, from what steps cost and what each request accepts.

    Cost: the engine reports each decode-only step's seconds with its batch size
    B and its drafted tokens E; a decayed mean is kept per (B, E), both bucketed
    (exact up to 8, then powers of two). Costs are not linear in E: host kernels
    change with the row count (SmolLM2 on 2 cores, float32: 16 ms for one row,
    25 ms for two, 54 ms for three), so no single slope is fitted. A (B, E) not
    yet seen lies on the line between the measured sizes around it (the plain
    step is E = 0); past the largest measured E it goes on at the dearer of that
    point's mean cost per token and the prior; with only the plain step seen,
    each drafted token costs PRIOR of a one-token share, so speculation gets
    tried. Measurements replace the guesses.

    Acceptance: per request, accepted drafts over drafts tried (a rejection ends
    the trial), decayed; a new request starts from the engine-wide rate.

    Plan: the step drafts the same k for every request whose acceptance is at
    least MIN_ALPHA, the k in 0..max_drafts with the most expected tokens per
    expected second (B + sum over those requests of alpha + ... + alpha^k, over the
    cost of B and k times their count). The others, and every request when k is
    0, draft one token now and then (every 4 steps, backing off to 64 while those
    probes are refused), so a change in what they write is noticed. After
    REMEASURE_EVERY drafting steps at a batch size, one step drafts nothing, so
    the plain cost drafting is weighed against stays measured; and a bucket's
    first step counts only if its second is not cheaper (a new shape's first
    step pays one-time costs: SmolLM2's first plain step at batch 32 took
    460 ms, the next ones 150).
    """

    DECAY = 0.9
    PRIOR = 0.3
    MIN_ALPHA = 0.5
    PROBE_MIN, PROBE_MAX = 4, 64
    REMEASURE_EVERY = 32

    def __init__(self, max_drafts: int):
        self.max_drafts = max_drafts
        self._times: dict[tuple[int, int], float] = {}
        self._seen: dict[tuple[int, int], int] = {}  # steps observed per bucket
        self._drafting: dict[int, int] = {}  # per batch bucket: steps planned with drafts since a plain one
        self._global = [1.4, 2.0]  # accepted, tried (prior: 0.7)
        self._requests: dict = {}  # request id -> [accepted, tried, steps until a probe, probe interval]

    def observe_step(self, batch: int, drafted: int, seconds: float) -> None:
        key = (_bucket(batch), _bucket(drafted))
        old = self._times.get(key)
        seen = self._seen[key] = self._seen.get(key, 0) + 1
        if old is None:
            self._times[key] = seconds
        elif seen == 2:  # the first step of a shape pays one-time costs (allocations, dense copies): not its cost
            self._times[key] = min(old, seconds)
        else:
            self._times[key] = old * self.DECAY + seconds * (1 - self.DECAY)

    def step_seconds(self, batch: int, drafted: int) -> float | None:
        """Expected seconds of a decode step of `batch` requests with `drafted` drafts; None before any plain one."""
        b = _bucket(batch)
        seen = self._times.get((b, _bucket(drafted)))
        if seen is not None:
            return seen
        base = self._times.get((b, 0))
        if base is None:
            return None
        prior = self.PRIOR * base / batch  # seconds per drafted token
        seen = sorted((e, t) for (bb, e), t in self._times.items() if bb == b)  # (0, base) first
        above = [(e, t) for e, t in seen if e > drafted]
        e, t = [(e, t) for e, t in seen if e < drafted][-1]
        if above:  # between two measured sizes: on the line joining them
            e2, t2 = above[0]
            return t + (t2 - t) * (drafted - e) / (e2 - e)
        if e == 0:
            return base + prior * drafted
        return t + max((t - base) / e, prior) * (drafted - e)  # past the largest: at the dearer of its mean cost and the prior

    def alpha(self, request_id) -> float:
        acc, tried = self._state(request_id)[:2]
        return acc / tried

    def plan(self, request_ids: list, batch: int) -> list[int]:
        """Drafts to ask of the proposer for each of these decoding requests' next step."""
        alphas = [self.alpha(r) for r in request_ids]
        takers = [a for a in alphas if a >= self.MIN_ALPHA]
        best_k, best_rate = 0, 0.0
        base = self.step_seconds(batch, 0)
        if base is not None and takers:
            best_rate = batch / base
            for k in range(1, self.max_drafts + 1):
                seconds = self.step_seconds(batch, k * len(takers))
                tokens = batch + sum(sum(a**j for j in range(1, k + 1)) for a in takers)
                if tokens / seconds > best_rate:
                    best_k, best_rate = k, tokens / seconds
        if best_k:
            b = _bucket(batch)
            self._drafting[b] = self._drafting.get(b, 0) + 1
            if self._drafting[b] > self.REMEASURE_EVERY:  # a plain step now and then keeps its cost current
                self._drafting[b] = 0
                return [0] * len(request_ids)
        return [best_k if best_k and a >= self.MIN_ALPHA else self._probe(r) for r, a in zip(request_ids, alphas)]

    def _probe(self, request_id) -> int:
        state = self._state(request_id)
        if state[2] > 0:
            state[2] -= 1
            return 0
        state[2] = state[3]
        return 1

    def _state(self, request_id) -> list:
        return self._requests.setdefault(request_id, [*self._global, self.PROBE_MIN, self.PROBE_MIN])

    def record(self, request_id, num_drafts: int, num_accepted: int) -> None:
        tried = num_accepted + (num_accepted < num_drafts)
        state = self._requests.get(request_id)
        if state is not None:
            state[0] = state[0] * self.DECAY + num_accepted
            state[1] = state[1] * self.DECAY + tried
            state[3] = self.PROBE_MIN if num_accepted else min(self.PROBE_MAX, state[3] * 2)
            if not num_accepted:
                state[2] = state[3]  # the next probe waits the longer interval
        g = self._global
        g[0], g[1] = g[0] * self.DECAY + num_accepted, g[1] * self.DECAY + tried

    def forget(self, request_id) -> None:
        self._requests.pop(request_id, None)


@dataclass
class SpecDecodeStats:
    """Counters of verified drafts (the Prometheus metrics `infer:spec_decode_*`)."""

    num_drafts: int = 0  # request-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # accepted drafts at each position

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying step gave a request on average (accepted drafts + 1)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class DraftModelProposer(Proposer):
    """A smaller model of the same tokenizer drafts greedily, on the target's backend,
    with its own KV cache (as many blocks of the same size as the target's pool).

    Each call first computes, in one batch, the tokens a request gained since the
    last call (the accepted drafts and the token after them; KV of rejected drafts
    is overwritten), then runs decode steps for the requests that want more drafts.
    Greedy drafts are deterministic, so their q is one-hot at the drafted token:
    verification stays exact for sampled requests too.
    """

    method = "draft_model"

    def __init__(self, config: SpeculativeConfig, worker):
        super().__init__(config, worker)
        from .block_manager import BlockManager
        from .executor.rank import build_model

        if not config.model:
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (the draft's path or alias)")
        # The whole draft on the sampling rank, also when the target is sharded over several.
        draft_args = dataclasses.replace(worker.args, model=config.model, max_model_len=worker.max_model_len,
                                         speculative_config=None, enable_lora=False,
                                         disable_hybrid_kv_cache_manager=True)  # one table: the draft's BlockManager
        target_tokenizer = worker.model.tokenizer
        parts = build_model(draft_args, worker.backend, worker.ops, None, load_tokenizer=target_tokenizer is not None)
        vocab = parts.graph.config.vocab_size
        if vocab != worker.vocab_size or not _same_vocabulary(parts.loaded.tokenizer, target_tokenizer):
            raise ValueError(f"speculative_config: the draft model {config.model!r} has a different tokenizer "
                             f"(vocabulary of {vocab} against the target's {worker.vocab_size}); a draft must "
                             "share the target's tokenizer")
        self.runner, self.backend = parts.runner, worker.backend
        self.runner.allocate_kv_caches(worker.num_blocks, worker.block_size)
        self.blocks = BlockManager(worker.num_blocks, worker.block_size)
        self.block_size = worker.block_size
        self._computed: dict = {}  # request id -> tokens whose KV the draft cache holds

    def forget(self, request_id) -> None:
        self._computed.pop(request_id, None)
        self.blocks.free(request_id)

    def propose(self, requests: list, max_drafts: list[int]) -> list[list[int]]:
        from types import SimpleNamespace

        drafts: list[list[int]] = [[] for _ in requests]
        live = []  # (index, shim for the block manager, tokens to compute now)
        for i, (r, k) in enumerate(zip(requests, max_drafts)):
            if k <= 0:
                continue
            tokens = r.all_token_ids
            done = min(self._computed.get(r.request_id, 0), len(tokens) - 1)
            shim = SimpleNamespace(request_id=r.request_id, num_computed_tokens=done, num_tokens=len(tokens))
            # Room for the catch-up and the k - 1 decode steps after it.
            if not self.blocks.allocate_slots(shim, len(tokens) - done + k - 1):
                continue
            live.append((i, shim, tokens[done:]))
        step = [(i, shim, new) for i, shim, new in live]
        while step:
            picked = self._forward([(shim, new) for _, shim, new in step])
            nxt = []
            for (i, shim, new), token in zip(step, picked):
                shim.num_computed_tokens += len(new)
                drafts[i].append(token)
                if len(drafts[i]) < max_drafts[i]:
                    nxt.append((i, shim, [token]))
            step = nxt
        for i, shim, _ in live:  # the drafts' own KV is past the request's tokens: recomputed next time if kept
            self._computed[requests[i].request_id] = len(requests[i].all_token_ids)
        return drafts

    def _forward(self, rows: list) -> list[int]:
        """Greedy next token of each (shim, new tokens) in one batch of the draft model."""
        import numpy as np

        from .distributed import StepInput
        from .executor.rank import execute_step
        from .scheduler_output import ScheduledRequest, SchedulerOutput

        scheduled = [ScheduledRequest(shim.request_id, shim.num_computed_tokens, len(new), list(new),
                                      self.blocks.block_table_row(shim.request_id), True, None) for shim, new in rows]
        mi = SchedulerOutput(scheduled, [], [], [], self.block_size).model_input()
        out = execute_step(self.runner, StepInput(mi.input_ids, mi.positions, mi.logits_indices, mi.attn_metadata))
        return [int(t) for t in np.argmax(self.backend.to_numpy(out.logits), axis=-1)]


def _same_vocabulary(a, b) -> bool:
    """Two tokenizers map the same strings to the same ids (True when either is not loaded)."""
    if a is None or b is None:
        return True
    return a.get_vocab() == b.get_vocab()


@hookimpl
def infer_register_spec_proposers() -> dict[str, type]:
    return {NgramProposer.method: NgramProposer, DraftModelProposer.method: DraftModelProposer}
