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
    # sandwich norms with 1 + w, embeddings scaled by sqrt(hidden), a sliding layer (window < prompt)
    # then a global one, query_pre_attn_scalar, attention and final-logit soft-caps low enough to bite
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                                         head_dim=32, query_pre_attn_scalar=24, sliding_window=6,
                                                         attn_logit_softcapping=1.5, final_logit_softcapping=2.0)),
    # per-head q/k norms with 1 + w, local layers with their own rope base, linear scaling on the global
    # one, MQA
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=5, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # fused qkv and gate_up checkpoints, partial rotary (24 of 32 dims), LongRoPE short factors with
    # the attention factor of a 4x context
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.75,
        max_position_embeddings=1024, original_max_position_embeddings=256, sliding_window=None,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0 + 0.1 * i for i in range(12)],
                         "long_factor": [2.0 + 0.5 * i for i in range(12)]})),
    # embedding, residual, attention and logit multipliers, tied embeddings
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=3.0,
        residual_multiplier=0.5, attention_multiplier=0.05, logits_scaling=2.5, tie_word_embeddings=True)),
    # norms after attention and MLP only, q/k norms over the whole projection
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)),
    # every second layer without rope
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(hidden_size=128, num_attention_heads=4,
                                                            num_key_value_heads=2, no_rope_layer_interval=2)),
    # sandwich norms, fused gate_up, q/k/v biases, half the head dims rotated GPT-J style
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                                   head_dim=32, partial_rotary_factor=0.5, attention_bias=True)),
}


def random_model(cfg_cls: str, model_cls: str, norms_near_one: bool = False, **config):
    """(transformers model, config dict, state dict as NumPy) of a random model built from a config.

    ``norms_near_one``: norm weights 1 + N(0, 0.08) instead of N(0, 0.08), whose small
    q and k leave attention near uniform, so that a wrong softmax scale or rope hides."""
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**config)
    model = getattr(transformers, model_cls)(cfg).eval()
    for name, p in model.named_parameters():  # larger weights than the init, so errors are not hidden by tiny logits
        p.data.normal_(0, 0.08)
        if norms_near_one and "norm" in name:
            p.data.add_(1.0)
    config = cfg.to_dict()
    config["architectures"] = [model_cls]
    return model, config, {k: v.numpy() for k, v in model.state_dict().items()}


def make_model(kind: str):
    cfg_cls, model_cls, extra = MODELS[kind]
    return random_model(cfg_cls, model_cls, **{**dict(intermediate_size=160, num_hidden_layers=2, vocab_size=211, pad_token_id=0,
                                                      max_position_embeddings=256), **extra})


def assert_logits_match_through_chunks(model, runner, backend, vocab_size: int) -> None:
    """Two steps of a paged batch through `runner` give the transformers model's logits (atol 1e-4):
    request 0 prefills 17 tokens (crossing a block) while request 1 prefills all 5, then request 0
    prefills its last 4 while request 1 decodes one token."""
    bs = 16
    runner.allocate_kv_caches(num_blocks=12, block_size=bs)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, vocab_size, n) for n in (21, 5)]
    tables = [[7, 2], [4]]
    nxt = int(rng.integers(0, vocab_size))
    steps = [([(0, 17), (0, 5)], np.concatenate([prompts[0][:17], prompts[1]])),
             ([(17, 4), (5, 1)], np.concatenate([prompts[0][17:], [nxt]]))]
    got = []
    for chunks, ids in steps:
        positions = np.concatenate([np.arange(c, c + q) for c, q in chunks])
        logits = runner.forward(backend.asarray(ids), backend.asarray(positions), backend.asarray(np.arange(len(ids))),
                                runner.prepare_metadata(meta_for(chunks, bs, tables))).logits
        got.append(backend.to_numpy(logits))
    with torch.no_grad():
        full0 = model(torch.from_numpy(prompts[0])[None]).logits[0].numpy()
        full1 = model(torch.from_numpy(np.append(prompts[1], nxt))[None]).logits[0].numpy()
    np.testing.assert_allclose(got[0][:17], full0[:17], atol=1e-4)
    np.testing.assert_allclose(got[0][17:], full1[:5], atol=1e-4)
    np.testing.assert_allclose(got[1][:4], full0[17:], atol=1e-4)
    np.testing.assert_allclose(got[1][4], full1[5], atol=1e-4)


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


def add_gguf_shape(writer, config, head_dim: int, kv_heads: int | None = None, value_dim: int | None = None) -> None:
    """The size metadata every llama.cpp conversion writes (layers, widths, heads, norm eps);
    `kv_heads` and `value_dim` where they are not the config's KV heads and `head_dim` (MLA)."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads if kv_heads is None else kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim if value_dim is None else value_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
