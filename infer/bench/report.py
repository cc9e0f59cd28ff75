"""The benchmark report as text and as a PNG bar chart."""

from __future__ import annotations

from .runners import HF_BATCH
from .machine import MIB


def _mib(n: float) -> str:
    return f"{n / MIB:,.0f} MiB"


def format_report(r: dict) -> str:
    cfg, inf, hf, mach, w = r["config"], r["infer"], r["transformers"], r["machine"], r["workload"]
    load = r["load_avg"]
    lines = [
        f"infer bench throughput: {cfg['model']} on backend '{cfg['backend']}' "
        f"(load average {load['start'][0]:.2f} at start, {load['end'][0]:.2f} at end)",
        f"machine: memory bandwidth {mach['bandwidth_gbs']:.1f} GB/s (copy {mach['bandwidth_copy_gbs']:.1f}, "
        f"read {mach['bandwidth_read_gbs']:.1f}), fp32 matmul {mach['matmul_gflops']:.1f} GFLOP/s, "
        f"{mach['torch_threads']} torch threads, {mach['cpu_count']} CPUs",
        *(f"  {dt} GEMM peak {g['peak_gflops']:.1f} GFLOP/s (best of {cfg['gemm_n']}^3: {g['square_gflops']:.1f} and the "
          f"model's linears at 256 rows: {g['model_256_rows_gflops']:.1f}; at {g['model_batch_rows']} rows "
          f"{g['model_batch_gflops']:.1f})" for dt, g in mach.get("gemm", {}).items()),
        f"engine: {r['engine_args']}",
        f"workload: {w['num_prompts']} prompts, {w['prompt_tokens']} prompt tokens ({cfg['min_len']}-{cfg['max_len']} each, "
        f"seed {cfg['seed']}), {w['output_tokens']} output tokens ({cfg['output_len']} each, greedy, ignore_eos)",
    ]
    if load["start"][0] > 0.5 * mach["cpu_count"]:
        lines.append(f"warning: the machine was busy before the run (load {load['start'][0]:.2f} on {mach['cpu_count']} CPUs); "
                     "timings are noisy, and torch's threads stall on cores other processes hold")
    lines += [
        "",
        f"{'':34}{'output tok/s':>14}{'total tok/s':>14}{'elapsed s':>11}",
    ]

    def row(name, t):
        lines.append(f"{name:34}{t['output_tok_s']:14.1f}{t['total_tok_s']:14.1f}{t['elapsed_s']:11.2f}")

    row("infer", inf["workload"])
    roof = mach.get("workload_roofline")
    if roof:
        lines.append(f"{'roofline (' + mach['dtype'] + ')':34}{roof['output_tok_s']:14.1f}{'':14}{roof['seconds']:11.2f}"
                     f"   infer at {inf['workload']['output_tok_s'] / roof['output_tok_s']:.0%}")
        lines.append(f"  (prefill {roof['prefill_s']:.2f} s: its FLOPs at the {mach['dtype']} GEMM peak; decode "
                     f"{roof['decode_s']:.2f} s: each step's FLOPs at that peak or its weights + KV at the bandwidth)")
    if hf:
        row(f"transformers batch {HF_BATCH} (left pad)", hf["batch"])
        row("transformers one at a time", hf["single"])
    lines += ["", f"{'':34}{'infer':>14}{'transformers':>14}{'limit':>11}{'infer/limit':>13}"]
    for name, side, key, lim in (
        (f"decode tok/s (1 stream, {cfg['decode_len']} tok)", "decode", "decode_tok_s", mach["decode_limit_tok_s"]),
        (f"prefill tok/s ({cfg['prefill_len']}-tok TTFT)", "prefill", "prefill_tok_s", mach["prefill_limit_tok_s"]),
    ):
        theirs = f"{hf[side][key]:14.1f}" if hf else f"{'-':>14}"
        lines.append(f"{name:34}{inf[side][key]:14.1f}{theirs}{lim:11.1f}{inf[side][key] / lim:13.1%}")
    m = r["model"]
    lines.append(f"  (decode limit: bandwidth / {_mib(m['decode_bytes_per_token'])} read per token; prefill limit: "
                 f"matmul peak / {m['prefill_flops_per_token'] / 1e6:,.0f} MFLOP per prompt token)")
    mem = inf["memory"]
    cols = (("baseline_rss", "after imports"), ("loaded_rss", "after load"), ("load_peak_rss", "peak in load"),
            ("end_rss", "at end"), ("peak_rss", "peak"))
    lines += ["", f"{'RSS, MiB':34}" + "".join(f"{title:>14}" for _, title in cols)]
    for name, side in (("infer", inf), ("transformers", hf)):
        if side:
            lines.append(f"{name:34}" + "".join(f"{side['memory'][k] / MIB:14,.0f}" for k, _ in cols))
    lines.append(f"  (model weights {_mib(mem['weights_bytes'])}; infer holds {_mib(mem['runner_weight_bytes'])} of weight "
                 f"buffers, backend-prepared copies included; KV pool {_mib(mem['kv_pool_bytes'])})")
    lines += _expert_load_lines(inf.get("expert_load"))
    spec = inf.get("spec_decode")
    if spec:
        lines.append(f"speculative decoding: {spec['num_draft_tokens']} tokens drafted in {spec['num_drafts']} steps, "
                     f"{spec['acceptance_rate']:.0%} accepted, {spec['mean_accepted_length']:.2f} tokens per verifying "
                     f"step; accepted by position {spec['accepted_per_position']}")
    ratios = r["ratios"]
    if hf:
        agree = ratios["greedy_agreement"]
        lines.append(f"greedy agreement with transformers (one at a time): first token {agree['first_token']:.0%}, "
                     f"mean common prefix {agree['mean_common_prefix']:.1f} of {cfg['output_len']} tokens")
    lines += ["", "targets (reported, not asserted):"]
    for name, t in r["targets"].items():
        lines.append(f"  {name:40} {t['value']:7.2f}x  (target {t['op']} {t['target']}x)  {'met' if t['met'] else 'NOT met'}")
    lines.append(f"  peak RSS above the after-imports baseline / (weights + KV pool): "
                 f"{ratios['peak_rss_above_baseline_over_weights_kv']:.2f}x")
    return "\n".join(lines)


