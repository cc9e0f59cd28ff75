"""torch tensors in, torch tensors out: the native kernels behind the torch backend's primitives.

Each function returns None when its kernel does not apply (kernels off, not a
CPU tensor, a dtype other than float32/bfloat16, a layout it does not read, or
more work than one thread should do while torch's ops would use every core);
the caller then runs its torch ops. A kernel that finds an index out of range
raises IndexError, as torch's indexing would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import bf16_dot, library, openmp

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}

# Up to these sizes one thread running a kernel beat torch's ops on both cores of
# a 2-core machine (SmolLM2 shapes, bf16 and fp32); SiLU (an exp per value) lost
# past 32 rows (measurements: docs/backends/torch-measurements.md).
MAX_ROWS = 256
SILU_MAX_ROWS = 32
# Split over torch's OpenMP team (kernels.c, PAR_FOR), rms_norm and rotary beat torch's ops
# at every size (2-7x at 2048 rows); SiLU-and-mul in float32 from 256 rows (torch's float32
# SiLU ran 7x longer at 2048 rows), in bfloat16 at every size (torch's path widens to float32
# and back: 13x longer at 256 and 2048 rows on an AVX-512 Zen 4).
SILU_PAR_MIN_ROWS = 256
MAX_ATTENTION_WORK = 1 << 23  # query rows x keys x query heads x head_dim
# The bf16 dot-product path serves any step whose requests each have at most this many
# query rows x keys: it beat torch's SDPA (one prompt at a time) on prefill steps of 20-200
# token prompts and on one 256-token prompt, was even at 512 and lost from 768 (each row
# reads its keys again: no tiling over queries) (docs/backends/torch-measurements.md).
BF16_ATTENTION_MAX_REQUEST_KEYS = 1 << 17
# ... and at most this much work in all: the kernel's per-unit partial results take ~work / 16
# bytes (64 MiB here).
BF16_ATTENTION_MAX_WORK = 1 << 30


def _lib(*tensors: torch.Tensor):
    dtype = tensors[0].dtype
    if dtype not in _SUFFIX:
        return None
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu:
            return None
    return library()


_FUNCTIONS: dict = {}


def _fn(lib, name: str, dtype: torch.dtype):
    """The typed kernel ``infer_<name>_<f32|bf16>`` (looked up once)."""
    key = (name, dtype)
    fn = _FUNCTIONS.get(key)
    if fn is None:
        fn = _FUNCTIONS[key] = getattr(lib, f"infer_{name}_{_SUFFIX[dtype]}")
    return fn


# A GEMV given an x with inf or nan declines it (torch's arithmetic says what comes out).
_NOT_FINITE = -4


def _check(rc: int, what: str) -> None:
    if rc == -1:
        raise IndexError(f"{what}: an index is out of range")
    if rc != 0:
        raise MemoryError(f"{what}: the native kernel could not allocate its scratch")


def _limit(serial: int) -> int:
    """Rows up to which an elementwise kernel runs: on torch's OpenMP team a big call is split
    over its threads (kernels.c, PAR_FOR) and beat torch's ops at prefill sizes too; with the
    kernels' own pool it runs on one thread, up to `serial` rows."""
    return 1 << 62 if openmp() else serial


def _rows(x: torch.Tensor, limit: int = MAX_ROWS) -> bool:
    return x.dim() == 2 and x.stride(1) == 1 and x.shape[0] <= limit


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    args = (x, weight) if residual is None else (x, weight, residual)
    lib = _lib(*args)
    if lib is None or not _rows(x, _limit(MAX_ROWS)) or not weight.is_contiguous() or weight.shape != x.shape[1:]:
        return None
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        return None
    rows, n = x.shape
    # empty_like: cheaper than torch.empty, and a decode step makes 120 of these
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    fn = _fn(lib, "rms_norm", x.dtype)
    if residual is None:
        _check(fn(x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), out.data_ptr(), n, None, 0, rows, n, eps),
               "rms_norm")
        return out
    summed = torch.empty_like(x, memory_format=torch.contiguous_format)
    _check(fn(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(), out.data_ptr(), n,
              summed.data_ptr(), n, rows, n, eps), "rms_norm")
    return out, summed


def _heads(x: torch.Tensor, limit: int = MAX_ROWS) -> bool:
    return x.dim() == 3 and x.stride(2) == 1 and x.shape[0] <= limit


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, neox_style: bool):
    lib = _lib(q, k)
    rows = _limit(MAX_ROWS)
    if lib is None or not (_heads(q, rows) and _heads(k, rows)) or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        return None
    rot = cos_sin_cache.shape[1]
    if cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous() or rot > q.shape[2] or rot % 2:
        return None
    if positions.dtype != torch.int64 or not positions.is_contiguous() or positions.shape != q.shape[:1]:
        return None
    t, hq, d = q.shape
    hk = k.shape[1]
    out = torch.empty((t, hq + hk, d), dtype=q.dtype)
    fn = _fn(lib, "rotary", q.dtype)
    _check(fn(q.data_ptr(), q.stride(0), q.stride(1), hq, k.data_ptr(), k.stride(0), k.stride(1), hk,
              positions.data_ptr(), cos_sin_cache.data_ptr(), cos_sin_cache.shape[0], rot, int(neox_style),
              out.data_ptr(), t, d), "rotary: a position is outside the rope table")
    return out[:, :hq], out[:, hq:]


