"""The torch backend's `linear`: every path it dispatches to against float64 NumPy.

Paths (see infer/backends/torch_native/linear.py): fp32 CPU with few rows runs
the N-split bmm on N-major or K-major pieces; fp32 with many rows, bf16 and
unprepared weights run F.linear; fp16 from FP16_UPCAST_ROWS rows computes in
fp32. Timings are reported by benchmarks/primitives.py, never asserted here.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from infer.backends.torch_native import linear as L
from infer.primitives.types import DenseWeight

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# fp32: accumulation-order noise; half types: inputs are exactly representable, so
# the error is the final rounding plus low-precision accumulation inside the kernel.
TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
# (N, K): N-major pieces, K-major pieces (N >= 4K), odd N (no split), tiny N.
SHAPES = [(192, 64), (320, 48), (75, 32), (8, 16)]
ROWS = [1, 2, L.SPLIT_MAX_ROWS, L.SPLIT_MAX_ROWS + 1, L.SPLIT_MAX_ROWS_KMAJOR, L.SPLIT_MAX_ROWS_KMAJOR + 1]


@pytest.fixture(autouse=True)
def two_threads(monkeypatch):
    """The split layout depends on the intra-op thread count; under xdist each
    worker runs one thread, so pretend there are two and test the split path
    whatever the machine (the results must not depend on it)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)