def _expert_load_lines(load: dict | None) -> list[str]:
    """MoE models: tokens per expert over the workload, and how uneven they were."""
    if not load:
        return []
    lines = ["", f"expert load over the workload ({load['steps']} steps; imbalance = max/mean tokens per expert, "
                 "1.00 = even)"]
    for layer, counts, imb in zip(load["layers"], load["tokens_per_expert"], load["imbalance"]):
        shown = " ".join(str(c) for c in counts[:16]) + (" ..." if len(counts) > 16 else "")
        lines.append(f"  layer {layer:3}: imbalance {'-' if imb is None else f'{imb:.2f}'}  tokens per expert {shown}")
    if load["max_imbalance"] is not None:
        lines.append(f"  worst layer imbalance {load['max_imbalance']:.2f}")
    return lines


def save_png(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inf, hf, mach, cfg = r["infer"], r["transformers"], r["machine"], r["config"]
    panels = [("workload output tok/s", {"infer": inf["workload"]["output_tok_s"]}
               | ({f"hf batch {HF_BATCH}": hf["batch"]["output_tok_s"], "hf batch 1": hf["single"]["output_tok_s"]} if hf else {})),
              ("single-stream decode tok/s", {"infer": inf["decode"]["decode_tok_s"]}
               | ({"hf": hf["decode"]["decode_tok_s"]} if hf else {}) | {"limit": mach["decode_limit_tok_s"]}),
              (f"{cfg['prefill_len']}-token prefill tok/s", {"infer": inf["prefill"]["prefill_tok_s"]}
               | ({"hf": hf["prefill"]["prefill_tok_s"]} if hf else {}) | {"limit": mach["prefill_limit_tok_s"]}),
              ("peak RSS MiB", {"infer": inf["memory"]["peak_rss"] / MIB}
               | ({"hf": hf["memory"]["peak_rss"] / MIB} if hf else {})
               | {"weights+KV": (inf["memory"]["weights_bytes"] + inf["memory"]["kv_pool_bytes"]) / MIB})]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    colors = {"infer": "tab:blue", "limit": "tab:gray", "weights+KV": "tab:gray"}
    for ax, (title, bars) in zip(axes, panels):
        xs = list(bars)
        ax.bar(xs, list(bars.values()), color=[colors.get(x, "tab:orange") for x in xs])
        for i, v in enumerate(bars.values()):
            ax.annotate(f"{v:,.0f}" if v >= 100 else f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    load = r["load_avg"]
    fig.suptitle(f"infer ({cfg['backend']}) vs transformers, {cfg['model']}; load avg {load['start'][0]:.1f}/{load['end'][0]:.1f}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
