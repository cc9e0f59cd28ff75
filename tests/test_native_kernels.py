"""The torch backend's native CPU kernels (`torch_native/native`) against its torch ops.

Every kernel is compared with the torch-op path it replaces, on layouts the
model runner produces (q/k/v as column views of one qkv row, rows of a wider
buffer), in float32 and bfloat16. Rotary and kv_write are exact (same
arithmetic, products rounded before sums); reductions may differ in their
summation order, so rms_norm, silu and attention are held to float32 rounding
(bfloat16: one unit in the last place). The attention kernel is also checked
against float64 dense attention in test_torch_backend.py, which runs each test
with and without these kernels.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from infer.backends.torch_native import TorchBackend, fast_paths, native, ops
from infer.dispatch import Ops
from infer.backends.torch_native import attention as attention_mod
from infer.backends.torch_native.native import ops as nops

from test_torch_backend import BATCHES, dense_attention, paged_batch

BACKEND = TorchBackend()
# The primitives as the runtime resolves them: the native fast path first, the torch ops when it declines.
OPS = Ops(BACKEND, validate=False)
DTYPES = [torch.float32, torch.bfloat16]
# Skipped only where they cannot be built by design: switched off, or no C compiler on the
# machine. With a compiler present a failed build fails these tests instead of hiding.
pytestmark = pytest.mark.skipif(os.environ.get("INFER_NATIVE") == "0" or shutil.which(os.environ.get("CC", "cc")) is None,
                                reason="native kernels switched off or no C compiler")


@pytest.fixture
def torch_ops(monkeypatch):
    """Run `fn` with the native kernels off (the torch-op path)."""
    def run(fn, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(nops, "library", lambda: None)
            return fn(*args, **kwargs)
    return run


def _close(got, want, dtype):
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


def _qkv(t, hq, hk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype)
    q, k, v = qkv.split((hq * d, hk * d, hk * d), 1)
    return qkv, q.reshape(-1, hq, d), k.reshape(-1, hk, d), v.reshape(-1, hk, d)


def test_the_kernels_are_built_and_cached():
    assert native.status().startswith("built (")
    # linked against the OpenMP runtime torch loaded, and no second one
    assert native.status().endswith("torch's OpenMP threads)") and native.openmp_runtime()
    runtimes = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line or "libomp" in line}
    assert runtimes == {native.openmp_runtime()}
    path = native._library_path()
    assert path.exists() and path.parent == native.cache_dir()
    native._build(path)  # already there: nothing is rebuilt
    assert path.stat().st_size > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 64, 600])  # 600: split over the OpenMP team
def test_rms_norm_matches_the_torch_ops(torch_ops, dtype, residual, rows):
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 700, generator=g).to(dtype)
    x = wide[:, 50:626]  # rows of a wider buffer
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    r = torch.randn(rows, 576, generator=g).to(dtype) if residual else None
    got, want = OPS.rms_norm(x, w, 1e-5, r), torch_ops(ops.rms_norm, x, w, 1e-5, r)
    if residual:
        assert torch.equal(got[1], want[1])  # the residual stream itself is exact
        got, want = got[0], want[0]
    assert got.dtype == dtype and got.shape == (rows, 576)
    _close(got, want, dtype)


def test_rms_norm_past_the_row_limit_uses_the_torch_ops(monkeypatch):
    """On torch's OpenMP team the kernel takes any rows; with its own pool (one thread) up to MAX_ROWS."""
    x, w = torch.randn(nops.MAX_ROWS + 1, 64), torch.ones(64)
    assert nops.rms_norm(x, w, 1e-6) is not None
    monkeypatch.setattr(nops, "openmp", lambda: False)
    assert nops.rms_norm(x, w, 1e-6) is None
    assert nops.rms_norm(x[:3], w, 1e-6) is not None
    assert nops.rms_norm(x[:3].double(), w.double(), 1e-6) is None  # float64: not a kernel dtype
    assert nops.rms_norm(x[:3], w.bfloat16(), 1e-6) is None  # mixed dtypes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rot", [64, 32])
@pytest.mark.parametrize("adjacent", [True, False])
@pytest.mark.parametrize("tokens", [5, 300])  # 300: split over the OpenMP team
def test_rotary_is_exactly_the_torch_ops(torch_ops, dtype, neox, rot, adjacent, tokens):
    _, q, k, _ = _qkv(tokens, 6, 2, 64, dtype)
    if not adjacent:
        q, k = q.clone(), k.clone()
    table = torch.randn(100, rot)
    positions = torch.tensor([0, 3, 99, 7, 42] * (tokens // 5))
    got = OPS.rotary(q, k, positions, table, neox)
    want = torch_ops(ops.rotary, q, k, positions, table, neox)
    for a, b in zip(got, want):
        assert a.dtype == dtype and a.shape == b.shape
        assert torch.equal(a, b)


def test_rotary_position_outside_the_table_raises():
    _, q, k, _ = _qkv(2, 2, 1, 16, torch.float32)
    with pytest.raises(IndexError, match="position"):
        OPS.rotary(q, k, torch.tensor([1, 100]), torch.randn(100, 16), True)
    with pytest.raises(IndexError):
        OPS.rotary(q, k, torch.tensor([-1, 0]), torch.randn(100, 16), True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 9, 300])  # 300: float32 split over the OpenMP team
def test_silu_and_mul_matches_the_torch_ops(torch_ops, dtype, rows):
    x = (torch.randn(rows, 2 * 1536) * 6).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturating and zero inputs
    _close(OPS.act_and_mul(x, "silu"), torch_ops(ops.act_and_mul, x, "silu"), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 9])
def test_gelu_tanh_and_mul_matches_the_torch_ops(torch_ops, dtype, rows, monkeypatch):
    """Gemma's GeGLU in the kernel: torch's GELU (tanh form) within float32 rounding."""
    x = (torch.randn(rows, 2 * 1536) * 6).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    calls = []
    real = nops.silu_and_mul
    monkeypatch.setattr(nops, "silu_and_mul", lambda *a: calls.append(a[1:]) or real(*a))
    got = OPS.act_and_mul(x, "gelu_tanh")
    assert calls == [("gelu_tanh",)]  # the kernel served it
    want = torch_ops(ops.act_and_mul, x, "gelu_tanh")
    # one bf16 rounding apart at most; in saturated tails 1 + tanh is 0 in one and an ulp in
    # the other, times values of ~10
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write_is_exactly_the_torch_ops_and_skips_padded_rows(torch_ops, dtype):
    _, _, k, v = _qkv(6, 4, 2, 32, dtype)
    slots = torch.tensor([5, -1, 17, 0, -1, 63])
    got = BACKEND.allocate_kv_cache(4, 16, 2, 32, str(dtype).removeprefix("torch."))
    want = got.clone()
    OPS.kv_write(k, v, got, slots)
    torch_ops(attention_mod.kv_write, k, v, want, slots)
    assert torch.equal(got, want)
    flat = got.view(2, -1, 2, 32)
    assert torch.equal(flat[0, 17], k[2]) and torch.equal(flat[1, 63], v[5])
    assert int(torch.count_nonzero(flat.abs().sum((2, 3)))) == 8  # 4 slots written, twice (k and v)


