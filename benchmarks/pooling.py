"""Embedding and rerank throughput against sentence-transformers on the same machine.

    python benchmarks/pooling.py --json out.json [--sentences 2000] [--models bert-base,qwen3-0.6b-d4]

Models (random weights, sentence-transformers directories made by tests/tiny_pooling.py):
``bert-base`` (BERT-base's shape: 768 wide, 12 layers, 12 heads, 3072 FFN; mean pooling,
normalised), ``qwen3-0.6b-d4`` (Qwen3-0.6B's layer shape, 1024 wide, 16 heads over 8 KV
heads of 128, 3072 FFN, at 4 of its 28 layers; last-token pooling, normalised) and the
cross-encoder ``bert-base-rerank`` (BERT-base's shape, one label). Inputs: `--sentences`
sentences of 6 to 254 words (8 to 256 tokens with the tokenizer's specials); rerank pairs one
8-word query with each sentence.

Rows, each in a fresh process (torch imported first, the same thread count): sentence-
transformers' ``encode`` / ``CrossEncoder.predict`` at its best batch size (each of
`--batch-sizes` timed on the first 100 inputs, the best then on all), and infer's
``LLM.embed`` / ``LLM.score`` with default flags, and with ``--dtype float32`` (the
checkpoints' dtype). Targets (issue 40): default-flag infer >= 1.5x sentence-transformers.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch  # noqa: F401  (first, as a user's script does)
from fresh import run_child, save_json

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

PEERS = ("sentence-transformers", "infer", "infer-float32")
MODELS = {
    "bert-base": ("embed", "bert", "mean", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                                intermediate_size=3072, max_position_embeddings=512)),
    "qwen3-0.6b-d4": ("embed", "qwen3", "lasttoken", dict(hidden_size=1024, num_hidden_layers=4,
                                                          num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                                          intermediate_size=3072, max_position_embeddings=512)),
    "bert-base-rerank": ("rerank", "bert", None, dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                                      intermediate_size=3072, max_position_embeddings=512)),
}


def inputs(kind: str, n: int) -> list:
    from tiny_pooling import sentences

    texts = sentences(n, seed=7, min_words=6, max_words=254)
    if kind == "embed":
        return texts
    query = " ".join(sentences(1, seed=8, min_words=8, max_words=8)[0].split()[:8])
    return [(query, t) for t in texts]


def child(name: str, path: str, peer: str, n: int, batch_sizes: list[int]) -> dict:
    kind = MODELS[name][0]
    data = inputs(kind, n)
    if peer == "sentence-transformers":
        from sentence_transformers import CrossEncoder, SentenceTransformer

        model = SentenceTransformer(path, device="cpu") if kind == "embed" else CrossEncoder(path, device="cpu")
        run = (lambda xs, bs: model.encode(xs, batch_size=bs)) if kind == "embed" else (
            lambda xs, bs: model.predict(xs, batch_size=bs))
        run(data[:8], 8)  # warm-up
        trial = {}
        for bs in batch_sizes:
            start = time.perf_counter()
            run(data[:100], bs)
            trial[bs] = time.perf_counter() - start
        best = min(trial, key=trial.get)
        start = time.perf_counter()
        run(data, best)
        return {"seconds": time.perf_counter() - start, "batch_size": best, "trials": trial,
                "threads": torch.get_num_threads()}
    from infer import LLM

    kw = {} if peer == "infer" else {"dtype": "float32"}
    llm = LLM(path, backend="torch", **kw)
    work = (lambda xs: llm.embed(xs, use_tqdm=False)) if kind == "embed" else (
        lambda xs: llm.score(xs[0][0], [d for _, d in xs], use_tqdm=False))
    work(data[:8])  # warm-up
    start = time.perf_counter()
    outs = work(data)
    seconds = time.perf_counter() - start
    assert not any(o.error for o in outs), next(o.error for o in outs if o.error)
    return {"seconds": seconds, "dtype": llm.engine.dtype, "threads": torch.get_num_threads(),
            "tokens": sum(len(o.prompt_token_ids) for o in outs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=5, metavar=("MODEL", "PATH", "PEER", "N", "BATCHES"))
    ap.add_argument("--sentences", type=int, default=2000)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batch-sizes", default="1,4,8,16,32")
    ap.add_argument("--peers", default=",".join(PEERS), help="which rows to run")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.child:
        import json

        name, path, peer, n, batches = a.child
        print(json.dumps(child(name, path, peer, int(n), [int(b) for b in batches.split(",")])))
        return
    from tiny_pooling import save_cross_encoder, save_embedding_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models.split(","):
            kind, arch, pooling, cfg = MODELS[name]
            path = (save_embedding_model(Path(tmp) / name, arch, pooling, True, **cfg) if kind == "embed"
                    else save_cross_encoder(Path(tmp) / name, arch, **cfg))
            results = {}
            for peer in a.peers.split(","):
                results[peer] = run_child(__file__, [name, path, peer, str(a.sentences), a.batch_sizes])
                r = results[peer]
                print(f"{name:18s} {peer:22s} {a.sentences / r['seconds']:8.2f} inputs/s "
                      f"({r['seconds']:.1f} s{', batch ' + str(r['batch_size']) if 'batch_size' in r else ''}"
                      f"{', ' + r['dtype'] if 'dtype' in r else ''})", flush=True)
            base = results.get("sentence-transformers", {}).get("seconds")
            for peer in [p for p in results if p != "sentence-transformers" and base]:
                print(f"{name:18s} {peer} / sentence-transformers: {base / results[peer]['seconds']:.2f}x", flush=True)
            rows.append({"model": name, "kind": kind, "inputs": a.sentences, **results})
    save_json(a.json, rows=rows, target="infer (default flags) >= 1.5x sentence-transformers")


if __name__ == "__main__":
    main()
