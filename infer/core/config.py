"""Cache and scheduler configuration, with vLLM's names and CPU-sensible defaults.

Both records validate themselves on construction, so a bad value fails where the
user wrote it, with the field name and the fix in the message.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal


POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("auto", "recompute", "swap")


def _positive(name: str, value: int | None, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(slots=True)
class CacheConfig:
    """How the paged KV cache is sized and whether prefix caching is on.

    block_size             tokens per KV block; None takes the backend's
                           `preferred_block_size` (16 when it states none; 128
                           on Ascend) when the engine calls `resolve`.
    num_blocks             size of the pool in blocks (vLLM:
                           num_gpu_blocks_override). Wins over the bytes below.
    kv_cache_memory_bytes  size of the pool in bytes, all layers together; the
                           engine turns it into blocks from the model's
                           per-token KV footprint. One of the two must be
                           set (the engine's default budget is its own:
                           `EngineArgs.kv_cache_memory`).
    enable_prefix_caching  reuse the KV of full blocks whose token prefix was
                           already computed (vLLM V1 turns it on by default).
    num_tier_blocks        blocks of the host tier under the pool (`kv_tier`):
                           evicted prefix blocks and swapped-out requests; 0: none.
    block_multiples        block sizes requests may use, in blocks of
                           `block_size` (``--block-size auto``: (1, 2, 4), each
                           request's chosen by its expected length); (1,): one size.
    kv_group_windows       the hybrid cache's groups (`kv_groups`): each group's
                           sliding window, None for full attention; (None,):
                           one table per request, the plain cache. A block is
                           then a page of one group's layers.
    """

    block_size: int | None = None
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    num_tier_blocks: int = 0
    block_multiples: tuple[int, ...] = (1,)
    kv_group_windows: tuple[int | None, ...] = (None,)

    def __post_init__(self) -> None:
        if self.num_tier_blocks < 0:
            raise ValueError(f"CacheConfig.num_tier_blocks must be >= 0, got {self.num_tier_blocks}")
        _positive("CacheConfig.block_size", self.block_size)
        _positive("CacheConfig.num_blocks", self.num_blocks)
        _positive("CacheConfig.kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if self.num_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError(
                "CacheConfig: set num_blocks or kv_cache_memory_bytes, not both "
                f"(got {self.num_blocks} blocks and {self.kv_cache_memory_bytes} bytes)"
            )

    @property
    def is_resolved(self) -> bool:
        return self.block_size is not None and self.num_blocks is not None

    def resolve(self, preferred_block_size: int = 16, kv_bytes_per_token: int | None = None) -> CacheConfig:
        """A copy with `block_size` and `num_blocks` settled.

        `preferred_block_size` is the backend's; `kv_bytes_per_token` is the KV
        footprint of one token over all layers (2 * layers * kv_heads *
        head_dim * dtype bytes), needed only when the pool is given in bytes.
        """
        block_size = self.block_size or preferred_block_size
        _positive("preferred_block_size", block_size, allow_none=False)
        num_blocks = self.num_blocks
        if num_blocks is None:
            if kv_bytes_per_token is None or self.kv_cache_memory_bytes is None:
                raise ValueError(
                    "CacheConfig.resolve: set CacheConfig.num_blocks, or kv_cache_memory_bytes and pass "
                    "kv_bytes_per_token"
                )
            _positive("kv_bytes_per_token", kv_bytes_per_token, allow_none=False)
            budget = self.kv_cache_memory_bytes
            num_blocks = budget // (kv_bytes_per_token * block_size)
            if num_blocks == 0:
                raise ValueError(
                    f"KV cache of {budget} bytes holds no block of {block_size} tokens at "
                    f"{kv_bytes_per_token} bytes/token; raise kv_cache_memory_bytes"
                )
        return dataclasses.replace(self, block_size=block_size, num_blocks=num_blocks, kv_cache_memory_bytes=None)


@dataclass(slots=True)
class SchedulerConfig:
    """Continuous-batching limits and policy (vLLM V1's names).

    max_num_seqs                 requests in one step's batch.
    max_num_batched_tokens       token budget of one step, prefill and decode together.
    max_model_len                longest context (prompt + output); None lets the
                                 engine take it from the model (the scheduler alone
                                 falls back to what the KV pool can hold).
    enable_chunked_prefill       split a prompt over steps when the budget runs out;
                                 off, a prompt is admitted only whole.
    long_prefill_token_threshold cap on prompt tokens one request takes per step,
                                 so one long prompt cannot hog the budget; 0: no cap.
    policy                       'fcfs' (arrival order) or 'priority' (lower value first).
    priority_aging_s             with 'priority': waiting this many seconds is
                                 worth one priority level, so low priority cannot
                                 starve (see Scheduler); None or 0 disables aging.
    preemption_mode              'recompute' (free the blocks, compute them again on
                                 resuming), 'swap' (copy them to the host tier and
                                 back; recompute when the tier is full) or 'auto'
                                 (swap a request holding a full block when the tier
                                 has room, recompute shorter ones).
    max_loras                    distinct LoRA adapters one step may use (0: no limit,
                                 LoRA off); requests of others wait for a later step.
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: Literal["fcfs", "priority"] = "fcfs"
    priority_aging_s: float | None = 60.0
    preemption_mode: Literal["auto", "recompute", "swap"] = "auto"
    max_loras: int = 0

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        _positive("SchedulerConfig.max_num_seqs", self.max_num_seqs, allow_none=False)
        _positive("SchedulerConfig.max_num_batched_tokens", self.max_num_batched_tokens, allow_none=False)
        _positive("SchedulerConfig.max_model_len", self.max_model_len)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every scheduled request needs at least one token"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold needs enable_chunked_prefill=True")
        if self.policy not in POLICIES:
            raise ValueError(f"SchedulerConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        if self.priority_aging_s is not None and self.priority_aging_s < 0:
            raise ValueError(f"priority_aging_s must be >= 0 or None, got {self.priority_aging_s}")
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            self.check_fits_unchunked(self.max_model_len)

    def check_fits_unchunked(self, max_model_len: int) -> None:
        """Without chunking a whole context must fit one step's budget."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) < max_model_len ({max_model_len}) "
                "with chunked prefill off: long prompts could never be scheduled; raise the budget, "
                "lower max_model_len or set enable_chunked_prefill=True"
            )


def graph_batch_sizes(max_num_seqs: int, sizes=None) -> tuple[int, ...]:
    """Decode batch sizes to capture as graphs: the given ones (vLLM's
    ``cuda_graph_sizes``), else vLLM's pattern 1, 2, 4 and every multiple of 8
    up to ``max_num_seqs``, which is always one of them, so every decode batch
    the scheduler can form has a graph to be padded into."""
    if sizes is not None:
        out = sorted(set(sizes))
        if not out or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in out):
            raise ValueError(f"cuda_graph_sizes must be positive integers; got {list(sizes)!r}")
        return tuple(out)
    return tuple(sorted({s for s in (1, 2, 4, *range(8, max_num_seqs + 1, 8)) if s <= max_num_seqs} | {max_num_seqs}))