def test_kv_write_slot_outside_the_cache_raises_and_writes_nothing():
    _, _, k, v = _qkv(2, 2, 1, 8, torch.float32)
    cache = BACKEND.allocate_kv_cache(2, 4, 1, 8, "float32")
    with pytest.raises(IndexError, match="slot"):
        OPS.kv_write(k, v, cache, torch.tensor([1, 8]))
    assert not cache.any()


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_matches_the_torch_ops_and_dense_attention(torch_ops, batch, window, dtype):
    q_lens, seq_lens = BATCHES[batch]
    q, cache, meta, dense = paged_batch(q_lens, seq_lens, 3, 16, 4, dtype=dtype)
    meta = OPS.prepare_metadata(meta)
    got = OPS.attention(q, cache, meta, 0.25, window)
    want = torch_ops(BACKEND.attention, q, cache, meta, 0.25, window)
    exact = dense_attention(q, dense, q_lens, 0.25, window)
    assert got.dtype == dtype
    if dtype == torch.float32:
        _close(got, want, dtype)
        torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)
    else:
        # bfloat16 outputs: both paths within a rounding of the float64 result (the
        # torch ops round probabilities to bfloat16 before P @ V; the kernel does not).
        err = (got.double() - exact).abs().max()
        assert err <= 2**-8 * exact.abs().max()
        assert err <= (want.double() - exact).abs().max() + 2**-9


def test_attention_rows_past_the_batch_are_zero():
    q, cache, meta, _ = paged_batch([1, 1], [4, 9], 1, 8, 4)
    q = torch.cat([q, torch.randn(3, *q.shape[1:])])  # padded rows no request owns
    meta = OPS.prepare_metadata(meta)
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((3,), -1)])
    out = nops.attention(q, cache, meta, 0.5, None, work=1)
    assert out is not None and not out[2:].any() and out[:2].abs().sum() > 0


def test_attention_with_more_work_than_the_limit_uses_the_torch_ops(monkeypatch):
    q, cache, meta, _ = paged_batch([1, 1], [40, 9], 1, 8, 4)
    meta = OPS.prepare_metadata(meta)
    assert meta.plan.row_keys == 49
    assert nops.attention(q, cache, meta, 0.5, None, work=nops.MAX_ATTENTION_WORK + 1) is None
    calls = []
    monkeypatch.setattr(nops, "attention", lambda *a, **k: calls.append(1))  # returns None: the torch ops run
    out = OPS.attention(q, cache, meta, 0.5)
    assert calls == [1] and out.shape == q.shape


def test_attention_block_id_outside_the_cache_raises():
    q, cache, meta, _ = paged_batch([1], [6], 1, 8, 4)
    meta = OPS.prepare_metadata(meta)
    meta.block_table[0, 1] = cache.shape[1]
    with pytest.raises(IndexError, match="block table"):
        OPS.attention(q, cache, meta, 0.5)


def test_an_fp8_cache_without_scales_stays_on_the_torch_ops():
    q, cache, meta, _ = paged_batch([1], [6], 1, 8, 4)
    meta = OPS.prepare_metadata(meta)
    assert nops.attention(q, cache.to(torch.uint8), meta, 0.5, None, work=1) is None
    assert nops.kv_write(q[:, :1], q[:, :1], cache.to(torch.uint8), torch.tensor([0])) is False


