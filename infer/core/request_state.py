"""What the engine keeps per completion beside the scheduler's Request: text,
logprobs, and the stop conditions that belong to the engine (EOS, stop tokens,
stop strings, max_tokens)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .detokenizer import IncrementalDetokenizer, find_stop
from .outputs import CompletionOutput, Logprob
from .request import Request, RequestStatus
from .sampling_params import SamplingParams


@dataclass
class CompletionState:
    """One of the `n` completions of a user request."""

    index: int
    request: Request
    params: SamplingParams
    seed: int
    eos_token_ids: tuple[int, ...]
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: str | int | None = None
    first_token_time: float | None = None

    def __post_init__(self):
        if self.params.logprobs is not None:
            self.logprobs = []

    def banned_tokens(self) -> tuple[int, ...]:
        """Tokens that may not be sampled yet: EOS and stop tokens before min_tokens."""
        if self.request.num_output_tokens >= self.params.min_tokens:
            return ()
        return tuple(self.params.stop_token_ids) + (() if self.params.ignore_eos else self.eos_token_ids)

    def record_logprobs(self, token: int, logprob: float, rank: int | None, top_ids, top_lps, decode) -> None:
        self.cumulative_logprob += logprob
        if self.logprobs is None:
            return
        entry = {token: Logprob(logprob, rank, decode(token))}
        n = self.params.logprobs
        for i, (tid, lp) in enumerate(zip(top_ids[:n], top_lps[:n]), 1):
            if int(tid) != token:
                entry[int(tid)] = Logprob(float(lp), i, decode(int(tid)))
        self.logprobs.append(entry)

    def on_token(self) -> RequestStatus | None:
        """Process the request's newest token; a FINISHED_* status when it stops."""
        req, p = self.request, self.params
        token = req.output_token_ids[-1]
        if self.first_token_time is None:
            self.first_token_time = time.time()
        new_chars = 0
        if self.detokenizer is not None and p.detokenize:
            delta = self.detokenizer.add(token)
            self.text += delta
            new_chars = len(delta)
        if req.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                self.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not p.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if p.stop_strings and new_chars:
                hit = find_stop(self.text, new_chars, p.stop_strings)
                if hit is not None:
                    idx, stop = hit
                    self.text = self.text[: idx + len(stop)] if p.include_stop_str_in_output else self.text[:idx]
                    self.stop_reason = stop
                    return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def output(self) -> CompletionOutput:
        req = self.request
        token_ids = list(req.output_token_ids)
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self.logprobs,
            finish_reason=req.status.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class RequestState:
    """A user request: its prompt and its `n` completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[CompletionState] = field(default_factory=list)
    pending_forks: int = 0  # children to fork once the prompt is computed
    arrival_time: float = field(default_factory=time.time)

    @property
    def finished(self) -> bool:
        return self.pending_forks == 0 and all(c.request.is_finished for c in self.completions)
