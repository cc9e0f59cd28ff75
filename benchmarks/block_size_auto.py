"""``--block-size auto`` against fixed block sizes on SmolLM2 (CPU, torch backend).

    python benchmarks/block_size_auto.py --json out.json --png out.png

128 requests of mixed lengths arrive at once (``max_num_seqs=128``): 70% chat
turns (prompt 32-256 tokens, 16-96 new) and 30% long documents (prompt
512-1,536 tokens, 32-128 new), random token ids, greedy, ``ignore_eos``. The KV
pool holds ~60% of what they need together, so how many run at once depends on
how much of the pool their blocks waste. Each configuration runs in its own
process (torch imported first, default flags apart from ``--block-size`` and
the pool): 16 (the torch backend's default), auto (8/16/32 by expected length),
and 8 for reference.

Reported per configuration (medians over `--pairs` alternating runs):
fragmentation (``infer:kv_cache_fragmentation_perc``, the allocated-but-unused
share of running requests' slots, averaged over steps, and its peak), output
and total throughput, TTFT p50/p99 from arrival, mean running requests, and
under auto the requests per block size and those that fell back to 8.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch  # noqa: F401  (first, as a user's script does)
from fresh import pyplot, run_child, save_json

REQUESTS, LONG_SHARE, POOL_SHARE = 128, 0.3, 0.6
CONFIGS = ("16", "auto", "8")


def _workload():
    import numpy as np

    rng = np.random.default_rng(0)
    reqs = []
    for i in range(REQUESTS):
        if rng.random() < LONG_SHARE:
            n, new = int(rng.integers(512, 1537)), int(rng.integers(32, 129))
        else:
            n, new = int(rng.integers(32, 257)), int(rng.integers(16, 97))
        reqs.append((rng.integers(100, 49152, n).tolist(), new))
    return reqs


def _child(config: str) -> dict:
    import numpy as np

    from infer.core.engine import EngineArgs, LLMEngine
    from infer.core.sampling_params import SamplingParams

    reqs = _workload()
    need_tokens = sum(len(p) + new for p, new in reqs)
    block = 8 if config == "auto" else int(config)
    pool = int(need_tokens * POOL_SHARE) // block  # same number of KV tokens in every configuration
    engine = LLMEngine(EngineArgs(model="smollm2", show_progress=False, max_num_seqs=REQUESTS, max_model_len=2048,
                                  block_size=config if config == "auto" else block, num_gpu_blocks_override=pool))
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("warm", {"prompt_token_ids": list(range(100, 700))}, warm)
    while engine.has_unfinished_requests():
        engine.step()
    sched, bm = engine.scheduler, engine.scheduler.block_manager
    fallbacks0 = bm.num_run_fallbacks
    sizes: dict[int, int] = {}
    t0 = time.perf_counter()
    for i, (prompt, new) in enumerate(reqs):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    first: dict[str, float] = {}
    frag, running, out_tokens, steps = [], [], 0, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        stats = sched.get_stats()
        if stats.num_running:
            frag.append(stats.kv_cache_fragmentation_perc)
            running.append(stats.num_running)
        for rid in bm.req_to_blocks:
            sizes.setdefault(rid, bm.pages_per_block(rid) * bm.block_size)
        now = time.perf_counter() - t0
        for out in outs:
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                out_tokens += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - t0
    ttft = list(first.values())
    by_size = {str(s): sum(1 for v in sizes.values() if v == s) for s in sorted(set(sizes.values()))}
    return dict(config=config, seconds=seconds, output_tokens_per_s=out_tokens / seconds,
                total_tokens_per_s=(out_tokens + sum(len(p) for p, _ in reqs)) / seconds,
                ttft_p50=float(np.percentile(ttft, 50)), ttft_p99=float(np.percentile(ttft, 99)),
                fragmentation_mean=float(np.mean(frag)), fragmentation_peak=float(np.max(frag)),
                mean_running=float(np.mean(running)), steps=steps, preemptions=sched.num_preemptions,
                pool_tokens=pool * block, need_tokens=need_tokens, requests_by_block_size=by_size,
                run_fallbacks=bm.num_run_fallbacks - fallbacks0)


FIELDS = ("output_tokens_per_s", "total_tokens_per_s", "ttft_p50", "ttft_p99", "fragmentation_mean",
          "fragmentation_peak", "mean_running", "preemptions", "run_fallbacks", "seconds")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(args.child)))
        return 0
    configs = args.configs.split(",")
    rows: dict = {}
    for _ in range(args.pairs):
        for config in configs:
            r = run_child(__file__, [config])
            rows.setdefault(config, []).append(r)
            print(f"  block size {config}: fragmentation {r['fragmentation_mean']:.1f}% (peak "
                  f"{r['fragmentation_peak']:.1f}%), {r['output_tokens_per_s']:.1f} out tok/s, TTFT p50 "
                  f"{r['ttft_p50']:.1f} s p99 {r['ttft_p99']:.1f} s, running {r['mean_running']:.1f}, "
                  f"preemptions {r['preemptions']}, blocks {r['requests_by_block_size']}, "
                  f"fallbacks {r['run_fallbacks']}", flush=True)
    med = {c: {f: statistics.median(r[f] for r in v) for f in FIELDS} | {
        "requests_by_block_size": v[0]["requests_by_block_size"]} for c, v in rows.items()}
    summary = {}
    if "16" in med and "auto" in med:
        a, b = med["auto"], med["16"]
        summary = dict(fragmentation_16=b["fragmentation_mean"], fragmentation_auto=a["fragmentation_mean"],
                       throughput_ratio_auto_vs_16=a["output_tokens_per_s"] / b["output_tokens_per_s"],
                       ttft_p50_ratio_auto_vs_16=a["ttft_p50"] / b["ttft_p50"],
                       ttft_p99_ratio_auto_vs_16=a["ttft_p99"] / b["ttft_p99"])
    print(json.dumps(summary, indent=1))
    save_json(args.json, medians=med, summary=summary, runs=rows)
    if args.png:
        plt = pyplot()
        fig, ax = plt.subplots(1, 3, figsize=(12, 3.6))
        for a, (title, field) in zip(ax, (("fragmentation, mean over steps (%)", "fragmentation_mean"),
                                          ("output tok/s", "output_tokens_per_s"), ("TTFT p50 (s)", "ttft_p50"))):
            a.bar(configs, [med[c][field] for c in configs], color=["#999", "#3a7", "#bbb"][: len(configs)])
            a.set_title(title)
            a.set_xlabel("--block-size")
        fig.suptitle(f"{REQUESTS} concurrent mixed-length requests, SmolLM2 on 2 CPU cores (medians)")
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