@pytest.mark.parametrize("batch", ["decode", "mixed"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype,d", [(torch.float32, 16), (torch.bfloat16, 16), (torch.bfloat16, 64)])
def test_soft_capped_attention_in_the_kernel_matches_the_torch_ops(torch_ops, batch, window, dtype, d):
    """Gemma 2's logit soft-cap (cap * tanh(score / cap)) in the kernel, the generic loop and
    (bf16, head size 64) the dot-product path, against the torch ops' explicit attention."""
    q_lens, seq_lens = BATCHES[batch]
    q, cache, meta, _ = paged_batch(q_lens, seq_lens, 2, d, 16, dtype=dtype)
    q = (q * 3).to(dtype)  # scores of several units: a cap of 2 bends them
    meta = OPS.prepare_metadata(meta)
    with_cap = OPS.attention(q, cache, meta, 0.25, window, soft_cap=2.0)
    want = torch_ops(BACKEND.attention, q, cache, meta, 0.25, window, soft_cap=2.0)
    without = OPS.attention(q, cache, meta, 0.25, window)
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(with_cap.float(), want.float(), rtol=tol, atol=tol)
    assert (with_cap.float() - without.float()).abs().max() > 20 * tol  # the cap changed the result


@pytest.mark.parametrize("batch", ["decode", "mixed"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype,d", [(torch.float32, 16), (torch.bfloat16, 16), (torch.bfloat16, 64)])
def test_attention_with_sinks_in_the_kernel_matches_the_torch_ops(torch_ops, batch, window, dtype, d):
    """gpt-oss's sinks (a logit per query head in each softmax's denominator) in the kernel's
    merge, after the generic loop and (bf16, head size 64) the dot-product path, against the
    torch ops' explicit attention; sinks as the checkpoint stores them (the model's dtype)."""
    q_lens, seq_lens = BATCHES[batch]
    q, cache, meta, _ = paged_batch(q_lens, seq_lens, 2, d, 16, dtype=dtype)
    meta = OPS.prepare_metadata(meta)
    hq = q.shape[1]
    # around the scores' own size, one far above them (its heads' outputs shrink to near zero)
    sinks = torch.linspace(-1.0, 2.0, hq).to(dtype)
    sinks[-1] = 30.0
    got = OPS.attention(q, cache, meta, 0.25, window, sinks=sinks)
    served = nops.attention(q, cache, meta, 0.25, window, work=1, sinks=sinks.float())
    assert served is not None and torch.equal(served, got)  # the kernel served it
    want = torch_ops(BACKEND.attention, q, cache, meta, 0.25, window, sinks=sinks)
    without = OPS.attention(q, cache, meta, 0.25, window)
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert (got.float() - without.float()).abs().max() > 20 * tol  # the sinks changed the result
    assert got[:, -1].float().abs().max() < 1e-6 * max(1.0, without[:, -1].float().abs().max())


def _status_in_subprocess(env: dict) -> str:
    code = "from infer.backends.torch_native import native; print(native.status())"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env},
                         check=True)
    return res.stdout.strip()


def test_infer_native_0_turns_them_off():
    assert _status_in_subprocess({"INFER_NATIVE": "0"}) == "off (INFER_NATIVE=0)"


def test_a_failing_compiler_leaves_the_torch_ops(tmp_path):
    status = _status_in_subprocess({"CC": "false", "INFER_CACHE_DIR": str(tmp_path)})
    assert status.startswith("unavailable:")
    code = ("import torch; from infer.backends.torch_native import ops; "
            "print(ops.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6).sum().item())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "CC": "false", "INFER_CACHE_DIR": str(tmp_path)})
    assert float(res.stdout) == pytest.approx(8.0, rel=1e-5)


def test_a_fresh_cache_directory_builds_the_library(tmp_path):
    assert _status_in_subprocess({"INFER_CACHE_DIR": str(tmp_path)}).startswith(f"built ({tmp_path}")
    assert len(list((tmp_path / "native").glob("kernels-*.so"))) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("threads", [1, 3])
def test_int8_gemv_equals_the_dequantized_weight_product(monkeypatch, dtype, rows, threads):
    g = torch.Generator().manual_seed(rows)
    n, k, group = 300, 96, 32
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g) / 64
    x = torch.randn(rows, k + 8, generator=g).to(dtype)[:, 8:]  # rows of a wider buffer
    # threads > 1: parts of the output rows on the kernels' own thread pool
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    got = nops.int8_gemv(x, q, scales, group)
    want = x.double() @ (q.double() * scales.double().repeat_interleave(group, 1)).t()
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _int4(n, k, group, seed, zero_rows=()):
    g = torch.Generator().manual_seed(seed)
    qweight = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) / 32
    offsets = -8 * scales + torch.randn(n, k // group, generator=g) / 100
    for r in zero_rows:
        scales[r] = 0.0
    q = torch.stack((qweight & 15, qweight >> 4), -1).view(n, k).double()
    w = (q.view(n, -1, group) * scales.double()[..., None] + offsets.double()[..., None]).view(n, k)
    return qweight, scales, offsets, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,group,k", [(1, 32, 384), (3, 64, 384), (32, 128, 384), (5, 32, 352)])
@pytest.mark.parametrize("threads", [1, 3])
def test_int4_gemm_equals_the_dequantized_weight_product(monkeypatch, dtype, rows, group, k, threads):
    """float32: within float32 rounding of the float64 product of the dequantized weight;
    bfloat16: that product rounded once to bfloat16 (half an ulp), give or take a little.
    K = 352 (not a multiple of 64) runs the 256-bit kernel, the others the 512-bit one."""
    n = 132
    qweight, scales, offsets, w = _int4(n, k, group, seed=rows, zero_rows=(5,))
    g = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, k + 8, generator=g)
    x[:, 8:40] *= 1e-4  # one group far smaller than the rest, one value far smaller than its group
    x[0, 50] = 3e-6
    x[-1, 8 + group : 8 + 2 * group] = 0.0  # an all-zero group
    x = x.to(dtype)[:, 8:]  # rows of a wider buffer
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    got = nops.int4_gemm(x, qweight, scales, offsets, group)
    want = x.double() @ w.t()
    assert got.dtype == dtype and got.shape == (rows, n)
    scale = (x.double().abs() @ w.abs().t())  # what float32 rounding of the sum is relative to
    if dtype == torch.float32:
        assert ((got.double() - want).abs() <= 1e-6 * scale + 1e-30).all()
    else:
        assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-5 * scale).all()
    assert want[:, 5].abs().min() > 0  # the scale-0 row (offsets only) is in the bounds above


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [32, 64])
def test_int4_gemm_reads_float16_copies_of_float16_scales_to_the_same_result(monkeypatch, dtype, group):
    """Scales and offsets that are float16 values (GGUF's d and m) are read from float16
    copies where the build can: the same numbers, so the same result, bit for bit."""
    qweight, scales, offsets, _ = _int4(64, 256, group, seed=4)
    scales, offsets = scales.half().float(), offsets.half().float()
    x = torch.randn(3, 256).to(dtype)
    fast = nops.int4_prepare(qweight, scales, offsets, group)
    if not native.library().infer_int4_half_scales():
        pytest.skip("this build has no float16 path (no AVX512-VNNI)")
    assert fast.scales.dtype == torch.float16 and fast.args[4] == 1
    got = nops.int4_gemm_prepared(x, fast)
    monkeypatch.setattr(nops, "_half_copy", lambda t: None)
    plain = nops.int4_prepare(qweight, scales, offsets, group)
    assert plain.scales.dtype == torch.float32 and plain.args[4] == 0
    assert torch.equal(got, nops.int4_gemm_prepared(x, plain))
    offsets[0, 0] = 1 / 3  # not a float16 value: the float32 arrays are read
    assert nops.int4_prepare(qweight, scales, offsets, group).args[4] == 0


def test_int4_gemm_keeps_tiny_activations_and_declines_inf_and_nan():
    """Groups of x far below 1 (SiLU of a very negative gate gives ~1e-36) keep float32
    accuracy; an x with inf or nan is declined, so torch's arithmetic decides what comes out."""
    qweight, scales, offsets, w = _int4(16, 256, 32, seed=5)
    g = torch.Generator().manual_seed(5)
    for tiny in (1e-30, 1e-36, 1e-40):  # the last is below float32's normal range
        x = torch.randn(3, 256, generator=g)
        x[0] *= tiny
        x[1, ::3] = 0.0
        x[1, 1::3] *= tiny
        got = nops.int4_gemm(x, qweight, scales, offsets, 32).double()
        want = x.double() @ w.t()
        scale = x.double().abs() @ w.abs().t()
        assert ((got - want).abs() <= 1e-6 * scale + 2**-140).all(), tiny
    for bad in (float("inf"), float("nan")):
        y = x.clone()
        y[1, 7] = bad
        assert nops.int4_gemm(y, qweight, scales, offsets, 32) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_gemm_gives_each_row_what_it_gives_that_row_alone(dtype):
    """Rows of x computed together (bf16 rows go in pairs) equal each row computed alone, bit
    for bit: a request's tokens do not depend on what it is batched with."""
    for k, group in ((256, 32), (256, 128), (224, 32)):  # 512-bit steps (groups of 32 two a step), 256-bit
        qweight, scales, offsets, _ = _int4(64, k, group, seed=6)
        fast = nops.int4_prepare(qweight, scales.half().float(), offsets.half().float(), group)
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(6)).to(dtype)
        together = nops.int4_gemm_prepared(x, fast)
        assert torch.equal(together, torch.cat([nops.int4_gemm_prepared(x[i:i + 1], fast) for i in range(5)]))


