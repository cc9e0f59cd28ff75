"""Quantized `linear` and `embedding` for the torch backend.

Why each path (SmolLM2 shapes; measurements: docs/backends/torch-measurements.md,
from `python benchmarks/quant.py --part linear --threads 1`):

* torch's int4 CPU GEMM (``aten._weight_int4pack_mm_for_cpu``) has a fast,
  vectorised kernel for bfloat16/float16 activations: faster than the fp32
  dense GEMV at decode sizes, while reading 1/7 of the bytes. Its time
  grows with T while dequantize-in-tiles pays a fixed dequantization: it beat
  bf16 tiles at T=37 and T=128 and lost at T=512, so it takes up to
  INT4_KERNEL_MAX_ROWS rows. Its float32 kernel is scalar: far
  slower than the dense GEMV at T=1 and slower than dequantize-in-tiles at
  every T, so float32 never uses it. Its dequantization is
  ``(q - 8) * scale + zero``, our ``q * scale + offset`` with
  ``zero = offset + 8 * scale``; it needs N % 16 == 0.
* ``aten._weight_int8pack_mm`` takes one scale per output channel only, so a
  group-quantized int8 weight (GGUF Q8_0) runs as one call per K group
  (weight stored [K/G, N, G]) whose outputs are summed: faster than the fp32
  dense GEMV of SmolLM2's lm_head at T=1, behind tiles from T=32.
* Dequantizing row tiles (a few MiB, cache-resident) then one GEMM per tile:
  far slower than the dense GEMV at decode for int4, but close to dense at
  T=256 and the exact float32 path. For bfloat16 the tiles are dequantized
  to bfloat16 and multiplied by oneDNN's bf16 GEMM (faster than fp32 dense at T=256).
* The native int4 GEMV (native/kernels.c: integer dot products of the
  nibbles with x written as 16-bit integers per group, exact to float32
  rounding; float16 copies of float16 scales) beats torch's int4 kernel at
  T=1, both streaming SmolLM2's layers from memory and in cache. It
  unpacks each weight once per two rows of bf16 x and redoes the integer work
  per row otherwise (the weights stay in L1), so with bf16 it serves up to 2
  rows (even with torch's kernel at T=2, behind it from T=4) and with float32 up
  to 32: against float32 tiles it was well ahead at T=8, even at T=37 and
  behind at T=64.

So: a few rows take the native GEMVs; half precision takes the packed kernels
up to 160 rows and float32 the native GEMM up to 32. Past those limits (a
prefill chunk, or a batch of decodes with a prompt chunk beside them) the
weight is multiplied dense: the first such call dequantizes it in tiles, the
second makes a dequantized copy in the activations' precision (bf16, else fp32)
kept for the next ones, so a batched step does not dequantize every weight
again and one prefill of one prompt makes no copy; the copies together
stay within DENSE_COPY_BYTES (``$INFER_DEQUANT_CACHE_MB``, default 1024; 0
keeps none), and a weight past the budget is dequantized in tiles at each call
(no full float copy of it ever exists).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from dataclasses import dataclass

import torch

from ...primitives.types import DenseWeight, Fp8Weight, Int4GroupWeight, Int8GroupWeight, Mxfp4Weight, WeightHandle
from . import linear as dense
from . import mxfp4, ops
from .native import ops as native

# Half-precision rows up to which the packed kernels beat dequantize-in-tiles.
INT4_KERNEL_MAX_ROWS = 160
INT8_GROUP_KERNEL_MAX_ROWS = 8
INT4_KERNEL_GROUPS = (32, 64, 128, 256)
TILE_ELEMENTS = 1 << 20  # weights dequantized at once: 4 MiB of float32
_HALF = (torch.bfloat16, torch.float16)
DENSE_COPY_BYTES = int(float(os.environ.get("INFER_DEQUANT_CACHE_MB", "1024")) * 2**20)
# float32 rows up to which the native int4 GEMM runs where a dense copy may exist: it redoes
# the integer work per row, and a float32 copy held in cache overtook it from 2-4 rows, but a
# whole step streams every layer from memory (1/7 of the bytes for int4): SmolLM2 steps of
# 3/4/5/6 rows took 35/45/57/67 ms native against 51/61/63/68 ms with the float32 copies
# (2 cores; speculative decoding's verify steps). From 32 rows up it is only an option without a copy.
F32_NATIVE_BESIDE_DENSE_ROWS = 12
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class Int4Packed:
    """``Int4GroupWeight.prepared``: torch's int4 CPU layout and its [K/G, N, 2] (scale, zero) table."""

    packed: torch.Tensor
    scale_and_zeros: torch.Tensor