def _case(n, k, t, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(DTYPES[dtype])
    w = torch.randn(n, k, generator=g).to(DTYPES[dtype])
    b = torch.randn(n, generator=g).to(DTYPES[dtype]) if bias else None
    return x, w, b


def _expected(x, w, b):
    y = x.double().numpy() @ w.double().numpy().T
    return y if b is None else y + b.double().numpy()


def _check(y, x, w, b, dtype):
    want = _expected(x, w, b)
    assert y.dtype == DTYPES[dtype] and tuple(y.shape) == want.shape
    scale = np.abs(x.double().numpy()) @ np.abs(w.double().numpy()).T + (0 if b is None else np.abs(b.double().numpy()))
    err = np.abs(y.double().numpy() - want) / (scale + 1e-6)
    assert err.max() < TOL[dtype], f"max relative error {err.max():.2e}"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float64(dtype, n, k, t, bias):
    x, w, b = _case(n, k, t, dtype, bias)
    handle = L.prepare_weight(DenseWeight(w, b))
    _check(L.linear(x, handle), x, w, b, dtype)
    # the handle still describes the same weight
    assert handle.out_features == n and handle.in_features == k
    torch.testing.assert_close(handle.weight, w, rtol=0, atol=0)


@pytest.mark.parametrize("n,k", [(192, 64), (320, 48)])
def test_fp32_prepare_picks_the_split_layout(n, k):
    x, w, b = _case(n, k, 1, "float32", True)
    handle = L.prepare_weight(DenseWeight(w, b))
    assert isinstance(handle.prepared, L.CpuSplit)
    assert handle.prepared.k_major == (n >= L.KMAJOR_RATIO * k)
    assert handle.prepared.max_rows == (L.SPLIT_MAX_ROWS_KMAJOR if handle.prepared.k_major else L.SPLIT_MAX_ROWS)
    # the pieces are views of the returned weight: no second copy is kept
    assert handle.prepared.parts.untyped_storage().data_ptr() == handle.weight.untyped_storage().data_ptr()


def test_split_uses_whatever_thread_count(monkeypatch):
    x, w, b = _case(192, 64, 5, "float32", True)
    for threads in (1, 3, 4):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        _check(L.linear(x, L.prepare_weight(DenseWeight(w, b))), x, w, b, "float32")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("t", [1, 4, 40])
def test_non_contiguous_x(dtype, t):
    x, w, b = _case(320, 48, t, dtype, True)
    wide = torch.zeros(t, 2 * 48, dtype=x.dtype)
    wide[:, ::2] = x
    xs = wide[:, ::2]  # strided columns
    xt = x.t().contiguous().t()  # column-major
    assert not xs.is_contiguous() and (t == 1 or not xt.is_contiguous())
    handle = L.prepare_weight(DenseWeight(w, b))
    for xv in (xs, xt):
        _check(L.linear(xv, handle), x, w, b, dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_unprepared_weight_still_works(dtype):
    x, w, b = _case(192, 64, 3, dtype, True)
    _check(L.linear(x, DenseWeight(w, b)), x, w, b, dtype)


@pytest.mark.parametrize("n,k", [(192, 64), (320, 48), (75, 32)])
def test_prepare_weight_is_idempotent(n, k):
    x, w, b = _case(n, k, 2, "float32", True)
    once = L.prepare_weight(DenseWeight(w, b))
    twice = L.prepare_weight(once)
    assert twice is once
    torch.testing.assert_close(L.linear(x, twice), L.linear(x, once), rtol=0, atol=0)
    # preparing does not touch the caller's tensors
    torch.testing.assert_close(w, _case(n, k, 2, "float32", True)[1], rtol=0, atol=0)


def test_empty_batch():
    _, w, b = _case(192, 64, 1, "float32", True)
    y = L.linear(torch.zeros(0, 64), L.prepare_weight(DenseWeight(w, b)))
    assert tuple(y.shape) == (0, 192)


def test_primitives_benchmark_reports_instead_of_crashing(tmp_path, monkeypatch):
    """benchmarks/primitives.py --quick: linear rows with figures, unknown names as rows."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "primitives.py"
    spec = importlib.util.spec_from_file_location("bench_primitives", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    out = tmp_path / "out.json"
    rc = bench.main(["--quick", "--backends", "torch,nope", "--primitives", "linear,all_reduce",
                     "--tokens", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["machine"]["bandwidth_gbs"] > 0 and report["machine"]["matmul_gflops"] > 0
    rows = report["results"]
    linear = [r for r in rows if r["primitive"] == "linear"]
    assert {r["case"].split()[0] for r in linear} == set(bench.LINEARS)
    assert all(r["status"] == "ok" and r["gbs"] > 0 and r["provider"] == "torch" for r in linear)
    assert any(r["primitive"] == "all_reduce" and r["status"].startswith("skipped") for r in rows)
    assert any(r["backend"] == "nope" and r["status"].startswith("unavailable") for r in rows)


# -- kept-quantized weights past the quantized kernels' rows --------------------------------------

def _int4(n, k, seed=0):
    from infer.primitives.types import Int4GroupWeight

    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales, offsets = torch.rand(n, k // 32, generator=g) / 8, torch.randn(n, k // 32, generator=g) / 8
    return Int4GroupWeight(q, scales, offsets, 32, bias=torch.randn(n, generator=g))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_rows_use_one_kept_dense_copy_within_the_budget(monkeypatch, dtype):
    """Past the quantized kernels' rows a weight runs tiles the first time and from the second
    on a dequantized copy (in the activations' precision, made once, freed with the weight);
    with no budget left it runs tiles at every call. All give the dequantized weight's product."""
    import gc

    from infer.backends.torch_native import quant_linear as Q
    from infer.primitives.dequant import dequantize

    copies = Q._DenseCopies()
    monkeypatch.setattr(Q, "DENSE_COPIES", copies)
    calls = []
    real = Q.dequantize
    monkeypatch.setattr(Q, "dequantize", lambda *a, **k: (calls.append(a[1:]), real(*a, **k))[1])
    w = Q.prepare_weight(_with_dtype(_int4(64, 128), dtype))
    x = torch.randn(Q.INT4_KERNEL_MAX_ROWS + 40, 128).to(DTYPES[dtype])
    want = x.double() @ torch.from_numpy(dequantize(_np(w))).double().t() + w.bias.double()
    for _ in range(3):
        torch.testing.assert_close(Q.linear(x, w).double(), want, rtol=TOL[dtype] * 4, atol=TOL[dtype] * 4)
    assert calls == [(slice(0, 64),), ()]  # a tile (all 64 rows), then the whole weight once
    assert copies.held == 64 * 128 * (4 if dtype == "float32" else 2)
    monkeypatch.setattr(Q, "DENSE_COPY_BYTES", copies.held)  # full: another weight runs tiles
    other = Q.prepare_weight(_with_dtype(_int4(64, 128, seed=1), dtype))
    assert not copies.can_hold(other, DTYPES[dtype]) and copies.can_hold(w, DTYPES[dtype])
    for _ in range(3):
        Q.linear(x, other)
    assert len(copies.copies) == 1 and calls[2:] == [(slice(0, 64),)] * 3
    del w
    gc.collect()
    assert copies.held == 0 and not copies.copies


def test_float32_int4_batches_leave_the_native_kernel_where_dense_copies_fit(monkeypatch):
    from infer.backends.torch_native import quant_linear as Q
    from infer.backends.torch_native.native import ops as nops

    w = Q.prepare_weight(_int4(64, 128))

    def rows(dtype):  # the most rows the native kernel takes
        return max(t for t in range(1, 64) if Q.native_int4_takes(torch.zeros(t, 128, dtype=dtype), w))

    assert rows(torch.float32) == Q.F32_NATIVE_BESIDE_DENSE_ROWS
    assert rows(torch.bfloat16) == nops.INT4_BF16_MAX_ROWS
    monkeypatch.setattr(Q, "DENSE_COPY_BYTES", 0)  # no copy can be made: the native kernel keeps its rows
    assert rows(torch.float32) == nops.INT4_GEMM_MAX_ROWS


def _np(w):
    return dataclasses.replace(w, qweight=w.qweight.numpy(), scales=w.scales.numpy(), offsets=w.offsets.numpy(),
                               bias=None, prepared=None)


def _with_dtype(w, dtype):
    return dataclasses.replace(w, dtype=dtype)