def test_int4_gemm_runs_the_same_on_any_number_of_threads(monkeypatch):
    qweight, scales, offsets, _ = _int4(4 * 97, 256, 32, seed=3)
    x = torch.randn(2, 256)
    results = []
    for threads in (1, 2, 5):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        results.append(nops.int4_gemm(x, qweight, scales, offsets, 32))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_int4_gemm_declines_what_it_does_not_read():
    qweight, scales, offsets, _ = _int4(16, 64, 32, seed=0)
    x = torch.ones(1, 64)
    assert nops.int4_gemm(x, qweight, scales, offsets, 32) is not None
    assert nops.int4_gemm(torch.ones(nops.INT4_GEMM_MAX_ROWS + 1, 64), qweight, scales, offsets, 32) is None
    assert nops.int4_gemm(x.half(), qweight, scales, offsets, 32) is None
    assert nops.int4_gemm(x, qweight[:14], scales[:14], offsets[:14], 32) is None  # rows not a multiple of 4
    q16, s16, o16, _ = _int4(16, 64, 16, seed=0)
    assert nops.int4_gemm(x, q16, s16, o16, 16) is None  # groups of 16
    assert nops.int4_gemm(x, qweight, scales.double(), offsets, 32) is None
    assert nops.int4_gemm(torch.ones(1, 64)[:, ::1].t().contiguous().t(), qweight, scales, offsets, 32) is not None


def _vnni_int8():
    if nops.int8_prepare(torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 1), None, 32) is None:
        pytest.skip("the integer int8 GEMM needs a build with AVX512-VNNI")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,group,k,offsets", [(1, 32, 384, False), (3, 16, 384, True), (8, 64, 384, True),
                                                  (2, 16, 96, False), (5, 32, 352, True)])
@pytest.mark.parametrize("threads", [1, 3])
def test_int8_gemm_equals_the_dequantized_weight_product(monkeypatch, dtype, rows, group, k, offsets, threads):
    """The integer int8 GEMM (GGUF Q8_0/Q5_0/Q6_K ... kept as int8 groups, with Q5_1/Q5_K's
    offsets): float32 within float32 rounding of the float64 product, bfloat16 that product
    rounded once to bfloat16, give or take a little (as the int4 GEMM)."""
    _vnni_int8()
    n = 132
    g = torch.Generator().manual_seed(rows + group)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g) / 64
    scales[7] = 0.0  # a row of offsets only (or zeros)
    offs = -16 * scales + torch.randn(n, k // group, generator=g) / 100 if offsets else None
    w = q.double().view(n, -1, group) * scales.double()[..., None]
    if offsets:
        w = w + offs.double()[..., None]
    w = w.view(n, k)
    x = torch.randn(rows, k + 8, generator=g)
    x[:, 8:24] *= 1e-4  # a group far smaller than the rest
    x[-1, 8 + 2 * group: 8 + 3 * group] = 0.0  # an all-zero group
    x = x.to(dtype)[:, 8:]  # rows of a wider buffer
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    prepared = nops.int8_prepare(q, scales, offs, group)
    got = nops.int8_gemm_prepared(x, prepared)
    want = x.double() @ w.t()
    assert got.dtype == dtype and got.shape == (rows, n)
    scale = x.double().abs() @ w.abs().t()
    if dtype == torch.float32:
        assert ((got.double() - want).abs() <= 1e-6 * scale + 1e-30).all()
    else:
        assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-5 * scale).all()
    # Each activation row's result is what it gets alone.
    alone = torch.cat([nops.int8_gemm_prepared(x[i:i + 1].contiguous(), prepared) for i in range(rows)])
    assert torch.equal(got, alone)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("low,span,group,offsets", [(-16, 32, 32, False), (-32, 64, 16, False), (0, 32, 32, True),
                                                    (-4, 8, 16, False), (-12, 25, 64, False), (-128, 256, 128, True),
                                                    (3, 9, 32, True)])
