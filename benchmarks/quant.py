"""Quantized weights on the torch CPU backend: per-T linear paths, and SmolLM2 decode.

    python benchmarks/quant.py                  # both parts
    python benchmarks/quant.py --part linear    # per-T timings of each path at SmolLM2's shapes
    python benchmarks/quant.py --part decode --tokens 64 --json out.json
    python benchmarks/quant.py --part decode --tokens 128 --rounds 3 --llama-python /path/to/venv/bin/python
    python benchmarks/quant.py --part kv        # fp8 vs 16-bit KV cache on the same bytes

``linear``: for each SmolLM2 projection shape and T in 1/4/32/256, the median
time of each way the torch backend can run it (fp32 dense, torch's int4
kernel with fp32 or bf16 activations, dequantize-in-tiles, the per-group
int8 kernel, bf16 dense), all in one process, so ratios hold on a loaded
machine. ``decode``: single-stream greedy decode of the SmolLM2 Q4_1 GGUF,
each configuration in its own process (so its peak RSS is its own): kept
quantized (fp32 and bf16 activations) vs dequantized (fp32, bf16). Peak RSS
is set beside the GGUF file size. ``kv``: the kept-quantized bf16 model with a
16-bit and an fp8 KV cache on the same bytes: tokens each holds, throughput of
a 16-request batch, greedy agreement. The CPU load average is printed with
each part; rerun when it is well above 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import torch  # first, as a user's script does (the "infer first" row imports infer before it)

H, I, V = 576, 1536, 49152
SHAPES = {"qkv": (960, H), "o": (H, H), "gate_up": (2 * I, H), "down": (H, I), "lm_head": (V, H)}
CONFIGS = {"fp32 dequantized": ("none", "float32"), "bf16 dequantized": ("none", "bfloat16"),
           "Q4_1 kept, fp32 act": ("auto", "float32"), "Q4_1 kept, bf16 act": ("auto", "bfloat16"),
           # the same run in an interpreter that imports infer before torch: speed must not depend on it
           "Q4_1 kept, bf16, infer 1st": ("auto", "bfloat16", "infer first")}


def _median_ms(fn, min_s: float = 0.3) -> float:
    fn()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < min_s or len(times) < 3:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def linear_table(tokens: list[int]) -> list[dict]:
    from infer.backends.torch_native import linear as dense
    from infer.backends.torch_native import quant_linear as ql
    from infer.backends.torch_native.native import ops as native
    from infer.core.loader.quant_gguf import to_handle
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = (rng.standard_normal((n, k)) * k**-0.5).astype(np.float32)
        qtype = "Q8_0" if name == "lm_head" else "Q4_1"  # as in SmolLM2's file
        host = to_handle(quants.quantize(w, GGMLQuantizationType[qtype]), qtype, n, k)
        fields = {f: torch.from_numpy(np.asarray(getattr(host, f))) for f in ("qweight", "scales", "offsets")
                  if hasattr(host, f)}
        q32 = ql.prepare_weight(dataclasses.replace(host, **fields, dtype="float32"))
        q16 = ql.prepare_weight(dataclasses.replace(host, **fields, dtype="bfloat16"))
        wf = torch.from_numpy(w)
        d32 = dense.prepare_weight(dense.DenseWeight(wf))
        d16 = dense.DenseWeight(wf.bfloat16())
        for t in tokens:
            x = torch.randn(t, k)
            xb = x.bfloat16()
            paths = {"fp32 dense": lambda: dense.linear(x, d32), "bf16 dense": lambda: dense.linear(xb, d16),
                     "fp32 dequant tiles": lambda: ql._linear_in_tiles(x, q32)}
            packed = q16.prepared.packed if isinstance(q16.prepared, ql.Int4Prepared) else None
            if packed is not None:  # the scalar float32 kernel (never chosen)
                pk = ql.Int4Packed(packed.packed, packed.scale_and_zeros.float())
                paths["int4 kernel fp32"] = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x, pk.packed, q32.group_size, pk.scale_and_zeros)
                paths["int4 kernel bf16"] = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    xb, packed.packed, q16.group_size, packed.scale_and_zeros)
            fast = q16.prepared.native if isinstance(q16.prepared, ql.Int4Prepared) else None
            if fast is not None and t <= native.INT4_GEMM_MAX_ROWS:
                paths["native int4 fp32"] = lambda: native.int4_gemm_prepared(x, fast)
                paths["native int4 bf16"] = lambda: native.int4_gemm_prepared(xb, fast)
            if isinstance(q16.prepared, ql.Int8Grouped):
                paths["int8 group kernel bf16"] = lambda: ql._int8_grouped(xb, q16, q16.prepared)
            paths["bf16 dequant tiles"] = lambda: ql._linear_in_tiles(xb, q16)
            paths["chosen fp32"] = lambda: ql.linear(x, q32)
            paths["chosen bf16"] = lambda: ql.linear(xb, q16)
            for path, fn in paths.items():
                rows.append({"shape": name, "n": n, "k": k, "format": qtype, "T": t, "path": path,
                             "ms": _median_ms(fn, 0.15 if t >= 32 else 0.3)})
            base = next(r["ms"] for r in rows if r["shape"] == name and r["T"] == t and r["path"] == "fp32 dense")
            line = "  ".join(f"{r['path']} {r['ms']:.3f} ({base / r['ms']:.2f}x)" for r in rows
                             if r["shape"] == name and r["T"] == t)
            print(f"{name:8s} [{n}x{k}] {qtype} T={t:<4d} ms (speed vs fp32 dense): {line}", flush=True)
    return rows


def decode_one(quantization: str, dtype: str, tokens: int, model: str = "smollm2") -> dict:
    """Runs in a child process: load, warm up, then time a greedy decode of `tokens` tokens."""
    import resource

    from infer.core.llm import LLM
    from infer.core.sampling_params import SamplingParams

    t0 = time.perf_counter()
    # max_model_len 512: the KV pool holds the context llama.cpp's row gets (n_ctx=512), not 8k.
    llm = LLM(model, backend="torch", quantization=quantization, dtype=dtype, max_num_seqs=1,
              kv_cache_memory=32 << 20, max_model_len=512, show_progress=False)
    load_s = time.perf_counter() - t0
    prompt = "The history of the printing press begins"
    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
    llm.generate([prompt], greedy(4), use_tqdm=False)
    t = time.perf_counter()
    llm.generate([prompt], greedy(1), use_tqdm=False)
    first = time.perf_counter() - t
    t = time.perf_counter()
    out = llm.generate([prompt], greedy(tokens + 1), use_tqdm=False)
    total = time.perf_counter() - t
    return {"quantization": quantization, "dtype": dtype, "load_s": load_s,
            "decode_tok_s": tokens / max(total - first, 1e-9),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "text": out[0].outputs[0].text[:60]}


def kv_one(kv_cache_dtype: str, requests: int, tokens: int) -> dict:
    """Runs in a child process: a batch of `requests` greedy completions on one KV budget."""
    from infer.core.llm import LLM
    from infer.core.sampling_params import SamplingParams

    # max_model_len 512: the pool is not raised to one full 8k context, so the budget decides the capacity.
    llm = LLM("smollm2", backend="torch", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_num_seqs=requests,
              kv_cache_memory=KV_BUDGET, max_model_len=512, show_progress=False)
    capacity = llm.engine.scheduler.block_manager.num_blocks * llm.engine.scheduler.block_manager.block_size
    prompts = [f"Question {i}: explain in detail how a printing press works." for i in range(requests)]
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    total = time.perf_counter() - t
    return {"kv_cache_dtype": kv_cache_dtype, "kv_tokens": capacity, "requests": requests,
            "output_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / total,
            "tokens": [o.outputs[0].token_ids for o in outs]}


KV_BUDGET = 64 << 20  # bytes of KV cache, all layers: 16 requests fit with either cache


def _in_child(call: str, label: str, infer_first: bool = False) -> dict | None:
    """`quant.<call>` run in a fresh interpreter (so its peak RSS is its own): its JSON row, or None.
    The interpreter imports torch first (this module does), or infer when `infer_first`."""
    code = f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); " \
           f"{'import infer.core.llm; ' if infer_first else ''}import quant; print(json.dumps(quant.{call}))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if res.returncode:
        print(f"{label}: failed\n{res.stderr[-2000:]}")
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])


def kv_table(requests: int, tokens: int) -> list[dict]:
    """bf16 16-bit cache vs fp8 cache on the same bytes: token capacity, batch throughput, greedy agreement."""
    rows = []
    for kv_dtype in ("auto", "fp8"):
        row = _in_child(f"kv_one({kv_dtype!r}, {requests}, {tokens})", f"kv {kv_dtype}")
        if row is None:
            return rows
        rows.append(row)
    base = rows[0]
    for r in rows:
        same = [sum(a == b for a, b in zip(x, y)) / max(1, len(y)) for x, y in zip(r["tokens"], base["tokens"])]
        r["greedy_agreement"] = sum(same) / len(same)
        print(f"kv cache {r['kv_cache_dtype']:5s} on {KV_BUDGET >> 20} MiB: {r['kv_tokens']:6d} tokens "
              f"({r['kv_tokens'] / base['kv_tokens']:.2f}x)  {r['requests']} x {tokens} tokens at "
              f"{r['output_tok_s']:6.1f} tok/s ({r['output_tok_s'] / base['output_tok_s']:.2f}x)  "
              f"greedy tokens equal to the 16-bit cache's: {r['greedy_agreement']:.1%}", flush=True)
    for r in rows:
        del r["tokens"]
    return rows


def bare_torch_rss_mb() -> float:
    """Peak RSS of an interpreter that only imports torch: what a model's own memory is measured above."""
    code = "import resource, torch; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def _decode_row(label: str, quant: str, dtype: str, tokens: int, gguf_mb: float, order: str = "torch first",
                model: str = "smollm2", base_mb: float = 0.0) -> dict | None:
    row = _in_child(f"decode_one({quant!r}, {dtype!r}, {tokens}, {model!r})", label,
                    infer_first=order == "infer first")
    if row is None:
        return None
    row |= {"config": label, "gguf_mb": gguf_mb, "bare_torch_mb": base_mb}
    above = f", {(row['peak_rss_mb'] - base_mb) / gguf_mb:.2f}x above bare torch" if base_mb else ""
    print(f"{label:22s} decode {row['decode_tok_s']:6.1f} tok/s  peak RSS {row['peak_rss_mb']:6.0f} MB "
          f"({row['peak_rss_mb'] / gguf_mb:.1f}x the {gguf_mb:.0f} MB GGUF{above})  load {row['load_s']:.1f}s  "
          f"{row['text']!r}", flush=True)
    return row


