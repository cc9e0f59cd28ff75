"""DeepSeek V2/V3: multi-head latent attention (MLA) and fine-grained experts.

Attention caches one latent per token instead of K and V per head: the
hidden state's down-projection ``kv_a_proj_with_mqa`` gives a compressed KV
``c`` of ``kv_lora_rank`` dims (RMS-normalised) and one rope key ``k_pe``
of ``qk_rope_head_dim`` dims shared by every head. Head h's key is
``[W_UK[h] c, k_pe]`` and its value ``W_UV[h] c``, with ``kv_b_proj`` holding
each head's W_UK then W_UV rows. The `mla_kv_write` and `mla_attention`
primitives store and read the latent; queries come from ``q_proj`` or, with a
``q_lora_rank``, ``q_b_proj(norm(q_a_proj(x)))``. Rope rotates interleaved
pairs (GPT-J's layout; V3's ``rope_interleave`` reorders the dims of q and k
alike, which leaves their dot products, all the cache is read for, as they
are), with YaRN's mscale folded into the softmax scale.

The feed-forward is dense for the first ``first_k_dense_replace`` layers,
then routed experts plus ``n_shared_experts`` always-on experts (one MLP of
their summed width), routed as `deepseek_moe_spec` says.
"""

from __future__ import annotations

import dataclasses
import math

from ..graph import Graph
from .config import ModelConfig, normalize_config
from .llama import build_decoder, dense_mlp
from .moe import MoESpec, sparse_block

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclasses.dataclass(frozen=True, slots=True)
class MLASpec:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scale: float


def mla_spec(config: dict) -> MLASpec:
    nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
    scale = (nope + rope) ** -0.5
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type", "default")) != "default" and params.get("mscale_all_dim"):
        factor = float(params["factor"])
        mscale = 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    q_lora = config.get("q_lora_rank")
    return MLASpec(int(q_lora) if q_lora else None, int(config["kv_lora_rank"]), nope, rope,
                   int(config["v_head_dim"]), scale)


def deepseek_model_config(config: dict) -> ModelConfig:
    """The decoder's config; its KV "head" is the latent: one, of (R + P) / 2 dims a
    plane (the cache holds it split over the K and V planes)."""
    cfg = normalize_config(config)
    spec = mla_spec(config)
    latent = spec.kv_lora_rank + spec.qk_rope_head_dim
    if latent % 2:
        raise ValueError(f"kv_lora_rank + qk_rope_head_dim must be even to fill the cache's two planes, got {latent}")
    return dataclasses.replace(cfg, num_kv_heads=1, head_dim=latent // 2, rotary_dim=spec.qk_rope_head_dim,
                               neox_style=not config.get("rope_interleave", True), sliding_window=None,
                               layer_types=None, attn_scale=spec.scale)


def deepseek_moe_spec(config: dict, num_layers: int) -> MoESpec:
    """V2: softmax scores, the top-k (``greedy``) or the top-k of the best groups by
    their best expert (``group_limited_greedy``), weights as scored. V3 (``noaux_tc``):
    sigmoid scores, chosen with ``e_score_correction_bias`` added among the groups
    whose two best experts lead, weighed without it (renormalised with
    ``norm_topk_prob``). Both scale the routed sum by ``routed_scaling_factor``."""
    arch = (config.get("architectures") or [""])[0]
    v3 = arch == "DeepseekV3ForCausalLM"
    method = config.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"DeepSeek routing {method!r} is not supported (supported: greedy, group_limited_greedy, "
                         "noaux_tc)")
    scaling = float(config.get("routed_scaling_factor") or 1.0)
    first_sparse = int(config.get("first_k_dense_replace") or 0)
    experts = int(config.get("n_routed_experts") or config["num_local_experts"])
    inter = int(config["moe_intermediate_size"])
    groups = None
    if method != "greedy":
        groups = (int(config["n_group"]), int(config["topk_group"]), "top2" if method == "noaux_tc" else "max")
    return MoESpec(experts, int(config["num_experts_per_tok"]), v3 and bool(config.get("norm_topk_prob", False)),
                   inter, shared_intermediate_size=inter * int(config.get("n_shared_experts") or 0),
                   sparse_layers=frozenset(range(first_sparse, num_layers)), shared_module="mlp.shared_experts",
                   routed_scaling_factor=scaling if scaling != 1.0 else None,
                   scoring_func="sigmoid" if method == "noaux_tc" else None,
                   routing_bias="e_score_correction_bias" if method == "noaux_tc" else None, expert_groups=groups)


