"""torch_npu's MoE routing ops and grouped GEMM, emulated in torch on the CPU.

From torch_npu's documentation (Ascend/op-plugin docs/context:
torch_npu-npu_moe_gating_top_k.md, torch_npu-npu_moe_init_routing_v2.md,
torch_npu-npu_grouped_matmul.md) and CANN's aclnnMoeTokenUnpermute formula
(``out[i] = sum_j permuted[sorted_indices[i*K + j]] * probs[i, j]``), for the
argument values vllm-ascend passes (dropless routing, count-mode group lists,
m-axis grouping, no quantization).

Where the documents are silent the emulation picks one behaviour and says so:
equal gating scores keep the lowest expert id first (a stable sort).
"""

from __future__ import annotations

import torch

from .checks import require
from .layer_ops import FLOAT_DTYPES


def npu_moe_gating_top_k(x, k, *, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0, norm_type=0,
                         out_flag=False, routed_scaling_factor=1.0, eps=1e-20):
    """(y_out, expert_idx_out int32, norm_out float32) for one expert group (group_count=1), no bias.

    norm_out is softmax (norm_type 0) or sigmoid (1) of x in float32;
    expert_idx_out the k best experts per row (lowest id first on ties);
    y_out their norm_out values in x's dtype. Only norm_out and
    expert_idx_out have a documented meaning we rely on; y_out's rescaling
    (routed_scaling_factor, eps) is not emulated beyond the gather.
    """
    op = "npu_moe_gating_top_k"
    require(x.dim() == 2 and x.dtype in FLOAT_DTYPES, op, f"x must be a 2-D float tensor, got {x.dtype} {tuple(x.shape)}")
    experts = x.shape[-1]
    require(experts <= 2048, op, f"at most 2048 experts, got {experts}")
    require(group_count == 1 and k_group == 1 and bias is None, op, "only group_count=1, k_group=1, bias=None is emulated")
    require(experts // group_count > 2, op, "each group needs more than 2 experts")
    require(1 <= k <= experts, op, f"k must be in [1, {experts}], got {k}")
    require(renorm == 0, op, "renorm must be 0 (norm before top-k)")
    require(norm_type in (0, 1), op, f"norm_type must be 0 (softmax) or 1 (sigmoid), got {norm_type}")
    norm = torch.softmax(x.float(), dim=-1) if norm_type == 0 else torch.sigmoid(x.float())
    values, idx = torch.sort(norm, dim=-1, descending=True, stable=True)
    return values[:, :k].to(x.dtype), idx[:, :k].to(torch.int32), norm


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1, expert_num=-1,
                            drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False, quant_mode=0,
                            active_expert_range=(), row_idx_type=0):
    """(expanded_x, expanded_row_idx, expert_tokens_count, expanded_scale), dropless, unquantized.

    The flattened (token, choice) pairs ``p = t*K + j`` are sorted by expert id
    (stably); ``expanded_x[i] = x[sorted[i] // K]`` and
    ``expanded_row_idx[sorted[i]] = i`` -- where each pair's row landed, the
    index npu_moe_token_unpermute takes back. The count (type 1) per expert of
    ``active_expert_range`` is int64.
    """
    op = "npu_moe_init_routing_v2"
    require(x.dim() == 2 and expert_idx.dim() == 2 and expert_idx.shape[0] == x.shape[0], op,
            "x must be [NUM_ROWS, H] and expert_idx [NUM_ROWS, K]")
    require(expert_idx.dtype == torch.int32, op, f"expert_idx must be int32, got {expert_idx.dtype}")
    require(drop_pad_mode == 0 and quant_mode == -1 and scale is None and offset is None, op,
            "only dropless (drop_pad_mode=0), unquantized (quant_mode=-1) routing is emulated")
    require(expert_tokens_num_type == 1 and expert_tokens_num_flag, op, "only count mode (expert_tokens_num_type=1, flag=True) is emulated")
    require(row_idx_type == 0, op, "only row_idx_type=0 is emulated")
    rows, k = expert_idx.shape
    require(active_num == rows * k, op, f"active_num must equal NUM_ROWS*K = {rows * k}, got {active_num}")
    lo, hi = (list(active_expert_range) or [0, expert_num])
    require(lo == 0 and hi == expert_num, op, "only the full active_expert_range [0, expert_num] is emulated")
    flat = expert_idx.flatten().long()
    if flat.numel():
        require(int(flat.min()) >= 0 and int(flat.max()) < expert_num, op, f"expert ids must lie in [0, {expert_num})")
    order = torch.argsort(flat, stable=True)
    expanded_x = x.index_select(0, order // k)
    expanded_row_idx = torch.empty_like(order)
    expanded_row_idx[order] = torch.arange(order.numel())
    counts = torch.bincount(flat, minlength=expert_num).long()
    return expanded_x, expanded_row_idx.to(torch.int32), counts, torch.zeros(rows * k, dtype=torch.float32)


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                       per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                       output_dtype=None, tuning_config=None):
    """The single-tensor, m-axis-grouped case ("单单单"): ``[y]`` with
    ``y[rows of group g] = x[rows of group g] @ weight[g]``.

    x = [tensor [M, K]], weight = [tensor [G, K, N]] (a transposed view is
    allowed), group_list int64 [G]: cumulative row ends (type 0) or row
    counts (type 1) that cover exactly M rows. Accumulates in float32.
    """
    op = "npu_grouped_matmul"
    unsupported = [n for n, v in (("bias", bias), ("scale", scale), ("offset", offset), ("antiquant_scale", antiquant_scale),
                                  ("antiquant_offset", antiquant_offset), ("per_token_scale", per_token_scale)) if v is not None]
    require(not unsupported and act_type == 0 and output_dtype in (None, x[0].dtype), op, f"not emulated: {unsupported or 'act_type/output_dtype'}")
    require(len(x) == 1 and len(weight) == 1 and split_item in (2, 3) and group_type == 0, op,
            "only single x, single weight, split_item 2/3, group_type 0 is emulated")
    a, w = x[0], weight[0]
    require(a.dim() == 2 and w.dim() == 3 and a.shape[1] == w.shape[1], op,
            f"x must be [M, K] and weight [G, K, N], got {tuple(a.shape)} and {tuple(w.shape)}")
    require(a.dtype == w.dtype and a.dtype in FLOAT_DTYPES, op, f"x/weight must share a float dtype, got {a.dtype}/{w.dtype}")
    require(a.is_contiguous(), op, "x must not be transposed")
    require(isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64 and group_list.dim() == 1, op,
            "group_list must be a 1-D int64 tensor")
    require(group_list.shape[0] == w.shape[0] and group_list.shape[0] <= 1024, op, "one group_list entry per weight group (<= 1024)")
    require(group_list_type in (0, 1), op, f"group_list_type must be 0 (cumsum) or 1 (count), got {group_list_type}")
    counts = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
    require(bool((counts >= 0).all()) and int(counts.sum()) == a.shape[0], op,
            f"group sizes must be non-negative and sum to M={a.shape[0]}")
    out = torch.empty(a.shape[0], w.shape[2], dtype=a.dtype)
    start = 0
    for g, n in enumerate(counts.tolist()):
        out[start:start + n] = (a[start:start + n].float() @ w[g].float()).to(a.dtype)
        start += n
    return [out]


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    """``out[i] = sum_j permuted_tokens[sorted_indices[i*K + j]] * probs[i, j]`` (K = probs.shape[1], 1 without probs)."""
    op = "npu_moe_token_unpermute"
    require(not padded_mode and restore_shape is None, op, "only padded_mode=False is emulated")
    require(sorted_indices.dtype == torch.int32 and sorted_indices.dim() == 1, op, "sorted_indices must be 1-D int32")
    require(sorted_indices.shape[0] == permuted_tokens.shape[0], op, "one sorted index per permuted token")
    require(sorted_indices.unique().numel() == sorted_indices.numel(), op, "sorted_indices must not repeat")
    k = 1 if probs is None else probs.shape[1]
    if probs is not None:
        require(probs.dtype == permuted_tokens.dtype, op, f"probs must have permuted_tokens' dtype, got {probs.dtype}")
        require(probs.numel() == permuted_tokens.shape[0], op, "probs must be [num_tokens, topk] with num_tokens*topk rows permuted")
    gathered = permuted_tokens.index_select(0, sorted_indices.long()).float()
    gathered = gathered.view(-1, k, permuted_tokens.shape[-1])
    if probs is not None:
        gathered = gathered * probs.float().unsqueeze(-1)
    return gathered.sum(dim=1).to(permuted_tokens.dtype)
