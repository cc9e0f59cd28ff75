"""Speculative decoding with n-gram drafts on SmolLM2 against plain decoding.

    python benchmarks/speculative.py --json out.json --png out.png
    python benchmarks/speculative.py --dtype bfloat16 --rounds 5

Two workloads, greedy chat requests: ``single`` runs repetitive prompts one at
a time (rewrite a paragraph with one word changed, rename a variable in code,
repeat a text, answer from a quoted text), and ``batch32`` runs 32 requests at
once, half of those and half open-ended (stories, explanations) that give
n-gram lookup little to find. Each engine runs in its own process (torch
imported first, default flags apart from --speculative-config), warms up with
two requests, then runs the workload `--rounds` times; `--pairs` pairs of
processes alternate plain and n-gram, and each figure is the median of the
processes' medians (this 2-core machine drifts by +-20% between processes).

Reported: output tok/s end to end (prefill included) and decode tok/s (the
tokens after each request's first over the time after it: what speculation
changes; prefill is the same work either way), TTFT, the acceptance rate
(accepted / drafted tokens), the mean tokens a verifying step gave a request,
and the acceptance at each draft position. Targets: single-stream decode
>= 1.5x, batch32 end to end >= 0.95x.
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

TEXT = ("The city council met on Tuesday to discuss the new park. Members agreed that the park should have a "
        "playground, a small pond, and walking paths lined with oak trees. The budget for the project is two million "
        "dollars, and construction will begin in the spring. Residents can share their ideas at the library until "
        "March.")
CODE = ("def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
        "        subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n    return subtotal + tax\n")
REPETITIVE = [
    f"Rewrite this text, replacing 'park' with 'garden':\n\n{TEXT}",
    f"Rename the variable subtotal to base in this code and show the full code:\n\n{CODE}",
    f"Repeat this text exactly:\n\n{TEXT}",
    f"Read the text and list every place and amount it mentions, quoting the text:\n\n{TEXT}",
]
OPEN = ["Write a short story about a lighthouse keeper.", "Explain how a refrigerator works.",
        "Describe a day at a busy train station.", "Give advice to someone learning to cook.",
        "Write a poem about autumn rain.", "Explain why the sky is blue.",
        "Describe your ideal weekend.", "Tell a story about a lost dog finding its way home."]
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
WORKLOADS = {"single": (1, 128), "batch32": (32, 64)}


def _messages(workload: str) -> list[list[dict]]:
    if workload == "single":
        prompts = REPETITIVE
    else:
        prompts = [REPETITIVE[i % 4] + ("" if i < 4 else f"\n(Version {i}.)") for i in range(16)]
        prompts += [OPEN[i % 8] + ("" if i < 8 else " Keep it brief.") for i in range(16)]
    return [[{"role": "user", "content": p}] for p in prompts]


def _worker(model: str, workload: str, spec: bool, rounds: int, dtype: str) -> dict:
    from infer import LLM, SamplingParams

    batch, max_tokens = WORKLOADS[workload]
    llm = LLM(model, dtype=dtype, speculative_config=NGRAM if spec else None)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    messages = _messages(workload)
    for m in messages[:2]:  # warm: two prefills, so the second makes the dense copies long prompts use
        llm.chat([m], params, use_tqdm=False)
    before = llm.engine.get_stats().spec_decode
    rates, decode_rates, ttfts, outputs = [], [], [], None
    for _ in range(rounds):
        tokens, wall, decode_tokens, decode_wall = 0, 0.0, 0, 0.0
        outs = []
        groups = [[m] for m in messages] if batch == 1 else [messages]
        for group in groups:
            start, start_wall = time.perf_counter(), time.time()
            got = llm.chat(group, params, use_tqdm=False)
            wall += time.perf_counter() - start
            end_wall = time.time()
            tokens += sum(len(o.outputs[0].token_ids) for o in got)
            outs += [o.outputs[0].token_ids for o in got]
            # decode: the tokens after each request's first, over the time after its first
            first = min(o.metrics["first_token_time"] for o in got)
            ttfts += [o.metrics["first_token_time"] - start_wall for o in got]
            decode_tokens += sum(len(o.outputs[0].token_ids) - 1 for o in got)
            decode_wall += end_wall - first
        rates.append(tokens / wall)
        decode_rates.append(decode_tokens / decode_wall)
        outputs = outs
    s = llm.engine.get_stats().spec_decode
    drafts, drafted, accepted = (s.num_drafts - before.num_drafts, s.num_draft_tokens - before.num_draft_tokens,
                                 s.num_accepted_tokens - before.num_accepted_tokens)
    per_pos = [a - (before.accepted_per_position[i] if i < len(before.accepted_per_position) else 0)
               for i, a in enumerate(s.accepted_per_position)]
    return {"tok_s": statistics.median(rates), "rounds": rates, "outputs": outputs,
            "decode_tok_s": statistics.median(decode_rates), "ttft_s": statistics.median(ttfts),
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
            "per_position": [a / drafts for a in per_pos] if drafts else [],
            "draft_steps": drafts, "drafted_tokens": drafted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=2, help="workload passes per process (median)")
    ap.add_argument("--pairs", type=int, default=3, help="plain/ngram process pairs, alternating (median)")
    ap.add_argument("--workload", choices=list(WORKLOADS), nargs="+", default=list(WORKLOADS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        workload, spec = a.worker.split(":")
        print(json.dumps(_worker(a.model, workload, spec == "ngram", a.rounds, a.dtype)))
        return
    result = {"config": {"model": a.model, "dtype": a.dtype, "rounds": a.rounds, "pairs": a.pairs,
                         "speculative_config": NGRAM}}
    for workload in a.workload:
        runs: dict[str, list[dict]] = {"plain": [], "ngram": []}
        for _ in range(a.pairs):  # alternating processes, so drift in the machine hits both alike
            for name in runs:
                cmd = [sys.executable, __file__, "--worker", f"{workload}:{name}", "--model", a.model,
                       "--rounds", str(a.rounds), "--dtype", a.dtype]
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode:
                    sys.exit(f"{workload} {name} failed:\n{res.stderr[-3000:]}")
                runs[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
        plain, ngram = runs["plain"][-1], dict(runs["ngram"][-1])
        for name, row in (("plain", plain), ("ngram", ngram)):
            for key in ("tok_s", "decode_tok_s", "ttft_s"):
                row[key] = statistics.median(r[key] for r in runs[name])
            row["rounds"] = [x for r in runs[name] for x in r["rounds"]]
        same = sum(x == y for x, y in zip(plain.pop("outputs"), ngram.pop("outputs")))
        r = {"plain_tok_s": plain["tok_s"], "ngram_tok_s": ngram["tok_s"], "speedup": ngram["tok_s"] / plain["tok_s"],
             "plain_decode_tok_s": plain["decode_tok_s"], "ngram_decode_tok_s": ngram["decode_tok_s"],
             "decode_speedup": ngram["decode_tok_s"] / plain["decode_tok_s"],
             "plain_ttft_s": plain["ttft_s"], "ngram_ttft_s": ngram["ttft_s"],
             "identical_outputs": f"{same}/{len(_messages(workload))}",
             **{k: ngram[k] for k in ("acceptance_rate", "mean_accepted_length", "per_position", "draft_steps",
                                      "drafted_tokens")},
             "plain_rounds": plain["rounds"], "ngram_rounds": ngram["rounds"]}
        result[workload] = r
        print(f"{workload:8s} plain {r['plain_tok_s']:6.1f} tok/s, ngram {r['ngram_tok_s']:6.1f} tok/s: "
              f"{r['speedup']:.2f}x end to end; decode (after each first token) {r['plain_decode_tok_s']:.1f} -> "
              f"{r['ngram_decode_tok_s']:.1f} tok/s: {r['decode_speedup']:.2f}x; TTFT {1e3 * r['plain_ttft_s']:.0f} / "
              f"{1e3 * r['ngram_ttft_s']:.0f} ms; acceptance {100 * r['acceptance_rate']:.0f}% of {r['drafted_tokens']} drafted, "
              f"{r['mean_accepted_length']:.2f} tokens per verifying step, by position "
              f"{[round(p, 2) for p in r['per_position']]}; identical greedy outputs {r['identical_outputs']} "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [w for w in a.workload]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [result[w]["plain_tok_s"] for w in names], 0.4, label="plain")
        ax.bar([x + 0.2 for x in xs], [result[w]["ngram_tok_s"] for w in names], 0.4, label="ngram k=5")
        ax.set_xticks(list(xs), [f"{w}\n{result[w]['speedup']:.2f}x" for w in names])
        ax.set_ylabel("output tok/s")
        ax.set_title(f"SmolLM2 speculative decoding ({a.dtype})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.png, dpi=120)


if __name__ == "__main__":
    main()
