"""A CPU emulation of exactly the torch_npu functions the ascend backend calls.

Each op follows torch_npu's documented signature, layouts, dtypes and
constraints (see the op modules for the documents used), computes in torch on
the CPU, and is checked against `cpu_ref` in tests/test_npu_emulation.py. With
`installed()` active, ``import torch_npu`` inside the backend finds this module
and ``torch.npu`` exists, so the real backend code runs unchanged. Test-only:
nothing in infer's production paths imports it.

    from infer.testing.npu_emulation import installed
    with installed():
        ...  # AscendBackend().attention(...) runs the emulated fused ops
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types

import torch

from . import attention_ops, layer_ops, moe_ops, quant_ops, w8a8_ops
from .checks import NpuOpError
from .device import make_torch_npu_namespace

__all__ = ["EMULATED_OPS", "NpuOpError", "installed", "make_module"]

# Every torch_npu function infer's ascend backend calls, and nothing else.
EMULATED_OPS = {
    "npu_scatter_pa_kv_cache": attention_ops.npu_scatter_pa_kv_cache,
    "npu_fused_infer_attention_score": attention_ops.npu_fused_infer_attention_score,
    "npu_rms_norm": layer_ops.npu_rms_norm,
    "npu_add_rms_norm": layer_ops.npu_add_rms_norm,
    "npu_rotary_mul": layer_ops.npu_rotary_mul,
    "npu_swiglu": layer_ops.npu_swiglu,
    "npu_moe_gating_top_k": moe_ops.npu_moe_gating_top_k,
    "npu_moe_init_routing_v2": moe_ops.npu_moe_init_routing_v2,
    "npu_grouped_matmul": moe_ops.npu_grouped_matmul,
    "npu_moe_token_unpermute": moe_ops.npu_moe_token_unpermute,
    "npu_weight_quant_batchmatmul": quant_ops.npu_weight_quant_batchmatmul,
    "npu_dynamic_quant": w8a8_ops.npu_dynamic_quant,
    "npu_quant_matmul": w8a8_ops.npu_quant_matmul,
}


def make_module() -> tuple[types.ModuleType, types.ModuleType]:
    """(a `torch_npu` stand-in, the `torch.npu` namespace it provides)."""
    mod = types.ModuleType("torch_npu")
    # A spec, so importlib.util.find_spec("torch_npu") answers as for an installed package.
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
    mod.__version__ = f"{torch.__version__.split('+')[0]}+emulated"
    mod.__doc__ = __doc__
    for name, fn in EMULATED_OPS.items():
        setattr(mod, name, fn)
    npu = make_torch_npu_namespace()
    mod.npu = npu
    return mod, npu


@contextlib.contextmanager
def installed():
    """Put the emulation in sys.modules as `torch_npu` and at `torch.npu`; restore both on exit."""
    if hasattr(torch, "npu") and not getattr(torch.npu, "emulated_host_device", None):
        raise RuntimeError("a real torch_npu is loaded; the emulation must not shadow it")
    mod, npu = make_module()
    saved = {name: sys.modules.get(name) for name in ("torch_npu", "torch.npu")}
    had_attr, old_attr = hasattr(torch, "npu"), getattr(torch, "npu", None)
    sys.modules["torch_npu"], sys.modules["torch.npu"] = mod, npu
    torch.npu = npu
    try:
        yield mod
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
        if had_attr:
            torch.npu = old_attr
        else:
            del torch.npu