def decode_table(tokens: int, rounds: int = 1, llama_python: str | None = None,
                 ggufs: list[str] | None = None) -> list[dict]:
    """Each configuration (and llama.cpp, given its Python) once per round, rounds one after
    another, so a slow spell of the machine hits every configuration of a round alike; with
    several rounds, the median speed and the median of each round's ratio to llama.cpp.

    `ggufs`: other GGUF files (a llama.cpp-written Q4_K_M, Q6_K ...) instead of the bundled
    one: each kept quantized with bf16 activations, beside llama.cpp on the same file."""
    from infer.core.loader import resolve_model_path

    models = ggufs or ["smollm2"]
    rows = []
    base_mb = bare_torch_rss_mb()
    print(f"bare `import torch` interpreter: peak RSS {base_mb:.0f} MB", flush=True)
    for r in range(rounds):
        if rounds > 1:
            print(f"-- round {r + 1} of {rounds} (load average {os.getloadavg()[0]:.2f})", flush=True)
        for model in models:
            path = resolve_model_path(model)[0]
            gguf_mb = path.stat().st_size / 2**20
            configs = CONFIGS if not ggufs else {f"{path.stem} kept, bf16": ("auto", "bfloat16")}
            for label, config in configs.items():
                order = config[2] if len(config) > 2 else "torch first"
                if row := _decode_row(label, config[0], config[1], tokens, gguf_mb, order, model, base_mb):
                    rows.append(row | {"round": r, "model": path.stem})
            if llama_python and (row := llama_cpp_row(llama_python, tokens, model)):
                rows.append(row | {"round": r, "model": path.stem})
    if rounds > 1:
        llama = {(row["round"], row["model"]): row["decode_tok_s"] for row in rows
                 if row["config"].startswith("llama.cpp")}
        print(f"-- median of {rounds} rounds")
        for label in dict.fromkeys(row["config"] for row in rows):
            speeds = [row["decode_tok_s"] for row in rows if row["config"] == label]
            ratios = [row["decode_tok_s"] / llama[row["round"], row["model"]] for row in rows
                      if row["config"] == label and (row["round"], row["model"]) in llama]
            vs = f"  {statistics.median(ratios):.2f}x llama.cpp (rounds: {', '.join(f'{x:.2f}' for x in ratios)})" \
                if ratios and not label.startswith("llama.cpp") else ""
            print(f"{label:22s} decode {statistics.median(speeds):6.1f} tok/s{vs}", flush=True)
    return rows


