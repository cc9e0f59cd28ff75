"""Decode speed of each architecture against Llama of the same size, per FLOP (torch backend).

    python benchmarks/architectures.py [--rounds 3] [--batches 1,8] [--json out.json]
    python benchmarks/architectures.py --only Llama,DeepseekV3 --rounds 1

One random model per architecture infer serves, all of one size: hidden 512,
8 layers, 8 heads of 64 dims (4 KV heads), MLP width 1536, vocabulary 8192.
The MoE models route top-2 of 8 experts of width 768 (DeepSeek: 512, plus
one shared expert of 512, after one dense first layer), so each token's
active MLP work matches Llama's; DeepSeek's latent attention has
``kv_lora_rank`` 128, rope 32, no-rope 64, value 64 (V3 with a
``q_lora_rank`` of 256). Windowed families keep their layer patterns
(Gemma 2 and gpt-oss alternate, Gemma 3 five windowed to one full), with a
64-token window for the Gemmas and gpt-oss's own 128, so windows bite
within the run. Each is saved by transformers as a bfloat16 safetensors
directory (``--dtype float32`` for float32), which the engine serves in
bfloat16 on a CPU with AVX512-BF16 and in float32 elsewhere (its auto dtype).

Each (architecture, batch) row runs in a fresh interpreter that imports torch
first, builds ``infer.LLM(dir, backend="torch")`` with default flags
otherwise, warms up with one generate of the same shape, then times greedy
decode of `--new-tokens` tokens (``ignore_eos``) after a 16-token prompt, for
1 and 8 prompts at once. Decode tok/s counts the tokens after each request's
first over the time from the last first token to the end (the prefill step
excluded). A timing during which other processes used over 10% of the CPUs
is retaken (up to 3 times, the least disturbed kept; its share is the
``load %`` column). Rounds run every row once, in a rotated order, and
figures are medians over rounds; a row's spread is (max - min) / median of
its tok/s, and rows with a spread over 15% are named as noisy.

FLOPs per decoded token, analytically: 2 x the matmul weights a token
multiplies (the checkpoint's 2-D weights and lm_head; expert tensors counted
top_k / E of their size; biases, norms and the embedding lookup not
counted), plus attention over the mean context c of the timed steps (each
windowed layer's c capped at its window): 4 x heads x head_dim x c a layer,
and for latent attention, which infer runs absorbed in decode (queries taken
into the latent space by W_UK, the output out by W_UV: their FLOPs are 2 x
``kv_b_proj``'s weights, already counted), 2 x heads x (2 kv_lora_rank +
rope) x c. Per-FLOP slowdown = Llama's GFLOP/s / the architecture's, at the
same batch; the issue's target is <= 1.3x.

Decode on a CPU streams weights, so beside the FLOPs each row shows the
matmul weights a step reads (``wMB/step``, `weight_bytes_per_step`) and the
rate it read them at (``wGB/s``; ``per byte``: Llama's rate / the row's): a
batch of 8 touches most experts of an MoE layer, several times the bytes of
Llama's MLP for the same FLOPs.
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
from fresh import run_child, save_json

PROMPT, TARGET, NOISY_SPREAD = 16, 1.3, 0.15
BUSY, ATTEMPTS = 0.1, 3  # a timing during which other processes used over BUSY of the CPUs is retaken
COMMON = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
              intermediate_size=1536, vocab_size=8192, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
MOE = dict(intermediate_size=768, num_local_experts=8, num_experts_per_tok=2)
MLA = dict(kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=8,
           num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=512, first_k_dense_replace=1)

# name -> (config class, model class, what the family sets on top of COMMON)
ARCHS = {
    "Llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "Gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(query_pre_attn_scalar=64, sliding_window=64)),
    "Gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(query_pre_attn_scalar=64, sliding_window=64)),
    "Phi3": ("Phi3Config", "Phi3ForCausalLM", dict(original_max_position_embeddings=4096)),
    "Granite": ("GraniteConfig", "GraniteForCausalLM", dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                                            attention_multiplier=0.015625, logits_scaling=8.0)),
    "Olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "SmolLM3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layer_interval=4)),
    "Glm4": ("Glm4Config", "Glm4ForCausalLM", dict(partial_rotary_factor=0.5, attention_bias=True)),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "Mixtral": ("MixtralConfig", "MixtralForCausalLM", MOE),
    "Qwen3Moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(moe_intermediate_size=768, num_experts=8,
                                                               num_experts_per_tok=2, norm_topk_prob=True)),
    "GptOss": ("GptOssConfig", "GptOssForCausalLM", MOE | dict(sliding_window=128)),
    "DeepseekV2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", MLA | dict(q_lora_rank=None)),
    "DeepseekV3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", MLA | dict(
        q_lora_rank=256, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
}


def _experts(config: dict) -> tuple[int, int]:
    """(routed experts, top-k), (1, 1) for a dense model."""
    e = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts")
    return (int(e), int(config["num_experts_per_tok"])) if e else (1, 1)


def _contexts(new_tokens: int) -> list[int]:
    """Each timed step's context: the step making token i + 1 attends over the prompt and i tokens."""
    return [PROMPT + i for i in range(1, new_tokens)]


