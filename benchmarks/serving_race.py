"""infer's OpenAI server against llama-cpp-python's on the same GGUF, side by side.

    python benchmarks/serving_race.py --llama-cpp-python /path/to/venv/bin/python \\
        --concurrency 1 8 16 32 --json race.json --png race.png

For each concurrency, each server is started fresh (its own process, the
default flags: `infer serve --model GGUF`; `python -m llama_cpp.server` with
--n_threads/--n_threads_batch at the torch thread count), driven by
`serving.py` with the same text prompts (random token ids of the GGUF's
tokenizer, decoded), then stopped; the two servers alternate which goes first.
Reported per concurrency: output tok/s, TTFT and ITL p50/p99, and infer's
output tok/s as a multiple of llama.cpp's. llama-cpp-python lives in its own
environment (it builds llama.cpp from source): pass its interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
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
    return summary


COLUMNS = (("output tok/s", "output_throughput", "{:.1f}"), ("TTFT p50", "median_ttft_ms", "{:.0f}"),
           ("TTFT p99", "p99_ttft_ms", "{:.0f}"), ("ITL p50", "median_itl_ms", "{:.1f}"),
           ("ITL p99", "p99_itl_ms", "{:.1f}"))


def table(rows: dict) -> str:
    head = f"{'conc':>4}  {'server':10}" + "".join(f"{c[0]:>14}" for c in COLUMNS) + f"{'infer / llama.cpp':>20}"
    out = [head, "-" * len(head)]
    for c, pair in rows.items():
        for kind in ("infer", "llama.cpp"):
            s = pair[kind]
            cells = "".join(f"{fmt.format(s[key]):>14}" for _, key, fmt in COLUMNS)
            ratio = pair["infer"]["output_throughput"] / max(pair["llama.cpp"]["output_throughput"], 1e-9)
            out.append(f"{c:>4}  {kind:10}{cells}{f'{ratio:.2f}x' if kind == 'infer' else '':>20}")
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
    p.add_argument("--gguf", default="smollm2", help="GGUF file or infer alias both servers load")
    p.add_argument("--llama-cpp-python", required=True, help="interpreter of an environment with llama-cpp-python[server]")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16, 32])
    p.add_argument("--prompts-per-slot", type=int, default=2, help="prompts per unit of concurrency")
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: torch's thread count)")
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--infer-args", default="", help="extra `infer serve` flags (default: none)")
    p.add_argument("--log", default="serving_race.log", help="both servers' output")
    serving.add_workload_args(p)
    args = p.parse_args(argv)
    if args.gguf and not args.gguf.endswith(".gguf"):
        from infer.core.loader import resolve_model_path

        args.gguf = str(resolve_model_path(args.gguf)[0])
    if args.threads is None:
        import torch

        args.threads = torch.get_num_threads()
    args.tokenizer = args.gguf
    rows: dict = {}
    with open(args.log, "w") as log:
        for i, c in enumerate(args.concurrency):
            order = ("infer", "llama.cpp") if i % 2 == 0 else ("llama.cpp", "infer")
            rows[c] = {}
            for kind in order:
                print(f"concurrency {c}: {kind} ...", file=sys.stderr, flush=True)
                rows[c][kind] = one_run(kind, c, args, log)
                if rows[c][kind]["failed"]:
                    print(f"  {rows[c][kind]['failed']} failed: {rows[c][kind]['errors']}", file=sys.stderr)
    print(table(rows))
    config = {k: v for k, v in vars(args).items() if k not in ("json", "png")}
    config["request_rate"] = str(args.request_rate)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    if args.png:
        plot(rows, args.png, f"{Path(args.gguf).name}: {args.input_len} in / {args.output_len} out, "
                             f"{os.cpu_count()} CPUs, llama.cpp {args.threads} threads")
    return 0 if all(r[k]["failed"] == 0 for r in rows.values() for k in r) else 1


if __name__ == "__main__":
    sys.exit(main())