_LLAMA_CPP = """
import json, resource, sys, time
from llama_cpp import Llama
path, tokens, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t0 = time.perf_counter()
llm = Llama(model_path=path, n_ctx=512, n_threads=threads, verbose=False)
load_s = time.perf_counter() - t0
prompt = "The history of the printing press begins"
llm(prompt, max_tokens=4, temperature=0.0)
t = time.perf_counter(); llm(prompt, max_tokens=1, temperature=0.0); first = time.perf_counter() - t
t = time.perf_counter(); out = llm(prompt, max_tokens=tokens + 1, temperature=0.0); total = time.perf_counter() - t
print(json.dumps({"decode_tok_s": (out["usage"]["completion_tokens"] - 1) / max(total - first, 1e-9),
                  "completion_tokens": out["usage"]["completion_tokens"], "load_s": load_s,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "text": out["choices"][0]["text"][:60]}))
"""


def llama_cpp_row(python: str, tokens: int, model: str = "smollm2") -> dict | None:
    """llama.cpp (llama-cpp-python in the interpreter `python`) on the same GGUF, same prompt, greedy."""
    from infer.core.loader import resolve_model_path

    path = resolve_model_path(model)[0]
    threads = torch.get_num_threads()
    res = subprocess.run([python, "-c", _LLAMA_CPP, str(path), str(tokens), str(threads)], capture_output=True, text=True)
    if res.returncode:
        print(f"llama.cpp: failed\n{res.stderr[-2000:]}")
        return None
    label = f"llama.cpp ({threads} thr)" + ("" if model == "smollm2" else f" {path.stem}")
    row = json.loads(res.stdout.strip().splitlines()[-1]) | {"config": label}
    print(f"{row['config']:22s} decode {row['decode_tok_s']:6.1f} tok/s  peak RSS {row['peak_rss_mb']:6.0f} MB  "
          f"({row['completion_tokens']} tokens; may stop at EOS)  {row['text']!r}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("linear", "decode", "kv", "all"), default="all")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per run")
    ap.add_argument("--T", default="1,4,32,256", help="row counts for the linear part")
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--llama-python", help="a Python with llama-cpp-python installed: adds llama.cpp's decode")
    ap.add_argument("--rounds", type=int, default=1, help="decode: run every configuration this many times, "
                                                          "interleaved, and report medians")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's); 1 is steadier on a busy machine")
    ap.add_argument("--gguf", action="append", help="decode: this GGUF (repeatable) instead of the bundled one, "
                                                    "kept quantized with bf16 activations, beside llama.cpp")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
        os.environ["OMP_NUM_THREADS"] = str(a.threads)  # the decode children
    out: dict[str, list] = {}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    if a.part in ("linear", "all"):
        out["linear"] = linear_table([int(t) for t in a.T.split(",")])
    if a.part in ("decode", "all"):
        print(f"load average {os.getloadavg()[0]:.2f}")
        out["decode"] = decode_table(a.tokens, a.rounds, a.llama_python, a.gguf)
    if a.part in ("kv", "all"):
        print(f"load average {os.getloadavg()[0]:.2f}")
        out["kv"] = kv_table(16, a.tokens)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
