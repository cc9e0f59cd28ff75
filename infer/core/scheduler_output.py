"""What one step computes: the scheduler's decision and the model inputs built from it.

`SchedulerOutput.model_input()` turns the decision into the flat NumPy arrays
of the batch convention (DESIGN.md): every scheduled token of every request,
prefill chunks and decodes mixed, concatenated in the order of `scheduled`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..primitives.types import AttentionMetadata
from .request import Request, RequestId, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    start       tokens already in the cache: position of the first token computed now.
    num_tokens  tokens computed this step (a prompt chunk, a recompute, or 1 to decode).
    token_ids   those tokens: ``request.all_token_ids[start : start + num_tokens]``.
    block_ids   the request's block table, covering ``start + num_tokens`` tokens.
    do_sample   whether this step reaches the request's last known token, so the
                logits of its last row are sampled (False for a partial prefill).
    num_drafts  speculative tokens after the last known one (the last `num_drafts`
                of `token_ids`): the logits of the last ``1 + num_drafts`` rows are
                sampled, verifying each draft.
    pages_per_block  pages (blocks of the pool's `block_size`) in each of the
                request's blocks; `block_ids` lists pages either way, k > 1
                of them in aligned runs of k (``--block-size auto``).
    groups      with a hybrid KV cache (`kv_groups`): (block ids, pages per
                block) in each group after the first, whose table is
                `block_ids`; a windowed group's dropped blocks read 0.
    """

    request_id: RequestId
    start: int
    num_tokens: int
    token_ids: list[int]
    block_ids: np.ndarray | list[int]  # int32 from the block manager
    do_sample: bool
    request: Request = field(repr=False)
    num_drafts: int = 0
    pages_per_block: int = 1
    groups: tuple = ()

    @property
    def seq_len(self) -> int:
        """Context length once this step's tokens are computed."""
        return self.start + self.num_tokens


@dataclass(slots=True)
class ModelInput:
    """Host arrays of one step; the backend moves them once (`prepare_metadata`).

    input_ids           [T] int64, scheduled tokens, flattened.
    positions           [T] int64, position of each in its request.
    attn_metadata       AttentionMetadata (query_start_loc, seq_lens, block_table,
                        slot_mapping, max_query_len, max_seq_len, block_size).
    logits_indices      [L] int64, rows of `input_ids` whose logits are sampled
                        (the last ``1 + num_drafts`` rows of each request with do_sample).
    sample_request_ids  [S] the requests sampled, in order.
    sample_num_rows     [S] int64, entries of `logits_indices` per sampled request
                        (1 + its drafts), or None when every request has one.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    attn_metadata: AttentionMetadata
    logits_indices: np.ndarray
    sample_request_ids: list[RequestId]
    sample_num_rows: np.ndarray | None = None


@dataclass(slots=True)
class SchedulerOutput:
    """The scheduler's decision for one step.

    scheduled              requests computed this step, in batch order.
    block_copies           (src, dst) block copies the engine performs, in order,
                           before the forward pass (copy-on-write of forks).
    preempted_request_ids  requests that lost their blocks this step and went
                           back to waiting; they will recompute their KV.
    finished_request_ids   requests finished or aborted since the previous step,
                           so per-request state elsewhere can be dropped.
    block_size             tokens per KV block.
    tier_ops               copies between the device pool and the host tier
                           (`kv_tier.TierOp`), in order, performed before the
                           block copies and the forward pass.
    forks                  requests forked from scheduled ones while the step is
                           in flight (`Scheduler.fork_request`): each takes a token
                           from its parent's logits.
    """

    scheduled: list[ScheduledRequest]
    block_copies: list[tuple[int, int]]
    preempted_request_ids: list[RequestId]
    finished_request_ids: list[RequestId]
    block_size: int
    tier_ops: list = field(default_factory=list)
    forks: list[ScheduledRequest] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_scheduled_tokens(self) -> dict[RequestId, int]:
        return {s.request_id: s.num_tokens for s in self.scheduled}

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def model_input(self) -> ModelInput:
        """Build the step's flat token arrays and attention metadata."""
        bs, scheduled = self.block_size, self.scheduled
        q_lens = np.array([s.num_tokens for s in scheduled], dtype=np.int32)
        seq_lens = np.array([s.seq_len for s in scheduled], dtype=np.int32)
        query_start_loc = np.zeros(len(scheduled) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        row_req = np.repeat(np.arange(len(scheduled)), q_lens)
        offset_in_query = np.arange(num_tokens) - query_start_loc[row_req]
        positions = (seq_lens - q_lens)[row_req].astype(np.int64) + offset_in_query
        tables = [_tables([s.block_ids for s in scheduled], [s.pages_per_block for s in scheduled], row_req, positions, bs)]
        for g in range(len(scheduled[0].groups) if scheduled else 0):
            tables.append(_tables([s.groups[g][0] for s in scheduled], [s.groups[g][1] for s in scheduled], row_req,
                                  positions, bs))
        input_ids = np.fromiter((t for s in scheduled for t in s.token_ids), dtype=np.int64, count=num_tokens)
        sampled = [b for b, s in enumerate(scheduled) if s.do_sample]
        ends = query_start_loc[1:][sampled].astype(np.int64)
        drafts = np.array([scheduled[b].num_drafts for b in sampled], dtype=np.int64)
        if drafts.any():
            num_rows = drafts + 1
            logits_indices = np.repeat(ends - num_rows, num_rows) + (
                np.arange(int(num_rows.sum())) - np.repeat(np.cumsum(num_rows) - num_rows, num_rows))
        else:
            num_rows, logits_indices = None, ends - 1
        metas = [AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=slot_mapping,
            max_query_len=int(q_lens.max(initial=0)),
            max_seq_len=int(seq_lens.max(initial=0)),
            block_size=bs,
            block_sizes=block_sizes,
        ) for block_table, slot_mapping, block_sizes in tables]
        meta = metas[0]
        if len(metas) > 1:
            meta.kv_groups = tuple(metas[1:])
        return ModelInput(
            input_ids=input_ids,
            positions=positions,
            attn_metadata=meta,
            logits_indices=logits_indices,
            sample_request_ids=[scheduled[b].request_id for b in sampled],
            sample_num_rows=num_rows,
        )


