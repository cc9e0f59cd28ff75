"""Tensor and pipeline parallelism on this machine: SmolLM2 at TP = 1, 2, 3 and PP = 2 (mp executor).

    python benchmarks/parallel.py --json parallel.json --png parallel.png
    python benchmarks/parallel.py --configs 1x1 3x1 --decode-tokens 64     # TPxPP

Each row runs in a fresh process, as a user runs it (``LLM(model,
tensor_parallel_size=N)``, default flags), and reports:

- decode tok/s: one request, greedy, the mean over its decode steps;
- workload tok/s: --requests requests of --prompt-len tokens generating
  --output-len each, all submitted at once: generated tokens / wall time;
- per-rank RSS (current and peak, from /proc) and rank 0's weight bytes
  (every rank holds the same share, one padding row of the vocabulary aside);
- collectives' share of rank 0's step time: the time its all_reduce and
  all_gather calls took (a timed dispatch trace), over the time of its steps.
  That includes waiting for the slowest rank, which is what a rank pays
  (pipeline sends are not collectives: 0 for a PP-only row).

On a machine with fewer cores than ranks x threads TP cannot be faster; the
point is the overhead, reported honestly. The H200 x 8 case is modelled in
docs/distributed.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _status(pid: int | str) -> dict[str, int]:
    """VmRSS and VmHWM (bytes) of a process."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def child(spec: dict) -> dict:
    import torch  # noqa: F401  (torch first, as a user's script)

    from infer import LLM, SamplingParams
    from infer.bench.runners import held_bytes

    tp, pp = spec["tp"], spec["pp"]
    start = time.perf_counter()
    llm = LLM(spec["model"], tensor_parallel_size=tp, pipeline_parallel_size=pp, trace_dispatch=True,
              max_model_len=spec["max_model_len"], show_progress=False)
    load_s = time.perf_counter() - start
    engine, trace = llm.engine, llm.engine.dispatch_trace
    trace.timed = True
    vocab = engine.vocab_size
    rng = __import__("numpy").random.default_rng(0)

    def run(prompts, out_len):
        params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{time.perf_counter_ns()}-{i}", {"prompt_token_ids": p}, params)
        steps = []
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            s = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - s)
        return time.perf_counter() - t0, steps

    run([rng.integers(0, vocab, 16).tolist()], 4)  # warm-up
    trace.clear()
    _, steps = run([rng.integers(0, vocab, spec["prompt_len"]).tolist()], spec["decode_tokens"] + 1)
    decode = steps[1:]  # after the prefill step
    decode_tok_s = len(decode) / sum(decode)
    collectives_decode = sum(s for (node, call, impl), s in trace.seconds.items() if call in ("all_reduce", "all_gather"))
    decode_share = collectives_decode / sum(steps)
    trace.seconds.clear()
    prompts = [rng.integers(0, vocab, spec["prompt_len"]).tolist() for _ in range(spec["requests"])]
    wall, steps = run(prompts, spec["output_len"])
    collectives = sum(s for (node, call, impl), s in trace.seconds.items() if call in ("all_reduce", "all_gather"))
    rss = {"rank0": _status("self")}
    for i, p in enumerate(engine.executor.dist.workers if engine.executor.dist else []):
        rss[f"rank{i + 1}"] = _status(p.pid)
    result = dict(tp=tp, pp=pp, label=f"TP={tp}" + (f" PP={pp}" if pp > 1 else ""), load_s=load_s,
                  decode_tok_s=decode_tok_s, decode_collective_share=decode_share,
                  workload_tok_s=spec["requests"] * spec["output_len"] / wall, workload_s=wall,
                  workload_collective_share=collectives / sum(steps), weight_bytes_rank0=held_bytes(engine.worker.runner),
                  rss=rss, calls={f"{call}": n for (node, call, impl), n in trace.counts.items()
                                  if call in ("all_reduce", "all_gather")})
    engine.shutdown()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--configs", nargs="+", default=["1x1", "2x1", "3x1", "1x2"], help="TPxPP per row")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    rows = []
    for config in args.configs:
        tp, pp = (int(x) for x in config.split("x"))
        spec = dict(model=args.model, tp=tp, pp=pp, decode_tokens=args.decode_tokens, prompt_len=args.prompt_len,
                    output_len=args.output_len, requests=args.requests, max_model_len=args.max_model_len)
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"{config} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
            return 1
        row = json.loads(lines[-1][len("RESULT "):])
        rows.append(row)
        ranks = ", ".join(f"{k} {v['VmRSS'] / 2**20:.0f} MiB (peak {v['VmHWM'] / 2**20:.0f})" for k, v in row["rss"].items())
        print(f"{row['label']}: decode {row['decode_tok_s']:.1f} tok/s (collectives {row['decode_collective_share']:.0%} of "
              f"step time), workload {row['workload_tok_s']:.1f} tok/s (collectives "
              f"{row['workload_collective_share']:.0%}), rank 0 weights {row['weight_bytes_rank0'] / 2**20:.1f} MiB; "
              f"RSS {ranks}", flush=True)
    base = rows[0]
    for r in rows:
        r["decode_vs_tp1"] = r["decode_tok_s"] / base["decode_tok_s"]
        r["workload_vs_tp1"] = r["workload_tok_s"] / base["workload_tok_s"]
        r["weights_vs_tp1"] = r["weight_bytes_rank0"] / base["weight_bytes_rank0"]
    report = {"model": args.model, "cpus": os.cpu_count(), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.png:
        plot(rows, args.png, args.model)
    print(json.dumps(report))
    return 0


def plot(rows: list[dict], path: str, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    labels = [r["label"] for r in rows]
    x = list(range(len(rows)))

    def pair(ax, key_a, key_b, scale, ylabel):
        ax.bar([i - 0.2 for i in x], [scale * r[key_a] for r in rows], 0.4, label="decode (1 request)")
        ax.bar([i + 0.2 for i in x], [scale * r[key_b] for r in rows], 0.4, label="workload")
        ax.set_xticks(x, labels)
        ax.set_ylabel(ylabel)
        ax.legend()

    pair(axes[0], "decode_tok_s", "workload_tok_s", 1, "tokens / s")
    axes[1].bar(x, [r["weight_bytes_rank0"] / 2**20 for r in rows])
    axes[1].set_xticks(x, labels)
    axes[1].set_ylabel("weights per rank (MiB)")
    pair(axes[2], "decode_collective_share", "workload_collective_share", 100, "collectives, % of rank 0 step time")
    fig.suptitle(f"{model}: tensor and pipeline parallel on {os.cpu_count()} CPU cores (gloo)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