def silu_and_mul(x: torch.Tensor, kind: str = "silu"):
    """act(x[:, :h]) * x[:, h:] for act SiLU or (kind 'gelu_tanh') GELU's tanh form; None
    where the kernel does not apply."""
    lib = _lib(x)
    if lib is None or not _rows(x, _limit(SILU_MAX_ROWS)) or x.shape[1] % 2:
        return None
    if x.shape[0] > SILU_MAX_ROWS and x.dtype == torch.float32 and x.shape[0] < SILU_PAR_MIN_ROWS:
        return None  # on the team: float32 from SILU_PAR_MIN_ROWS only
    rows, h = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, h), dtype=x.dtype)
    name = "gelu_tanh_and_mul" if kind == "gelu_tanh" else "silu_and_mul"
    _check(_fn(lib, name, x.dtype)(x.data_ptr(), x.stride(0), out.data_ptr(), rows, h),
           "act_and_mul")
    return out


def token_bitmask(x: torch.Tensor, bitmask: torch.Tensor):
    """float32 logits [B, V] with -inf where the structured-output bitmask [B, ceil(V/32)] int32 clears the bit."""
    if x.dtype != torch.float32 or bitmask.dtype != torch.int32 or not (x.is_cpu and bitmask.is_cpu):
        return None
    lib = library()
    if lib is None or x.dim() != 2 or x.stride(1) != 1 or bitmask.stride(1) != 1:
        return None
    rows, v = x.shape
    out = torch.empty((rows, v), dtype=torch.float32)
    _check(lib.infer_token_bitmask(x.data_ptr(), x.stride(0), bitmask.data_ptr(), bitmask.stride(0),
                                   out.data_ptr(), rows, v), "token_bitmask")
    return out


def kv_write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             scales: tuple[float, float] | None = None) -> bool:
    """True when written; False when the kernel does not apply. An fp8 (uint8) cache takes `scales`."""
    lib = _lib(k, v)
    fp8 = kv_cache.dtype == torch.uint8
    if lib is None or not (_heads(k) and _heads(v)) or not kv_cache.is_contiguous() or not kv_cache.is_cpu:
        return False
    if (kv_cache.dtype != k.dtype and not fp8) or (fp8 and scales is None):
        return False
    t, hk, d = k.shape
    if v.shape != k.shape or kv_cache.shape[-2:] != (hk, d) or kv_cache.shape[0] != 2:
        return False
    if k.stride(1) != d or v.stride(1) != d or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        return False
    if slot_mapping.shape[0] != t:
        raise ValueError(f"kv_write: slot_mapping has {slot_mapping.shape[0]} entries for {t} rows of k")
    nslots = kv_cache.numel() // (2 * hk * d)
    head = (k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slot_mapping.data_ptr(), t, kv_cache.data_ptr(), nslots)
    if fp8:
        rc = _fn(lib, "kv_write_fp8", k.dtype)(*head, hk * d, float(scales[0]), float(scales[1]))
    else:
        rc = lib.infer_kv_write(*head, hk * d, kv_cache.element_size())
    _check(rc, "kv_write: a slot is outside the cache")
    return True


