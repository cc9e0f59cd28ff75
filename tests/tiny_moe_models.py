"""Tiny random MoE models from transformers configs: the oracle for the MoE tests."""

from __future__ import annotations

import numpy as np
import transformers

from tiny_models import random_model

COMMON = dict(num_hidden_layers=2, vocab_size=211, max_position_embeddings=256, hidden_size=64)

MOE_MODELS = {
    # renormalised top-2 of 4, GQA 2:1, a sliding window shorter than the prompts
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                                            intermediate_size=48, num_local_experts=4,
                                                            num_experts_per_tok=2, sliding_window=7)),
    # top-4 of 8 as the softmax gives them, a gated shared expert, and a dense middle layer
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_hidden_layers=3, num_attention_heads=2,
                                                                num_key_value_heads=2, intermediate_size=96,
                                                                moe_intermediate_size=32, num_experts=8,
                                                                num_experts_per_tok=4, norm_topk_prob=False,
                                                                shared_expert_intermediate_size=48,
                                                                mlp_only_layers=[1])),
    # q/k norm, head_dim set apart, MQA, norm_topk_prob over top-2 of 16
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1,
                                                                head_dim=32, intermediate_size=96,
                                                                moe_intermediate_size=32, num_experts=16,
                                                                num_experts_per_tok=2, norm_topk_prob=True)),
    # router and expert biases, clamped SwiGLU (a limit low enough to bite), attention sinks and biases,
    # a windowed layer (window < prompt) then a full one, YaRN with the fractional correction range
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                                          intermediate_size=48, num_local_experts=4,
                                                          num_experts_per_tok=2, sliding_window=6, swiglu_limit=0.6,
                                                          rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                           "beta_fast": 32.0, "beta_slow": 1.0,
                                                                           "truncate": False, "rope_theta": 150000.0,
                                                                           "original_max_position_embeddings": 64})),
}


def fused_layout(kind: str, state: dict) -> dict:
    """A state dict in the layout infer's graph reads (transformers 5's fused experts:
    gate_up [E, 2I, H] gate rows then up rows, down [E, H, I]). gpt-oss's module keeps
    gate_up as [E, H, 2I] with gate and up columns interleaved and down as [E, I, H]."""
    if kind != "gpt_oss":
        return state
    out = dict(state)
    for name, w in state.items():
        if name.endswith("experts.gate_up_proj"):
            out[name] = np.concatenate([w[:, :, 0::2], w[:, :, 1::2]], axis=2).transpose(0, 2, 1).copy()
        elif name.endswith("experts.gate_up_proj_bias"):
            out[name] = np.concatenate([w[:, 0::2], w[:, 1::2]], axis=1)
        elif name.endswith("experts.down_proj"):
            out[name] = w.transpose(0, 2, 1).copy()
    return out


def make_moe_model(kind: str):
    """(transformers model, config dict, state dict as NumPy in the fused layout) of one tiny MoE model."""
    cfg_cls, model_cls, extra = MOE_MODELS[kind]
    model, config, state = random_model(cfg_cls, model_cls, **(COMMON | extra))
    return model, config, fused_layout(kind, state)


def save_moe_model(kind: str, directory) -> transformers.PreTrainedModel:
    """Save one tiny MoE model as an HF directory (safetensors, per-expert
    layout as transformers writes it); returns the model."""
    model, _, _ = make_moe_model(kind)
    model.save_pretrained(directory)
    return model
