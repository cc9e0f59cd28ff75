"""Pooling models as graphs: embedding models (an encoder or a decoder, then `pool`)
and sequence classifiers (`pool`, then a `classifier` head), output ``pooled``.

The pooling method comes from the checkpoint's sentence-transformers files
(``config["infer_pooling"]``, set by the loader from ``modules.json``), else
vLLM's defaults: the CLS row for an encoder, the last token for a decoder.
Decoders are the Llama family's builder with the head replaced; their bare
checkpoints (``Qwen3Model``, saved without the ``model.`` prefix) are read by
`align_sources`.
"""

from __future__ import annotations

from typing import Iterable

from ..graph import Graph
from .bert import ENCODER_ARCHITECTURES, build_encoder
from .config import normalize_config
from .llama import ARCHITECTURES as DECODER_ARCHITECTURES, build_decoder, dense_mlp

# Bare decoders (what sentence-transformers saves) and decoder classifiers, by the causal LM they share layers with.
DECODER_BACKBONES = {f"{name}Model": f"{name}ForCausalLM" for name in ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma2",
                                                                       "Gemma3", "Phi3", "Granite", "Olmo2", "Glm4")}
DECODER_CLASSIFIERS = {f"{name}ForSequenceClassification": f"{name}ForCausalLM"
                       for name in ("Llama", "Mistral", "Qwen2", "Qwen3")}
POOLING_ARCHITECTURES = (*ENCODER_ARCHITECTURES, *DECODER_BACKBONES, *DECODER_CLASSIFIERS)


def is_classifier(arch: str) -> bool:
    return arch.endswith("ForSequenceClassification")


def default_method(arch: str) -> str:
    return "cls" if arch in ENCODER_ARCHITECTURES else "last"


def build_pooling(config: dict) -> Graph:
    """The pooling graph of any architecture here (a causal LM served with ``--runner pooling`` too)."""
    arch = (config.get("architectures") or [""])[0]
    method = (config.get("infer_pooling") or {}).get("method") or default_method(arch)
    if arch in ENCODER_ARCHITECTURES:
        g, cfg = build_encoder(config)
        x = "hidden"
    elif arch in DECODER_BACKBONES or arch in DECODER_CLASSIFIERS or arch in DECODER_ARCHITECTURES:
        causal = DECODER_BACKBONES.get(arch) or DECODER_CLASSIFIERS.get(arch) or arch
        cfg = normalize_config({**config, "architectures": [causal]})
        g = build_decoder(cfg, dense_mlp)
        head = next(i for i, n in enumerate(g.nodes) if n.op == "lm_head")
        del g.nodes[head:]  # the vocabulary head and its scaling: a pooling model has none
        g.params.pop("lm_head", None)
        g.architecture = arch
        x = "normed"
    else:
        raise ValueError(f"no pooling form of {arch!r} (pooling architectures: {', '.join(POOLING_ARCHITECTURES)})")
    if not is_classifier(arch):
        g.add("pool", "pool", [x], ["pooled"], method=method)
        return g
    g.add("pool", "pool", [x], ["pooled_hidden"], method="cls" if arch in ENCODER_ARCHITECTURES else "last")
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
    h = cfg.hidden_size
    if arch == "BertForSequenceClassification":  # BERT's pooler (dense + tanh on CLS), then the classifier
        params = {"dense": g.param("head.dense", (h, h), "bert.pooler.dense.weight"),
                  "dense_bias": g.param("head.dense_bias", (h,), "bert.pooler.dense.bias"),
                  "out_proj": g.param("head.out_proj", (labels, h), "classifier.weight"),
                  "out_bias": g.param("head.out_bias", (labels,), "classifier.bias")}
    elif arch == "XLMRobertaForSequenceClassification":
        params = {"dense": g.param("head.dense", (h, h), "classifier.dense.weight"),
                  "dense_bias": g.param("head.dense_bias", (h,), "classifier.dense.bias"),
                  "out_proj": g.param("head.out_proj", (labels, h), "classifier.out_proj.weight"),
                  "out_bias": g.param("head.out_bias", (labels,), "classifier.out_proj.bias")}
    else:  # a decoder's score head on the last token
        params = {"out_proj": g.param("head.out_proj", (labels, h), "score.weight")}
    g.add("classifier", "classifier", ["pooled_hidden"], ["pooled"], params, act="tanh")
    return g


# Where checkpoints keep a model's tensors, besides the names a builder gives.
_PREFIXES = ("model.", "bert.", "roberta.")


def align_sources(graph: Graph, names: Iterable[str]) -> None:
    """Point each parameter at the checkpoint's own name for its tensors: a bare
    encoder or decoder saved without its class's prefix (``model.``, ``bert.``)
    or with one the builder did not give."""
    have = set(names)
    for p in graph.params.values():
        fixed = []
        for s in p.sources:
            if s not in have:
                bare = next((s[len(x):] for x in _PREFIXES if s.startswith(x)), s)
                s = next((c for c in (bare, *(x + bare for x in _PREFIXES)) if c in have), s)
            fixed.append(s)
        p.sources = tuple(fixed)
