"""EngineArgs: every engine setting, under vLLM's names (the engine, its worker ranks and the CLI read them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .distributed import ParallelConfig

# Without an explicit size the KV pool holds max_num_seqs full contexts, capped
# at 1 GiB, so small runs do not reserve gigabytes (--kv-cache-memory raises it).
MAX_DEFAULT_KV_BYTES = 1 << 30


@dataclass
class EngineArgs:
    """Engine settings with vLLM's names."""

    model: str = "smollm2"
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


# What must be equal on every rank of a job (the rest is per rank or per node).
PER_RANK_ARGS = ("device", "show_progress", "node_rank", "skip_tokenizer_init", "trace_dispatch", "master_port",
                 "data_parallel_rank", "kv_offload_path")
