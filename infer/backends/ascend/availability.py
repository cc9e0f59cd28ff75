"""Whether torch_npu and an NPU are usable here, and the exact reason when not.

torch_npu is imported lazily and only by the ascend backend: importing it
without Huawei's CANN toolkit fails (``libhccl.so``), and an installed wheel
even breaks plain ``import torch`` through its autoload entry point unless
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import torch

from ...primitives.types import Support

SETUP = "see docs/backends/ascend.md"
CANN_LIBS = ("libhccl", "libascend", "libacl", "libge_runner", "libruntime", "libtsdclient")


def torch_npu() -> ModuleType:
    """The torch_npu module (imported on first use, never at infer's import time)."""
    import torch_npu as mod

    return mod


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def probe(find_spec=importlib.util.find_spec, import_module=importlib.import_module, environ=os.environ) -> Support:
    """Each prerequisite in order; the first one missing is the reason."""
    if find_spec("torch_npu") is None:
        return Support(False, f"torch_npu not installed (pip install torch-npu=={torch.__version__.split('+')[0]} on a "
                              f"host with Huawei's CANN toolkit; {SETUP})")
    try:
        mod = import_module("torch_npu")
    except ImportError as exc:
        if any(lib in str(exc) for lib in CANN_LIBS):
            return Support(False, f"torch_npu installed but CANN's libraries are not loadable ({exc}): install the CANN "
                                  "toolkit and run `source /usr/local/Ascend/ascend-toolkit/set_env.sh`")
        return Support(False, f"torch_npu not importable: {exc} ({SETUP})")
    except Exception as exc:  # e.g. a torch_npu built for another torch
        return Support(False, f"torch_npu failed to import: {type(exc).__name__}: {exc} ({SETUP})")
    version = getattr(mod, "__version__", "")
    if version and _minor(version) != _minor(torch.__version__):
        return Support(False, f"torch_npu {version} does not match torch {torch.__version__}: install the torch-npu "
                              "release built for this torch")
    npu = getattr(torch, "npu", None)
    if npu is None:
        hint = (" (TORCH_DEVICE_BACKEND_AUTOLOAD=0 is set, and torch_npu did not register itself when imported)"
                if environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") == "0" else "")
        return Support(False, f"torch_npu imported but torch.npu is missing{hint}")
    if not npu.is_available():
        return Support(False, "torch_npu imported but no NPU is visible (torch.npu.is_available() is False; check "
                              "`npu-smi info` and ASCEND_RT_VISIBLE_DEVICES)")
    return Support(True)


def tensor_device(device: str) -> str:
    """Where tensors of `device` live: the device itself, or the host for an
    emulated torch.npu that declares ``emulated_host_device`` (tests only)."""
    host = getattr(getattr(torch, "npu", None), "emulated_host_device", None)
    return host if host and str(device).startswith("npu") else device