def test_packed_int8_codes_give_the_int8_kernels_results_bit_for_bit(dtype, low, span, group, offsets):
    """Codes of few bits (Q5_0's -16..15, Q6_K's -32..31, Q5_1's 0..31, Q3_K's, MXFP4's; any
    other int8 codes) packed into 4, 5, 6 or 8 bits in row quads: each code unpacks to itself,
    and the GEMM gives what the unpacked int8 kernel gives, float16 scales or not: bit for bit,
    except groups of 16 and 32, whose lanes sum in another order (float32 rounding apart)."""
    _vnni_int8()
    n, k = 136, 384
    g = torch.Generator().manual_seed(span + group)
    q = torch.randint(low, low + span, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g) / 64
    if span == 32:
        scales = scales.half().float()  # exact in float16: the packed weight keeps float16 scales
    offs = torch.randn(n, k // group, generator=g) / 100 if offsets else None
    plain, packed = nops.int8_prepare(q, scales, offs, group, pack=False), nops.int8_prepare(q, scales, offs, group)
    assert packed.packed and not plain.packed and packed.shape == (n, k)
    bits = next(b for b in (4, 5, 6, 8) if span <= 1 << b)
    assert packed.bits == bits and packed.qweight.numel() == n * k * bits // 8
    assert (packed.scales.dtype == torch.float16) == (span == 32 and not offsets)
    assert torch.equal(packed.codes(), q)
    ids = torch.tensor([n - 1, 0, 5, 5])
    assert torch.equal(packed.codes(ids), q[ids]) and torch.equal(packed.codes(slice(3, 11)), q[3:11])
    w = q.double().view(n, -1, group) * scales.double()[..., None]
    w = (w if offs is None else w + offs.double()[..., None]).view(n, k)
    for rows in (1, 2, 8):
        x = torch.randn(rows, k, generator=g).to(dtype)
        got, want = nops.int8_gemm_prepared(x, packed), nops.int8_gemm_prepared(x, plain)
        if group not in (16, 32):
            assert torch.equal(got, want)
            continue
        bound = 1e-6 * (x.double().abs() @ w.abs().t())  # float32 rounding of the sums
        if dtype == torch.float32:
            assert ((got.double() - want.double()).abs() <= bound + 1e-30).all()
        else:  # one bfloat16 rounding of values that differ by float32 rounding
            assert ((got.double() - want.double()).abs() <= 2**-7 * want.double().abs() + bound).all()


def test_a_packed_int8_weight_serves_every_path_from_its_packed_codes():
    """After prepare_weight a packed weight's own arrays are shape-only: decode rows, prefill
    rows (dequantized tiles) and embedding rows all read the packed codes and agree with the
    weight as loaded."""
    _vnni_int8()
    from infer.backends.torch_native import quant_linear
    from infer.primitives.types import Int8GroupWeight

    n, k, group = 64, 128, 32
    g = torch.Generator().manual_seed(7)
    q = torch.randint(-16, 16, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=g) / 64).half().float()
    w = Int8GroupWeight(q, scales, group, bias=None, dtype="float32")
    prepared = quant_linear.prepare_weight(w)
    assert prepared.prepared.packed and prepared.qweight.device.type == "meta"
    dense = (q.float().view(n, -1, group) * scales[..., None]).view(n, k)
    assert torch.equal(quant_linear.dequantize(prepared), dense)
    assert torch.equal(quant_linear.embedding(torch.tensor([3, 0, 63]), prepared), dense[[3, 0, 63]])
    for rows in (1, 40):
        x = torch.randn(rows, k, generator=g)
        want = x.double() @ dense.double().t()
        got = quant_linear.linear(x, prepared) if rows > 8 else fast_paths.linear(x, prepared)
        assert ((got.double() - want).abs() <= 1e-5 * (x.double().abs() @ dense.double().abs().t())).all()


def test_int8_gemm_declines_what_it_does_not_read():
    _vnni_int8()
    q, s = torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, 2)
    assert nops.int8_prepare(q, s, None, 32) is not None
    assert nops.int8_prepare(q[:15], s[:15], None, 32) is None  # N % 4
    assert nops.int8_prepare(q, torch.ones(16, 8), None, 8) is None  # groups of 8
    assert nops.int8_prepare(q, torch.ones(16, 4), None, 16) is not None
    assert nops.int8_prepare(torch.zeros(16, 48, dtype=torch.int8), torch.ones(16, 3), None, 16) is None  # K % 32
    assert nops.int8_prepare(q, s, torch.ones(16, 3), 32) is None  # offsets of another shape
    w = nops.int8_prepare(q, s, None, 32)
    assert nops.int8_gemm_prepared(torch.ones(nops.INT8_GEMM_MAX_ROWS + 1, 64), w) is None
    x = torch.ones(1, 64)
    x[0, 3] = float("nan")
    assert nops.int8_gemm_prepared(x, w) is None  # torch's arithmetic says what nan gives


def test_int8_gemv_declines_what_it_does_not_read():
    q, s = torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, 2)
    assert nops.int8_gemv(torch.ones(nops.INT8_GEMV_MAX_ROWS + 1, 64), q, s, 32) is None
    assert nops.int8_gemv(torch.ones(1, 64), q, s, 8) is None  # groups of 8: not a multiple of 16
    assert nops.int8_gemv(torch.ones(1, 64, dtype=torch.float16), q, s, 32) is None
    assert nops.int8_gemv(torch.ones(1, 64), q, s, 32) is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 3.0)])
def test_fp8_kv_write_gives_the_codes_torchs_cast_gives(torch_ops, dtype, scales):
    g = torch.Generator().manual_seed(7)
    t, hk, d = 40, 2, 32
    # magnitudes from e4m3's subnormals (2^-9) past its largest value (448, saturated)
    mags = torch.exp2(torch.empty(2, t, hk, d).uniform_(-12, 10, generator=g))
    kv = (mags * torch.randn(2, t, hk, d, generator=g).sign()).to(dtype)
    kv[0, 0, 0, :4] = torch.tensor([0.0, -0.0, 448.0, -1e6])
    slots = torch.arange(t) * 2  # every other slot
    slots[3] = -1
    got = BACKEND.allocate_kv_cache(6, 16, hk, d, "fp8")
    want = got.clone()
    OPS.kv_write(kv[0], kv[1], got, slots, scales)
    torch_ops(attention_mod.kv_write, kv[0], kv[1], want, slots, scales)
    assert torch.equal(got, want)
    assert got.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_fp8_attention_matches_the_torch_ops(torch_ops, dtype, batch):
    q_lens, seq_lens = BATCHES[batch]
    q, cache, meta, _ = paged_batch(q_lens, seq_lens, 3, 16, 4, dtype=dtype)
    fp8 = BACKEND.allocate_kv_cache(cache.shape[1], 4, 3, 16, "fp8")
    flat = cache.view(2, -1, 3, 16)
    everything = torch.arange(flat.shape[1])
    torch_ops(attention_mod.kv_write, flat[0], flat[1], fp8, everything, (0.5, 0.25))  # the same codes for both
    meta = OPS.prepare_metadata(meta)
    got = OPS.attention(q, fp8, meta, 0.25, kv_scales=(0.5, 0.25))
    want = torch_ops(BACKEND.attention, q, fp8, meta, 0.25, kv_scales=(0.5, 0.25))
    if dtype == torch.float32:
        _close(got, want, dtype)
    else:  # the torch ops round probabilities to bfloat16 before P @ V; the kernel does not
        torch.testing.assert_close(got.float(), want.float(), atol=2**-7 * want.abs().max().item(), rtol=0)


def test_scales_for_a_model_dtype_cache_are_refused():
    _, _, k, v = _qkv(1, 2, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="fp8"):
        OPS.kv_write(k, v, BACKEND.allocate_kv_cache(1, 4, 1, 8, "float32"), torch.tensor([0]), (1.0, 1.0))


