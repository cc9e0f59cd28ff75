"""The `moe` primitive beyond the conformance cases: the torch backend's work
grows with top_k and not with the number of experts, top_k and the shared-expert
arguments are checked, and an all-expert dense computation agrees with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from infer.backends.torch_native.moe import moe
from infer.primitives.spec import PrimitiveArgumentError, check_moe

H, I = 32, 24


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def routed_gemm_flops(t: int, top_k: int) -> int:
    """GEMM FLOPs of running top_k SwiGLU experts per token: 2 * rows * (2I*H + H*I)."""
    return 2 * t * top_k * (2 * I * H + H * I)


def expert_gemm_flops(experts: int, top_k: int, t: int = 64) -> int:
    x, logits = torch.randn(t, H), torch.randn(t, experts)
    w13, w2 = torch.randn(experts, 2 * I, H), torch.randn(experts, H, I)
    with FlopCounterMode(display=False) as counter:
        moe(x, logits, w13, w2, top_k, True)
    counts = counter.get_flop_counts()["Global"]
    combine = 2 * t * top_k * H  # each token's weighted sum of its top_k rows
    return sum(v for op, v in counts.items() if "mm" in str(op)) - combine


@pytest.mark.parametrize("experts", [4, 8, 16, 64])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_torch_moe_work_is_proportional_to_top_k_not_experts(experts, top_k):
    # The padded path may compute up to 2x the routed rows; never a row per unchosen expert.
    flops = expert_gemm_flops(experts, top_k)
    assert routed_gemm_flops(64, top_k) <= flops <= 2 * routed_gemm_flops(64, top_k)


def test_sparse_routing_computes_exactly_the_routed_rows():
    # 64 experts for 16 tokens: most get none, so experts run one by one on their own rows.
    assert expert_gemm_flops(64, 2, t=16) == routed_gemm_flops(16, 2)


@pytest.mark.parametrize("t, e, k, padded", [(64, 4, 2, True), (5, 16, 2, False), (40, 8, 3, None)])
def test_torch_moe_equals_every_expert_computed_densely(t, e, k, padded, monkeypatch):
    import infer.backends.torch_native.moe as torch_moe

    calls = []
    real = torch_moe._experts_padded
    monkeypatch.setattr(torch_moe, "_experts_padded", lambda *a: calls.append(1) or real(*a))
    x, logits = torch.randn(t, H), torch.randn(t, e)
    w13, w2 = 0.2 * torch.randn(e, 2 * I, H), 0.2 * torch.randn(e, H, I)
    probs = logits.softmax(-1)
    top, ids = probs.topk(k, dim=-1)
    gates = torch.zeros_like(probs).scatter_(1, ids, top / top.sum(-1, keepdim=True))
    gate_up = torch.einsum("th,eih->eti", x, w13)
    y = torch.einsum("eti,ehi->eth", torch.nn.functional.silu(gate_up[..., :I]) * gate_up[..., I:], w2)
    out, counts = moe(x, logits, w13, w2, k, True)
    torch.testing.assert_close(out, torch.einsum("te,eth->th", gates, y), atol=1e-5, rtol=1e-5)
    assert torch.equal(counts, torch.bincount(ids.flatten(), minlength=e))
    if padded is not None:  # the cases above that must take one path or the other
        assert bool(calls) == padded


def test_gated_shared_expert_adds_sigmoid_gate_times_shared_output():
    t, e = 6, 4
    x, logits = torch.randn(t, H), torch.randn(t, e)
    w13, w2 = torch.randn(e, 2 * I, H), torch.randn(e, H, I)
    shared, gate = torch.randn(t, H), torch.randn(t, 1)
    routed, _ = moe(x, logits, w13, w2, 2, False)
    with_shared, _ = moe(x, logits, w13, w2, 2, False, shared, gate)
    torch.testing.assert_close(with_shared, routed + torch.sigmoid(gate) * shared)
    plain, _ = moe(x, logits, w13, w2, 2, False, shared)
    torch.testing.assert_close(plain, routed + shared)


def _args(t=3, e=4, shared_shape=None, gate_shape=None, top_k=2):
    f = np.float32
    shared = np.zeros(shared_shape, f) if shared_shape else None
    gate = np.zeros(gate_shape, f) if gate_shape else None
    return (np.zeros((t, 8), f), np.zeros((t, e), f), np.zeros((e, 6, 8), f), np.zeros((e, 8, 3), f), top_k, True,
            shared, gate)


@pytest.mark.parametrize("top_k", [1, 4])
def test_top_k_from_one_expert_to_every_expert_passes_the_check(top_k):
    check_moe(*_args(e=4, top_k=top_k))


@pytest.mark.parametrize("top_k", [0, 5])
def test_top_k_outside_one_to_the_number_of_experts_is_refused(top_k):
    with pytest.raises(PrimitiveArgumentError) as err:
        check_moe(*_args(e=4, top_k=top_k))
    assert err.value.argument == "top_k"


@pytest.mark.parametrize("shared_shape, gate_shape, argument", [
    ((3, 7), None, "shared"),
    ((3, 8), (3, 2), "shared_gate"),
    (None, (3, 1), "shared_gate"),
])
def test_shared_expert_arguments_are_checked(shared_shape, gate_shape, argument):
    with pytest.raises(PrimitiveArgumentError) as err:
        check_moe(*_args(shared_shape=shared_shape, gate_shape=gate_shape))
    assert err.value.argument == argument


def test_valid_shared_expert_arguments_pass_the_check():
    check_moe(*_args(shared_shape=(3, 8), gate_shape=(3, 1)))
