"""Online serving benchmark, like `vllm bench serve`: drive an OpenAI-compatible
server over HTTP and report request throughput, output tokens/s and the
mean / median / p99 of TTFT, TPOT, ITL and end-to-end latency.

    # against a running server
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --num-prompts 32 --max-concurrency 8
    # launch `infer serve` for the run, then stop it
    python benchmarks/serving.py --launch "--model smollm2 --backend torch" --request-rate 4 --json out.json --png out.png

Prompts are text (vLLM's "random" dataset: --input-len random token ids of
the --tokenizer model, decoded; ids whose text does not survive a round trip
are not drawn), sent to /v1/completions with ignore_eos and the end-of-text
token's logit_bias at -100, so any OpenAI-compatible server (llama.cpp's,
vLLM's, infer's) generates --output-len tokens. ``--dataset random-ids`` sends
the ids themselves (servers that take token-id prompts only). Output tokens are
the server's usage counts where it streams them, else the streamed chunks.
Arrivals are Poisson at --request-rate (inf: all at once), at most
--max-concurrency in flight.

``--offline`` (with --launch) then runs the same prompts, one at a time, through
the engine in a fresh process on its main thread (as `infer run` does, same
flags) and prints single-stream decode and TTFT served vs offline side by side:
what the server's own path (HTTP, the engine thread, streaming) costs.

    python benchmarks/serving.py --launch "--model smollm2" --max-concurrency 1 --num-prompts 8 --offline
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np


@dataclass
class RequestResult:
    ok: bool
    start: float
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def one_request(http: httpx.AsyncClient, model: str | None, prompt: list[int] | str, output_len: int,
                      eos: int | None = None) -> RequestResult:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if eos is not None:
        body["logit_bias"] = {str(eos): -100}
    if model:
        body["model"] = model
    start = time.perf_counter()
    res = RequestResult(ok=False, start=start)
    last = None
    chunks = 0
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    chunks += 1
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.ok = res.output_tokens > 0
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def make_prompts(args: argparse.Namespace) -> tuple[list, int | None]:
    """The prompts and the end-of-text id to bias against (None for token-id prompts)."""
    rng = np.random.default_rng(args.seed)
    if args.dataset == "random-ids":
        return [rng.integers(args.min_token_id, args.max_token_id, args.input_len).tolist()
                for _ in range(args.num_prompts)], None
    from infer.core.loader import open_checkpoint

    tok = open_checkpoint(args.tokenizer).load_tokenizer()
    pool = np.arange(args.min_token_id, min(args.max_token_id, len(tok)))
    clean = [i for i in pool.tolist() if tok.encode(tok.decode([i]), add_special_tokens=False) == [i]]
    return [tok.decode(rng.choice(clean, args.input_len).tolist()) for _ in range(args.num_prompts)], tok.eos_token_id


async def run(args: argparse.Namespace, base_url: str) -> tuple[list[RequestResult], float]:
    prompts, eos = make_prompts(args)
    rng = np.random.default_rng(args.seed + 1)
    gaps = rng.exponential(1.0 / args.request_rate, args.num_prompts) if args.request_rate != float("inf") else None
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=args.timeout, limits=limits) as http:
        warm = await one_request(http, args.model, prompts[0], 4, eos)
        if not warm.ok:
            raise SystemExit(f"warm-up request failed: {warm.error}")
        gate = asyncio.Semaphore(args.max_concurrency or args.num_prompts)

        async def limited(prompt):
            async with gate:
                return await one_request(http, args.model, prompt, args.output_len, eos)

        tasks = []
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.create_task(limited(prompt)))
            if gaps is not None:
                await asyncio.sleep(gaps[i])
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out = {"duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
           "request_throughput": len(ok) / duration,
           "output_throughput": sum(r.output_tokens for r in ok) / duration}
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [x for r in ok for x in r.itl], "e2e": [r.e2e for r in ok]}
    for name, xs in series.items():
        xs = np.array(xs) * 1000 if xs else np.zeros(1)
        out[f"mean_{name}_ms"] = float(xs.mean())
        out[f"median_{name}_ms"] = float(np.median(xs))
        out[f"p99_{name}_ms"] = float(np.percentile(xs, 99))
    return out


def print_report(s: dict) -> None:
    print(f"{'Successful requests:':<36}{s['completed']}")
    print(f"{'Failed requests:':<36}{s['failed']}")
    print(f"{'Benchmark duration (s):':<36}{s['duration_s']:.2f}")
    print(f"{'Request throughput (req/s):':<36}{s['request_throughput']:.2f}")
    print(f"{'Output token throughput (tok/s):':<36}{s['output_throughput']:.1f}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2e", "End-to-end Latency")):
        print(f"---- {title} ----")
        for stat in ("mean", "median", "p99"):
            print(f"{f'{stat.capitalize()} {name.upper()} (ms):':<36}{s[f'{stat}_{name}_ms']:.2f}")


def plot_cdfs(results: list[RequestResult], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    series = {"TTFT": [r.ttft for r in ok], "TPOT": [r.tpot for r in ok if r.tpot is not None],
              "ITL": [x for r in ok for x in r.itl], "End-to-end": [r.e2e for r in ok]}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, xs) in zip(axes.flat, series.items()):
        xs = np.sort(np.array(xs) * 1000)
        if len(xs):
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")
            for q in (50, 99):
                ax.axvline(np.percentile(xs, q), ls="--", lw=0.8, color="grey")
        ax.set_title(f"{name} (p50, p99 dashed)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of tokens")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def launch(serve_args: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "infer.cli", "serve", "--port", "0", "--uvicorn-log-level", "warning",
           *shlex.split(serve_args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        sys.stderr.write(line)
        m = re.search(r"on (http://\S+:\d+)", line)
        if m:
            # Keep reading, or a chatty server would block on a full pipe.
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, m.group(1)
    raise SystemExit(f"infer serve exited with {proc.wait()} before listening")


def offline(serve_args: str, prompts: list, output_len: int, eos: int | None) -> dict:
    """The prompts one at a time through an engine built from `infer serve SERVE_ARGS`'s flags,
    stepped on this (main) thread: each one's TTFT and TPOT, timed as the server's are."""
    from infer.cli import build_parser
    from infer.cli_model import engine_args
    from infer.core.engine import LLMEngine
    from infer.core.sampling_params import SamplingParams

    ns = build_parser().parse_args(["serve", *shlex.split(serve_args)])
    engine = LLMEngine(engine_args(ns, model=(ns.model or ["smollm2"])[0], show_progress=False))
    bias = {eos: -100.0} if eos is not None else None

    def one(rid: str, prompt, n: int) -> tuple[float, float | None]:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logit_bias=bias)
        start = time.perf_counter()
        engine.add_request(rid, prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}, params)
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter()
                if out.finished:
                    got = len(out.outputs[0].token_ids)
                    end = time.perf_counter()
        return first - start, (end - first) / (got - 1) if got > 1 else None

    one("warm", prompts[0], 4)
    timed = [one(str(i), p, output_len) for i, p in enumerate(prompts)]
    return {"ttft": [t for t, _ in timed], "tpot": [t for _, t in timed if t is not None]}


def compare_offline(served: list[RequestResult], off: dict) -> dict:
    """Median TTFT and single-stream decode tok/s (1 / median TPOT), served beside offline."""
    ok = [r for r in served if r.ok]
    s_ttft, s_tpot = np.median([r.ttft for r in ok]), np.median([r.tpot for r in ok if r.tpot is not None])
    o_ttft, o_tpot = np.median(off["ttft"]), np.median(off["tpot"])
    return {"served_decode_tok_s": float(1 / s_tpot), "offline_decode_tok_s": float(1 / o_tpot),
            "decode_served_over_offline": float(o_tpot / s_tpot),
            "served_median_ttft_ms": float(s_ttft * 1000), "offline_median_ttft_ms": float(o_ttft * 1000)}


def print_comparison(c: dict) -> None:
    print("---- Served vs offline (same prompts, one at a time) ----")
    print(f"{'':<36}{'served':>10}{'offline':>10}{'ratio':>8}")
    print(f"{'Decode (tok/s, 1 / median TPOT):':<36}{c['served_decode_tok_s']:>10.1f}{c['offline_decode_tok_s']:>10.1f}"
          f"{c['decode_served_over_offline']:>7.2f}x")
    print(f"{'Median TTFT (ms):':<36}{c['served_median_ttft_ms']:>10.1f}{c['offline_median_ttft_ms']:>10.1f}")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson arrivals (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--dataset", choices=("random-text", "random-ids"), default="random-text")
    p.add_argument("--tokenizer", default="smollm2", help="model whose tokenizer makes the text prompts")
    p.add_argument("--min-token-id", type=int, default=100, help="random prompt ids are drawn from [min, max)")
    p.add_argument("--max-token-id", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None, help="write config, summary and per-request results here")
    p.add_argument("--png", default=None, help="write latency CDFs here")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # the offline half of --offline, in a fresh process
        job = json.loads(argv[1])
        print(json.dumps(offline(job["serve_args"], job["prompts"], job["output_len"], job["eos"])))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--launch", metavar="SERVE_ARGS", help="start `infer serve SERVE_ARGS` for the run")
    p.add_argument("--model", default=None, help="served model name (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--offline", action="store_true",
                   help="with --launch: also run the prompts one at a time offline (same flags, fresh process) and "
                        "print single-stream decode and TTFT served vs offline")
    add_workload_args(p)
    args = p.parse_args(argv)
    if args.offline and not args.launch:
        p.error("--offline needs --launch (the offline engine takes the server's flags)")
    proc, base_url = launch(args.launch) if args.launch else (None, args.base_url)
    try:
        results, duration = asyncio.run(run(args, base_url))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    summary = summarize(results, duration)
    print_report(summary)
    if args.offline:
        from fresh import run_child

        prompts, eos = make_prompts(args)
        job = {"serve_args": args.launch, "prompts": prompts, "output_len": args.output_len, "eos": eos}
        summary["offline"] = compare_offline(results, run_child(__file__, [json.dumps(job)]))
        print_comparison(summary["offline"])
    for r in results:
        if not r.ok:
            print(f"failed: {r.error}", file=sys.stderr)
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    config["request_rate"] = str(args.request_rate)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config, "summary": summary, "requests": [asdict(r) for r in results]}, f, indent=1)
    if args.png:
        rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}/s"
        plot_cdfs(results, args.png, f"{args.num_prompts} requests, {args.input_len} in / {args.output_len} out, "
                                     f"rate {rate}, concurrency {args.max_concurrency or 'unbounded'}")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