def test_a_forked_child_runs_the_split_gemvs_on_its_own_threads():
    """The parent's threads (its OpenMP team, or the kernels' own pool) do not survive fork;
    the child must not wait on them forever."""
    code = """
import os, torch
from infer.backends.torch_native.native import ops as nops
torch.get_num_threads = lambda: 2
q, s, x = torch.ones(256, 32, dtype=torch.int8), torch.ones(256, 1), torch.ones(1, 32)
q4, s4, o4 = torch.full((256, 16), 0x21, dtype=torch.uint8), torch.ones(256, 1), torch.zeros(256, 1)
def ok():
    return nops.int8_gemv(x, q, s, 32)[0, 0] == 32 and nops.int4_gemm(x, q4, s4, o4, 32)[0, 0] == 48
assert ok()  # the parent's pool has a worker now
pid = os.fork()
if pid == 0:
    os._exit(0 if ok() else 1)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "0"


@pytest.mark.skipif(__import__("platform").machine() != "x86_64", reason="x86-64 baseline build")
def test_the_portable_build_without_avx512_matches_the_torch_ops(tmp_path):
    """The loops a CPU without AVX-512 runs (dot products, the Q8_0 and int4 GEMVs) give the torch ops'
    results; built without OpenMP, the GEMVs split over the kernels' own thread pool."""
    code = """
import torch
from infer.backends.torch_native import native, ops
from infer.backends.torch_native.native import ops as nops
from test_torch_backend import BATCHES, paged_batch, BACKEND
from infer.dispatch import Ops
OPS = Ops(BACKEND, validate=False)
assert native.status().startswith("built") and native.status().endswith("own thread pool)"), native.status()
torch.manual_seed(0)
x, w = torch.randn(3, 576), torch.rand(576) + 0.5
got = OPS.rms_norm(x, w, 1e-6)
q, s = torch.randint(-127, 128, (64, 96), dtype=torch.int8), torch.rand(64, 3)
y = nops.int8_gemv(x[:, :96].contiguous(), q, s, 32)
q_lens, seq_lens = BATCHES["mixed"]
qq, cache, meta, _ = paged_batch(q_lens, seq_lens, 3, 16, 4)
meta = OPS.prepare_metadata(meta)
att = OPS.attention(qq, cache, meta, 0.25)
q4 = torch.randint(0, 256, (64, 48), dtype=torch.uint8)
s4, o4 = torch.rand(64, 3) / 16, torch.randn(64, 3) / 16
w4 = torch.stack((q4 & 15, q4 >> 4), -1).view(64, 96).double() * s4.double().repeat_interleave(32, 1)
w4 += o4.double().repeat_interleave(32, 1)
y4 = nops.int4_gemm(x[:, :96].contiguous(), q4, s4, o4, 32)
lib = nops.library
nops.library = lambda: None
torch.testing.assert_close(got, ops.rms_norm(x, w, 1e-6), rtol=2e-6, atol=1e-6)
torch.testing.assert_close(att, OPS.attention(qq, cache, meta, 0.25), rtol=2e-6, atol=1e-6)
torch.testing.assert_close(y.double(), x[:, :96].double() @ (q.double() * s.double().repeat_interleave(32, 1)).t(),
                           rtol=1e-5, atol=1e-5)
torch.testing.assert_close(y4.double(), x[:, :96].double() @ w4.t(), rtol=1e-5, atol=1e-5)
print("ok")
"""
    env = {**os.environ, "INFER_NATIVE_MARCH": "x86-64", "INFER_NATIVE_OPENMP": "0", "INFER_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.path.dirname(__file__)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "ok"


def test_a_compiler_without_openmp_builds_the_kernels_with_their_own_pool(tmp_path):
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = "-fopenmp" ] && { echo "no openmp" >&2; exit 1; }; done\n'
                  'exec cc "$@"\n')
    cc.chmod(0o755)
    code = "from infer.backends.torch_native import native; print(native.status())"
    env = {**os.environ, "CC": str(cc), "INFER_CACHE_DIR": str(tmp_path / "cache")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().startswith("built (") and res.stdout.strip().endswith("; own thread pool)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_gemv_gives_each_row_what_it_gives_that_row_alone(dtype):
    """Rows of x go through the int8 GEMV in blocks of up to four (each weight converted once
    for the block); each row's result equals that row computed alone, bit for bit."""
    g = torch.Generator().manual_seed(7)
    n, k, group = 64, 96, 32
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g) / 64
    x = torch.randn(nops.INT8_GEMV_MAX_ROWS, k, generator=g).to(dtype)
    alone = torch.cat([nops.int8_gemv(x[i:i + 1], q, scales, group) for i in range(x.shape[0])])
    for rows in range(2, x.shape[0] + 1):
        assert torch.equal(nops.int8_gemv(x[:rows], q, scales, group), alone[:rows]), rows


def _bf16_served() -> bool:
    """The bf16 GEMV runs where the host has AVX512-BF16; elsewhere it must decline."""
    if native.bf16_dot():
        return True
    assert nops.bf16_gemv(torch.ones(1, 64, dtype=torch.bfloat16), torch.ones(8, 64, dtype=torch.bfloat16)) is None
    return False


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 32, 64])  # x rows in blocks of 6 at most: 9 = 5 + 4, 32 = 6+6+5+5+5+5
@pytest.mark.parametrize("k", [576, 100, 96])
@pytest.mark.parametrize("threads", [1, 3])
def test_bf16_gemv_is_the_float64_product_rounded_once_to_bf16(monkeypatch, rows, k, threads):
    """Products of bf16 pairs summed in float32: the float64 product rounded once to bf16,
    give or take float32 rounding of the sum. K = 100 and 96 take the tail steps (a 32-lane
    step after the 64-lane ones, masked past the end)."""
    if not _bf16_served():
        pytest.skip("no AVX512-BF16 on this host: the kernel declines (checked)")
    g = torch.Generator().manual_seed(rows * k)
    n = 4 * 37 + 3  # not a multiple of the 4-row blocks of a thread's part
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k + 8, generator=g).to(torch.bfloat16)[:, 8:]  # rows of a wider buffer
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    got = nops.bf16_gemv(x, w)
    want = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-6 * scale).all()


