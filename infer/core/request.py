"""One generation request as the scheduler and the block manager see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; every FINISHED_* value is terminal."""

    WAITING = 0
    RUNNING = 1
    # Back in the waiting queue after losing its blocks; it recomputes its KV.
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # a stop condition of the engine (EOS, stop string, ...)
    FINISHED_LENGTH_CAPPED = 4  # max_tokens or max_model_len reached
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason: 'stop', 'length', 'abort', or None while alive."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


# eq=False: requests are compared by identity, which is what list.remove and
# `in` on the running list need (two requests may hold equal tokens).
@dataclass(slots=True, eq=False)
class Request:
    """A request: its tokens, how many have KV in the cache, and its status.

    request_id           unique among live requests.
    prompt_token_ids     the prompt; never empty.
    sampling_params      the engine's sampling parameters; opaque to the core.
    arrival_time         seconds (time.time() by default); orders fcfs and
                         breaks priority ties.
    priority             lower is served first under the 'priority' policy.
    cache_salt           separates prefix-cache entries (e.g. per tenant): blocks
                         are shared only between requests with the same salt.
    output_token_ids     generated tokens so far.
    num_computed_tokens  leading tokens of `all_token_ids` whose KV is in the
                         cache; the rest are computed in coming steps.
    block_hashes         prefix-cache hashes of the full blocks of
                         `all_token_ids`, filled lazily by the block manager.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any = None
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
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

    def fork(self, request_id: str, sampling_params: Any = None) -> Request:
        """A copy under a new id (n > 1 sampling); KV sharing is the block manager's job."""
        child = Request(
            request_id=request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params if sampling_params is None else sampling_params,
            arrival_time=self.arrival_time,
            priority=self.priority,
            cache_salt=self.cache_salt,
            output_token_ids=self.output_token_ids,
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
        )
        # Same tokens, so the same hashes: saves rehashing the shared prefix.
        child.block_hashes = list(self.block_hashes)
        return child
