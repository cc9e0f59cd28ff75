"""EngineArgs: every engine setting, under vLLM's names (the engine, its worker ranks and the CLI read them)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from .config import POLICIES, CacheConfig, graph_batch_sizes
from .distributed import ParallelConfig
from .kv_groups import blocks_for
from .quant_params import QUANTIZATIONS

# Without an explicit size the KV pool holds max_num_seqs full contexts, capped
# at 1 GiB, so small runs do not reserve gigabytes (--kv-cache-memory raises it).
MAX_DEFAULT_KV_BYTES = 1 << 30
RUNNERS = ("auto", "generate", "pooling")


@dataclass
class EngineArgs:
    """Engine settings with vLLM's names."""

    model: str = "smollm2"
    # 'generate' (a language model's logits, sampled), 'pooling' (embeddings and scores:
    # `core/pooling.py`), or 'auto': pooling for encoder, bare-backbone and classifier
    # architectures, generate for the rest (vLLM's --runner).
    runner: str = "auto"
    backend: str = "auto"
    dtype: str = "auto"
    device: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    # Tokens per KV block; None: the backend's preferred size; "auto": blocks of
    # 1, 2 or 4 pages of the backend's `auto_block_sizes[0]` per request, by its
    # expected length (see block_manager).
    block_size: int | str | None = None
    kv_cache_memory: int | None = None  # bytes, all layers
    gpu_memory_utilization: float = 0.9  # on accelerators, when kv_cache_memory is not given
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # Models mixing sliding-window and full-attention layers keep a block table per
    # layer group and free the blocks a window has passed (core/kv_groups.py); True:
    # one table, every layer keeps every block (vLLM's flag).
    disable_hybrid_kv_cache_manager: bool = False
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    # Grammar library for structured outputs: xgrammar, guidance (llguidance), or
    # auto (xgrammar, llguidance for what xgrammar cannot compile).
    structured_outputs_backend: str = "auto"
    # A reasoning parser's name (deepseek_r1, qwen3, a plugin's): structured outputs
    # then constrain only the answer after the reasoning's end marker.
    reasoning_parser: str | None = None
    # Speculative decoding, vLLM's dict (or its JSON): {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_max": b, "prompt_lookup_min": a}.
    speculative_config: Any = None
    seed: int = 0
    skip_tokenizer_init: bool = False
    show_progress: bool | None = None
    # 'auto': weights stored quantized (GGUF Q4_0/Q4_1/Q8_0, AWQ, GPTQ, fp8) stay
    # quantized when `dtype` is 16-bit and are dequantized for float32; 'none':
    # always dequantize them to `dtype` at load; 'fp8': keep them, and quantize a
    # float model's projections to fp8 e4m3 at load (vLLM's online fp8).
    quantization: str = "auto"
    # 'auto' (the model dtype) or 'fp8' (e4m3, per-layer scales: twice the tokens per byte).
    kv_cache_dtype: str = "auto"
    # Run every step eagerly: no decode graphs (CUDA graphs on the cuda backend).
    enforce_eager: bool = False
    # Decode batch sizes to capture; None: 1, 2, 4, every multiple of 8, up to max_num_seqs.
    cuda_graph_sizes: tuple[int, ...] | None = None
    # A second KV tier under the device pool (core/kv_tier.py), in bytes over all layers (0: none):
    # evicted prefix-cache blocks and swapped-out requests. Host memory; on the CPU backend a
    # memory-mapped file, at kv_offload_path when given (an unlinked file in /dev/shm otherwise).
    kv_offload_bytes: int = 0
    kv_offload_path: str | None = None
    # How a request gives up its blocks when the pool runs out: auto | recompute | swap.
    preemption_mode: str = "auto"
    # Multi-LoRA (core/lora.py): PEFT adapters chosen per request; at most max_loras of
    # them in one step (device slots), rank up to max_lora_rank, max_cpu_loras kept in
    # host memory (None: max_loras). lora_modules: adapters known from the start.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple = ()
    # Vision-language models (core/multimodal.py): at most this many items of each modality per
    # prompt (vLLM's --limit-mm-per-prompt, e.g. {"image": 2}); the encoder output cache's size in
    # feature rows (vLLM sizes it by the token budget the same way).
    limit_mm_per_prompt: dict | None = None
    encoder_cache_rows: int = 16384
    # Where chat image URLs may point: file:// paths under this directory (none by default),
    # http(s) hosts in this list (None: any).
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple | None = None
    # Count which implementation served every call (`engine.dispatch_trace`, `infer run --trace-dispatch`).
    trace_dispatch: bool = False
    # Distributed serving (core/distributed.py, docs/distributed.md).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # mp | external_launcher | ray; None: mp when needed
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # Which data-parallel replica this engine is (`infer serve` sets it; its ranks use the
    # devices after the earlier replicas', and with --master-port, the port + this index).
    data_parallel_rank: int = 0

    def parallel_config(self) -> ParallelConfig:
        port = self.master_port + self.data_parallel_rank if self.master_port else self.master_port
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size,
                              self.distributed_executor_backend, self.nnodes, self.node_rank, self.master_addr, port)

    def check(self) -> None:
        """Reject what the engine would otherwise silently replace (0 read as 'unset'), before loading anything."""
        if self.enable_lora:
            if self.max_loras < 1 or self.max_lora_rank < 1 or (self.max_cpu_loras is not None
                                                                 and self.max_cpu_loras < 1):
                raise ValueError(f"max_loras ({self.max_loras}), max_lora_rank ({self.max_lora_rank}) and "
                                 f"max_cpu_loras ({self.max_cpu_loras}) must be >= 1")
        elif self.lora_modules:
            raise ValueError("lora_modules needs enable_lora=True (--enable-lora)")
        for name in ("max_model_len", "block_size", "num_gpu_blocks_override", "kv_cache_memory"):
            value = getattr(self, name)
            if name == "block_size" and value == "auto":
                continue
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, or None for the default"
                                 f"{' (or auto)' if name == 'block_size' else ''}; got {value!r}")
        if self.cuda_graph_sizes is not None:
            graph_batch_sizes(self.max_num_seqs, self.cuda_graph_sizes)  # raises on a bad size
        for kind, n in (self.limit_mm_per_prompt or {}).items():
            if kind != "image":
                raise ValueError(f"limit_mm_per_prompt: only 'image' inputs are supported, got {kind!r}")
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"limit_mm_per_prompt['image'] must be an integer >= 0, got {n!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {self.runner!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8'; got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}; got {self.scheduling_policy!r}")

    def batched_tokens(self) -> int:
        """Tokens one step computes at most (max_num_batched_tokens, or its default)."""
        return self.max_num_batched_tokens or max(2048, self.max_num_seqs)

    def cache_config(self, backend, per_token: int, max_model_len: int,
                     profile: Callable[[int, int], int], windows: tuple[int | None, ...] = (None,)) -> CacheConfig:
        """The KV pool: block size, and blocks from num_gpu_blocks_override, kv_cache_memory,
        or (neither given) `kv_budget`; `per_token`: KV bytes of one token of one block on
        the rank holding the most (with a hybrid cache, of one page: a group's layers);
        `profile(tokens, block_size)`: peak device bytes of a forward; `windows`: the
        hybrid cache's groups (`kv_groups`)."""
        multiples = (1,)
        if self.block_size == "auto":
            sizes = backend.auto_block_sizes
            block_size, multiples = sizes[0], tuple(s // sizes[0] for s in sizes)
        else:
            block_size = self.block_size or backend.preferred_block_size
        if self.kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_bytes must be >= 0, got {self.kv_offload_bytes}")
        tier = self.kv_offload_bytes // (per_token * block_size)
        if self.kv_offload_bytes and not tier:
            raise ValueError(f"kv_offload_bytes={self.kv_offload_bytes} holds no KV block of {block_size} tokens "
                             f"({per_token * block_size} bytes); raise it or pass 0 for no host tier")
        common = dict(enable_prefix_caching=self.enable_prefix_caching, num_tier_blocks=tier,
                      block_multiples=multiples, kv_group_windows=windows)
        if self.num_gpu_blocks_override:
            return CacheConfig(block_size, num_blocks=self.num_gpu_blocks_override, **common).resolve(block_size)
        # One full context's pages, in tokens of one page (max_model_len without a hybrid cache).
        context = blocks_for(windows, max_model_len, block_size, self.batched_tokens()) * block_size
        kv_bytes = self.kv_cache_memory or self.kv_budget(backend, per_token, block_size, max_model_len, profile,
                                                           context)
        # At least one full context, or the scheduler could never finish a long request.
        floor = per_token * (context + block_size)
        if self.kv_cache_memory and self.kv_cache_memory < floor:
            logging.getLogger("infer").warning(
                "kv_cache_memory=%.1f MiB is less than one full context (max_model_len=%d tokens at %d bytes per "
                "token); the KV cache is %.1f MiB instead. Lower max_model_len for a smaller cache",
                self.kv_cache_memory / 2**20, max_model_len, per_token, floor / 2**20)
        return CacheConfig(block_size, kv_cache_memory_bytes=max(kv_bytes, floor), **common).resolve(block_size,
                                                                                                     per_token)

    def kv_budget(self, backend, per_token: int, block_size: int, max_model_len: int, profile,
                  context: int | None = None) -> int:
        """KV pool bytes when the user gave none: on host memory, enough for max_num_seqs
        full contexts (capped; `context`: one context's tokens of `per_token` bytes, by
        default max_model_len); on an accelerator, what gpu_memory_utilization leaves
        after profiling one full-budget forward."""
        mem = backend.memory_info()
        if mem is None:
            return min(MAX_DEFAULT_KV_BYTES, per_token * self.max_num_seqs * (context or max_model_len))
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        peak = profile(min(self.max_num_batched_tokens or 2048, max_model_len), block_size)
        budget = int(mem[0] * self.gpu_memory_utilization) - peak
        if budget < per_token * block_size:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} of {mem[0] / 2**30:.1f} GiB "
                             "leaves no room for the KV cache after weights and activations "
                             f"({peak / 2**30:.2f} GiB); raise it")
        return budget


# What must be equal on every rank of a job (the rest is per rank or per node).
PER_RANK_ARGS = ("device", "show_progress", "node_rank", "skip_tokenizer_init", "trace_dispatch", "master_port",
                 "data_parallel_rank", "kv_offload_path")
