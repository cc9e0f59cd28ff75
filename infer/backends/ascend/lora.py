"""Batched LoRA on torch_npu's grouped GEMM (`npu_grouped_matmul`, the op the MoE path
uses): tokens sorted by adapter slot, one group per slot, shrink by the A of each
token's group, expand by each slice's B, added to y in float32.

Slot 0 (no adapter) is never read: its tokens sort first and are left out of
the groups. Sorting needs the slot counts on the host; the step's indices are
one tensor passed to every layer's calls, so they are read (one sync) once per
step, not per call (`_plan`).
"""

from __future__ import annotations

import threading

import torch

from .availability import torch_npu

_steps = threading.local()  # per engine thread: (the step's lora_indices tensor, its plan)


def _plan(lora_indices: torch.Tensor, slots: int):
    """(order of the adapter tokens, their group sizes for slots 1.., how many) for a step."""
    held = getattr(_steps, "held", None)
    if held is not None and held[0] is lora_indices:
        return held[1]
    idx = lora_indices.long()
    order = torch.argsort(idx, stable=True)
    counts = torch.bincount(idx, minlength=slots)
    skip = int(counts[0])  # the step's one host read
    plan = (order[skip:], counts[1:].to(torch.int64), idx.numel() - skip)
    _steps.held = (lora_indices, plan)
    return plan


def lora(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, lora_indices: torch.Tensor,
         output_slices=None) -> torch.Tensor:
    slots = lora_a.shape[0]
    if x.shape[0] == 0 or slots < 2:
        return y
    rows, group_list, m = _plan(lora_indices, slots)
    if m == 0:
        return y
    npu = torch_npu()
    slices = tuple(output_slices) if output_slices is not None else (y.shape[1],)
    r = lora_a.shape[1] // len(slices)
    xs = x.index_select(0, rows).contiguous()
    # Weights [G, K, N] for the op: transposed views of the stacks' [G, N, K].
    mid = npu.npu_grouped_matmul([xs], [lora_a[1:].transpose(1, 2)], group_list=group_list, split_item=2,
                                 group_type=0, group_list_type=1)[0]
    parts, lo = [], 0
    for i, n in enumerate(slices):
        b = lora_b[1:, lo : lo + n].contiguous().transpose(1, 2)  # [G, R, n]
        parts.append(npu.npu_grouped_matmul([mid[:, i * r : (i + 1) * r].contiguous()], [b], group_list=group_list,
                                            split_item=2, group_type=0, group_list_type=1)[0])
        lo += n
    delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    out = y.float()
    out.index_add_(0, rows, delta.float())
    return out.to(y.dtype)