def _bf16_attention(dtype: torch.dtype, cache_dtype: torch.dtype, hq: int, hk: int, d: int) -> bool:
    """Whether the kernel's bf16 dot-product path serves these heads (kernels.c, ATT_FAST_BF16)."""
    return (dtype == torch.bfloat16 and cache_dtype == torch.bfloat16 and bf16_dot() and d in (64, 128, 256)
            and hk > 0 and hq % hk == 0 and hq // hk <= 8)


def _attention_fits(work: int, request_keys: int, bf16_path: bool) -> bool:
    """Whether a step's attention is the kernel's to do: little work in all, or (bf16 dot-product
    path) no request with more than BF16_ATTENTION_MAX_REQUEST_KEYS query rows x keys and at
    most BF16_ATTENTION_MAX_WORK in all."""
    return work <= MAX_ATTENTION_WORK or (bf16_path and 0 <= request_keys <= BF16_ATTENTION_MAX_REQUEST_KEYS
                                          and work <= BF16_ATTENTION_MAX_WORK)


def _sinks_ok(sinks: torch.Tensor, hq: int) -> bool:
    return sinks.dtype == torch.float32 and sinks.is_cpu and sinks.is_contiguous() and tuple(sinks.shape) == (hq,)


def attention(q: torch.Tensor, kv_cache: torch.Tensor, meta, scale: float, sliding_window: int | None,
              work: int, kv_scales: tuple[float, float] | None = None, request_keys: int = -1,
              soft_cap: float | None = None, sinks: torch.Tensor | None = None):
    """`work`: query rows x keys read x query heads x head_dim, summed over the batch (the caller
    plans it once a step); `request_keys`: the most query rows x keys of one request (-1:
    unknown). An fp8 (uint8) cache takes `kv_scales`; `soft_cap` caps scores and `sinks`
    (float32 [query heads], contiguous) join each softmax's denominator, as `spec.attention`.

    Split over torch's threads when the kernels run on its OpenMP team; with their own pool,
    one thread: between torch ops, that pool and torch's spinning OpenMP threads take each
    other's cores (dense float32 decode measured slower with the attention split across 2
    threads: docs/backends/torch-measurements.md)."""
    lib = _lib(q)
    fp8 = kv_cache.dtype == torch.uint8
    if lib is None or q.dim() != 3 or q.stride(2) != 1 or kv_cache.dim() != 5 or not kv_cache.is_contiguous():
        return None
    bf16_path = _bf16_attention(q.dtype, kv_cache.dtype, q.shape[1], kv_cache.shape[3], q.shape[2])
    if not _attention_fits(work, request_keys, bf16_path):
        return None
    if not kv_cache.is_cpu or (kv_cache.dtype != q.dtype and not fp8) or (fp8 and kv_scales is None):
        return None
    t, hq, d = q.shape
    _, nblocks, bs, hk, dk = kv_cache.shape
    ints = (meta.block_table, meta.query_start_loc, meta.seq_lens)
    if dk != d or hq % hk or any(x.dtype != torch.int32 or not x.is_cpu for x in ints):
        return None
    bt = meta.block_table
    if bt.dim() != 2 or bt.stride(1) != 1 or not meta.query_start_loc.is_contiguous() or not meta.seq_lens.is_contiguous():
        return None
    if meta.query_start_loc.shape != (meta.seq_lens.shape[0] + 1,) or bt.shape[0] < meta.seq_lens.shape[0]:
        return None
    if sinks is not None and not _sinks_ok(sinks, hq):
        return None
    out = torch.empty((t, hq, d), dtype=q.dtype)
    fn = _fn(lib, "attention_fp8" if fp8 else "attention", q.dtype)
    k_scale, v_scale = kv_scales if fp8 else (1.0, 1.0)
    _check(fn(q.data_ptr(), q.stride(0), q.stride(1), t, hq, kv_cache.data_ptr(), nblocks, bs, hk, d,
              bt.data_ptr(), bt.stride(0), bt.shape[1], meta.query_start_loc.data_ptr(), meta.seq_lens.data_ptr(),
              meta.seq_lens.shape[0], scale, sliding_window or 0, out.data_ptr(), float(k_scale), float(v_scale),
              float(soft_cap or 0.0), None if sinks is None else sinks.data_ptr(),
              torch.get_num_threads() if openmp() else 1),
           "attention: the batch metadata points outside q, the block table or the cache")
    return out


# -- quantized GEMVs (few rows): the kernels split output rows across torch's thread count
# on their own thread pool (native/kernels.c), which hands off in a microsecond or two.
INT8_GEMV_MAX_ROWS = 8


def int8_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int):
    """float32 ``x @ (q * scales).T`` for a few rows of x; None when the kernel does not apply."""
    lib = _lib(x)
    if lib is None or x.dim() != 2 or x.stride(1) != 1 or not 0 < x.shape[0] <= INT8_GEMV_MAX_ROWS:
        return None
    n, k = qweight.shape
    if (qweight.dtype != torch.int8 or scales.dtype != torch.float32 or qweight.device.type != "cpu"
            or not (qweight.is_contiguous() and scales.is_contiguous()) or x.shape[1] != k
            or group_size % 16 or k % group_size or scales.shape != (n, k // group_size)):
        return None
    rows = x.shape[0]
    y = torch.empty((rows, n), dtype=torch.float32)
    _check(_fn(lib, "int8_gemv", x.dtype)(qweight.data_ptr(), scales.data_ptr(), x.data_ptr(), x.stride(0), rows, k,
                                          group_size, y.data_ptr(), n, torch.get_num_threads()), "int8 linear")
    return y


# bf16 rows up to which the AVX512-BF16 kernel (a register tile) beats torch's bf16 GEMM (oneDNN) on a dense weight;
# set by measurement (docs/backends/torch-measurements.md).
BF16_GEMV_MAX_ROWS = 64


def bf16_gemv(x: torch.Tensor, weight: torch.Tensor):
    """bfloat16 ``x @ weight.T`` for up to BF16_GEMV_MAX_ROWS rows of x (AVX512-BF16 dot products, float32 sums);
    None when the kernel does not apply (no AVX512-BF16, other dtypes or layouts, more rows)."""
    lib = _lib(x, weight)
    if (lib is None or x.dtype != torch.bfloat16 or not bf16_dot() or x.dim() != 2 or x.stride(1) != 1
            or not 0 < x.shape[0] <= BF16_GEMV_MAX_ROWS or weight.dim() != 2 or not weight.is_contiguous()
            or weight.shape[1] != x.shape[1]):
        return None
    rows, (n, k) = x.shape[0], weight.shape
    y = torch.empty((rows, n), dtype=torch.bfloat16)
    _check(lib.infer_bf16_gemv(x.data_ptr(), x.stride(0), rows, k, weight.data_ptr(), y.data_ptr(), n,
                               torch.get_num_threads()), "bf16 linear")
    return y


def _bf16_rows(t: torch.Tensor | None, shape: tuple) -> torch.Tensor | None:
    """t as a contiguous bf16 tensor of `shape` (None stays None); raises ValueError on another shape."""
    if t is None:
        return None
    if tuple(t.shape) != shape:
        raise ValueError(f"moe: a tensor of shape {tuple(t.shape)} where {shape} was expected")
    return t.to(torch.bfloat16).contiguous()


def moe_bf16(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
             renormalize: bool, shared=None, shared_gate=None, w13_bias=None, w2_bias=None, activation=None,
             alpha: float = 1.702, limit: float = 7.0, scaling: float | None = None, scoring_func=None,
             routing_bias=None, expert_groups=None):
    """The `moe` primitive for up to BF16_GEMV_MAX_ROWS bf16 rows in one call (kernels.c, infer_moe_bf16),
    its routing included (softmax or sigmoid scores, DeepSeek's selection bias and groups): (out,
    tokens per expert), or None where the kernel does not apply."""
    lib = _lib(x, w13, w2)
    if (lib is None or x.dtype != torch.bfloat16 or not bf16_dot() or x.dim() != 2 or not x.is_contiguous()
            or not 0 < x.shape[0] <= BF16_GEMV_MAX_ROWS or w13.dim() != 3 or not w13.is_contiguous()
            or w2.dim() != 3 or not w2.is_contiguous() or activation not in (None, "silu", "swiglu_oai")):
        return None
    (rows, hidden), (nexp, two_i, _) = x.shape, w13.shape
    inter = two_i // 2
    if w13.shape != (nexp, 2 * inter, hidden) or w2.shape != (nexp, hidden, inter) or not 0 < top_k <= nexp:
        return None
    if scoring_func not in (None, "softmax", "sigmoid"):
        return None
    groups, keep, kind = expert_groups or (0, 0, "max")
    if expert_groups is not None and (kind not in ("max", "top2") or groups < 1 or nexp % groups
                                      or not 0 < keep <= groups or top_k > keep * (nexp // groups)):
        return None
    logits = router_logits.float().contiguous()
    bias = None if routing_bias is None else routing_bias.float().contiguous()
    if logits.shape != (rows, nexp) or (bias is not None and bias.shape != (nexp,)):
        return None
    ids = torch.empty((rows, top_k), dtype=torch.int64)
    weights = torch.empty((rows, top_k), dtype=torch.float32)
    b13, b2 = _bf16_rows(w13_bias, (nexp, 2 * inter)), _bf16_rows(w2_bias, (nexp, hidden))
    shared = _bf16_rows(shared, (rows, hidden))
    gate = None if shared_gate is None else shared_gate.float().reshape(rows).contiguous()
    out = torch.empty((rows, hidden), dtype=torch.bfloat16)
    counts = torch.empty(nexp, dtype=torch.int64)

    def ptr(t):
        return None if t is None else t.data_ptr()

    rc = lib.infer_moe_bf16(x.data_ptr(), rows, hidden, inter, nexp, top_k, logits.data_ptr(), 1, int(renormalize),
                            float(1.0 if scaling is None else scaling), int(scoring_func == "sigmoid"), ptr(bias),
                            groups, keep, int(kind == "top2"), ids.data_ptr(),
                            weights.data_ptr(), w13.data_ptr(), w2.data_ptr(), ptr(b13), ptr(b2),
                            int(activation == "swiglu_oai"), float(alpha), float(limit), ptr(shared), ptr(gate),
                            out.data_ptr(), counts.data_ptr(), torch.get_num_threads())
    _check(rc, "moe: the routing's top_k or groups do not fit the experts")
    return out, counts


INT4_GEMM_MAX_ROWS = 32
# bf16 rows up to which the native GEMV beats torch's packed int4 kernel (it unpacks each weight
# once per two rows; on SmolLM2's shapes the two were even at T=2, torch's ahead from T=4).
INT4_BF16_MAX_ROWS = 2


@dataclass(frozen=True, slots=True)
class Int4Native:
    """An int4 weight checked once for the native GEMV (the weight never changes, so a
    decode step's calls only check x). Where the scales and offsets are float16 values
    (GGUF's d and m are) the kernel reads float16 copies: the weight streams from memory
    in 0.625 bytes per value instead of 0.75."""

    qweight: torch.Tensor
    scales: torch.Tensor  # float32, or its float16 copy
    offsets: torch.Tensor
    args: tuple[int, int, int, int, int]  # qweight, scales, offsets pointers, group size, float16 (0/1)

    @property
    def shape(self) -> tuple[int, int]:
        """(out features, in features)."""
        return self.qweight.shape[0], 2 * self.qweight.shape[1]


@dataclass(frozen=True, slots=True)
class DenseNative:
    """A dense bf16 weight [N, K] for the fused attention block and MLP (bf16 activations):
    its pointer where an int4 weight's go, no scales (kernels.c, layer_gemm)."""

    weight: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def args(self) -> tuple[int, int, int, int, int]:
        return (self.weight.data_ptr(), 0, 0, 0, 0)


def dense_prepare(weight: torch.Tensor) -> DenseNative | None:
    """A dense weight the fused bf16 layers read, or None (no AVX512-BF16, not bf16, strided)."""
    if (not bf16_dot() or weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_cpu
            or not weight.is_contiguous()):
        return None
    return DenseNative(weight)


def _max_rows(dtype: torch.dtype, *weights) -> int:
    """Rows of x a fused layer serves: each projection's kernel's limit, SiLU's too."""
    if all(isinstance(w, DenseNative) for w in weights):
        limit = BF16_GEMV_MAX_ROWS if dtype == torch.bfloat16 else 0
    elif all(isinstance(w, (Int4Native, Int8Native)) for w in weights):  # K-quant mixes: both in one layer
        limit = min(INT8_GEMM_MAX_ROWS if isinstance(w, Int8Native) else
                    INT4_GEMM_MAX_ROWS if dtype == torch.float32 else INT4_BF16_MAX_ROWS for w in weights)
    else:
        limit = 0  # one layer's projections dense and quantized: not packed
    return min(limit, SILU_MAX_ROWS)


def _half_copy(t: torch.Tensor) -> torch.Tensor | None:
    """t as float16 when that is exact (finite, no value rounded), else None."""
    h = t.to(torch.float16)
    return h if torch.equal(h.float(), t) else None


def int4_prepare(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int):
    """The weight as the native GEMV reads it, or None when it cannot (see `int4_gemm`)."""
    lib = library()
    if lib is None:
        return None
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    if (qweight.dtype != torch.uint8 or not qweight.is_cpu or not qweight.is_contiguous() or n % 4
            or group_size % 32 or k % group_size or scales.dtype != torch.float32 or offsets.dtype != torch.float32
            or not (scales.is_contiguous() and offsets.is_contiguous())
            or scales.shape != (n, k // group_size) or offsets.shape != scales.shape):
        return None
    halves = (_half_copy(scales), _half_copy(offsets)) if lib.infer_int4_half_scales() else (None, None)
    if halves[0] is not None and halves[1] is not None:
        scales, offsets = halves
    f16 = int(scales.dtype == torch.float16)
    pointers = (qweight.data_ptr(), scales.data_ptr(), offsets.data_ptr())
    return Int4Native(qweight, scales, offsets, (*pointers, group_size, f16))


def int4_gemm_prepared(x: torch.Tensor, w: Int4Native):
    """``x @ (q * scales + offsets).T`` in x's dtype for up to INT4_GEMM_MAX_ROWS rows of x,
    split across torch's thread count; None when the kernel does not apply to x."""
    lib = _lib(x)
    n, k = w.qweight.shape[0], 2 * w.qweight.shape[1]
    if lib is None or x.dim() != 2 or x.stride(1) != 1 or not 0 < x.shape[0] <= INT4_GEMM_MAX_ROWS or x.shape[1] != k:
        return None
    rows = x.shape[0]
    y = torch.empty((rows, n), dtype=x.dtype)
    rc = _fn(lib, "int4_gemm", x.dtype)(*w.args, x.data_ptr(), x.stride(0), rows, k, y.data_ptr(), n,
                                        torch.get_num_threads())
    if rc == _NOT_FINITE:
        return None
    _check(rc, "int4 linear")
    return y


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int):
    """`int4_gemm_prepared` for a weight not prepared beforehand."""
    w = int4_prepare(qweight, scales, offsets, group_size)
    return None if w is None else int4_gemm_prepared(x, w)


# Rows up to which the integer int8 GEMM serves a step (its per-row work is small: one
# conversion of the codes per activation row, and torch's alternatives for a few rows are
# a per-group int8 kernel or a dequantized copy).
INT8_GEMM_MAX_ROWS = 8
_INT8_KIND = 2  # the kind slot of a weight's packed arguments (kernels.c, layer_gemm)


@dataclass(frozen=True, slots=True)
class Int8Native:
    """An int8 group weight (with or without offsets) checked once for the integer GEMM
    (`infer_int8_gemm`: VNNI builds only)."""

    qweight: torch.Tensor  # [N, K] int8, or (bits < 8) the packed codes (kernels.c, LOWBIT_KIND)
    scales: torch.Tensor  # float32, or float16 where exact (packed codes only)
    offsets: torch.Tensor | None
    args: tuple[int, int, int, int, int]  # qweight, scales, offsets (0: none) pointers, group size, kind
    bits: int = 8  # bits a packed code takes: 4, 5, 6 or 8
    centre: int = 0  # packed codes are q + centre
    dims: tuple[int, int] = (0, 0)  # [N, K] of a packed weight; (0, 0): qweight is the int8 [N, K]

    @property
    def packed(self) -> bool:
        return self.dims != (0, 0)

    @property
    def shape(self) -> tuple[int, int]:
        return self.dims if self.packed else tuple(self.qweight.shape)

    def codes(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """int8 q of the given rows (a packed weight's codes unpacked)."""
        if not self.packed:
            return self.qweight[rows]
        n, k = self.dims
        blocks = self.qweight.view(n // 4, k // 64, 4, -1)
        ids = torch.arange(n)[rows]
        b = blocks[ids // 4, :, ids % 4]  # [R, K/64, block bytes]
        if self.bits == 8:
            u = b.view(torch.int8)
        else:
            b = b.to(torch.int16)
            u = torch.cat((b[..., :32] & 15, b[..., :32] >> 4), -1)
            for p in range(self.bits - 4):
                plane = b[..., 32 + 8 * p:40 + 8 * p]
                u += ((plane[..., None] >> _BIT_INDEX) & 1).flatten(-2) << (4 + p)
            u = u - self.centre
        if self.args[3] in _GROUP_UNORDER:
            u = u[..., _GROUP_UNORDER[self.args[3]]]
        return u.reshape(len(ids), k).to(torch.int8)


_BIT_INDEX = torch.arange(8, dtype=torch.int16)
# A block's packed order (kernels.c, lowbit_lo / lowbit_quarters): groups of 32, codes 0-15 of
# both of its groups then 16-31 of both; groups of 16, codes 0-7 of its four, then 8-15.
_GROUP_ORDER = {32: torch.arange(64).view(2, 2, 16).transpose(0, 1).reshape(-1),
                16: torch.arange(64).view(4, 2, 8).transpose(0, 1).reshape(-1)}
_GROUP_UNORDER = {g: torch.argsort(order) for g, order in _GROUP_ORDER.items()}


def _pack_low_bits(q: torch.Tensor, group: int) -> tuple[torch.Tensor, int, int] | None:
    """[N, K] int8 codes as the packed layout of kernels.c (LOWBIT_KIND): (bytes, bits, centre);
    codes spanning 64 values or more keep 8 bits."""
    n, k = q.shape
    lo, hi = (int(v) for v in torch.aminmax(q))
    bits = next((b for b in (4, 5, 6) if hi - lo < 1 << b), 8)
    order = _GROUP_ORDER.get(group, slice(None))
    if bits == 8:
        u = q.view(torch.uint8).view(n // 4, 4, k // 64, 64)[..., order]
        return u.transpose(1, 2).contiguous().view(-1), 8, 0
    u = (q.to(torch.int16) - lo).view(n, k // 64, 64)[..., order]
    parts = [((u[..., :32] & 15) | ((u[..., 32:] & 15) << 4)).to(torch.uint8)]
    for p in range(bits - 4):
        bit = ((u >> (4 + p)) & 1).view(n, k // 64, 8, 8) << _BIT_INDEX
        parts.append(bit.sum(-1).to(torch.uint8))
    packed = torch.cat(parts, -1).view(n // 4, 4, k // 64, -1).transpose(1, 2).contiguous()
    return packed.view(-1), bits, -lo


def int8_prepare(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, group_size: int,
                 pack: bool = True):
    """The weight as `infer_int8_gemm` reads it, or None where it cannot (no VNNI; N % 4,
    K % 32; groups other than 16 or a multiple of 32; not contiguous float32 tables).

    Codes spanning fewer than 64 values (GGUF Q5_0, Q5_1, Q5_K, Q6_K, Q3_K, MXFP4: the int8
    form of 3- to 6-bit formats) are packed (`pack`) into 4, 5 or 6 bits with float16 scales
    where exact: a decode step streams what the GGUF file stores, not 1.125 bytes a weight;
    the results are the int8 kernel's (to float32 rounding; see LOWBIT_KIND)."""
    lib = library()
    if lib is None or not lib.infer_int4_half_scales():  # the VNNI build
        return None
    n, k = qweight.shape
    if (qweight.dtype != torch.int8 or not qweight.is_cpu or not qweight.is_contiguous() or n % 4 or k % 32
            or (group_size != 16 and group_size % 32) or k % group_size or scales.dtype != torch.float32
            or not scales.is_contiguous() or scales.shape != (n, k // group_size)):
        return None
    if offsets is not None and (offsets.dtype != torch.float32 or not offsets.is_contiguous()
                                or offsets.shape != scales.shape):
        return None
    if pack and k % 64 == 0 and (group_size in (16, 32) or group_size % 64 == 0):
        halves = (_half_copy(scales), None if offsets is None else _half_copy(offsets))
        half = halves[0] is not None and (offsets is None or halves[1] is not None)
        if half:
            scales, offsets = halves
        codes, bits, centre = _pack_low_bits(qweight, group_size)
        kind = _INT8_KIND + 1 | bits << 4 | int(half) << 8 | (centre + 256) << 12
        pointers = (codes.data_ptr(), scales.data_ptr(), 0 if offsets is None else offsets.data_ptr())
        return Int8Native(codes, scales, offsets, (*pointers, group_size, kind), bits, centre, (n, k))
    pointers = (qweight.data_ptr(), scales.data_ptr(), 0 if offsets is None else offsets.data_ptr())
    return Int8Native(qweight, scales, offsets, (*pointers, group_size, _INT8_KIND))


def int8_gemm_prepared(x: torch.Tensor, w: Int8Native):
    """``x @ (q * scales (+ offsets)).T`` in x's dtype for up to INT8_GEMM_MAX_ROWS rows; None
    when the kernel does not apply to x (or x holds inf or nan)."""
    lib = _lib(x)
    n, k = w.shape
    if lib is None or x.dim() != 2 or x.stride(1) != 1 or not 0 < x.shape[0] <= INT8_GEMM_MAX_ROWS or x.shape[1] != k:
        return None
    y = torch.empty((x.shape[0], n), dtype=x.dtype)
    rc = _fn(lib, "int8_gemm", x.dtype)(*w.args, x.data_ptr(), x.stride(0), x.shape[0], k, y.data_ptr(), n,
                                        torch.get_num_threads())
    if rc == _NOT_FINITE:
        return None
    _check(rc, "int8 linear")
    return y


# -- a decode step's attention block and MLP in one call each (quantized or bf16 weights) ---
@dataclass(frozen=True, slots=True)
class Packed:
    """Arguments checked once and packed for the native attention block or MLP (a layer's
    weights and cache, or a step's metadata): the tensors they point into, and the array."""

    keep: tuple
    array: torch.Tensor  # int64
    dtype: torch.dtype | None = None  # the activations' (layers)
    hidden: int = 0
    scale: float = 0.0
    max_rows: int = 0  # rows of x its kernels serve (layers)
    bf16_attention: bool = False  # its attention takes the bf16 dot-product path (layers)
    heads: int = 0  # query heads (latent attention layers)
    latent: int = 0  # values a token's latent holds (latent attention layers)


def _pack(values, keep, **kw) -> Packed:
    return Packed(tuple(keep), torch.tensor(values, dtype=torch.int64), **kw)


def attention_block_layer(qkv: Int4Native | Int8Native | DenseNative, o: Int4Native | Int8Native | DenseNative,
                          cos_sin: torch.Tensor,
                          neox_style: bool,
                          kv_cache: torch.Tensor, heads: tuple[int, int, int], scale: float, window: int | None,
                          soft_cap: float | None = None, qk_norms: tuple | None = None,
                          biases: tuple = (None, None), sinks: torch.Tensor | None = None):
    """A layer's side of `attention_block`, checked and packed, or None when the kernels cannot
    serve it. `heads` is (query heads, KV heads, head_dim); `cos_sin` None: no rotary (q and k
    as projected); `qk_norms` (q weight, k weight, whole, eps): RMSNorm of q and k before
    rotary, per head (weights [d]) or over all heads of the projection (``whole``, weights
    [hq * d] and [hk * d]); `biases`: the qkv and o projections' (or None), added after each
    product; `sinks`: float32 [hq], as `attention`'s."""
    hq, hk, d = heads
    norms = (0, 0, 0, 0)
    if qk_norms is not None:
        qw, kw, whole, eps = qk_norms
        want = ((hq * d,), (hk * d,)) if whole else ((d,), (d,))
        if (tuple(qw.shape), tuple(kw.shape)) != want or qw.dtype != kv_cache.dtype or kw.dtype != kv_cache.dtype \
                or not (qw.is_contiguous() and kw.is_contiguous()):
            return None
        norms = (qw.data_ptr(), kw.data_ptr(), int(whole), _float_bits(eps))
    if library() is None or kv_cache.dtype not in _SUFFIX or hk <= 0 or hq % hk:
        return None
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_cpu or not kv_cache.is_contiguous() \
            or kv_cache.shape[-2:] != (hk, d):
        return None
    hidden, max_rows = o.shape[0], _max_rows(kv_cache.dtype, qkv, o)
    if qkv.shape != ((hq + 2 * hk) * d, hidden) or o.shape != (hidden, hq * d) or not max_rows:
        return None
    if cos_sin is None:
        rope = (0, 1 << 62, 0)
    elif cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous() or cos_sin.shape[1] > d or cos_sin.shape[1] % 2:
        return None
    else:
        rope = (cos_sin.data_ptr(), cos_sin.shape[0], cos_sin.shape[1])
    bias_args = []
    for b, n in zip(biases, (qkv.shape[0], hidden)):
        if b is not None and (tuple(b.shape) != (n,) or b.dtype != kv_cache.dtype or not b.is_contiguous()):
            return None
        bias_args.append(0 if b is None else b.data_ptr())
    if sinks is not None and not _sinks_ok(sinks, hq):
        return None
    _, nblocks, bs = kv_cache.shape[:3]
    values = (*qkv.args, *o.args, *rope, int(neox_style), kv_cache.data_ptr(), nblocks, bs, hq, hk, d, hidden,
              window or 0, _float_bits(soft_cap or 0.0), *norms, *bias_args, 0 if sinks is None else sinks.data_ptr())
    return _pack(values, (qkv, o, cos_sin, kv_cache, qk_norms, biases, sinks), dtype=kv_cache.dtype, hidden=hidden,
                 scale=scale, max_rows=max_rows,
                 bf16_attention=_bf16_attention(kv_cache.dtype, kv_cache.dtype, hq, hk, d))


def attention_block_step(meta):
    """A step's side of `attention_block` (its slots, block table and lengths), checked and
    packed, or None."""
    bt, qsl, seq, slots = meta.block_table, meta.query_start_loc, meta.seq_lens, meta.slot_mapping
    if any(t.dtype != torch.int32 or not t.is_cpu for t in (bt, qsl, seq)) or bt.dim() != 2 or bt.stride(1) != 1:
        return None
    if not (qsl.is_contiguous() and seq.is_contiguous()) or slots.dtype != torch.int64 or slots.dim() != 1 \
            or not slots.is_contiguous() or not slots.is_cpu or qsl.shape != (seq.shape[0] + 1,) \
            or bt.shape[0] < seq.shape[0]:
        return None
    values = (slots.data_ptr(), bt.data_ptr(), bt.stride(0), bt.shape[1], qsl.data_ptr(), seq.data_ptr(), seq.shape[0])
    return _pack(values, (bt, qsl, seq, slots))


def _step_rows(positions: torch.Tensor, step: Packed, rows: int) -> bool:
    """Whether a fused attention call's positions and the step's slots are for its `rows` rows."""
    return (positions.dtype == torch.int64 and positions.is_contiguous() and positions.shape == (rows,)
            and step.keep[3].shape == (rows,))


def attention_block(x: torch.Tensor, positions: torch.Tensor, layer: Packed, step: Packed, work: int,
                    request_keys: int = -1):
    """The attention node (qkv projection, rotary, kv_write, attention, o projection) for the
    rows of x; None when the kernels do not apply. `work` and `request_keys` as in `attention`."""
    lib = _lib(x)
    if lib is None or x.dtype != layer.dtype or not _layer_rows(x, layer) or x.shape[1] != layer.hidden \
            or not _attention_fits(work, request_keys, layer.bf16_attention):
        return None
    rows = x.shape[0]
    if not _step_rows(positions, step, rows):
        return None
    out = torch.empty((rows, layer.hidden), dtype=x.dtype)
    rc = _fn(lib, "attention_block_packed", x.dtype)(x.data_ptr(), rows, positions.data_ptr(), layer.array.data_ptr(),
                                                     step.array.data_ptr(), layer.scale, out.data_ptr(),
                                                     torch.get_num_threads())
    if rc == _NOT_FINITE:  # this step's kv_write may have run: the primitives write the same again
        return None
    _check(rc, "attention block: a position, slot or block is outside its table")
    return out


def mla_block_layer(down: DenseNative, up: DenseNative, o: DenseNative, q_a_norm, kv_a_norm: torch.Tensor,
                    kv_b: torch.Tensor, cos_sin: torch.Tensor, neox_style: bool, kv_cache: torch.Tensor, attrs: dict,
                    dtype: torch.dtype):
    """A layer's side of `mla_block` (DeepSeek's latent attention; bf16 dense weights), checked and
    packed, or None. `down` is ``kv_a_proj`` or (with `q_a_norm`, a q LoRA) ``q_a_kv_a_proj``, `up`
    ``q_proj`` or ``q_b_proj``; `attrs` the node's (head sizes, scale, eps)."""
    n, p, r, vd = attrs["qk_nope_head_dim"], attrs["rotary_dim"], attrs["kv_lora_rank"], attrs["v_head_dim"]
    if (library() is None or dtype != torch.bfloat16 or not bf16_dot() or not all(isinstance(w, DenseNative)
                                                                                 for w in (down, up, o))):
        return None
    if kv_b.dim() != 2 or kv_b.shape[0] % (n + vd) or kv_b.shape[1] != r:
        return None
    heads, hidden = kv_b.shape[0] // (n + vd), o.shape[0]
    qr = down.shape[0] - r - p
    if (qr < 0 or (qr > 0) != (q_a_norm is not None) or down.shape[1] != hidden
            or up.shape != (heads * (n + p), qr or hidden) or o.shape != (hidden, heads * vd)):
        return None
    half = (r + p) // 2
    if r < half:  # the kernel reads c as the first plane and the start of the second
        return None
    if kv_cache.dtype != dtype or kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != (1, half) \
            or not kv_cache.is_contiguous() or not kv_cache.is_cpu or 2 * half != r + p:
        return None
    if cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous() or cos_sin.shape[1] != p or p % 2:
        return None
    norms = [w if w is None else w.to(dtype).contiguous() for w in (q_a_norm, kv_a_norm)]
    if norms[1].shape != (r,) or (norms[0] is not None and norms[0].shape != (qr,)):
        return None
    kv_b = kv_b.to(dtype).contiguous()
    _, nblocks, bs = kv_cache.shape[:3]
    values = (up.weight.data_ptr(), down.weight.data_ptr(), qr, 0 if norms[0] is None else norms[0].data_ptr(),
              norms[1].data_ptr(), kv_b.data_ptr(), o.weight.data_ptr(), cos_sin.data_ptr(), cos_sin.shape[0],
              int(neox_style), kv_cache.data_ptr(), nblocks, bs, half, heads, n, p, r, vd, hidden,
              _float_bits(attrs["eps"]), _float_bits(attrs["scale"]))
    return _pack(values, (down, up, o, norms, kv_b, cos_sin, kv_cache), dtype=dtype, hidden=hidden,
                 max_rows=BF16_GEMV_MAX_ROWS, heads=heads, latent=r + p)


def mla_block(x: torch.Tensor, positions: torch.Tensor, layer: Packed, step: Packed, row_keys: int):
    """The latent attention node for the rows of x (`row_keys`: query rows x keys of the step);
    None when the kernel does not apply (more attention work than MAX_ATTENTION_WORK)."""
    lib = _lib(x)
    if lib is None or x.dtype != layer.dtype or not _layer_rows(x, layer) or x.shape[1] != layer.hidden \
            or row_keys * layer.heads * layer.latent > MAX_ATTENTION_WORK:
        return None
    rows = x.shape[0]
    if not _step_rows(positions, step, rows):
        return None
    out = torch.empty((rows, layer.hidden), dtype=x.dtype)
    _check(lib.infer_mla_block_bf16(x.data_ptr(), rows, positions.data_ptr(), layer.array.data_ptr(),
                                    step.array.data_ptr(), out.data_ptr(), torch.get_num_threads()),
           "latent attention: a position, slot or block is outside its table")
    return out


def mlp_layer(gate_up: Int4Native | Int8Native | DenseNative, down: Int4Native | Int8Native | DenseNative,
              dtype: torch.dtype,
              act: str = "silu"):
    """A layer's side of `mlp` for activations of `dtype` and `act` ('silu' or 'gelu_tanh'),
    checked and packed, or None."""
    if library() is None or act not in ("silu", "gelu_tanh"):
        return None
    (hidden, inter), max_rows = down.shape, _max_rows(dtype, gate_up, down)
    if gate_up.shape != (2 * inter, hidden) or not max_rows:
        return None
    return _pack((*gate_up.args, *down.args, hidden, inter, int(act == "gelu_tanh")), (gate_up, down), dtype=dtype,
                 hidden=hidden, max_rows=max_rows)


def _float_bits(value: float) -> int:
    """A float32's bits as an int (a packed argument the kernel reads back as float)."""
    return int(np.float32(value).view(np.int32))


def _layer_rows(x: torch.Tensor, layer: Packed) -> bool:
    return x.dim() == 2 and x.is_contiguous() and 0 < x.shape[0] <= layer.max_rows


def mlp(x: torch.Tensor, layer: Packed):
    """The SwiGLU MLP node for the rows of x; None when the kernels do not apply."""
    lib = _lib(x)
    if lib is None or x.dtype != layer.dtype or not _layer_rows(x, layer) or x.shape[1] != layer.hidden:
        return None
    out = torch.empty((x.shape[0], layer.hidden), dtype=x.dtype)
    rc = _fn(lib, "mlp_packed", x.dtype)(x.data_ptr(), x.shape[0], layer.array.data_ptr(), out.data_ptr(),
                                         torch.get_num_threads())
    if rc == _NOT_FINITE:
        return None
    _check(rc, "mlp")
    return out
