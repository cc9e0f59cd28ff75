"""Routed experts on torch_npu's MoE ops, as vllm-ascend chains them on 910B:
gating top-k -> init routing (sort tokens by expert) -> grouped GEMM (gate/up)
-> swiglu -> grouped GEMM (down) -> unpermute with the routing weights."""

from __future__ import annotations

import torch

from .availability import torch_npu


def moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
        renormalize: bool, shared=None, shared_gate=None, w13_bias=None, w2_bias=None, activation=None,
        swiglu_alpha=None, swiglu_limit=None, routed_scaling_factor=None, scoring_func=None, routing_bias=None,
        expert_groups=None) -> tuple[torch.Tensor, torch.Tensor]:
    routing = (routed_scaling_factor, scoring_func, routing_bias, expert_groups)
    if (shared is not None or w13_bias is not None or w2_bias is not None or activation not in (None, "silu")
            or any(a is not None for a in routing)):
        # Declined in AscendBackend.supports (shared_expert, expert_bias, moe_activation, routing): Ops sends
        # these calls to torch.
        raise NotImplementedError("backend 'ascend' moe has no shared expert, expert biases, clamped SwiGLU or "
                                  "DeepSeek routing; resolve moe with the dispatch key")
    npu = torch_npu()
    num_tokens = x.shape[0]
    num_experts = w13.shape[0]
    if num_tokens == 0:
        return torch.empty_like(x), torch.zeros(num_experts, dtype=torch.int64, device=x.device)
    logits = router_logits if router_logits.dtype == x.dtype else router_logits.float()
    # norm_out (out_flag) is the float32 softmax: the weights are read from it
    # rather than from y_out, whose rescaling the documents leave to a formula
    # image; renormalisation is ours.
    _, ids, probs = npu.npu_moe_gating_top_k(logits, top_k, k_group=1, group_count=1, group_select_mode=0, renorm=0,
                                             norm_type=0, out_flag=True)
    weights = probs.gather(1, ids.long())
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    expanded_x, expanded_row_idx, counts, _ = npu.npu_moe_init_routing_v2(
        x, ids, active_num=num_tokens * top_k, expert_num=num_experts, expert_tokens_num_type=1,
        expert_tokens_num_flag=True, active_expert_range=[0, num_experts], quant_mode=-1)
    # grouped_matmul takes weights [E, K, N]: transposed views of [E, N, K] (allowed by the op).
    gate_up = npu.npu_grouped_matmul([expanded_x], [w13.transpose(1, 2)], group_list=counts, split_item=2,
                                     group_type=0, group_list_type=1)[0]
    hidden = npu.npu_swiglu(gate_up, dim=-1)
    down = npu.npu_grouped_matmul([hidden], [w2.transpose(1, 2)], group_list=counts, split_item=2, group_type=0,
                                  group_list_type=1)[0]
    out = npu.npu_moe_token_unpermute(down, expanded_row_idx, probs=weights.to(down.dtype))
    return out, counts.long()
