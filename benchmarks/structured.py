"""Structured outputs on SmolLM2: grammar compile time, and decode throughput with a
JSON schema against the same requests without one.

    python benchmarks/structured.py                     # both parts, both grammar libraries
    python benchmarks/structured.py --part compile
    python benchmarks/structured.py --part decode --rounds 3 --json out.json

``compile``: for xgrammar and llguidance, the one-time tokenizer tables and then
each of the test suite's JSON schemas compiled cold (a fresh compiler, no cache
hit), median and max. ``decode``: each grammar library in its own process
(default engine flags, torch imported first); in each, rounds alternate the
same greedy requests with and without a JSON schema that cannot end before
max_tokens (an array of at least 64 short strings), so both runs decode the
same number of tokens; reported as output tok/s and the schema's slowdown, at
batch 1 and 32, greedy and sampled with top_p 0.9. Greedy (and unfiltered
sampling) rows sample without their mask first and fill it only when the grammar
refuses the model's choice (`grammar_masks_skipped`, reported as "unmasked");
top_p needs every mask every step, the grammar library's full cost. Target:
<= 10% slower at batch 32.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch  # noqa: F401  (first, as a user's script does)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
LIBRARIES = ("xgrammar", "guidance")
LONG_ARRAY = {"type": "array", "minItems": 64, "items": {"type": "string", "maxLength": 8}}


def part_compile(model: str) -> dict:
    from structured_schemas import SCHEMAS

    from infer.core.loader.load import open_checkpoint
    from infer.core.structured import StructuredOutputs, StructuredOutputsParams

    ckpt = open_checkpoint(model)
    tok = ckpt.load_tokenizer()
    vocab = int(ckpt.config.get("vocab_size", len(tok)))
    out = {}
    for lib in LIBRARIES:
        so = StructuredOutputs(lib, tok, vocab, (tok.eos_token_id,))
        start = time.perf_counter()
        so._backend(lib)
        tables = time.perf_counter() - start
        times = []
        for _, schema in SCHEMAS:
            start = time.perf_counter()
            so._backends[lib].compile(StructuredOutputsParams(json=schema))
            times.append(time.perf_counter() - start)
        so.shutdown()
        out[lib] = {"tokenizer_tables_s": tables, "schemas": len(times),
                    "compile_ms_median": 1e3 * statistics.median(times), "compile_ms_max": 1e3 * max(times)}
        print(f"{lib:9s} tokenizer tables {tables:.2f} s; {len(times)} schemas: median "
              f"{out[lib]['compile_ms_median']:.1f} ms, max {out[lib]['compile_ms_max']:.1f} ms", flush=True)
    return out


SAMPLING = {"greedy": {"temperature": 0.0}, "top_p": {"temperature": 0.8, "top_p": 0.9, "seed": 0}}


def _decode_worker(model: str, lib: str, batch: int, tokens: int, rounds: int, sampling: str) -> dict:
    from infer import LLM, SamplingParams
    from infer.core.structured import StructuredOutputsParams

    llm = LLM(model, structured_outputs_backend=lib)
    prompts = [f"List {batch + i} words in a JSON array:" for i in range(batch)]
    free = SamplingParams(**SAMPLING[sampling], max_tokens=tokens, ignore_eos=True)
    constrained = SamplingParams(**SAMPLING[sampling], max_tokens=tokens,
                                 structured_outputs=StructuredOutputsParams(json=LONG_ARRAY))
    rates: dict[str, list[float]] = {"none": [], "json": []}
    llm.generate(prompts, constrained, use_tqdm=False)  # warm: kernels, grammar compiled and cached
    skipped, constrained_tokens = llm.engine.grammar_masks_skipped, 0
    for _ in range(rounds):
        for name, p in (("none", free), ("json", constrained)):
            start = time.perf_counter()
            outs = llm.generate(prompts, p, use_tqdm=False)
            wall = time.perf_counter() - start
            n = sum(len(c.token_ids) for o in outs for c in o.outputs)
            assert n == batch * tokens, (name, n)
            rates[name].append(n / wall)
            constrained_tokens += n if name == "json" else 0
    out = {k: statistics.median(v) for k, v in rates.items()}
    out["unmasked"] = (llm.engine.grammar_masks_skipped - skipped) / constrained_tokens
    return out


def part_decode(model: str, batches: list[int], tokens: int, rounds: int) -> dict:
    out = {}
    for lib in LIBRARIES:
        for sampling in SAMPLING:
            for b in batches:
                cmd = [sys.executable, __file__, "--worker", lib, "--batch", str(b), "--tokens", str(tokens),
                       "--rounds", str(rounds), "--model", model, "--sampling", sampling]
                res = subprocess.run(cmd, capture_output=True, text=True, check=True)
                r = json.loads(res.stdout.strip().splitlines()[-1])
                r["slowdown"] = 1 - r["json"] / r["none"]
                out[f"{lib} {sampling} batch {b}"] = r
                print(f"{lib:9s} {sampling:6s} batch {b:2d}: none {r['none']:7.1f} tok/s, json schema "
                      f"{r['json']:7.1f} tok/s, slowdown {100 * r['slowdown']:5.1f}%, unmasked "
                      f"{100 * r['unmasked']:3.0f}% of rows  (load {os.getloadavg()[0]:.1f})", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["compile", "decode", "all"], default="all")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--worker", choices=LIBRARIES, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sampling", choices=list(SAMPLING), default="greedy", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(_decode_worker(a.model, a.worker, a.batch[0], a.tokens, a.rounds, a.sampling)))
        return
    result = {}
    if a.part in ("compile", "all"):
        result["compile"] = part_compile(a.model)
    if a.part in ("decode", "all"):
        result["decode"] = part_decode(a.model, a.batch, a.tokens, a.rounds)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