def flops_per_token(config: dict, state: dict, new_tokens: int) -> dict:
    """GFLOP per decoded token: the matmuls (see the module docstring) and attention at the mean context."""
    e, k = _experts(config)
    h, vocab = config["hidden_size"], config["vocab_size"]
    dense, experts = vocab * h, 0  # lm_head, tied or not
    for name, w in state.items():
        if w.dim() < 2 or name.endswith("bias") or "embed_tokens" in name or name.startswith("lm_head"):
            continue
        if ".experts." in name and w.dim() == 3:
            experts += w.numel()
        else:
            dense += w.numel()
    matmul = dense + experts * k // e
    ctx = _contexts(new_tokens)
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    kinds = config.get("layer_types") or ["full_attention"] * layers
    window = config.get("sliding_window")
    if "kv_lora_rank" in config:
        per_key = 2 * heads * (2 * config["kv_lora_rank"] + config["qk_rope_head_dim"])
    else:
        per_key = 4 * heads * (config.get("head_dim") or h // heads)
    attention = sum(per_key * statistics.mean(min(c, window) if kind == "sliding_attention" and window else c
                                              for c in ctx) for kind in kinds)
    return dict(gflop=(2 * matmul + attention) / 1e9, matmul_params=matmul, attention_gflop=attention / 1e9,
                dense_params=dense, expert_params=experts, experts=e, top_k=k)


def weight_bytes_per_step(f: dict, batch: int, itemsize: int) -> float:
    """The matmul weights a decode step of `batch` tokens reads: every dense one, and the experts
    routing touches (E (1 - (1 - k/E)^batch) of them a layer, routing uniform): a batch of MoE
    tokens reads more weights per token than a dense model of the same FLOPs."""
    touched = f["experts"] * (1 - (1 - f["top_k"] / f["experts"]) ** batch)
    return itemsize * (f["dense_params"] + f["expert_params"] * touched / f["experts"])


def build_models(root: Path, names: list[str], dtype: str, new_tokens: int) -> dict[str, dict]:
    """Save each architecture's random model under root/<name>; its FLOP figures by name."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    out = {}
    for name in names:
        cfg_cls, model_cls, extra = ARCHS[name]
        torch.manual_seed(0)
        cfg = getattr(transformers, cfg_cls)(**(COMMON | extra), torch_dtype=dtype)
        model = getattr(transformers, model_cls)(cfg).to(getattr(torch, dtype)).eval()
        model.save_pretrained(root / name)
        config = cfg.to_dict()
        out[name] = flops_per_token(config, model.state_dict(), new_tokens)
        del model
    return out


def _child(path: str, batch: int, new_tokens: int, wait_quiet: float) -> dict:
    import numpy as np

    import infer
    from infer.bench.machine import CpuLoad

    llm = infer.LLM(path, backend="torch", skip_tokenizer_init=True)
    vocab = llm.engine.vocab_size
    rng = np.random.default_rng(batch)
    params = infer.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    def prompts():  # fresh ids each call: no prefix-cache hits
        return [{"prompt_token_ids": rng.integers(0, vocab, PROMPT).tolist()} for _ in range(batch)]

    llm.generate(prompts(), params, use_tqdm=False)  # warm-up: the same shapes
    timings = []
    for _ in range(ATTEMPTS):
        # With a torch thread per core, another process on one core stalls every OpenMP barrier
        # (decode slows many times over): such a timing is retaken, and the least disturbed kept.
        CpuLoad().wait_quiet(wait_quiet)
        load = CpuLoad()
        outs = llm.generate(prompts(), params, use_tqdm=False)
        end = time.time()
        got = [len(o.outputs[0].token_ids) for o in outs]
        if got != [new_tokens] * batch:
            raise RuntimeError(f"{path}: expected {new_tokens} tokens per request, got {got} "
                               f"({[o.outputs[0].finish_reason for o in outs]})")
        first = max(o.metrics["first_token_time"] for o in outs)
        timings.append((load.other() or 0.0, batch * (new_tokens - 1) / (end - first)))
        if timings[-1][0] < BUSY:
            break
    other, tok_s = min(timings)
    return dict(tok_s=tok_s, dtype=str(llm.engine.dtype), threads=torch.get_num_threads(), other_load=other,
                attempts=len(timings))


def _rows(names, batches, figures, runs) -> list[dict]:
    rows = []
    for batch in batches:
        for name in names:
            tok = [r["tok_s"] for r in runs[(name, batch)]]
            med = statistics.median(tok)
            loads = [r["other_load"] for r in runs[(name, batch)] if r["other_load"] is not None]
            f = figures[name]
            itemsize = 2 if runs[(name, batch)][0]["dtype"] in ("bfloat16", "float16") else 4
            step_mb = weight_bytes_per_step(f, batch, itemsize) / 1e6
            rows.append(dict(arch=ARCHS[name][1], name=name, batch=batch, tok_s=med, tok_s_runs=tok,
                             spread=(max(tok) - min(tok)) / med, gflop_per_token=f["gflop"],
                             attention_gflop_per_token=f["attention_gflop"], matmul_params=f["matmul_params"],
                             gflop_s=med * f["gflop"], weight_mb_per_step=step_mb,
                             weight_gb_s=step_mb * med / batch / 1e3,
                             other_load=statistics.median(loads) if loads else None))
    for r in rows:
        base = next(b for b in rows if b["name"] == "Llama" and b["batch"] == r["batch"])
        r["slowdown_per_flop"] = base["gflop_s"] / r["gflop_s"]
        r["slowdown_per_weight_byte"] = base["weight_gb_s"] / r["weight_gb_s"]
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'architecture':24}{'batch':>6}{'tok/s':>9}{'spread':>8}{'GFLOP/tok':>11}{'GFLOP/s':>9}"
             f"{'vs Llama':>10}{'wMB/step':>10}{'wGB/s':>7}{'per byte':>10}{'load %':>8}"]
    for r in rows:
        load = "-" if r["other_load"] is None else f"{100 * r['other_load']:.0f}"
        flag = "  > 1.3x" if r["slowdown_per_flop"] > TARGET else ""
        lines.append(f"{r['arch']:24}{r['batch']:>6}{r['tok_s']:9.1f}{100 * r['spread']:7.0f}%"
                     f"{r['gflop_per_token']:11.4f}{r['gflop_s']:9.2f}{r['slowdown_per_flop']:9.2f}x"
                     f"{r['weight_mb_per_step']:10.1f}{r['weight_gb_s']:7.1f}{r['slowdown_per_weight_byte']:9.2f}x"
                     f"{load:>8}{flag}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the checkpoints' dtype")
    ap.add_argument("--only", type=lambda s: s.split(","), default=None, help="architectures (Llama always runs)")
    ap.add_argument("--wait-quiet", type=float, default=2.0, help="seconds to wait for idle CPUs before each timing")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs=4, metavar=("PATH", "BATCH", "NEW", "WAIT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], int(args.child[1]), int(args.child[2]), float(args.child[3]))))
        return
    names = list(ARCHS) if not args.only else ["Llama"] + [n for n in args.only if n != "Llama"]
    unknown = set(names) - set(ARCHS)
    if unknown:
        sys.exit(f"unknown architectures {sorted(unknown)}; known: {', '.join(ARCHS)}")
    cells = [(n, b) for n in names for b in args.batches]
    runs: dict = {c: [] for c in cells}
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        figures = build_models(Path(tmp), names, args.dtype, args.new_tokens)
        for rnd in range(args.rounds):
            shift = rnd * len(cells) // max(args.rounds, 1)  # rotate, so no row always runs first
            for name, batch in cells[shift:] + cells[:shift]:
                runs[(name, batch)].append(run_child(__file__, [str(Path(tmp) / name), str(batch),
                                                                str(args.new_tokens), str(args.wait_quiet)]))
            print(f"round {rnd + 1}/{args.rounds} done ({time.time() - started:.0f} s)", file=sys.stderr)
    rows = _rows(names, args.batches, figures, runs)
    sample = runs[cells[0]][0]
    print(f"decode on the torch backend ({args.dtype} checkpoints served in {sample['dtype']}, "
          f"{sample['threads']} torch threads), "
          f"{PROMPT}-token prompts, {args.new_tokens} new tokens, medians of {args.rounds} rounds")
    print(format_table(rows))
    over = [f"{r['name']}@{r['batch']}" for r in rows if r["slowdown_per_flop"] > TARGET]
    print(f"target: no architecture more than {TARGET}x slower per FLOP than Llama: "
          f"{'met' if not over else 'NOT met (' + ', '.join(over) + ')'}")
    noisy = [f"{r['name']}@{r['batch']}" for r in rows if r["spread"] > NOISY_SPREAD or (r["other_load"] or 0) > BUSY]
    if noisy:
        print(f"noisy: {len(noisy)} rows had a spread over {100 * NOISY_SPREAD:.0f}% or other processes using "
              f"over {100 * BUSY:.0f}% of the CPUs while they ran ({', '.join(noisy)}): compare such rows with care")
    save_json(args.json, prompt_tokens=PROMPT, new_tokens=args.new_tokens, dtype=args.dtype, rounds=args.rounds,
              shape=COMMON, rows=rows, target=TARGET, over_target=over)


if __name__ == "__main__":
    main()