def test_bf16_gemv_gives_each_row_what_it_gives_that_row_alone_on_any_thread_count(monkeypatch):
    if not _bf16_served():
        pytest.skip("no AVX512-BF16 on this host: the kernel declines (checked)")
    g = torch.Generator().manual_seed(11)
    w = torch.randn(302, 576, generator=g).to(torch.bfloat16)  # 302: two rows past the last block of four
    x = torch.randn(33, 576, generator=g).to(torch.bfloat16)
    results = []
    for threads in (1, 2, 5):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        together = nops.bf16_gemv(x, w)
        assert torch.equal(together, torch.cat([nops.bf16_gemv(x[i:i + 1], w) for i in range(33)]))
        assert torch.equal(together[:7], nops.bf16_gemv(x[:7], w))
        results.append(together)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_bf16_gemv_declines_what_it_does_not_read_and_serves_the_dense_linear():
    from infer.backends.torch_native import fast_paths
    from infer.primitives.types import DenseWeight

    if not _bf16_served():
        pytest.skip("no AVX512-BF16 on this host: the kernel declines (checked)")
    w, x = torch.ones(16, 64, dtype=torch.bfloat16), torch.ones(2, 64, dtype=torch.bfloat16)
    assert nops.bf16_gemv(x, w) is not None
    assert nops.bf16_gemv(torch.ones(nops.BF16_GEMV_MAX_ROWS + 1, 64, dtype=torch.bfloat16), w) is None
    assert nops.bf16_gemv(x.float(), w) is None and nops.bf16_gemv(x, w.float()) is None
    assert nops.bf16_gemv(x, w.t().contiguous().t()) is None  # a weight stored K-major
    assert nops.bf16_gemv(x[:, :32], w) is None
    # The backend's linear: a dense bf16 weight at decode sizes is served here, bias added after.
    bias = torch.arange(16, dtype=torch.bfloat16)
    backend = TorchBackend()
    assert backend.fast_path("linear", weight_kind="dense", dtype="bfloat16") is not None
    assert backend.fast_path("linear", weight_kind="dense", dtype="float32") is None
    got = fast_paths.linear(x, DenseWeight(w, bias))
    assert torch.equal(got, nops.bf16_gemv(x, w) + bias)
    assert fast_paths.linear(torch.ones(nops.BF16_GEMV_MAX_ROWS + 1, 64, dtype=torch.bfloat16),
                             DenseWeight(w)) is NotImplemented


def test_auto_dtype_serves_a_bf16_checkpoint_in_bf16_where_the_cpu_has_bf16_dot_products(tmp_path):
    """``dtype="auto"``: the torch backend serves a bfloat16 checkpoint in bfloat16 where the
    native bf16 GEMV runs (else float32, what the loader gives); cpu_ref always float32; a
    float32 checkpoint stays float32."""
    from tiny_models import make_model

    from infer import LLM

    model = make_model("llama3")[0]
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model.to(torch.float32).save_pretrained(tmp_path / "f32")
    want = "bfloat16" if native.bf16_dot() else "float32"
    assert LLM(str(tmp_path / "bf16"), backend="torch", skip_tokenizer_init=True).engine.dtype == want
    assert LLM(str(tmp_path / "bf16"), backend="cpu_ref", skip_tokenizer_init=True).engine.dtype == "float32"
    assert LLM(str(tmp_path / "f32"), backend="torch", skip_tokenizer_init=True).engine.dtype == "float32"


def _fast_and_generic(q, cache, meta, window):
    """The bf16 attention kernel's output on its dot-product path, then on the generic loop."""
    lib = native.library()
    fast = nops.attention(q, cache, meta, 0.125, window, work=1, kv_scales=(1.0, 1.0))
    was = lib.infer_attention_bf16_fast(0)
    try:
        generic = nops.attention(q, cache, meta, 0.125, window, work=1, kv_scales=(1.0, 1.0))
    finally:
        lib.infer_attention_bf16_fast(was)
    assert was == 1 and fast is not None and generic is not None
    return fast, generic


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hk", [1, 2])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("batch", [*BATCHES, "long_decode"])
def test_bf16_attention_dot_product_path_matches_the_generic_loop_and_float64(batch, window, hk, d):
    """bf16 q and cache with head size 64/128: q . k as AVX512-BF16 dot products, four keys'
    lanes summed together, P @ V over widened V rows. Within a bf16 rounding of float64
    attention and no further from it than the generic loop; long contexts span several
    64-key units (merged after), key counts not a multiple of four."""
    if not native.bf16_dot():
        pytest.skip("no AVX512-BF16 on this host: the generic loop serves bf16 (tested above)")
    q_lens, seq_lens = ([1, 1, 1], [150, 131, 64]) if batch == "long_decode" else BATCHES[batch]
    q, cache, meta, dense = paged_batch(q_lens, seq_lens, hk, d, 16, dtype=torch.bfloat16)
    meta = OPS.prepare_metadata(meta)
    fast, generic = _fast_and_generic(q, cache, meta, window)
    exact = dense_attention(q, dense, q_lens, 0.125, window)
    err = (fast.double() - exact).abs().max()
    assert err <= 2**-8 * exact.abs().max()
    assert err <= (generic.double() - exact).abs().max() + 2**-9
    assert not torch.equal(fast, torch.zeros_like(fast))


def test_bf16_attention_serves_much_work_in_small_requests_and_leaves_long_prompts_to_sdpa(monkeypatch):
    """The bf16 dot-product path takes steps past MAX_ATTENTION_WORK while no request has more
    than BF16_ATTENTION_MAX_REQUEST_KEYS query rows x keys (it re-reads keys per query row; SDPA
    tiles a long prompt better), up to BF16_ATTENTION_MAX_WORK in all."""
    if not native.bf16_dot():
        pytest.skip("no AVX512-BF16 on this host: the work limit alone applies (tested above)")
    q, cache, meta, dense = paged_batch([7, 12, 1], [7, 12, 30], 1, 64, 16, dtype=torch.bfloat16)
    meta = OPS.prepare_metadata(meta)
    assert meta.plan.request_keys == 144 and meta.plan.row_keys == 49 + 144 + 30
    big = nops.MAX_ATTENTION_WORK + 1
    served = nops.attention(q, cache, meta, 0.125, None, big, (1.0, 1.0), meta.plan.request_keys)
    assert served is not None
    exact = dense_attention(q, dense, [7, 12, 1], 0.125)
    assert (served.double() - exact).abs().max() <= 2**-8 * exact.abs().max()
    monkeypatch.setattr(nops, "BF16_ATTENTION_MAX_REQUEST_KEYS", 143)
    assert nops.attention(q, cache, meta, 0.125, None, big, (1.0, 1.0), meta.plan.request_keys) is None
    assert nops.attention(q, cache, meta, 0.125, None, big, (1.0, 1.0)) is None  # unknown: the work limit
    assert nops.attention(q.float(), cache.float(), meta, 0.125, None, big, (1.0, 1.0), 1) is None  # float32
    monkeypatch.setattr(nops, "BF16_ATTENTION_MAX_REQUEST_KEYS", 144)
    assert nops.attention(q, cache, meta, 0.125, None, nops.BF16_ATTENTION_MAX_WORK, (1.0, 1.0), 144) is not None
    # the kernel's partial results grow with the work: a cap on it in all
    assert nops.attention(q, cache, meta, 0.125, None, nops.BF16_ATTENTION_MAX_WORK + 1, (1.0, 1.0), 144) is None


