"""The throughput benchmark's workload, engine settings, and the limits the machine and model set."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .machine import measure_bandwidth, measure_linear, measure_peak


@dataclass
class BenchConfig:
    model: str = "smollm2"
    backend: str = "torch"
    num_prompts: int = 32
    output_len: int = 64
    min_len: int = 20
    max_len: int = 200
    seed: int = 0
    decode_len: int = 128  # single stream: tokens generated after a short prompt
    decode_prompt_len: int = 16
    prefill_len: int = 512
    repeats: int = 3  # decode and prefill: best of this many, each on a fresh prompt
    skip_transformers: bool = False
    threads: int | None = None  # torch intra-op threads in every process; None: torch's default
    limits_mib: int = 512  # array size of the bandwidth probe
    gemm_n: int = 2048
    dtype: str = "float32"  # infer's --dtype; float32 does the transformers peer's arithmetic
    speculative_config: str | None = None  # infer's --speculative-config (JSON)


QUICK = dict(num_prompts=4, output_len=8, min_len=8, max_len=32, decode_len=16, prefill_len=64, repeats=1,
             limits_mib=64, gemm_n=512)


@dataclass
class Workload:
    """Token ids shared by both runtimes, so they do exactly the same work."""

    prompts: list[list[int]]
    output_len: int
    decode_prompts: list[list[int]]  # one per repeat, fresh so no prefix-cache hit
    prefill_prompts: list[list[int]]
    warmup_prompts: list[list[int]] = field(default_factory=list)


def make_workload(cfg: BenchConfig, vocab_size: int, special_ids: list[int]) -> Workload:
    """Random non-special ids with exact lengths drawn from `cfg.seed`."""
    rng = np.random.default_rng(cfg.seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(special_ids, dtype=np.int64))

    def ids(n: int) -> list[int]:
        return rng.choice(allowed, size=n).tolist()

    lengths = rng.integers(cfg.min_len, cfg.max_len + 1, size=cfg.num_prompts)
    return Workload(prompts=[ids(int(n)) for n in lengths], output_len=cfg.output_len,
                    decode_prompts=[ids(cfg.decode_prompt_len) for _ in range(cfg.repeats)],
                    prefill_prompts=[ids(cfg.prefill_len) for _ in range(cfg.repeats)],
                    warmup_prompts=[ids(24), ids(40)])


def engine_kwargs(cfg: BenchConfig, work: Workload, block_size: int, kv_bytes_per_token: int) -> dict[str, Any]:
    """infer's settings for the run: every prompt runs at once, the KV pool fits the workload.

    The step budget is the engine's default, 2048 tokens (a 512-token prompt
    prefills in one step); 4096, one step for the whole workload's prefill,
    measured no faster here and took a third more peak RSS.
    """
    max_model_len = max(cfg.max_len + cfg.output_len, cfg.prefill_len + 1, cfg.decode_prompt_len + cfg.decode_len)
    blocks = sum(-(-(len(p) + work.output_len) // block_size) for p in work.prompts)
    kv_tokens = max(blocks, -(-max_model_len // block_size) + 1) * block_size
    # float32 (the default) with the checkpoint dequantized: the same arithmetic as the transformers
    # peer, so the two runs' greedy tokens can be compared (benchmarks/quant.py times quantized runs).
    return dict(model=cfg.model, backend=cfg.backend, dtype=cfg.dtype, quantization="none",
                max_num_seqs=max(32, cfg.num_prompts),
                max_num_batched_tokens=max(2048, cfg.prefill_len), max_model_len=max_model_len,
                kv_cache_memory=kv_tokens * kv_bytes_per_token, show_progress=False,
                speculative_config=cfg.speculative_config)


def set_threads(cfg: BenchConfig) -> None:
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)


# -- what the machine allows -----------------------------------------------------
def linear_shapes(config: dict) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's projections, as the runner fuses them (qkv, o, gate_up, down)."""
    h, hd = config["hidden_size"], config["head_dim"]
    hq, hk = config["num_attention_heads"], config["num_key_value_heads"]
    inter = config.get("intermediate_size") or config.get("moe_intermediate_size")
    return [((hq + 2 * hk) * hd, h), (h, hq * hd), (2 * inter, h), (h, inter)]


def gemm_limits(cfg: BenchConfig, config: dict | None, dtype: str, batch_rows: int) -> dict[str, Any]:
    """The GEMM peak in `dtype`: the best of an n^3 matmul and the model's linears at 256 rows;
    and the linears' rate at `batch_rows` (0.0 without a model config)."""
    shapes = linear_shapes(config) if config else []
    square = max(measure_peak(cfg.gemm_n, 5, dtype).values())  # float32: NumPy's too
    wide = measure_linear(shapes, 256, dtype) if shapes else 0.0
    return dict(peak_gflops=max(square, wide), square_gflops=square, model_256_rows_gflops=wide,
                model_batch_rows=batch_rows,
                model_batch_gflops=measure_linear(shapes, batch_rows, dtype) if shapes else 0.0)