@dataclass(slots=True)
class StepOutput:
    """What the model computed in one step: the new tokens of each sampling request.

    Row i belongs to ``request_ids[i]``; the arrays are host NumPy. A request has
    one row, or after a speculative step one per token it takes (the accepted
    drafts and the token after them), consecutive and in order.

      token_ids      [S] int64, the sampled tokens.
      logprobs       [S] float32, each token's raw logprob.
      ranks          [S] int64 (1-based, among the raw logprobs) or None when no
                     request asked for top logprobs.
      top_token_ids  [S, K] int64 and top_logprobs [S, K] float32, or None.
    """

    request_ids: list[RequestId]
    token_ids: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray | None = None
    top_token_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None

    @classmethod
    def of_tokens(cls, tokens: dict[RequestId, int]) -> StepOutput:
        """Sampled tokens alone (logprobs 0): for drivers without a model, such as tests."""
        return cls(list(tokens), np.fromiter(tokens.values(), np.int64, len(tokens)), np.zeros(len(tokens), np.float32))


@dataclass(slots=True)
class RequestProgress:
    """A request that took its sampled token in a step.

    row     its row in the step's `StepOutput`.
    status  a FINISHED_* status when the scheduler stopped it on this token
            (EOS, a stop token, max_tokens, max_model_len), else None.
    """

    request: Request
    row: int
    status: RequestStatus | None


@dataclass(slots=True)
class StepResult:
    """What `Scheduler.update_from_output` returns: requests that took a token, in
    row order, and every request that finished in the step."""

    progressed: list[RequestProgress]
    finished: list[Request]


def _tables(rows, pages: list[int], row_req: np.ndarray, positions: np.ndarray, bs: int):
    """(block_table, slot_mapping, block_sizes) of one block table per request: the
    table in pages (in units of each request's blocks when some use several pages)."""
    block_table = np.zeros((len(rows), max((len(r) for r in rows), default=0)), dtype=np.int32)
    for b, row in enumerate(rows):
        block_table[b, : len(row)] = row
    # Each row's slot through its request's block table.
    slot_mapping = block_table[row_req, positions // bs].astype(np.int64) * bs + positions % bs
    k_of = np.array(pages, dtype=np.int32)
    block_sizes = None
    if (k_of > 1).any():  # mixed block sizes: each row in units of its own blocks
        block_sizes = k_of * bs
        width = max(-(-len(r) // k) for r, k in zip(rows, pages))
        table = np.zeros((len(rows), width), dtype=np.int32)
        for b, (r, k) in enumerate(zip(rows, pages)):
            row = np.asarray(r[::k]) // k
            table[b, : len(row)] = row
        block_table = table
    return block_table, slot_mapping, block_sizes
