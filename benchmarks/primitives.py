"""Per-primitive timings of each backend at SmolLM2-135M shapes, set beside what the machine allows.

    python benchmarks/primitives.py                       # every available backend, T = 1, 32, 512
    python benchmarks/primitives.py --backends torch --primitives linear,attention --tokens 1 --json out.json
    python benchmarks/primitives.py --quick               # short probes, T = 1, 32

At start it measures the memory bandwidth (best of large-array read/copy
kernels in torch and NumPy, all threads) and the fp32 matmul peak (best of a
large GEMM in torch and NumPy). Each case is warmed up, then timed; the table
gives the median (and min) time, the bytes that must move and the FLOPs as
GB/s and GFLOP/s, and their ratios to those two limits. `linear` cycles through
enough copies of its weight to overflow the last-level cache, as a model's
layers do. A primitive a backend lacks, or a case that fails, is a row, not a
crash. On a shared machine other processes' work stalls multi-threaded
kernels: before each case the benchmark waits (up to --wait-quiet seconds) for
the CPUs to be free, and each row gives the other processes' CPU share while it
ran ("load %"); a row timed under load is not what the machine can do.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from infer.primitives.types import DenseWeight
from infer.dispatch import Ops
from infer.registry import BackendUnavailableError, get_backend, registry
from infer.bench.machine import GB, CpuLoad, blas_info, l3_bytes, measure_bandwidth, measure_peak
from infer.testing import inputs

H, HQ, HK, D, I, V = 576, 9, 3, 64, 1536, 49152  # SmolLM2-135M
LINEARS = {"qkv": (960, H), "o": (H, H), "gate_up": (2 * I, H), "down": (H, I), "lm_head": (V, H)}
MOE = dict(e=8, top_k=2, i=768)
PRIMITIVES = ("embedding", "rms_norm", "linear", "rotary", "act_and_mul", "kv_write", "attention", "moe", "sample")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


# -- the cases ------------------------------------------------------------------------
@dataclass
class Case:
    primitive: str
    name: str
    fn: object  # zero-argument callable running the primitive once
    nbytes: float = 0.0
    flops: float = 0.0


def build_cases(backend, impl, ops: Ops, prim: str, t: int, dtype: str, ctx: int, rng) -> list[Case]:
    """The cases of one primitive at T tokens, calling `impl`."""
    es, f = ITEMSIZE[dtype], (lambda a: backend.asarray(a, dtype))
    if prim == "embedding":
        ids, table = backend.asarray(rng.integers(0, V, t).astype(np.int64)), f(rng.standard_normal((V, H), np.float32))
        return [Case(prim, f"V={V} H={H}", lambda: impl(ids, table), 2 * t * H * es)]
    if prim == "rms_norm":
        x, w, r = (f(rng.standard_normal(s, np.float32)) for s in ((t, H), (H,), (t, H)))
        return [Case(prim, f"H={H}", lambda: impl(x, w, 1e-5), 2 * t * H * es),
                Case(prim, f"H={H} +residual", lambda: impl(x, w, 1e-5, r), 4 * t * H * es)]
    if prim == "linear":
        cases = []
        for name, (n, k) in LINEARS.items():
            x = f(rng.standard_normal((t, k), np.float32))
            copies = max(1, min(64, -(-4 * l3_bytes() // (n * k * es))))  # cycle through > 4x the L3
            ws = [backend.prepare_weight(DenseWeight(f(rng.standard_normal((n, k), np.float32) * k**-0.5)))
                  for _ in range(copies)]
            it = iter(range(1 << 62))
            cases.append(Case(prim, f"{name} {k}->{n}", lambda x=x, ws=ws, it=it: impl(x, ws[next(it) % len(ws)]),
                              (n * k + t * (n + k)) * es, 2.0 * t * n * k))
        return cases
    if prim == "rotary":
        a = inputs.rotary(rng, dtype, D, True, t=t, hq=HQ, hk=HK, max_pos=4096)
        q, k, pos, cs = f(a["q"]), f(a["k"]), backend.asarray(a["positions"]), backend.asarray(a["cos_sin_cache"])
        return [Case(prim, f"neox D={D}", lambda: impl(q, k, pos, cs, True), 2 * t * (HQ + HK) * D * es + t * D * 4)]
    if prim == "act_and_mul":
        x = f(rng.standard_normal((t, 2 * I), np.float32))
        return [Case(prim, f"silu I={I}", lambda: impl(x, "silu"), 3 * t * I * es)]
    if prim == "kv_write":
        bs = backend.preferred_block_size
        cache = backend.allocate_kv_cache(-(-t // bs) + 1, bs, HK, D, dtype)
        k, v = (f(rng.standard_normal((t, HK, D), np.float32)) for _ in range(2))
        slots = backend.asarray(np.arange(t, dtype=np.int64))
        return [Case(prim, f"Hk={HK} D={D}", lambda: impl(k, v, cache, slots, None), 4 * t * HK * D * es)]
    if prim == "attention":
        cases = []
        for name, reqs in ((f"decode {t}x ctx {ctx}", [(1, ctx)] * t), (f"prefill 1x{t}", [(t, t)])):
            a = inputs.attention(rng, dtype, reqs, HQ, D, hk=HK, block_size=backend.preferred_block_size)
            cache = backend.allocate_kv_cache(*a["cache_shape"], dtype)
            write = ops.resolve("kv_write", dtype=dtype)[0]
            if len(a["cached_slots"]):
                write(f(a["cached_k"]), f(a["cached_v"]), cache, backend.asarray(a["cached_slots"]), None)
            meta = ops.prepare_metadata(a["meta"], dtype=dtype, head_dim=D, sliding_window=False, soft_cap=False)
            write(f(a["new_k"]), f(a["new_v"]), cache, meta.slot_mapping, None)
            q = f(a["q"])
            keys = sum(q_len * s - q_len * (q_len - 1) // 2 for q_len, s in reqs)  # (query, key) pairs
            kv_bytes = sum(s for _, s in reqs) * 2 * HK * D * es
            cases.append(Case(prim, name, lambda q=q, cache=cache, meta=meta: impl(q, cache, meta, D**-0.5, None, None),
                              kv_bytes + 2 * t * HQ * D * es, 4.0 * HQ * D * keys))
        return cases
    if prim == "moe":
        e, top_k, i = MOE["e"], MOE["top_k"], MOE["i"]
        a = inputs.moe(rng, dtype, top_k, True, t=t, h=H, i=i, e=e)
        x, logits, w13, w2 = f(a["x"]), f(a["router_logits"]), f(a["w13"]), f(a["w2"])
        used = len(np.unique(np.argsort(-a["router_logits"], axis=1)[:, :top_k]))
        return [Case(prim, f"E={e} top{top_k} H={H} I={i}", lambda: impl(x, logits, w13, w2, top_k, True),
                     used * 3 * i * H * es + 2 * t * H * es, 6.0 * t * top_k * i * H)]
    if prim == "sample":
        cases = []
        for name, kw in (("greedy", dict(temperature=0.0)), ("top-p 0.9", dict(temperature=0.8, top_p=0.9))):
            a = inputs.sample(rng, dtype, b=t, v=V, **kw)
            logits, params = backend.asarray(a["logits"]), backend.prepare_sampling(a["params"])
            cases.append(Case(prim, f"{name} V={V}", lambda logits=logits, params=params: impl(logits, params), t * V * 4))
        return cases
    raise ValueError(f"no benchmark for {prim}")


def time_case(case: Case, sync, budget: float, max_repeats: int) -> tuple[float, float, int]:
    for _ in range(2):
        case.fn()
    sync()
    t = time.perf_counter()
    case.fn()
    sync()
    repeats = int(min(max_repeats, max(5, budget / max(time.perf_counter() - t, 1e-7))))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        case.fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times), repeats


# -- the run ----------------------------------------------------------------------------
def machine_limits(args, load: CpuLoad) -> dict:
    load.wait_quiet(args.wait_quiet)
    bw = measure_bandwidth(128 if args.quick else 512)
    peak = measure_peak(2048) | ({} if args.quick else measure_peak(4096, 2))
    m = dict(bandwidth_gbs=max(bw.values()), bandwidth_methods=bw, matmul_gflops=max(peak.values()),
             matmul_methods=peak, l3_bytes=l3_bytes(), blas=blas_info())
    print(f"memory bandwidth {m['bandwidth_gbs']:.1f} GB/s (" + ", ".join(f"{k} {v:.1f}" for k, v in bw.items()) + ")")
    print(f"fp32 matmul peak {m['matmul_gflops']:.1f} GFLOP/s (" + ", ".join(f"{k} {v:.1f}" for k, v in peak.items()) + ")")
    print("blas: " + ", ".join(f"{k}={v}" for k, v in m["blas"].items()))
    return m


def time_row(row: dict, c: Case, backend, args, machine: dict, load: CpuLoad) -> dict:
    budget, max_rep = (0.05, 20) if args.quick else (0.4, 200)
    try:
        for _ in range(3):  # a case timed under load is timed again, twice at most
            load.wait_quiet(args.wait_quiet)
            case_load = CpuLoad()
            med, best, n = time_case(c, backend.synchronize, budget, max_rep)
            if (other := case_load.other(0.0 if args.quick else 0.2)) is None or other < 0.2 or not args.wait_quiet:
                break
    except Exception as exc:
        return row | dict(status=f"error: {type(exc).__name__}: {exc}")
    row |= dict(status="ok", median_s=med, min_s=best, repeats=n, other_load=other)
    if c.nbytes:
        row |= dict(gbs=c.nbytes / med / GB, bandwidth_ratio=c.nbytes / med / GB / machine["bandwidth_gbs"])
    if c.flops:
        row |= dict(gflops=c.flops / med / GB, peak_ratio=c.flops / med / GB / machine["matmul_gflops"])
    return row


def bench_backend(bname: str, args, tokens, prims, machine: dict, load: CpuLoad) -> list[dict]:
    try:
        backend = get_backend(bname)
        ops = Ops(backend, validate=False)
    except Exception as exc:  # unknown or unavailable: one row says why
        return [dict(backend=bname, primitive="*", case="", tokens=None, status=f"unavailable: {exc}")]
    rows = []
    for t in tokens:
        for prim in prims:
            base = dict(backend=bname, primitive=prim, tokens=t, dtype=args.dtype, case="")
            if prim not in PRIMITIVES:
                rows.append(base | dict(status=f"skipped (no benchmark for {prim}; have {','.join(PRIMITIVES)})"))
                continue
            if bname == "cpu_ref" and t > args.ref_max_tokens:
                rows.append(base | dict(status=f"skipped (cpu_ref above --ref-max-tokens {args.ref_max_tokens})"))
                continue
            try:
                impl, provider = ops.resolve(prim, dtype=args.dtype, **({"weight_kind": "dense"} if prim == "linear" else {}))
                cases = build_cases(backend, impl, ops, prim, t, args.dtype, args.context, np.random.default_rng(0))
            except BackendUnavailableError as exc:
                rows.append(base | dict(status=f"missing: {exc}"))
                continue
            except Exception as exc:
                rows.append(base | dict(status=f"error: {type(exc).__name__}: {exc}"))
                continue
            for c in cases:
                row = base | dict(case=c.name, provider=provider, bytes=c.nbytes, flops=c.flops)
                rows.append(time_row(row, c, backend, args, machine, load))
                print_row(rows[-1])
            del cases
    return rows


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    load = CpuLoad()
    machine = machine_limits(args, load)
    names = args.backends.split(",") if args.backends else [n for n, i in registry().backends.items() if i.available]
    prims = args.primitives.split(",") if args.primitives else list(PRIMITIVES)
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else ([1, 32] if args.quick else [1, 32, 512])
    rows = [row for bname in names for row in bench_backend(bname, args, tokens, prims, machine, load)]
    machine["bandwidth_methods_at_end"] = end = measure_bandwidth(128 if args.quick else 512, 3)
    machine["bandwidth_at_end_gbs"] = max(end.values())
    machine["other_processes_cpu_share"] = load.other()
    return dict(machine=machine, settings=dict(dtype=args.dtype, tokens=tokens, context=args.context,
                                               quick=args.quick, threads=torch.get_num_threads()), results=rows)


def _fmt(row: dict, key: str, scale: float = 1.0, spec: str = ".1f") -> str:
    return "" if row.get(key) is None else format(row[key] * scale, spec)


def print_row(row: dict) -> None:
    print(f"  {row['backend']:8s} T={row['tokens']:<4d} {row['primitive']:11s} {row['case']:24s} "
          f"{_fmt(row, 'median_s', 1e6):>10s} us  {_fmt(row, 'gbs'):>6s} GB/s  {_fmt(row, 'gflops'):>6s} GFLOP/s"
          f"  load {_fmt(row, 'other_load', 100, '.0f')}%  {'' if row['status'] == 'ok' else row['status']}", flush=True)


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    m = report["machine"]
    table = Table(title=f"primitives ({report['settings']['dtype']}): bandwidth {m['bandwidth_gbs']:.1f} GB/s, "
                        f"fp32 peak {m['matmul_gflops']:.0f} GFLOP/s")
    for col in ("backend", "T", "primitive", "case", "median us", "min us", "GB/s", "% BW", "GFLOP/s", "% peak", "load %", "status"):
        table.add_column(col, justify="right" if col not in ("backend", "primitive", "case", "status") else "left")
    for r in report["results"]:
        table.add_row(r["backend"], str(r.get("tokens") or ""), r["primitive"], r.get("case", ""),
                      _fmt(r, "median_s", 1e6), _fmt(r, "min_s", 1e6), _fmt(r, "gbs"), _fmt(r, "bandwidth_ratio", 100, ".0f"),
                      _fmt(r, "gflops"), _fmt(r, "peak_ratio", 100, ".0f"), _fmt(r, "other_load", 100, ".0f"),
                      "" if r["status"] == "ok" else r["status"])
    console = Console(width=200)
    console.print(table)
    other = m.get("other_processes_cpu_share")
    console.print(f"bandwidth at end {m['bandwidth_at_end_gbs']:.1f} GB/s; other processes used "
                  f"{'?' if other is None else f'{100 * other:.0f}%'} of the CPUs during the run")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", help="comma-separated (default: every available backend)")
    p.add_argument("--primitives", help=f"comma-separated from {','.join(PRIMITIVES)} (default: all)")
    p.add_argument("--tokens", help="comma-separated T values (default 1,32,512; --quick: 1,32)")
    p.add_argument("--dtype", default="float32", choices=list(ITEMSIZE))
    p.add_argument("--context", type=int, default=512, help="decode attention: context tokens per request (default 512)")
    p.add_argument("--ref-max-tokens", type=int, default=32, help="skip cpu_ref above this T (default 32)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's own)")
    p.add_argument("--quick", action="store_true", help="small machine probes and short timings")
    p.add_argument("--wait-quiet", type=float, help="before each case, wait up to this many seconds for other "
                   "processes to leave the CPUs (default 10, --quick 0)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    args = p.parse_args(argv)
    if args.wait_quiet is None:
        args.wait_quiet = 0.0 if args.quick else 10.0
    report = run(args)
    print_table(report)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1, default=str)
    return 1 if any(r["status"].startswith("error") for r in report["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
