"""KV capacity of the hybrid cache: long contexts on a Gemma 3-shaped model.

    python benchmarks/hybrid_kv.py [--context 32768] [--json out.json]

A Gemma 3 1B-shaped model (26 layers, five sliding-window layers to each full
one, one KV head of 256 dims, bfloat16 KV) with the 1024-token window of the
larger Gemma 3 models (tiny random weights elsewhere, which do not change the
cache) is built as a transformers
directory. Each configuration builds the engine as `infer serve` would with
the same KV budget (`--kv-cache-memory`, default flags otherwise, torch
backend) -- once with the hybrid cache, once with
``disable_hybrid_kv_cache_manager`` -- and then drives the engine's own
scheduler and block manager through 64 requests of `--context` tokens (the
last 2048 generated, so that all have started before the first ends), with sampled tokens from a driver instead of the
model (the cache's bookkeeping is what is measured, not the forward pass).

Reported per configuration: the pool (blocks, MiB), how many requests were in
decode at once at the peak (each holding 30,720 to 32,768 tokens at the
default context), the preemptions (requests grow until the pool is full),
and the engine's own concurrency figure at this context (what the startup
log prints: a windowed group counted with its window plus a whole step's
2048 tokens, the most it holds during a prefill); then the ratio of the peaks.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import torch  # noqa: F401  (first, as a user's script does)
from fresh import run_child, save_json

REQUESTS, NEW_TOKENS, WINDOW = 64, 2048, 1024
KV_BYTES = 4 << 30


def _model(path: str, context: int) -> None:
    import transformers

    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)]
    cfg = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, sliding_window=WINDOW, layer_types=kinds, vocab_size=512, max_position_embeddings=context,
        torch_dtype="bfloat16")
    transformers.Gemma3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def _child(path: str, context: int, hybrid: bool) -> dict:
    import numpy as np

    from infer.core.engine import EngineArgs, LLMEngine, kv_concurrency
    from infer.core.request import Request
    from infer.core.sampling_params import SamplingParams
    from infer.core.scheduler_output import StepOutput

    engine = LLMEngine(EngineArgs(model=path, backend="torch", max_model_len=context, kv_cache_memory=KV_BYTES,
                                  disable_hybrid_kv_cache_manager=not hybrid, show_progress=False,
                                  skip_tokenizer_init=True, max_num_seqs=REQUESTS, enforce_eager=True))
    sched, cache = engine.scheduler, engine.cache_config
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    for i in range(REQUESTS):
        sched.add_request(Request(f"r{i}", rng.integers(0, 512, context - NEW_TOKENS).tolist(), params))
    peak = steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        decoding = sum(s.start >= context - NEW_TOKENS for s in out.scheduled)
        peak = max(peak, decoding)
        sampled = {s.request_id: 7 for s in out.scheduled if s.do_sample}
        sched.update_from_output(out, StepOutput.of_tokens(sampled))
        steps += 1
    per_block = engine.worker.runner.kv_cache_bytes_per_block(cache.block_size)
    result = dict(hybrid=hybrid, groups=engine.worker.runner.kv_groups.describe(), blocks=cache.num_blocks,
                  block_size=cache.block_size, pool_mib=round(cache.num_blocks * per_block / 2**20, 1),
                  peak_decoding=peak, preemptions=sched.num_preemptions, steps=steps,
                  engine_concurrency=round(kv_concurrency(cache, sched, context), 2))
    engine.shutdown()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs=3, metavar=("PATH", "CONTEXT", "HYBRID"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], int(args.child[1]), args.child[2] == "1")))
        return
    with tempfile.TemporaryDirectory() as path:
        _model(path, args.context)
        rows = [run_child(__file__, [path, str(args.context), flag]) for flag in ("1", "0")]
    for r in rows:
        print(f"{'hybrid' if r['hybrid'] else 'plain ':7} {r['groups']:45} {r['blocks']:7} blocks of "
              f"{r['block_size']} ({r['pool_mib']} MiB): {r['peak_decoding']} requests in decode at once "
              f"({args.context - NEW_TOKENS}-{args.context} tokens each), {r['preemptions']} preemptions, engine's concurrency {r['engine_concurrency']}x")
    ratio = rows[0]["peak_decoding"] / max(1, rows[1]["peak_decoding"])
    print(f"hybrid / plain concurrent {args.context}-token requests: {ratio:.2f}x (target >= 3x)")
    save_json(args.json, context=args.context, rows=rows, ratio=ratio)
    sys.exit(0)


if __name__ == "__main__":
    main()
