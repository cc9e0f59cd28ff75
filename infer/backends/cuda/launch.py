"""What every kernel wrapper of the `cuda` backend needs at launch time.

Kept free of triton imports: `backend.py` reads `interpreting()` to decide
availability without paying for (or fixing the mode of) a triton import.
"""

from __future__ import annotations

import os

import torch

# Triton's own spelling of a true TRITON_INTERPRET (knobs.env_bool).
_TRUE = ("1", "true", "on", "yes", "y")


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1).

    The variable must be set before the kernel modules are imported: the
    `@triton.jit` decorator picks interpreter or compiler when it runs.
    """
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (tl.arange needs power-of-two extents)."""
    return 1 << max(0, int(n) - 1).bit_length()


def compute_f32(dtype: torch.dtype) -> bool:
    """Whether a kernel must widen its tiles to float32 before arithmetic.

    On a GPU fp16/bf16 tiles go to the tensor cores as they are. The
    interpreter computes bf16 arithmetic (and bf16 `tl.dot`) wrongly, so under
    it bf16 is widened first; fp16 stays native so the GPU path is what runs.
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` precision: exact fp32 for fp32 inputs (tf32 would miss the
    fp32 tolerance), irrelevant for fp16/bf16."""
    return "ieee" if dtype == torch.float32 else "tf32"


def row_warps(block: int) -> int:
    """num_warps for a one-row-per-program kernel touching `block` elements."""
    return 1 if block <= 256 else 4 if block <= 2048 else 8
