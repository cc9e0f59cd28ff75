"""The `moe` primitive against computing every expert densely, at Mixtral's shape ratios.

    python benchmarks/moe.py                          # torch backend, T = 1, 16, 256, JSON on stdout's last line
    python benchmarks/moe.py --tokens 256 --threads 1 --json moe.json

Mixtral 8x7B has 8 experts, top-2 routing, hidden 4096 and expert width
14336; the default here keeps those ratios at an eighth of the size (hidden
512, width 1792: 88 MB of fp32 expert weights, past the last-level cache like
the real model's). The dense baseline is the best plain-torch way to run all
experts on every token: one GEMM against all experts' gate/up rows, SwiGLU,
one batched down-projection, and the gate-weighted sum with zero weight for
experts a token did not choose; it gives the same output as `moe` (checked
before timing). Routing that computes only the chosen experts should take
about top_k / E of the dense time once T is large enough for every expert to
see many tokens; the issue's target is <= 0.35x at 8 experts, top-2, T = 256.

Runs alternate between the two so load from other processes hits both alike;
before each T the script waits (up to --wait-quiet s) for the CPUs to be
free, and reports the other processes' CPU share while it ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from infer.bench.machine import CpuLoad
from infer.dispatch import Ops
from infer.registry import get_backend
from infer.testing import inputs

TARGET_T, TARGET_RATIO = 256, 0.35


def dense_all_experts(x, router_logits, w13_all, w2, top_k: int, renormalize: bool):
    """Every expert on every token, then the gate-weighted sum (unchosen experts weigh 0)."""
    e, h, i = w2.shape
    probs = torch.softmax(router_logits.float(), dim=-1)
    top, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    gates = torch.zeros_like(probs).scatter_(1, ids, top)  # [T, E]
    gate_up = F.linear(x, w13_all).view(-1, e, 2 * i)
    act = (F.silu(gate_up[..., :i]) * gate_up[..., i:]).transpose(0, 1)  # [E, T, I]
    y = torch.bmm(act, w2.transpose(1, 2))  # [E, T, H]
    return torch.einsum("te,eth->th", gates, y.float()).to(x.dtype)


def measure(fns: dict, repeats: int, sync) -> dict[str, list[float]]:
    for fn in fns.values():  # warm-up
        fn()
    sync()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t)
    return times


def run(args) -> dict:
    backend = get_backend(args.backend, device=args.device)
    ops = Ops(backend)
    moe, provider = ops.resolve("moe", dtype=args.dtype)
    sync = getattr(backend, "synchronize", lambda: None)
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    rows = []
    for t in args.tokens:
        a = inputs.moe(rng, args.dtype, args.top_k, True, t=t, h=args.hidden, i=args.inter, e=args.experts)
        # Router logits as a trained router gives them: every expert used, none always.
        a["router_logits"] = rng.standard_normal((t, args.experts)).astype(np.float32)
        f = lambda v: backend.asarray(v, args.dtype)  # noqa: E731
        x, logits, w13, w2 = f(a["x"]), backend.asarray(a["router_logits"]), f(a["w13"]), f(a["w2"])
        w13_all = w13.reshape(-1, args.hidden)
        routed, _ = moe(x, logits, w13, w2, args.top_k, True)
        dense = dense_all_experts(x, logits, w13_all, w2, args.top_k, True)
        err = float((routed.float() - dense.float()).abs().max()) if t else 0.0
        if err > (1e-3 if args.dtype == "float32" else 5e-2):
            raise RuntimeError(f"T={t}: moe and the dense baseline disagree by {err:g}")
        CpuLoad().wait_quiet(args.wait_quiet)
        load = CpuLoad()
        times = measure({"moe": lambda: moe(x, logits, w13, w2, args.top_k, True),
                         "dense": lambda: dense_all_experts(x, logits, w13_all, w2, args.top_k, True)},
                        args.repeats, sync)
        med = {k: statistics.median(v) for k, v in times.items()}
        used = int((np.bincount(np.argsort(-a["router_logits"], axis=1)[:, : args.top_k].ravel(),
                                minlength=args.experts) > 0).sum())
        rows.append(dict(tokens=t, moe_ms=med["moe"] * 1e3, dense_ms=med["dense"] * 1e3,
                         moe_min_ms=min(times["moe"]) * 1e3, dense_min_ms=min(times["dense"]) * 1e3,
                         ratio=med["moe"] / med["dense"], experts_used=used, max_abs_diff=err,
                         other_load=load.other()))
    target = next((r for r in rows if r["tokens"] == TARGET_T), None)
    return dict(benchmark="moe", backend=backend.name, provider=provider, device=str(getattr(backend, "device", "cpu")),
                dtype=args.dtype, torch_threads=torch.get_num_threads(),
                shape=dict(experts=args.experts, top_k=args.top_k, hidden=args.hidden, inter=args.inter),
                results=rows,
                target=None if target is None else dict(tokens=TARGET_T, ratio=target["ratio"], max_ratio=TARGET_RATIO,
                                                        met=target["ratio"] <= TARGET_RATIO))


def format_table(r: dict) -> str:
    s = r["shape"]
    lines = [f"moe on '{r['backend']}' (provider {r['provider']}, {r['device']}, {r['dtype']}, {r['torch_threads']} threads): "
             f"E={s['experts']} top-{s['top_k']} H={s['hidden']} I={s['inter']}",
             f"{'T':>5}{'moe ms':>10}{'dense ms':>10}{'ratio':>8}{'experts used':>14}{'load %':>8}"]
    for row in r["results"]:
        load = "-" if row["other_load"] is None else f"{100 * row['other_load']:.0f}"
        lines.append(f"{row['tokens']:>5}{row['moe_ms']:10.2f}{row['dense_ms']:10.2f}{row['ratio']:8.3f}"
                     f"{row['experts_used']:>14}{load:>8}")
    if r["target"]:
        t = r["target"]
        lines.append(f"target: ratio at T={t['tokens']} <= {t['max_ratio']}: {t['ratio']:.3f} "
                     f"{'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="torch", help="a backend whose tensors are torch tensors (default torch)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[1, 16, 256])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=1792)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    p.add_argument("--wait-quiet", type=float, default=10.0, help="seconds to wait for idle CPUs before each T")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    args = p.parse_args(argv)
    report = run(args)
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
