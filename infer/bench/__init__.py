"""`infer bench throughput`: an offline workload through infer and through transformers.

Both runtimes get the same token ids. Single-stream decode and prefill are set
beside the limits measured on the machine: decode <= memory bandwidth / bytes
of weights read per token, prefill <= the GEMM peak in the served dtype / FLOPs
per prompt token; the workload beside its roofline (`workload_roofline`).
`benchmarks/throughput.py` is a script over the same functions.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from .report import format_report, save_png
from .throughput import run_benchmark
from .workload import QUICK, BenchConfig, Workload, make_workload

__all__ = ["BenchConfig", "QUICK", "Workload", "add_bench_parser", "add_throughput_args", "cmd_bench",
           "config_from_args", "format_report", "make_workload", "run_benchmark", "save_png"]


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    p.add_argument("--model", default=d.model, help=f"model alias, HF directory or .gguf (default {d.model})")
    p.add_argument("--backend", default=d.backend, help=f"infer backend (default {d.backend})")
    p.add_argument("--num-prompts", type=int, help=f"prompts in the workload (default {d.num_prompts})")
    p.add_argument("--output-len", type=int, help=f"greedy tokens generated per prompt (default {d.output_len})")
    p.add_argument("--min-len", type=int, help=f"shortest prompt, tokens (default {d.min_len})")
    p.add_argument("--max-len", type=int, help=f"longest prompt, tokens (default {d.max_len})")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of prompt lengths and token ids")
    p.add_argument("--repeats", type=int, help=f"decode and prefill: best of this many (default {d.repeats})")
    p.add_argument("--threads", type=int, help="torch threads in every process (default: torch's own)")
    p.add_argument("--dtype", default=d.dtype, choices=("float32", "bfloat16", "float16", "auto"),
                   help=f"infer's --dtype; the transformers peer runs in the dtype infer resolves (default {d.dtype}: "
                        "the peer's arithmetic, so greedy tokens compare)")
    p.add_argument("--skip-transformers", action="store_true", help="run infer only")
    p.add_argument("--speculative-config", metavar="JSON", help="infer's speculative decoding (as `infer run`); "
                                                                  "the report adds its acceptance")
    p.add_argument("--quick", action="store_true", help="a small version (4 prompts x 8 tokens, short probes) for tests")
    p.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    p.add_argument("--png", metavar="PATH", help="write a bar chart (needs matplotlib)")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    cfg = BenchConfig(model=args.model, backend=args.backend, seed=args.seed, skip_transformers=args.skip_transformers,
                      threads=args.threads, speculative_config=getattr(args, "speculative_config", None),
                      dtype=getattr(args, "dtype", None) or BenchConfig.dtype)
    if args.quick:
        cfg = replace(cfg, **QUICK)
    given = {k: getattr(args, k) for k in ("num_prompts", "output_len", "min_len", "max_len", "repeats")}
    cfg = replace(cfg, **{k: v for k, v in given.items() if v is not None})
    if not 1 <= cfg.min_len <= cfg.max_len:
        raise ValueError(f"--min-len {cfg.min_len} / --max-len {cfg.max_len}: need 1 <= min-len <= max-len")
    if min(cfg.num_prompts, cfg.output_len, cfg.repeats) < 1:
        raise ValueError("--num-prompts, --output-len and --repeats must be >= 1")
    return cfg


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = run_benchmark(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.png:
        save_png(report, args.png)
    return 0


def add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks (offline throughput against transformers)")
    sub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    t = sub.add_parser("throughput", help="offline workload, single-stream decode and prefill, infer vs transformers")
    add_throughput_args(t)
    t.set_defaults(func=cmd_bench)