def test_bf16_attention_dot_product_path_lets_a_nan_key_reach_its_rows_as_the_generic_loop_does():
    """A NaN in a cached key: every query row reading it comes out NaN on both paths (the
    vector max and exp keep NaN where the scalar loop does); rows not reading it stay finite."""
    if not native.bf16_dot():
        pytest.skip("no AVX512-BF16 on this host")
    q, cache, meta, _ = paged_batch([1, 1], [40, 9], 1, 64, 16, dtype=torch.bfloat16)
    row = int(meta.block_table[0, 1]) * 16 + 3  # position 19 of the first request
    cache.view(2, -1, 1, 64)[0, row, 0, 5] = float("nan")
    meta = OPS.prepare_metadata(meta)
    fast, generic = _fast_and_generic(q, cache, meta, None)
    assert fast[0].isnan().all() and generic[0].isnan().all()
    assert torch.isfinite(fast[1]).all() and torch.equal(fast[1].isnan(), generic[1].isnan())


# What the MoE architectures hand the primitive: Mixtral / Qwen3-MoE (renormalised softmax top-k),
# Qwen2-MoE (as the softmax gives them, a gated shared expert), gpt-oss (expert biases, clamped
# SwiGLU), DeepSeek V2 (groups by their best expert) and V3 (sigmoid scores, a selection bias,
# groups by their two best, scaled).
MOE_FORMS = ["mixtral", "qwen2_moe", "gpt_oss", "deepseek_v2_groups", "deepseek_v3"]


@pytest.mark.parametrize("tokens", [1, 8, 64])
@pytest.mark.parametrize("form", MOE_FORMS)
def test_bf16_moe_runs_decode_sized_steps_in_one_native_call_as_the_torch_moe_routes_them(tokens, form):
    """The whole primitive in the kernel, routing included: the same routing and counts as the
    torch moe, outputs within bf16 rounding of its."""
    from infer.backends.torch_native import fast_paths
    from infer.backends.torch_native import moe as moe_mod

    if not _bf16_served():
        pytest.skip("no AVX512-BF16 on this host: the kernel declines (checked)")
    assert BACKEND.fast_path("moe", dtype="bfloat16") is not None
    assert BACKEND.fast_path("moe", dtype="float32") is None
    g = torch.Generator().manual_seed(tokens)
    e, h, i = 8, 64, 96
    w13, w2 = (torch.randn(e, 2 * i, h, generator=g) * 0.2).bfloat16(), (torch.randn(e, h, i, generator=g) * 0.2).bfloat16()
    x, logits = torch.randn(tokens, h, generator=g).bfloat16(), torch.randn(tokens, e, generator=g).bfloat16()
    args = dict(x=x, router_logits=logits, w13=w13, w2=w2, top_k=2, renormalize=form != "qwen2_moe")
    if form == "qwen2_moe":
        args.update(shared=torch.randn(tokens, h, generator=g).bfloat16(),
                    shared_gate=torch.randn(tokens, 1, generator=g).bfloat16())
    if form == "gpt_oss":
        args.update(w13_bias=torch.randn(e, 2 * i, generator=g).bfloat16(),
                    w2_bias=torch.randn(e, h, generator=g).bfloat16(), activation="swiglu_oai", swiglu_alpha=1.702,
                    swiglu_limit=0.8)
    if form == "deepseek_v2_groups":  # softmax scores, the 2 of 4 groups with the best expert, scaled
        args.update(renormalize=False, routed_scaling_factor=1.5, expert_groups=(4, 2, "max"))
    if form == "deepseek_v3":
        args.update(shared=torch.randn(tokens, h, generator=g).bfloat16(), routed_scaling_factor=2.5,
                    scoring_func="sigmoid", routing_bias=torch.randn(e, generator=g) * 0.2, expert_groups=(4, 2, "top2"))
    calls = []
    real = nops.moe_bf16

    def counted(*a, **k):
        out = real(*a, **k)
        calls.append(out is not None)
        return out

    with pytest.MonkeyPatch.context() as m:
        m.setattr(nops, "moe_bf16", counted)
        got, got_counts = fast_paths.moe(**args)
    want, want_counts = moe_mod.moe(**args)
    assert calls == [True]  # served by the one call
    assert torch.equal(got_counts, want_counts)
    assert (got.float() - want.float()).abs().max() <= 2**-5 * want.float().abs().max()
    # where the one call declines, the GEMV-per-expert path gives the same within rounding
    with pytest.MonkeyPatch.context() as m:
        m.setattr(nops, "moe_bf16", lambda *a, **k: None)
        per_expert, per_expert_counts = fast_paths.moe(**args)
    assert torch.equal(per_expert_counts, want_counts)
    assert (per_expert.float() - want.float()).abs().max() <= 2**-5 * want.float().abs().max()
    assert fast_paths.moe(torch.ones(nops.BF16_GEMV_MAX_ROWS + 1, h, dtype=torch.bfloat16),
                          torch.zeros(nops.BF16_GEMV_MAX_ROWS + 1, e), w13, w2, 2, True) is NotImplemented
    assert fast_paths.moe(x.float(), logits, w13.float(), w2.float(), 2, True) is NotImplemented


def test_bf16_moe_kernel_declines_groups_that_do_not_fit_and_torch_refuses_them():
    if not _bf16_served():
        pytest.skip("no AVX512-BF16 on this host: the kernel declines (checked)")
    w13, w2 = torch.zeros(4, 16, 8, dtype=torch.bfloat16), torch.zeros(4, 8, 8, dtype=torch.bfloat16)
    x, logits = torch.ones(2, 8, dtype=torch.bfloat16), torch.zeros(2, 4)
    assert nops.moe_bf16(x, logits, w13, w2, 2, True, expert_groups=(3, 1, "max")) is None  # 3 groups of 4 experts
    assert nops.moe_bf16(x, logits, w13, w2, 3, True, expert_groups=(2, 1, "max")) is None  # top-3 of one kept pair
    assert nops.moe_bf16(x, logits, w13, w2, 2, True, expert_groups=(2, 1, "max")) is not None
