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
    # DeepSeek: latent attention (no q LoRA), a dense first layer then top-2 of 8 by softmax, two shared experts
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_hidden_layers=3, num_attention_heads=4, intermediate_size=96, moe_intermediate_size=32, kv_lora_rank=32,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8,
        num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=2)),
    # V2's group-limited routing (the 2 of 4 groups with the best expert) and a routed-sum scale, q LoRA
    "deepseek_v2_groups": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_attention_heads=4, intermediate_size=96, moe_intermediate_size=32, kv_lora_rank=32, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5, n_shared_experts=1)),
    # V3: q LoRA, sigmoid scores with a selection bias among the 2 of 4 groups whose two best experts lead,
    # renormalised and scaled, YaRN with mscale in the softmax scale
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_hidden_layers=3, num_attention_heads=4, intermediate_size=96, moe_intermediate_size=32, kv_lora_rank=32,
        q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8,
        num_experts_per_tok=2, first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, n_shared_experts=1,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "rope_theta": 10000.0})),
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
    model, config, state = random_model(cfg_cls, model_cls, norms_near_one=True, **(COMMON | extra))
    if kind == "deepseek_v3":  # a selection bias that changes the choice (the buffer starts at zero)
        import torch

        gen = torch.Generator().manual_seed(1)
        for layer in model.model.layers[1:]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(torch.randn(bias.shape, generator=gen) * 0.2)
        state = {k: v.numpy() for k, v in model.state_dict().items()}
    return model, config, fused_layout(kind, state)


def save_moe_model(kind: str, directory) -> transformers.PreTrainedModel:
    """Save one tiny MoE model as an HF directory (safetensors, per-expert
    layout as transformers writes it); returns the model."""
    model, _, _ = make_moe_model(kind)
    model.save_pretrained(directory)
    return model
