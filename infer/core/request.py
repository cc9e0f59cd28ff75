"""One generation request as the scheduler and the block manager see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Hashable, NamedTuple

from .sampling_params import SamplingParams

# A request's key in the scheduler and the block manager: any hashable (the
# engine uses `SeqId`, tests plain strings). Never parsed.
RequestId = Hashable


class SeqId(NamedTuple):
    """The engine's scheduler id of one of a user request's `n` completions."""

    request_id: str
    index: int

    def __str__(self) -> str:
        return f"{self.request_id}[{self.index}]"


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; every FINISHED_* value is terminal."""

    WAITING = 0
    RUNNING = 1
    # Back in the waiting queue after losing its blocks; it recomputes its KV.
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # a stop condition of the engine (EOS, stop string, ...)
    FINISHED_LENGTH_CAPPED = 4  # max_tokens or max_model_len reached
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # the model gave non-finite logits for it (a corrupt weight, an overflow)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason: 'stop', 'length', 'abort', 'error' (vLLM's), or None while alive."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


# eq=False: requests are compared by identity, which is what list.remove and
# `in` on the running list need (two requests may hold equal tokens).
@dataclass(slots=True, eq=False)
class Request:
    """A request: its tokens, how many have KV in the cache, and its status.

    request_id           unique among live requests.
    prompt_token_ids     the prompt; never empty.
    sampling_params      the request's `SamplingParams`: the scheduler stops it on
                         its stop tokens, EOS (after min_tokens) and max_tokens;
                         None: only max_model_len stops it.
    eos_token_ids        the model's end-of-sequence tokens (the engine sets them).
    arrival_time         seconds (time.time() by default); orders fcfs and
                         breaks priority ties.
    priority             lower is served first under the 'priority' policy.
    cache_salt           separates prefix-cache entries (e.g. per tenant): blocks
                         are shared only between requests with the same salt.
    lora_request         the LoRA adapter (`core.lora.LoRARequest`) the request runs
                         with (None: the base model); part of its prefix-cache hashes.
    mm_items             the images of the prompt (`multimodal.ImageItem`): their
                         content hashes are part of the hashes of the blocks they touch.
    output_token_ids     generated tokens so far.
    num_computed_tokens  leading tokens of `all_token_ids` whose KV is in the
                         cache; the rest are computed in coming steps.
    block_hashes         prefix-cache hashes of the full blocks of
                         `all_token_ids`, filled lazily by the block manager.
    """

    request_id: RequestId
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None = None
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    cache_salt: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    lora_request: Any = None
    mm_items: tuple = ()  # multimodal.ImageItem of the prompt's images, by placeholder offset
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id (or, set by the engine, stop string) that ended it
    # Speculative decoding: tokens drafted after the last one, verified by the next step.
    spec_token_ids: list[int] = field(default_factory=list, repr=False)
    all_token_ids: list[int] = field(init=False, repr=False)
    block_hashes: list[bytes] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        self.output_token_ids = [int(t) for t in self.output_token_ids]
        # Kept alongside the two lists so a step slices its input without concatenating.
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids
        self.block_hashes = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens: the context the next step must have computed."""
        return len(self.all_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(int(token_id))
        self.all_token_ids.append(int(token_id))

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output tokens past the first `num_output_tokens` (tokens a
        speculative step accepted after the one a stop string ended the output at)."""
        extra = self.num_output_tokens - num_output_tokens
        if extra > 0:
            del self.output_token_ids[-extra:]
            del self.all_token_ids[-extra:]

    def stop_status(self) -> RequestStatus | None:
        """FINISHED_* when the newest output token ends the request by its parameters, else None."""
        p = self.sampling_params
        if p is None:
            return None
        token, n = self.output_token_ids[-1], self.num_output_tokens
        if n >= p.min_tokens:
            if token in p.stop_token_ids:
                self.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not p.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if p.max_tokens is not None and n >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def fork(self, request_id: RequestId, sampling_params: SamplingParams | None = None) -> Request:
        """A copy under a new id (n > 1 sampling); KV sharing is the block manager's job."""
        child = Request(
            request_id=request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params if sampling_params is None else sampling_params,
            arrival_time=self.arrival_time,
            priority=self.priority,
            cache_salt=self.cache_salt,
            eos_token_ids=self.eos_token_ids,
            lora_request=self.lora_request,
            mm_items=self.mm_items,
            output_token_ids=self.output_token_ids,
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
        )
        # Same tokens, so the same hashes: saves rehashing the shared prefix.
        child.block_hashes = list(self.block_hashes)
        return child
