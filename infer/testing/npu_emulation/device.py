"""A stand-in for the `torch.npu` namespace torch_npu registers: one emulated NPU whose memory is the host's.

Only what the ascend backend touches exists. Tensors of the emulated device
live on the CPU: `emulated_host_device` tells the backend so (the real
torch.npu has no such attribute, so on a real host the backend uses npu:N).
"""

from __future__ import annotations

import types


class EmulatedMemoryError(RuntimeError):
    pass


def _no_memory(*_args, **_kwargs):
    raise EmulatedMemoryError("the emulated NPU has no device memory to measure; give the engine kv_cache_memory "
                              "or num_gpu_blocks_override")


def make_torch_npu_namespace() -> types.ModuleType:
    npu = types.ModuleType("torch.npu")
    npu.__doc__ = __doc__
    npu.emulated_host_device = "cpu"
    npu.is_available = lambda: True
    npu.device_count = lambda: 1
    npu.current_device = lambda: 0
    npu.set_device = lambda device: None
    # CPU work is done when the call returns: nothing is queued.
    npu.synchronize = lambda device=None: None
    npu.mem_get_info = _no_memory
    npu.max_memory_reserved = _no_memory
    npu.empty_cache = lambda: None
    npu.reset_peak_memory_stats = lambda device=None: None
    return npu
