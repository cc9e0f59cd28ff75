"""The host KV tier on SmolLM2 (CPU, torch backend): prefix offload and swap preemption.

    python benchmarks/kv_tier.py --json out.json --png out.png

Two workloads, each engine in its own process (torch imported first, default
flags apart from the ones compared):

* ``prefix``: requests that each begin with one of four 1,024-token system
  prompts (random token ids) plus a 32-token question, in rounds that cycle
  through the four, 16 new tokens each, one request at a time (what a chat
  server sees between bursts); the device pool holds ~25% of the distinct
  system prompts' KV (1.25 of 4), so without a tier each returning prompt was
  evicted meanwhile. Compared: no tier against ``--kv-offload-bytes`` large
  enough for all four. Reported: TTFT p50/p99, output tok/s, prefix hits by
  tier.
* ``preempt``: 16 requests of 256 prompt tokens generating 192 tokens each, at
  once, in a pool of ~35% of what they need together: requests are preempted
  again and again. Compared: ``--preemption-mode recompute`` without a tier
  (with one, a recomputed prompt finds its evicted blocks there) against
  ``swap``.
  Reported: output tok/s, preemptions, swaps.

`--pairs` runs each comparison that many times, alternating the two
configurations' processes (this 2-core machine drifts between processes);
figures are medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch  # noqa: F401  (first, as a user's script does)
from fresh import pyplot, run_child, save_json

PROMPT, QUESTION, SYSTEMS, ROUNDS, NEW = 1024, 32, 4, 3, 16
PRE_REQS, PRE_PROMPT, PRE_NEW = 16, 256, 192


def _child(workload: str, config: str) -> dict:
    import numpy as np

    from infer.core.engine import EngineArgs, LLMEngine
    from infer.core.sampling_params import SamplingParams

    rng = np.random.default_rng(0)
    vocab = 49152
    block = 16
    per_block = None
    if workload == "prefix":
        systems = [rng.integers(100, vocab, PROMPT).tolist() for _ in range(SYSTEMS)]
        prompts = [systems[r % SYSTEMS] + rng.integers(100, vocab, QUESTION).tolist()
                   for r in range(SYSTEMS * ROUNDS)]
        # The pool: ~25% of the four system prompts, plus room for one request's own blocks.
        pool = (SYSTEMS * PROMPT // 4 + PROMPT + QUESTION + NEW) // block + 2
        args = dict(max_num_seqs=1, num_gpu_blocks_override=pool, max_model_len=2048)
        tier = config == "tier"
    else:
        prompts = [rng.integers(100, vocab, PRE_PROMPT).tolist() for _ in range(PRE_REQS)]
        need = PRE_REQS * -(-(PRE_PROMPT + PRE_NEW) // block)
        args = dict(max_num_seqs=PRE_REQS, num_gpu_blocks_override=int(need * 0.35), max_model_len=1024,
                    preemption_mode=config)
        tier = config == "swap"  # recompute as it was before the tier: no host copy of anything
    probe = LLMEngine(EngineArgs(model="smollm2", show_progress=False, **args))
    per_block = probe.worker.runner.kv_cache_bytes_per_block(probe.cache_config.block_size)
    del probe
    offload = per_block * 4 * (SYSTEMS * PROMPT // block + 64) if tier else 0
    engine = LLMEngine(EngineArgs(model="smollm2", show_progress=False, kv_offload_bytes=offload, **args))
    # Warm up on other tokens (kernels, dense copies), then count from zero.
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"warm{i}", {"prompt_token_ids": rng.integers(100, vocab, 600 + i).tolist()}, warm)
        while engine.has_unfinished_requests():
            engine.step()
    bm = engine.scheduler.block_manager
    hits0, tier0 = bm.prefix_cache_stats.hits, bm.prefix_cache_stats.tier_hits
    sched = engine.scheduler
    pre0, swap0 = sched.num_preemptions, sched.num_swapped_out
    new = NEW if workload == "prefix" else PRE_NEW
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    ttft, tokens = [], 0
    start = time.perf_counter()
    batches = [[p] for p in prompts] if workload == "prefix" else [prompts]
    for b, batch in enumerate(batches):
        t0 = time.perf_counter()
        first: dict[str, float] = {}
        for i, p in enumerate(batch):
            engine.add_request(f"r{b}-{i}", {"prompt_token_ids": p}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.outputs[0].token_ids and out.request_id not in first:
                    first[out.request_id] = time.perf_counter() - t0
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
        ttft += list(first.values())
    seconds = time.perf_counter() - start
    return dict(workload=workload, config=config, seconds=seconds, tokens_per_s=tokens / seconds,
                ttft_p50=float(np.percentile(ttft, 50)), ttft_p99=float(np.percentile(ttft, 99)),
                prefix_hits=bm.prefix_cache_stats.hits - hits0, tier_hits=bm.prefix_cache_stats.tier_hits - tier0,
                preemptions=sched.num_preemptions - pre0, swaps=sched.num_swapped_out - swap0,
                pool_blocks=engine.cache_config.num_blocks, tier_blocks=engine.cache_config.num_tier_blocks)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(*args.child)))
        return 0
    rows: dict = {}
    for workload, configs in (("prefix", ("none", "tier")), ("preempt", ("recompute", "swap"))):
        for _ in range(args.pairs):
            for config in configs:
                r = run_child(__file__, [workload, config], timeout=1800)
                rows.setdefault(f"{workload}/{config}", []).append(r)
                print(f"  {workload}/{config}: {r['tokens_per_s']:.1f} tok/s, TTFT p50 {r['ttft_p50'] * 1e3:.0f} ms "
                      f"p99 {r['ttft_p99'] * 1e3:.0f} ms, hits {r['prefix_hits']} ({r['tier_hits']} from the tier), "
                      f"preemptions {r['preemptions']} ({r['swaps']} swapped)", flush=True)
    med = {k: {f: statistics.median(r[f] for r in v) for f in ("tokens_per_s", "ttft_p50", "ttft_p99", "prefix_hits",
                                                                "tier_hits", "preemptions", "swaps")}
           for k, v in rows.items()}
    summary = dict(
        prefix_throughput_ratio=med["prefix/tier"]["tokens_per_s"] / med["prefix/none"]["tokens_per_s"],
        prefix_ttft_p50_ratio=med["prefix/tier"]["ttft_p50"] / med["prefix/none"]["ttft_p50"],
        prefix_ttft_p99_ratio=med["prefix/tier"]["ttft_p99"] / med["prefix/none"]["ttft_p99"],
        swap_vs_recompute_throughput=med["preempt/swap"]["tokens_per_s"] / med["preempt/recompute"]["tokens_per_s"],
    )
    print(json.dumps(summary, indent=1))
    save_json(args.json, medians=med, summary=summary, runs=rows)
    if args.png:
        plt = pyplot()
        fig, ax = plt.subplots(1, 3, figsize=(12, 3.6))
        for a, (title, keys, field, scale) in zip(ax, (
                ("prefix: TTFT p50 (ms)", ("prefix/none", "prefix/tier"), "ttft_p50", 1e3),
                ("prefix: TTFT p99 (ms)", ("prefix/none", "prefix/tier"), "ttft_p99", 1e3),
                ("preemption: output tok/s", ("preempt/recompute", "preempt/swap"), "tokens_per_s", 1))):
            a.bar([k.split("/")[1] for k in keys], [med[k][field] * scale for k in keys], color=["#999", "#3a7"])
            a.set_title(title)
        fig.suptitle("host KV tier, SmolLM2 on 2 CPU cores (medians)")
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