def build_deepseek(config: dict) -> Graph:
    cfg = deepseek_model_config(config)
    spec, moe = mla_spec(config), deepseek_moe_spec(config, cfg.num_layers)

    def feed_forward(g: Graph, c: ModelConfig, i: int) -> None:
        if i in moe.sparse_layers:
            sparse_block(g, c, moe, i)
        else:
            dense_mlp(g, c, i)

    return build_decoder(cfg, feed_forward, lambda g, c, i: mla_block(g, c, spec, i))


def mla_block(g: Graph, cfg: ModelConfig, spec: MLASpec, i: int) -> None:
    """Layer i's norm and latent attention: ``normed`` and ``residual`` out, as
    `llama.attention_block`."""
    p, n = f"model.layers.{i}.self_attn", f"layers.{i}"
    h, heads = cfg.hidden_size, cfg.num_heads
    q_width = heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim)
    ins = ["hidden"] if i == 0 else ["hidden", "residual"]
    w = g.param(f"{n}.input_layernorm", (h,), f"model.layers.{i}.input_layernorm.weight")
    g.add("rms_norm", f"{n}.input_layernorm", ins, ["normed", "residual"], {"weight": w}, layer=i, eps=cfg.rms_norm_eps)
    lat = spec.kv_lora_rank + spec.qk_rope_head_dim
    params = {
        "kv_a_norm": g.param(f"{n}.kv_a_norm", (spec.kv_lora_rank,), f"{p}.kv_a_layernorm.weight"),
        "kv_b_proj": g.param(f"{n}.kv_b_proj", (heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank),
                             f"{p}.kv_b_proj.weight", shard="column"),
        "o_proj": g.param(f"{n}.o_proj", (h, heads * spec.v_head_dim), f"{p}.o_proj.weight", shard="row"),
    }
    if spec.q_lora_rank is None:
        params["kv_a_proj"] = g.param(f"{n}.kv_a_proj", (lat, h), f"{p}.kv_a_proj_with_mqa.weight")
        params["q_proj"] = g.param(f"{n}.q_proj", (q_width, h), f"{p}.q_proj.weight", shard="column")
    else:
        # Both down-projections read the same x, replicated under tensor parallelism: one linear.
        params["q_a_kv_a_proj"] = g.param(f"{n}.q_a_kv_a_proj", (spec.q_lora_rank + lat, h),
                                          (f"{p}.q_a_proj.weight", f"{p}.kv_a_proj_with_mqa.weight"),
                                          parts=(spec.q_lora_rank, lat))
        params["q_a_norm"] = g.param(f"{n}.q_a_norm", (spec.q_lora_rank,), f"{p}.q_a_layernorm.weight")
        params["q_b_proj"] = g.param(f"{n}.q_b_proj", (q_width, spec.q_lora_rank), f"{p}.q_b_proj.weight",
                                     shard="column")
    g.add("attention", f"{n}.self_attn", ["normed", "positions"], ["attn_out"], params, layer=i, mla=True,
          num_heads=heads, num_kv_heads=1, head_dim=cfg.head_dim, rotary_dim=spec.qk_rope_head_dim,
          neox_style=cfg.neox_style, scale=spec.scale, sliding_window=None, soft_cap=None, eps=cfg.rms_norm_eps,
          rope=None, kv_lora_rank=spec.kv_lora_rank, qk_nope_head_dim=spec.qk_nope_head_dim,
          v_head_dim=spec.v_head_dim)
    w = g.param(f"{n}.post_attention_layernorm", (h,), f"model.layers.{i}.post_attention_layernorm.weight")
    g.add("rms_norm", f"{n}.post_attention_layernorm", ["attn_out", "residual"], ["normed", "residual"],
          {"weight": w}, layer=i, eps=cfg.rms_norm_eps)