def machine_limits(cfg: BenchConfig, config: dict | None = None, batch_rows: int = 32) -> dict[str, Any]:
    """Memory bandwidth (GB/s), the fp32 matmul peak (GFLOP/s), and `gemm_limits` for float32 and
    the dtype infer is asked for (`auto`: bfloat16, what it resolves to where that is faster)."""
    import torch

    set_threads(cfg)
    bw = measure_bandwidth(cfg.limits_mib, repeats=5, allocations=1)
    asked = "bfloat16" if cfg.dtype == "auto" else cfg.dtype
    gemm = {dt: gemm_limits(cfg, config, dt, batch_rows) for dt in dict.fromkeys(("float32", asked))}
    return dict(bandwidth_copy_gbs=bw["torch copy (read+write)"], bandwidth_read_gbs=bw["torch sum (read)"],
                bandwidth_gbs=max(bw.values()), matmul_gflops=gemm["float32"]["square_gflops"], gemm=gemm,
                torch_threads=torch.get_num_threads(), cpu_count=os.cpu_count())


def model_costs(runner, config: dict, decode_ctx: float, prefill_len: int) -> dict[str, float]:
    """Bytes read per decode token and FLOPs per prompt token, from a model's lowered program.

    Decode reads every linear and norm weight once per step (the embedding
    table only as one row, unless tied as the LM head) plus the KV of its
    context. Prefill multiplies every layer weight per token, attends to half
    the prompt on average, and computes logits for the last token only.
    """
    params = runner.program.graph.params

    def size(name: str) -> int:
        return int(np.prod(params[name].shape))

    calls = runner.program.primitive_calls()
    linears = {c.params["weight"]: c.outputs[0] == "logits" for c in calls if c.primitive == "linear"}
    norms = {c.params["weight"] for c in calls if c.primitive == "rms_norm"}
    itemsize = 4 if runner.dtype == "float32" else 2
    by_source = {p.sources: size(n) for n, p in params.items()}  # a tied LM head is the embedding: once
    layers, hd = config["num_hidden_layers"], config["head_dim"]
    kv_per_token = 2 * layers * config["num_key_value_heads"] * hd * itemsize
    head = sum(size(w) for w, is_head in linears.items() if is_head)
    body = sum(size(w) for w, is_head in linears.items() if not is_head)
    # An MoE layer runs top_k of its E experts per token: that share of the
    # expert weights is read per decode token and multiplied per prompt token.
    body += sum((size(c.params["w13"]) + size(c.params["w2"])) * c.attrs["top_k"] // params[c.params["w13"]].shape[0]
                for c in calls if c.primitive == "moe")
    attn_per_key = 4 * layers * config["num_attention_heads"] * hd  # q . k and p @ v, per query and key
    weights_read = (head + body + sum(size(n) for n in norms)) * itemsize
    return dict(params=sum(by_source.values()), weight_bytes=sum(by_source.values()) * itemsize,
                decode_bytes_per_token=weights_read + kv_per_token * decode_ctx,
                prefill_flops_per_token=2 * body + attn_per_key * (prefill_len + 1) / 2 + 2 * head / prefill_len,
                body_params=body, head_params=head, weights_read_bytes=weights_read, kv_bytes_per_token=kv_per_token,
                attn_flops_per_query_key=attn_per_key)


def workload_roofline(costs: dict, prompt_lens: list[int], output_len: int, gemm_gflops: float,
                      bandwidth_gbs: float) -> dict[str, float]:
    """The least time the workload can take here, every prompt running at once: its prefill's
    FLOPs at the GEMM peak, then output_len - 1 decode steps of all requests, each bound by its
    FLOPs at that peak or by reading the weights and every request's KV at the bandwidth,
    whichever is longer."""
    n, gemm, bw = len(prompt_lens), gemm_gflops * 1e9, bandwidth_gbs * 1e9
    body, head, per_key = costs["body_params"], costs["head_params"], costs["attn_flops_per_query_key"]
    prefill = (2 * body * sum(prompt_lens) + 2 * head * n + per_key * sum(p * (p + 1) / 2 for p in prompt_lens)) / gemm
    decode = 0.0
    for i in range(1, output_len):
        ctx = sum(prompt_lens) + n * i  # keys every request reads at this step
        flops = n * 2 * (body + head) + per_key * ctx
        decode += max(flops / gemm, (costs["weights_read_bytes"] + costs["kv_bytes_per_token"] * ctx) / bw)
    return dict(seconds=prefill + decode, prefill_s=prefill, decode_s=decode, output_tok_s=n * output_len / (prefill + decode))
