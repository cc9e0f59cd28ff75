"""`linear` for the torch backend: dense weights, with CPU fast paths.

Why each path (measurements: docs/backends/torch-measurements.md;
benchmarks/primitives.py reproduces them):

* float32, few rows (T <= SPLIT_MAX_ROWS): torch runs a single-row ``F.linear``
  (MKL sgemv) on one thread, well short of memory bandwidth. Cutting the N
  outputs into one ``bmm`` batch entry per intra-op thread makes torch run the
  pieces in parallel; the gain is largest at decode sizes. The pieces are views
  of the weight, made once in `prepare_weight`.
* Wide weights (N >= KMAJOR_RATIO * K: gate_up, lm_head) stream faster stored
  K-major ([K, N]) at T=1..2, slightly slower at T=4..32, and the split stays
  ahead of F.linear up to SPLIT_MAX_ROWS_KMAJOR rows. `prepare_weight` makes
  that copy once and the returned handle's ``weight`` is a [N, K] view of it
  (no second copy kept).
* float32, many rows: plain ``F.linear`` (MKL sgemm) runs close to the fp32
  matmul peak.
* bfloat16: up to BF16_GEMV_MAX_ROWS rows (decode batches), the native AVX512-BF16
  kernel (`fast_paths.linear`: a register tile of weight rows x rows of x, the weight
  streamed once) runs 1.3-3x torch's oneDNN GEMM; past that, ``F.linear``.
* float16: CPUs without AVX512-FP16 run torch's fp16 GEMM several times slower
  than fp32, so from FP16_UPCAST_ROWS rows on, the product runs in float32
  (weight widened per call, cheap next to the GEMM) and is rounded to float16 once.

NumPy's BLAS on zero-copy views was also measured: slightly faster at T=1 alone,
but its speed depends on OPENBLAS_* settings, and its threads and torch's
OpenMP threads spin against each other when calls interleave (alternating with
a parallel torch op, both became many times slower), so it is not used.
Other devices: ``F.linear``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...primitives.types import DenseWeight

SPLIT_MAX_ROWS = 32  # fp32 CPU: up to this many rows, split N over threads...
SPLIT_MAX_ROWS_KMAJOR = 128  # ...and up to this many for a K-major weight
KMAJOR_RATIO = 1  # fp32 CPU: store K-major when N >= KMAJOR_RATIO * K
FP16_UPCAST_ROWS = 16  # fp16 CPU: from this many rows, compute in fp32
MIN_PART = 64  # smallest piece of N worth a thread


@dataclass(frozen=True, slots=True)
class CpuSplit:
    """`DenseWeight.prepared` of a float32 CPU weight.

    ``parts`` [S, K, N/S] is a view of the weight: part s holds output
    columns ``s*N/S .. (s+1)*N/S``; ``bias_parts`` [S, 1, N/S] (or None) a view
    of the bias. ``k_major`` says the weight's storage is [K, N]; the split
    path serves up to ``max_rows`` rows, F.linear more.
    """

    parts: torch.Tensor
    bias_parts: torch.Tensor | None
    k_major: bool
    max_rows: int


def _num_parts(n: int) -> int:
    """Pieces to cut N into: the intra-op thread count, or a divisor of N below it."""
    for s in range(torch.get_num_threads(), 1, -1):
        if n % s == 0 and n // s >= MIN_PART:
            return s
    return 1


def prepare_weight(weight: DenseWeight) -> DenseWeight:
    """Views (and for wide weights a K-major copy) for the fp32 CPU split path.

    Safe to call again on its own result (returns it unchanged). Other dtypes
    and devices are returned as they are.
    """
    if isinstance(weight.prepared, CpuSplit):
        return weight
    w, bias = weight.weight, weight.bias
    if not (isinstance(w, torch.Tensor) and w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2):
        return weight
    w = w.detach()
    n, k = w.shape
    s = _num_parts(n)
    if s == 1:
        return weight
    m = n // s
    k_major = n >= KMAJOR_RATIO * k
    if k_major:
        wt = w.t().contiguous()  # [K, N]
        parts = wt.as_strided((s, k, m), (m, n, 1))
        w = wt.t()
    else:
        w = w.contiguous()
        parts = w.view(s, m, k).transpose(1, 2)
    bias_parts = None
    if bias is not None:
        bias = bias.contiguous()
        bias_parts = bias.view(s, 1, m)
    max_rows = SPLIT_MAX_ROWS_KMAJOR if k_major else SPLIT_MAX_ROWS
    return DenseWeight(w, bias, prepared=CpuSplit(parts, bias_parts, k_major, max_rows))


def linear(x: torch.Tensor, weight: DenseWeight) -> torch.Tensor:
    p = weight.prepared
    t = x.shape[0]
    if isinstance(p, CpuSplit) and t <= p.max_rows and x.device.type == "cpu":
        s, k, m = p.parts.shape
        xs = x.expand(s, t, k)
        y = torch.bmm(xs, p.parts) if p.bias_parts is None else torch.baddbmm(p.bias_parts, xs, p.parts)
        # [S, T, N/S] -> [T, N]: a view for one row, a small copy otherwise.
        return y.view(1, s * m) if t == 1 else y.transpose(0, 1).reshape(t, s * m)
    if x.dtype == torch.float16 and x.device.type == "cpu" and t >= FP16_UPCAST_ROWS:
        b = None if weight.bias is None else weight.bias.float()
        return F.linear(x.float(), weight.weight.float(), b).to(torch.float16)
    return F.linear(x, weight.weight, weight.bias)
