"""Multi-LoRA throughput on SmolLM2 (CPU, torch backend): a batch of 32 requests
spread over 4 distinct rank-16 adapters against the base model alone.

    python benchmarks/lora.py --json out.json --png out.png

The adapters are made with `peft` (random weights, ``init_lora_weights=False``)
on SmolLM2's architecture, targeting all seven projections (q, k, v, o, gate,
up, down): the most work an adapter adds. 32 requests of 128 prompt tokens
(random ids) generate 128 tokens each (greedy, ``ignore_eos``), all submitted at
once. Each configuration runs in its own process (torch imported first, default
flags otherwise), alternating over `--pairs`; figures are medians:

* ``base``: the engine without LoRA;
* ``lora-idle``: ``--enable-lora --max-loras 4``, every request on the base
  model (the cost of the LoRA path itself);
* ``lora-4``: the same engine, requests round-robin over the 4 adapters.

Target (issue 23): lora-4 output throughput >= 0.8x base.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch  # noqa: F401  (first, as a user's script does)
from fresh import pyplot, run_child, save_json

BATCH, PROMPT, NEW, ADAPTERS, RANK = 32, 128, 128, 4, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIGS = ("base", "lora-idle", "lora-4")


def make_adapters(root: Path) -> list[Path]:
    """Four random rank-16 PEFT adapters on SmolLM2's architecture."""
    import transformers
    from peft import LoraConfig, get_peft_model

    from infer.core.loader import load_model

    c = load_model("smollm2", load_weights=False, load_tokenizer=False).config
    config = transformers.LlamaConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"], tie_word_embeddings=True)
    paths = []
    for i in range(ADAPTERS):
        torch.manual_seed(i)
        model = get_peft_model(transformers.LlamaForCausalLM(config),
                               LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, init_lora_weights=False))
        paths.append(root / f"adapter{i}")
        model.save_pretrained(paths[-1])
    return paths


def _child(config: str, adapters: list[str]) -> dict:
    import numpy as np

    from infer.core.engine import EngineArgs, LLMEngine
    from infer.core.lora import LoRARequest
    from infer.core.sampling_params import SamplingParams

    lora = {} if config == "base" else dict(enable_lora=True, max_loras=ADAPTERS, max_lora_rank=RANK)
    engine = LLMEngine(EngineArgs(model="smollm2", show_progress=False, max_num_seqs=BATCH, **lora))
    requests = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)] if config == "lora-4" else []
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 49152, PROMPT).tolist() for _ in range(BATCH)]
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, r in enumerate(requests or [None]):  # every adapter read and in a slot before timing
        engine.add_request(f"warm{i}", {"prompt_token_ids": prompts[i][:32]}, warm, lora_request=r)
    while engine.has_unfinished_requests():
        engine.step()
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params,
                           lora_request=requests[i % len(requests)] if requests else None)
    tokens, decode_start = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if decode_start is None and out.outputs[0].token_ids:
                decode_start = time.perf_counter()
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    return dict(config=config, seconds=seconds, output_tokens_per_s=tokens / seconds,
                total_tokens_per_s=(tokens + BATCH * PROMPT) / seconds, dtype=engine.dtype,
                slot_loads=engine.lora.loads if engine.lora else 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--child", nargs="+", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], args.child[1:])))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [str(x) for x in make_adapters(Path(tmp))]
        rows: dict = {}
        for _ in range(args.pairs):
            for config in CONFIGS:
                r = run_child(__file__, [config, *adapters])
                rows.setdefault(config, []).append(r)
                print(f"  {config}: {r['output_tokens_per_s']:.1f} output tok/s ({r['seconds']:.1f} s, {r['dtype']})",
                      flush=True)
    med = {c: statistics.median(r["output_tokens_per_s"] for r in v) for c, v in rows.items()}
    summary = dict(lora4_vs_base=med["lora-4"] / med["base"], lora_idle_vs_base=med["lora-idle"] / med["base"],
                   target=0.8, medians_output_tokens_per_s=med)
    print(json.dumps(summary, indent=1))
    save_json(args.json, summary=summary, runs=rows)
    if args.png:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6, 3.6))
        ax.bar(list(CONFIGS), [med[c] for c in CONFIGS], color=["#999", "#bbb", "#3a7"])
        ax.axhline(0.8 * med["base"], color="#c33", ls="--", lw=1, label="0.8x base (target)")
        ax.set_ylabel("output tok/s")
        ax.legend()
        ax.set_title(f"batch {BATCH}, {ADAPTERS} rank-{RANK} adapters, SmolLM2 on 2 CPU cores")
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