@dataclass(frozen=True, slots=True)
class Int4Prepared:
    """``Int4GroupWeight.prepared``: what each int4 kernel reads (None where it does not apply)."""

    packed: Int4Packed | None  # torch's kernel (half-precision activations, N % 16 == 0)
    native: native.Int4Native | None  # the native GEMV


@dataclass(frozen=True, slots=True)
class Int8Grouped:
    """``Int8GroupWeight.prepared``: q as [K/G, N, G] and scales as [K/G, N] in the activation dtype."""

    q: torch.Tensor
    scales: torch.Tensor


def prepare_weight(w: WeightHandle) -> WeightHandle:
    """Re-layout for the kernels above (CPU only; other devices dequantize in tiles)."""
    if w.prepared is not None or w.qweight.device.type != "cpu":
        return w
    if isinstance(w, Mxfp4Weight):
        # The same matrix in int8 groups (mxfp4.py), prepared for the native GEMVs, inside the
        # handle (which keeps its kind: the dispatch key): its own arrays become shape-only.
        inner = prepare_weight(mxfp4.as_int8_groups(w))
        meta = {f: torch.empty_like(getattr(w, f), device="meta") for f in ("qweight", "scales")}
        return dataclasses.replace(w, prepared=inner, **meta)
    dtype = _DTYPES[w.dtype]
    if isinstance(w, Int4GroupWeight):
        packed = None
        if dtype in _HALF and w.out_features % 16 == 0 and w.group_size in INT4_KERNEL_GROUPS \
                and w.in_features % w.group_size == 0:
            q = torch.stack((w.qweight & 15, w.qweight >> 4), -1).view(w.out_features, -1).to(torch.int32)
            zeros = w.offsets + 8 * w.scales
            sz = torch.stack((w.scales, zeros), -1).transpose(0, 1).contiguous().to(dtype)
            packed = Int4Packed(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2), sz)
        fast = native.int4_prepare(w.qweight, w.scales, w.offsets, w.group_size)
        return w if packed is None and fast is None else _replace(w, Int4Prepared(packed, fast))
    if isinstance(w, Int8GroupWeight) and (fast := native.int8_prepare(w.qweight, w.scales, w.offsets,
                                                                        w.group_size)) is not None:
        # The integer GEMM (fast_paths.linear) up to its rows, dense copies past them.
        if not fast.packed:
            return _replace(w, fast)
        # The packed codes and scales are the weight now: the handle's own arrays would double its
        # memory, so they become shape-only (meta) tensors and everything reads `fast` (`_int8_parts`).
        meta = {f: torch.empty_like(getattr(w, f), device="meta") for f in ("qweight", "scales", "offsets")
                if getattr(w, f) is not None}
        return dataclasses.replace(w, prepared=fast, **meta)
    if isinstance(w, Int8GroupWeight) and dtype in _HALF and w.in_features % w.group_size == 0 \
            and not _native_int8(w):
        n, k, g = w.out_features, w.in_features, w.group_size
        q = w.qweight.view(n, k // g, g).transpose(0, 1).contiguous()
        return _replace(w, Int8Grouped(q, w.scales.t().contiguous().to(dtype)))
    return w


def _native_int8(w: Int8GroupWeight) -> bool:
    """The native GEMV reads the weight as stored: no per-group copy is made for torch's kernel."""
    return (native.library() is not None and w.qweight.dtype == torch.int8 and w.scales.dtype == torch.float32
            and w.group_size % 16 == 0)


def _replace(w: WeightHandle, prepared) -> WeightHandle:
    return dataclasses.replace(w, prepared=prepared)


# -- dequantization (the exact fallback, and embedding rows) --------------------

def dequantize(w: WeightHandle, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
    """float32 rows of the weight (all of it by default)."""
    if isinstance(w, Int4GroupWeight):
        p = w.qweight[rows]
        q = torch.stack((p & 15, p >> 4), -1).view(p.shape[0], -1, w.group_size).to(torch.float32)
        return torch.addcmul(w.offsets[rows][..., None], q, w.scales[rows][..., None]).view(p.shape[0], -1)
    if isinstance(w, Int8GroupWeight):
        q, scales, offsets = _int8_parts(w, rows)
        q = q.view(q.shape[0], -1, w.group_size).to(torch.float32)
        if offsets is not None:
            return torch.addcmul(offsets[..., None], q, scales[..., None]).view(q.shape[0], -1)
        return (q * scales[..., None]).view(q.shape[0], -1)
    if isinstance(w, Mxfp4Weight):
        if isinstance(w.prepared, Int8GroupWeight):
            return dequantize(w.prepared, rows)
        return mxfp4.dequantize(w.qweight[rows], w.scales[rows])
    if isinstance(w, Fp8Weight):
        q = w.qweight[rows].view(torch.float8_e4m3fn).to(torch.float32)
        s = w.scales if w.scales.numel() == 1 else w.scales[rows][:, None]
        return q * s
    raise TypeError(f"torch cannot dequantize a {type(w).__name__} (kind {w.kind!r})")


def _int8_parts(w: Int8GroupWeight, rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """int8 q, float32 scales and offsets of the given rows, from the packed codes where the
    weight was packed (`prepare_weight`)."""
    p = w.prepared
    if isinstance(p, native.Int8Native) and p.packed:
        offsets = None if p.offsets is None else p.offsets[rows].float()
        return p.codes(rows), p.scales[rows].float(), offsets
    return w.qweight[rows], w.scales[rows], None if w.offsets is None else w.offsets[rows]


def _linear_in_tiles(x: torch.Tensor, w: WeightHandle) -> torch.Tensor:
    """Dequantize a few thousand rows at a time, so no full float copy of the weight ever exists."""
    n, k = w.out_features, w.in_features
    # bf16 GEMMs are fast on CPUs with AVX512-BF16; fp16 ones are not (see linear.py): fp32 for those.
    cdt = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    xc = x.to(cdt)
    out = torch.empty(x.shape[0], n, dtype=cdt, device=x.device)
    step = max(16, TILE_ELEMENTS // max(1, k))
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        torch.mm(xc, dequantize(w, slice(lo, hi)).to(cdt).t(), out=out[:, lo:hi])
    if w.bias is not None:
        out += w.bias.to(cdt)
    return out.to(x.dtype)


class _DenseCopies:
    """Dequantized copies of quantized weights, keyed by the weight's storage and the copy's
    dtype, freed with the weight (a finalizer on its qweight tensor); `held` bytes in all.

    A weight gets its copy the second time it is multiplied past the quantized kernels' rows
    (the first call runs tiles): one prefill of one prompt makes none, a batch that keeps
    stepping does."""

    def __init__(self):
        self.copies: dict[tuple[int, torch.dtype], DenseWeight] = {}
        self.uses: dict[tuple[int, torch.dtype], int] = {}
        self.held = 0
        self.lock = threading.Lock()

    def _size(self, w: WeightHandle, dtype: torch.dtype) -> int:
        return w.out_features * w.in_features * dtype.itemsize

    def can_hold(self, w: WeightHandle, dtype: torch.dtype) -> bool:
        """Whether `w` has a copy, or one would fit the budget."""
        return (id(w.qweight), dtype) in self.copies or self.held + self._size(w, dtype) <= DENSE_COPY_BYTES

    def get(self, w: WeightHandle, dtype: torch.dtype) -> DenseWeight | None:
        """The copy (prepared for the dense paths, bias included), or None: tiles this time."""
        key = (id(w.qweight), dtype)
        copy = self.copies.get(key)
        if copy is not None:
            return copy
        size = self._size(w, dtype)
        with self.lock:
            if self.held + size > DENSE_COPY_BYTES:
                return None
            uses = self.uses.get(key, 0)
            self.uses[key] = uses + 1
            if uses == 0:
                weakref.finalize(w.qweight, self._drop, key)
                return None
            self.held += size
        try:
            bias = None if w.bias is None else w.bias.to(dtype)
            copy = dense.prepare_weight(DenseWeight(dequantize(w).to(dtype), bias))
        except BaseException:
            with self.lock:
                self.held -= size
            raise
        self.copies[key] = copy
        return copy

    def _drop(self, key) -> None:
        with self.lock:
            self.uses.pop(key, None)
            copy = self.copies.pop(key, None)
            if copy is not None:
                self.held -= copy.weight.numel() * copy.weight.element_size()


DENSE_COPIES = _DenseCopies()


def native_int4_takes(x: torch.Tensor, *weights: WeightHandle) -> bool:
    """Whether the native int4 kernels take x's rows for `weights` (one layer's): up to the
    measured limits, in float32 fewer where dense copies can take the batch."""
    t = x.shape[0]
    if x.dtype != torch.float32:
        return t <= native.INT4_BF16_MAX_ROWS
    if t <= F32_NATIVE_BESIDE_DENSE_ROWS:  # decode: no budget lookup on the hot path
        return True
    return t <= native.INT4_GEMM_MAX_ROWS and not all(DENSE_COPIES.can_hold(w, torch.float32) for w in weights)


def _linear_dense(x: torch.Tensor, w: WeightHandle) -> torch.Tensor:
    """Rows past the quantized kernels' limits: the kept dense copy if the budget allows, else tiles."""
    cdt = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    copy = DENSE_COPIES.get(w, cdt) if isinstance(w, (Int4GroupWeight, Int8GroupWeight, Fp8Weight, Mxfp4Weight)) else None
    if copy is None:
        return _linear_in_tiles(x, w)
    return dense.linear(x.to(cdt), copy).to(x.dtype)


def _int8_grouped(x: torch.Tensor, w: Int8GroupWeight, p: Int8Grouped) -> torch.Tensor:
    xg = x.view(x.shape[0], -1, w.group_size)
    y = torch.zeros(x.shape[0], w.out_features, dtype=torch.float32, device=x.device)
    for g in range(p.q.shape[0]):
        # Each group's partial product is summed in float32: only the result is rounded to x's dtype.
        y += torch.ops.aten._weight_int8pack_mm(xg[:, g], p.q[g], p.scales[g])
    if w.offsets is not None:
        y += offset_term(x, w)
    if w.bias is not None:
        y += w.bias.float()
    return y.to(x.dtype)


def offset_term(x: torch.Tensor, w: Int8GroupWeight) -> torch.Tensor:
    """float32 ``sum_g offsets[n, g] * sum(x[:, group g])``: what an int8 weight's offsets add
    to ``x @ (q * scales).T`` (a [T, K/G] x [K/G, N] product, small beside the GEMV)."""
    sums = x.float().view(x.shape[0], -1, w.group_size).sum(-1)
    return sums @ w.offsets.t()


def unwrap(w: WeightHandle) -> WeightHandle:
    """The handle the kernels read: a prepared MXFP4 weight's int8 groups, else `w`."""
    return w.prepared if isinstance(w, Mxfp4Weight) and isinstance(w.prepared, Int8GroupWeight) else w


def linear(x: torch.Tensor, w: WeightHandle) -> torch.Tensor:
    w = unwrap(w)
    t, p = x.shape[0], w.prepared
    if t == 0:
        return x.new_zeros(0, w.out_features)
    if isinstance(p, Int4Prepared):  # the native GEMM is the fast path before this (fast_paths.linear)
        pk = p.packed
        if pk is not None and t <= INT4_KERNEL_MAX_ROWS and x.dtype == pk.scale_and_zeros.dtype:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), pk.packed, w.group_size, pk.scale_and_zeros)
            return y if w.bias is None else y + w.bias.to(x.dtype)
    if isinstance(p, Int8Grouped) and t <= INT8_GROUP_KERNEL_MAX_ROWS and x.dtype == p.scales.dtype:
        return _int8_grouped(x.contiguous(), w, p)
    return _linear_dense(x, w)


def embedding(ids: torch.Tensor, table: WeightHandle) -> torch.Tensor:
    """Rows of a quantized table, dequantized (a tied, quantized lm_head used as embedding)."""
    return dequantize(table, ids.long()).to(_DTYPES[table.dtype])


# -- what the backend registers: dense handles go to `linear.py` ------------------

def prepare_any(w: WeightHandle) -> WeightHandle:
    return dense.prepare_weight(w) if isinstance(w, DenseWeight) else prepare_weight(w)


def linear_any(x: torch.Tensor, weight: WeightHandle) -> torch.Tensor:
    return dense.linear(x, weight) if isinstance(weight, DenseWeight) else linear(x, weight)


def embedding_any(ids: torch.Tensor, table) -> torch.Tensor:
    return embedding(ids, table) if isinstance(table, WeightHandle) else ops.embedding(ids, table)
