"""infer's OpenAI server against llama-cpp-python's on the same GGUF, side by side.

    python benchmarks/serving_race.py --llama-cpp-python /path/to/venv/bin/python \\
        --concurrency 1 8 16 32 --json race.json --png race.png
    python benchmarks/serving_race.py --llama-cpp-python /path/to/venv/bin/python \\
        --gguf q4km.gguf q6k.gguf --concurrency 32 --rounds 3

For each concurrency, each server is started fresh (its own process, the
default flags: `infer serve --model GGUF`; `python -m llama_cpp.server` with
--n_threads/--n_threads_batch at the torch thread count), driven by
`serving.py` with the same text prompts (random token ids of the GGUF's
tokenizer, decoded), then stopped; the two servers alternate which goes first. With several files
and ``--rounds N``, every (file, concurrency) pair runs once per round, rounds
one after another, so a busy spell of the shared machine hits both servers of
a round alike. Reported per file and concurrency: output tok/s, TTFT and ITL
p50/p99 (medians over rounds), infer's output tok/s as a multiple of
llama.cpp's (the median of the rounds' ratios, and each round's), and the load
average before each run. llama-cpp-python's server runs one request at a time
(the rest queue behind its lock), so its output tok/s is its single-stream
decode at any concurrency. llama-cpp-python lives in its own
environment (it builds llama.cpp from source): pass its interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from infer.core.distributed import free_port

sys.path.insert(0, str(Path(__file__).parent))
import serving  # noqa: E402


def _wait_ready(proc: subprocess.Popen, url: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before listening: {' '.join(proc.args)}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server not ready after {timeout:.0f} s: {' '.join(proc.args)}")


def start(kind: str, args: argparse.Namespace, log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if kind == "infer":
        cmd = [sys.executable, "-m", "infer", "serve", "--model", args.gguf, "--port", str(port),
               "--uvicorn-log-level", "warning", *args.infer_args.split()]
    else:
        cmd = [args.llama_cpp_python, "-m", "llama_cpp.server", "--model", args.gguf, "--host", "127.0.0.1",
               "--port", str(port), "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
               "--n_ctx", str(args.n_ctx), "--interrupt_requests", "False"]  # queue requests, not cancel them
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    _wait_ready(proc, url)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def one_run(kind: str, concurrency: int, args: argparse.Namespace, log) -> dict:
    proc, url = start(kind, args, log)
    load = os.getloadavg()[0]
    try:
        wl = argparse.Namespace(**vars(args))
        wl.max_concurrency = concurrency
        wl.num_prompts = max(args.min_prompts, args.prompts_per_slot * concurrency)
        wl.model = None
        wl.api_key = None
        results, duration = asyncio.run(serving.run(wl, url))
    finally:
        stop(proc)
    summary = serving.summarize(results, duration)
    summary["errors"] = sorted({r.error for r in results if not r.ok})[:3]
    summary["num_prompts"] = wl.num_prompts
    summary["loadavg_before"], summary["loadavg_after"] = load, os.getloadavg()[0]
    return summary


def median_row(runs: list[dict]) -> dict:
    """The median of each figure over rounds (failed counts summed)."""
    out = {k: statistics.median(r[k] for r in runs) for k, v in runs[0].items() if isinstance(v, float)}
    out["failed"] = sum(r["failed"] for r in runs)
    return out


COLUMNS = (("output tok/s", "output_throughput", "{:.1f}"), ("TTFT p50", "median_ttft_ms", "{:.0f}"),
           ("TTFT p99", "p99_ttft_ms", "{:.0f}"), ("ITL p50", "median_itl_ms", "{:.1f}"),
           ("ITL p99", "p99_itl_ms", "{:.1f}"))


def table(rows: dict, rounds: dict) -> str:
    head = f"{'conc':>4}  {'server':10}" + "".join(f"{c[0]:>14}" for c in COLUMNS) + f"{'infer / llama.cpp':>20}  rounds (load avg)"
    out = [head, "-" * len(head)]
    for c, pair in rows.items():
        ratios = [r["infer"]["output_throughput"] / max(r["llama.cpp"]["output_throughput"], 1e-9) for r in rounds[c]]
        for kind in ("infer", "llama.cpp"):
            s = pair[kind]
            cells = "".join(f"{fmt.format(s[key]):>14}" for _, key, fmt in COLUMNS)
            each = "  ".join(f"{r[kind]['output_throughput']:.1f} ({r[kind]['loadavg_before']:.2f})" for r in rounds[c])
            ratio = f"{statistics.median(ratios):.2f}x" if kind == "infer" else ""
            out.append(f"{c:>4}  {kind:10}{cells}{ratio:>20}  {each}")
        if len(ratios) > 1:
            out.append(f"{'':>4}  {'':10}{'':>{14 * len(COLUMNS)}}{'':>20}  ratios " + "  ".join(f"{x:.2f}x" for x in ratios))
    return "\n".join(out)


def plot(rows: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    conc = list(rows)
    x = np.arange(len(conc))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (label, key) in zip(axes, (("output tok/s", "output_throughput"), ("TTFT p50 / p99 (ms)", "ttft"),
                                        ("ITL p50 / p99 (ms)", "itl"))):
        for j, kind in enumerate(("infer", "llama.cpp")):
            if key in ("ttft", "itl"):
                p50 = [rows[c][kind][f"median_{key}_ms"] for c in conc]
                p99 = [rows[c][kind][f"p99_{key}_ms"] for c in conc]
                ax.bar(x + (j - 0.5) * 0.38, p99, 0.38, alpha=0.35, color=f"C{j}")
                ax.bar(x + (j - 0.5) * 0.38, p50, 0.38, label=kind, color=f"C{j}")
                ax.set_yscale("log")
            else:
                ax.bar(x + (j - 0.5) * 0.38, [rows[c][kind][key] for c in conc], 0.38, label=kind, color=f"C{j}")
        ax.set_xticks(x, [str(c) for c in conc])
        ax.set_xlabel("concurrency")
        ax.set_title(label)
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", nargs="+", default=["smollm2"], help="GGUF files or infer aliases both servers load")
    p.add_argument("--llama-cpp-python", required=True, help="interpreter of an environment with llama-cpp-python[server]")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16, 32])
    p.add_argument("--rounds", type=int, default=1, help="times each (file, concurrency) pair runs, interleaved")
    p.add_argument("--prompts-per-slot", type=int, default=2, help="prompts per unit of concurrency")
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: torch's thread count)")
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--infer-args", default="", help="extra `infer serve` flags (default: none)")
    p.add_argument("--log", default="serving_race.log", help="both servers' output")
    serving.add_workload_args(p)
    args = p.parse_args(argv)
    from infer.core.loader import resolve_model_path

    ggufs = [g if g.endswith(".gguf") else str(resolve_model_path(g)[0]) for g in args.gguf]
    if args.threads is None:
        import torch

        args.threads = torch.get_num_threads()
    runs: dict = {g: {c: [] for c in args.concurrency} for g in ggufs}
    with open(args.log, "w") as log:
        for r in range(args.rounds):
            for i, (g, c) in enumerate((g, c) for g in ggufs for c in args.concurrency):
                args.gguf = args.tokenizer = g
                order = ("infer", "llama.cpp") if (i + r) % 2 == 0 else ("llama.cpp", "infer")
                pair = {}
                for kind in order:
                    print(f"round {r + 1}/{args.rounds} {Path(g).name} concurrency {c}: {kind} "
                          f"(load average {os.getloadavg()[0]:.2f}) ...", file=sys.stderr, flush=True)
                    pair[kind] = one_run(kind, c, args, log)
                    if pair[kind]["failed"]:
                        print(f"  {pair[kind]['failed']} failed: {pair[kind]['errors']}", file=sys.stderr)
                runs[g][c].append(pair)
    results = {}
    for g in ggufs:
        rows = {c: {k: median_row([pair[k] for pair in runs[g][c]]) for k in ("infer", "llama.cpp")}
                for c in args.concurrency}
        print(f"{Path(g).name}: {args.input_len} in / {args.output_len} out, {args.rounds} round(s), "
              f"medians; llama.cpp {args.threads} threads")
        print(table(rows, runs[g]))
        results[g] = {"rows": rows, "rounds": runs[g]}
        if args.png:
            png = args.png if len(ggufs) == 1 else str(Path(args.png).with_suffix(f".{Path(g).stem}.png"))
            plot(rows, png, f"{Path(g).name}: {args.input_len} in / {args.output_len} out, "
                            f"{os.cpu_count()} CPUs, llama.cpp {args.threads} threads")
    config = {k: v for k, v in vars(args).items() if k not in ("json", "png")}
    config["request_rate"] = str(args.request_rate)
    config["gguf"] = ggufs
    if args.json:
        Path(args.json).write_text(json.dumps({"config": config, "results": results}, indent=1))
    return 0 if all(pair[k]["failed"] == 0 for g in runs.values() for c in g.values() for pair in c for k in pair) else 1


if __name__ == "__main__":
    sys.exit(main())
