"""What llama.cpp's converter writes for each architecture, read back as transformers' checkpoint.

Three things differ per architecture: the HF class a `general.architecture`
names, the layer tensors whose GGUF names are not the Llama family's, and the
config that the metadata holds under GGUF keys or that llama.cpp fixes
instead of storing. Some HF tensors are stored as several GGUF ones (expert
stacks split into gate and up, DeepSeek's ``kv_b_proj`` split for MLA's
absorbed form): `joined_tensors` says how to put each back together.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

# GGUF general.architecture -> (HF architecture, model_type)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),  # llama.cpp stores Mistral (and Mixtral) as llama too
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "granite": ("GraniteForCausalLM", "granite"),
    "olmo2": ("Olmo2ForCausalLM", "olmo2"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "smollm3": ("SmolLM3ForCausalLM", "smollm3"),
    "glm4": ("Glm4ForCausalLM", "glm4"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "deepseek2": ("DeepseekV2ForCausalLM", "deepseek_v2"),  # V3 too: its routing tells them apart
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss"),
}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Phi-3 keeps q/k/v in one tensor and gate/up in `ffn_up`, as its HF checkpoint does.
_PHI3_LAYER_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# GLM-4: its fused gate/up in `ffn_up`, and the norms after attention and the MLP under GLM's names.
_GLM4_LAYER_NAMES = {"ffn_up": "mlp.gate_up_proj", "post_attention_norm": "post_self_attn_layernorm",
                     "post_ffw_norm": "post_mlp_layernorm"}
# Gemma's four norms per layer: llama.cpp calls the one before the MLP `ffn_norm` (HF's
# pre_feedforward_layernorm), the one after attention `post_attention_norm`.
_POST_NORM_NAMES = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_GEMMA_LAYER_NAMES = {"ffn_norm": "pre_feedforward_layernorm", **_POST_NORM_NAMES}
# Expert stacks: [E, out, in] as the fused HF tensors are (the graph's names carry no `.weight`).
_EXPERT_NAMES = {"ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj", "ffn_down_exps.weight": "mlp.experts.down_proj"}
_ROUTED_NAMES = {"ffn_gate_inp": "mlp.gate", **_EXPERT_NAMES}  # Mixtral (as llama), Qwen-MoE
_QWEN2MOE_LAYER_NAMES = {**_ROUTED_NAMES, "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                         "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
                         "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
_DEEPSEEK2_LAYER_NAMES = {
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",  # files converted before llama.cpp split it into k_b and v_b
    "ffn_gate_inp": "mlp.gate", "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj", **_EXPERT_NAMES,
}
# gpt-oss: one norm before attention, one (HF's post_attention_layernorm) before the experts.
_GPT_OSS_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm", "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router", "ffn_gate_up_exps.bias": "mlp.experts.gate_up_proj_bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias", **_EXPERT_NAMES,
}
# Per architecture, the layer tensor names that differ from the Llama family's; a key with a
# suffix (`exp_probs_b.bias`) names one tensor whose HF name is given whole.
ARCH_LAYER_NAMES = {"llama": _ROUTED_NAMES, "qwen2moe": _QWEN2MOE_LAYER_NAMES, "qwen3moe": _ROUTED_NAMES,
                    "gemma2": _GEMMA_LAYER_NAMES, "gemma3": _GEMMA_LAYER_NAMES, "olmo2": _POST_NORM_NAMES,
                    "phi3": _PHI3_LAYER_NAMES, "glm4": _GLM4_LAYER_NAMES, "deepseek2": _DEEPSEEK2_LAYER_NAMES,
                    "gpt-oss": _GPT_OSS_LAYER_NAMES}
PERMUTED_QK = {"llama", "granite", "smollm3"}  # converted by llama.cpp's LlamaModel (or a subclass)
# What llama.cpp fixes for an architecture instead of storing it: the period of its
# windowed/full layer pattern (the last layer of each period is full) and the layer count of
# the 27B models, whose attention scale is 1/sqrt(hidden / heads) rather than 1/sqrt(head_dim).
GEMMA = {"gemma2": (2, 46), "gemma3": (6, 62)}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m is None:
        return None
    names = ARCH_LAYER_NAMES.get(arch, {})
    if (whole := names.get(f"{m.group(2)}.{suffix}")) is not None:
        return f"model.layers.{m.group(1)}.{whole}"
    name = names.get(m.group(2)) or _LAYER_NAMES.get(m.group(2))
    return None if name is None else f"model.layers.{m.group(1)}.{name}.{suffix}"


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `LlamaModel.permute`: per head, rows (pairs, 2) -> (2, pairs)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True, slots=True)
class Joined:
    """One HF tensor that the file stores as several: their GGUF names, and how to join them."""

    parts: tuple[str, ...]
    join: Callable[[list[np.ndarray]], np.ndarray]


def stack_rows(parts: list[np.ndarray]) -> np.ndarray:
    """Gate then up rows of every expert: [E, I, H] + [E, I, H] -> [E, 2I, H] (biases [E, I] alike)."""
    return np.concatenate(parts, axis=1)


def _kv_b(parts: list[np.ndarray]) -> np.ndarray:
    """llama.cpp's k_b [heads, rank, nope] (transposed for the absorbed product) and v_b
    [heads, v, rank] back into kv_b_proj: per head its nope rows, then its v rows."""
    k_b, v_b = parts
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])


def joined_tensors(arch: str, names: Collection[str]) -> dict[str, Joined]:
    """HF name -> `Joined` for the tensors of `arch` that the file splits."""
    out: dict[str, Joined] = {}
    for name in names:
        m = re.fullmatch(r"blk\.(\d+)\.ffn_gate_exps\.(weight|bias)", name)
        if m is not None:
            up = f"blk.{m[1]}.ffn_up_exps.{m[2]}"
            target = "mlp.experts.gate_up_proj" + ("_bias" if m[2] == "bias" else "")
            out[f"model.layers.{m[1]}.{target}"] = Joined((name, up), stack_rows)
        m = re.fullmatch(r"blk\.(\d+)\.attn_k_b\.weight", name)
        if m is not None:
            out[f"model.layers.{m[1]}.self_attn.kv_b_proj.weight"] = Joined((name, f"blk.{m[1]}.attn_v_b.weight"), _kv_b)
    return out


Meta = Callable[..., Any]  # (key under `{arch}.`, default) -> the value stored


def routed_config(arch: str, meta: Meta, tensors: Collection[str], cfg: dict[str, Any]) -> dict[str, Any]:
    """Mixtral (a `llama` file with experts), Qwen2-MoE and Qwen3-MoE: the expert counts and
    widths, every layer sparse (llama.cpp's rule: these files hold no dense layers). The
    top-k weights are renormalised as llama.cpp does unless `expert_weights_norm` says
    otherwise: always for Mixtral and Qwen3-MoE, never for Qwen2-MoE."""
    experts = meta("expert_count")
    if not experts:
        return {}
    used = int(meta("expert_used_count"))
    if arch == "llama":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": int(experts),
                "num_experts_per_tok": used}
    out: dict[str, Any] = {
        "num_experts": int(experts), "num_experts_per_tok": used,
        "moe_intermediate_size": int(meta("expert_feed_forward_length")), "decoder_sparse_step": 1,
        "norm_topk_prob": bool(meta("expert_weights_norm", arch == "qwen3moe")), "mlp_only_layers": [],
    }
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = int(meta("expert_shared_feed_forward_length", 0))
        out["qkv_bias"] = "blk.0.attn_q.bias" in tensors
    return out


def deepseek2_config(meta: Meta, tensors: Collection[str], cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek V2/V3 as llama.cpp's converter writes them: MLA's widths as the MQA view it
    computes with (key_length = rank + rope, one KV head) beside the per-head `*_mla` lengths
    (files from before those keys hold the per-head ones in key/value_length); the routing as
    the gating function (absent: softmax, as llama.cpp assumes for early V2 files), expert
    groups, weight scale and norm; YaRN's mscale as 0.1 * mscale_all_dim."""
    rope = int(meta("rope.dimension_count"))
    key, value = meta("attention.key_length_mla"), meta("attention.value_length_mla")
    if key is None:
        key, value = meta("attention.key_length"), meta("attention.value_length")
    sigmoid = meta("expert_gating_func") == 2
    groups, used_groups = int(meta("expert_group_count", 1) or 1), int(meta("expert_group_used_count", 1) or 1)
    out: dict[str, Any] = {
        "num_key_value_heads": cfg["num_attention_heads"], "head_dim": rope,
        "q_lora_rank": int(q) if (q := meta("attention.q_lora_rank")) else None,
        "kv_lora_rank": int(meta("attention.kv_lora_rank")), "qk_rope_head_dim": rope,
        "qk_nope_head_dim": int(key) - rope, "v_head_dim": int(value),
        "n_routed_experts": int(meta("expert_count")), "num_experts_per_tok": int(meta("expert_used_count")),
        "moe_intermediate_size": int(meta("expert_feed_forward_length")),
        "n_shared_experts": int(meta("expert_shared_count", 0)),
        "first_k_dense_replace": int(meta("leading_dense_block_count", 0)),
        "routed_scaling_factor": float(meta("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(meta("expert_weights_norm", False)), "n_group": groups, "topk_group": used_groups,
        "rope_interleave": True,  # llama.cpp rotates DeepSeek's pairs in place (no permutation at conversion)
    }
    if sigmoid:
        out.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", topk_method="noaux_tc")
        if not any(n.endswith(".exp_probs_b.bias") for n in tensors):
            raise ValueError("sigmoid expert gating (DeepSeek V3) needs the exp_probs_b selection biases, which this "
                             "file lacks")
    else:
        out["topk_method"] = "group_limited_greedy" if used_groups < groups else "greedy"
    if (scaling := cfg.get("rope_scaling")) and scaling.get("rope_type") == "yarn":
        log_mul = meta("rope.scaling.yarn_log_multiplier")
        mscale = float(log_mul) / 0.1 if log_mul else 0.0
        out["rope_scaling"] = {**scaling, "mscale": mscale, "mscale_all_dim": mscale,
                               "beta_fast": float(meta("rope.scaling.yarn_beta_fast", 32.0)),
                               "beta_slow": float(meta("rope.scaling.yarn_beta_slow", 1.0))}
    return out


def gpt_oss_config(meta: Meta, cfg: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss as llama.cpp reads it: what the file stores (experts, window, YaRN) and what
    llama.cpp fixes for the architecture: windowed and full layers alternating from a
    windowed first one, the SwiGLU clamp at 7, YaRN's correction range as the model's own
    config has it (beta 32/1, not truncated)."""
    layers = cfg["num_hidden_layers"]
    out: dict[str, Any] = {
        "num_local_experts": int(meta("expert_count")), "num_experts_per_tok": int(meta("expert_used_count")),
        "intermediate_size": int(meta("expert_feed_forward_length")), "swiglu_limit": 7.0, "attention_bias": True,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
    }
    if (scaling := cfg.get("rope_scaling")) and scaling.get("rope_type") == "yarn":
        out["rope_scaling"] = {**scaling, "beta_fast": float(meta("rope.scaling.yarn_beta_fast", 32.0)),
                               "beta_slow": float(meta("rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}
    return out


def gemma_config(arch: str, meta: Meta, cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2/3 as llama.cpp reads them: its converter stores norm weights as 1 + w
    (so no offset is added at load), and the layer pattern, local rope base and
    attention scale are fixed by the architecture (and model size) rather than stored."""
    period, layers_27b = GEMMA[arch]
    layers = cfg["num_hidden_layers"]
    pattern = meta("attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple)):  # newer files: one flag per layer, true where windowed
        windowed = [bool(p) for p in pattern]
    else:
        n = int(pattern or period)
        windowed = [i % n < n - 1 for i in range(layers)]
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed],
        "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if layers == layers_27b
        else cfg["head_dim"],
        "attn_logit_softcapping": meta("attn_logit_softcapping"),
        "final_logit_softcapping": meta("final_logit_softcapping"),
        "gguf_norm_shift": 1.0,
    }
    if cfg.get("sliding_window") is None:  # no window stored: every layer attends fully
        out["layer_types"] = ["full_attention"] * layers
        out["sliding_window"] = None
    if arch == "gemma3":
        out["rope_local_base_freq"] = 10000.0
    return out
