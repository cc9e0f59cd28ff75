"""Tiny random transformers models (the oracle) and paged-batch helpers shared by tests."""

from __future__ import annotations

import numpy as np
import torch
import transformers

from infer.primitives import AttentionMetadata

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

MODELS = {
    # odd head count, GQA 3:1, head_dim 64, llama3 rope scaling
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                                                       rope_parameters=LLAMA3_ROPE)),
    # head_dim 128, sliding window smaller than the prompt
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                                                            sliding_window=7)),
    # qkv bias, tied embeddings, MHA
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                                                      tie_word_embeddings=True)),
    # q/k norm, head_dim set apart from hidden/heads, GQA 5:1
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(hidden_size=96, num_attention_heads=5, num_key_value_heads=1,
                                                      head_dim=64)),
}


def make_model(kind: str):
    cfg_cls, model_cls, extra = MODELS[kind]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(intermediate_size=160, num_hidden_layers=2, vocab_size=211,
                                         max_position_embeddings=256, **extra)
    model = getattr(transformers, model_cls)(cfg).eval()
    for p in model.parameters():  # larger weights than the init, so errors are not hidden by tiny logits
        p.data.normal_(0, 0.08)
    config = cfg.to_dict()
    config["architectures"] = [model_cls]
    return model, config, {k: v.numpy() for k, v in model.state_dict().items()}


def meta_for(chunks, block_size, tables):
    """Metadata for requests that each add `q` tokens to `ctx` cached ones."""
    qsl = np.concatenate([[0], np.cumsum([q for _, q in chunks])]).astype(np.int32)
    seq_lens = np.array([c + q for c, q in chunks], np.int32)
    slots = [tables[b][p // block_size] * block_size + p % block_size
             for b, (c, q) in enumerate(chunks) for p in range(c, c + q)]
    width = max(len(t) for t in tables)
    table = np.array([list(t) + [0] * (width - len(t)) for t in tables], np.int32)
    return AttentionMetadata(qsl, seq_lens, table, np.array(slots, np.int64), max(q for _, q in chunks),
                             int(seq_lens.max()), block_size)
