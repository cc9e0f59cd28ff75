"""`run_benchmark`: the limits probe here, then infer and transformers each in a spawned process.

A process per runtime keeps each peak RSS its own (peak RSS is a high-water
mark: one process for both would report the larger of the two for each) and
leaves neither runtime's threads, allocator or caches to the other.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from multiprocessing import get_context
from typing import Any

import numpy as np

from .runners import run_infer, run_transformers
from .machine import GB
from .workload import BenchConfig, engine_kwargs, gemm_limits, machine_limits, make_workload, workload_roofline


def _in_child(fn, *args):
    """Run fn in a fresh spawned interpreter: its own peak RSS, no state left by the other runtime."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """How far greedy outputs agree: first tokens equal, and the mean common prefix."""
    prefix = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(a, b)]
    return dict(first_token=float(np.mean([p[:1] == q[:1] for p, q in zip(a, b)])), mean_common_prefix=float(np.mean(prefix)))


def run_benchmark(cfg: BenchConfig, log=print) -> dict[str, Any]:
    from ..core.loader import load_model
    from ..registry import get_backend

    load_start = os.getloadavg()
    m = load_model(cfg.model, load_weights=False)
    special = list(m.tokenizer.all_special_ids) if m.tokenizer is not None else []
    work = make_workload(cfg, m.config["vocab_size"], special)
    kv_per_token = 2 * m.config["num_hidden_layers"] * m.config["num_key_value_heads"] * m.config["head_dim"] * m.dtype.itemsize
    kwargs = engine_kwargs(cfg, work, get_backend(cfg.backend).preferred_block_size, kv_per_token)
    log(f"engine args: {kwargs}")
    limits = machine_limits(cfg, m.config, batch_rows=min(len(work.prompts), kwargs["max_num_seqs"]))
    gemm_text = ", ".join(f"{dt} GEMM {g['peak_gflops']:.1f}" for dt, g in limits["gemm"].items())
    log(f"machine: {limits['bandwidth_gbs']:.1f} GB/s, {limits['matmul_gflops']:.1f} GFLOP/s fp32 matmul, "
        f"{gemm_text} GFLOP/s, {limits['torch_threads']} torch threads")
    log("running infer ...")
    inf = _in_child(run_infer, cfg, work, kwargs)
    dtype = inf["engine"]["dtype"]
    hf = None
    if not cfg.skip_transformers:
        log(f"running transformers ({dtype}) ...")
        hf = _in_child(run_transformers, cfg, work, dtype)
    costs = inf.pop("model")
    if dtype not in limits["gemm"]:  # a dtype the probe did not expect (--dtype auto resolving elsewhere)
        limits["gemm"][dtype] = gemm_limits(cfg, m.config, dtype, limits["gemm"]["float32"]["model_batch_rows"])
    peak = limits["gemm"][dtype]["peak_gflops"]
    limits |= dict(dtype=dtype, gemm_peak_gflops=peak,
                   decode_limit_tok_s=limits["bandwidth_gbs"] * GB / costs["decode_bytes_per_token"],
                   prefill_limit_tok_s=peak * GB / costs["prefill_flops_per_token"],
                   workload_roofline=workload_roofline(costs, [len(p) for p in work.prompts], work.output_len, peak,
                                                       limits["bandwidth_gbs"]))
    report = dict(config=asdict(cfg), engine_args=kwargs | {"resolved": inf.pop("engine")}, machine=limits,
                  model=costs, workload=dict(num_prompts=len(work.prompts), prompt_tokens=sum(map(len, work.prompts)),
                                              output_tokens=len(work.prompts) * work.output_len),
                  infer=inf, transformers=hf, load_avg=dict(start=load_start, end=os.getloadavg()))
    report["ratios"], report["targets"] = _ratios(report)
    for side in (inf, hf or {}):
        side.pop("tokens", None)
    return report


def _ratios(r: dict) -> tuple[dict, dict]:
    inf, hf, mach = r["infer"], r["transformers"], r["machine"]
    mem = inf["memory"]
    sized = mem["weights_bytes"] + mem["kv_pool_bytes"]
    ratios = dict(decode_of_limit=inf["decode"]["decode_tok_s"] / mach["decode_limit_tok_s"],
                  prefill_of_limit=inf["prefill"]["prefill_tok_s"] / mach["prefill_limit_tok_s"],
                  workload_of_roofline=inf["workload"]["output_tok_s"] / mach["workload_roofline"]["output_tok_s"],
                  peak_rss_over_weights_kv=mem["peak_rss"] / sized,
                  peak_rss_above_baseline_over_weights_kv=(mem["peak_rss"] - mem["baseline_rss"]) / sized)
    targets = {"peak RSS / (weights + KV pool)": (ratios["peak_rss_over_weights_kv"], 1.3, "<="),
               "workload / its roofline": (ratios["workload_of_roofline"], 0.4, ">=")}
    if hf is not None:
        ratios |= dict(
            workload_vs_hf_batch=inf["workload"]["output_tok_s"] / hf["batch"]["output_tok_s"],
            workload_vs_hf_single=inf["workload"]["output_tok_s"] / hf["single"]["output_tok_s"],
            decode_vs_hf=inf["decode"]["decode_tok_s"] / hf["decode"]["decode_tok_s"],
            prefill_vs_hf=inf["prefill"]["prefill_tok_s"] / hf["prefill"]["prefill_tok_s"],
            peak_rss_vs_hf=mem["peak_rss"] / hf["memory"]["peak_rss"],
            greedy_agreement=_agreement(inf["tokens"], hf["tokens"]))
        targets |= {"workload vs transformers batch-32": (ratios["workload_vs_hf_batch"], 2.2, ">="),
                    "single-stream decode vs transformers": (ratios["decode_vs_hf"], 3.0, ">="),
                    f"{r['config']['prefill_len']}-token prefill vs transformers": (ratios["prefill_vs_hf"], 1.2, ">=")}
    met = {k: dict(value=v, target=t, op=op, met=bool(v <= t if op == "<=" else v >= t)) for k, (v, t, op) in targets.items()}
    return ratios, met
