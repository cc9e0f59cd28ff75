"""What the engine keeps per completion beside the scheduler's Request: text,
logprobs, and the one stop condition that needs the text (stop strings; the
scheduler stops on tokens)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from .detokenizer import IncrementalDetokenizer, find_stop
from .outputs import CompletionOutput, Logprob
from .request import Request
from .sampling_params import SamplingParams
from .scheduler_output import StepOutput
from .structured import Matcher

log = logging.getLogger(__name__)


@dataclass
class CompletionState:
    """One of the `n` completions of a user request."""

    index: int
    request: Request
    params: SamplingParams
    seed: int
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    stop_string: str | None = None  # the stop string that ended it
    first_token_time: float | None = None
    matcher: Matcher | None = None  # structured outputs: where the output is in its grammar
    # The reasoning parser while the grammar waits for the reasoning to end (then None).
    reasoning: Any = None
    mask_next: bool = False  # the grammar refused the unmasked argmax last step: mask first next step

    def __post_init__(self):
        if self.params.logprobs is not None:
            self.logprobs = []

    def banned_tokens(self, ahead: int = 0) -> tuple[int, ...]:
        """Tokens that may not be sampled yet: EOS and stop tokens before min_tokens
        (`ahead`: for the token that many places further, after drafted ones)."""
        if self.request.num_output_tokens + ahead >= self.params.min_tokens:
            return ()
        return tuple(self.params.stop_token_ids) + (() if self.params.ignore_eos else self.request.eos_token_ids)

    def _record_logprobs(self, token: int, step: StepOutput, row: int, decode) -> None:
        logprob = float(step.logprobs[row])
        self.cumulative_logprob += logprob
        if self.logprobs is None:
            return
        rank = int(step.ranks[row]) if step.ranks is not None else None
        entry = {token: Logprob(logprob, rank, decode(token))}
        if step.top_token_ids is not None:
            n = self.params.logprobs
            for i, (tid, lp) in enumerate(zip(step.top_token_ids[row][:n], step.top_logprobs[row][:n]), 1):
                if int(tid) != token:
                    entry[int(tid)] = Logprob(float(lp), i, decode(int(tid)))
        self.logprobs.append(entry)

    def on_token(self, step: StepOutput, row: int, decode, later: int = 0) -> bool:
        """Take the request's next token (row `row` of `step`; `later`: tokens of the
        same step after it, already in the request): grammar, logprobs, text, stop
        strings. True when a stop string or the grammar's end ends the completion here."""
        req, p = self.request, self.params
        token = int(step.token_ids[row])
        ended_grammar = False
        waiting = self.reasoning is not None
        if self.matcher is not None and not waiting:
            if not self.matcher.accept(token):  # cannot happen to a token sampled under the mask
                log.warning("request %s: token %d is outside its grammar; the rest is unconstrained",
                            req.request_id, token)
                self.matcher = None
            else:
                # The grammar's end ends the output, even before min_tokens or under ignore_eos.
                ended_grammar = self.matcher.is_terminated()
        if self.first_token_time is None:
            self.first_token_time = time.time()
        self._record_logprobs(token, step, row, decode)
        if self.detokenizer is None or not p.detokenize:
            return ended_grammar
        delta = self.detokenizer.add(token)
        self.text += delta
        if waiting and self.reasoning.reasoning_ended(self.text):
            marker, self.reasoning = self.reasoning.end_marker, None
            self._feed_answer_so_far(marker)
        if not (p.stop_strings and delta and req.num_output_tokens - later >= p.min_tokens):
            return ended_grammar
        # A stop string wins over the token that may have ended the request too (as vLLM).
        hit = find_stop(self.text, len(delta), p.stop_strings)
        if hit is None:
            return ended_grammar
        idx, stop = hit
        self.text = self.text[: idx + len(stop)] if p.include_stop_str_in_output else self.text[:idx]
        self.stop_string = stop
        return True

    def _feed_answer_so_far(self, end_marker: str) -> None:
        """The reasoning just ended: the grammar takes the answer tokens already out, those
        after the end marker (all of them when the output opened no reasoning block)."""
        cut = self.text.rfind(end_marker)
        answer = (self.text[cut + len(end_marker):] if cut != -1 else self.text).lstrip()
        if not answer:
            return
        ids, decode = self.request.output_token_ids, self.detokenizer.tokenizer.decode
        for j in range(len(ids) - 1, -1, -1):
            tail = decode(ids[j:], skip_special_tokens=self.params.skip_special_tokens)
            if tail == answer:
                if all(self.matcher.accept(t) for t in ids[j:]):
                    return
                break
            if len(tail) > len(answer):
                break
        log.warning("request %s: the answer began with %r, which its grammar does not start with (or not "
                    "on a token boundary); the rest of the output is unconstrained", self.request.request_id, answer)
        self.matcher = None

    def output(self) -> CompletionOutput:
        req = self.request
        token_ids = list(req.output_token_ids)
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self.logprobs,
            finish_reason="stop" if self.stop_string is not None else req.status.finish_reason,
            stop_reason=self.stop_string if self.stop_string is not None else req.stop_reason,
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
    grammar: Any = None  # structured outputs: the compiled spec each completion's matcher follows

    @property
    def finished(self) -> bool:
        return self.pending_forks == 0 and all(c.request.is_finished for c in self.completions)
