"""One prepared check of the `cuda` backend on a GPU (H100/H200), < 10 minutes.

    python benchmarks/gpu_check.py                # on a GPU: the full check
    python benchmarks/gpu_check.py --smoke        # anywhere: tiny shapes in Triton's interpreter on the CPU
    python benchmarks/gpu_check.py --json out.json --skip conformance
    python benchmarks/gpu_check.py --only tune    # the tile sweep alone

Sections, in order of what a short device session needs most, each timed and
reported as it finishes (a failing section is a line, not a crash, and makes
the exit status 1). Every result computed at real sizes is compared with the
`torch` backend's on the same device, not only timed:
  1. peaks      measured device limits: copy bandwidth (GB/s, read+write) and a
                bf16 matmul (TFLOP/s), the yardsticks for everything below.
  2. references the kernels against torch at real sizes: an fp8 KV pool of
                ~140k blocks with a request's blocks at ids >= 131,072 (offsets
                past 2^31 bytes), long-context split-KV decode, a mixed
                prefill+decode step, head size 256 with a sliding window and a
                soft-cap, float32, int4/int8/fp8 linears, MoE with 64 experts top-8.
  3. conformance the cross-backend suite on the device in fp16 and bf16.
  4. attention  paged-attention decode at batch 64 x context 2048 (target:
                >= 70% of copy bandwidth) and flash-decoding at batch 1,
                each with a bf16 and an fp8 KV cache.
  5. compiles   one request decoding eagerly over a growing context, then
                batches 1..64: kernel variants compiled and the stalls they cost.
  6. e2e        a Llama-3-8B-shaped model with random bf16 weights (no hub):
                prefill throughput, decode step eager and with CUDA graphs at
                batch 1 (target: >= 80% of the weight-streaming roofline) and
                batch 64.
  7. memory     an engine sized by gpu_memory_utilization=0.9 (a random 1B
                Llama, max_num_seqs 256) capturing every decode batch size:
                KV blocks, peak memory against the budget, a full batch served.
  8. engine     LLMEngine on a random 1B-sized Llama and a small random
                Mixtral saved by transformers: a batch of greedy requests with
                --enforce-eager, with the graphs' padded static buffers run
                eagerly, and with the engine's CUDA graphs (the last two must
                give equal tokens and expert counts); the Llama also with an
                fp8 KV cache, static buffers against graphs; tokens/s of each.
  9. primitives each Triton kernel at Llama-3-8B / Mixtral shapes, beside the
                `torch` backend on the same device: ms, GB/s and TFLOP/s with
                their share of the measured peaks, and the largest difference.
 10. tune       (only with --tune or --only tune) sweeps the launch parameters
                of paged attention (decode, long decode, prefill) and of the
                int4 linear (T=1 and a prefill-sized T); prints the best of each.
Without a GPU the script switches to --smoke by itself: TRITON_INTERPRET=1 is
set before any kernel module is imported, shapes shrink to toy sizes, and the
numbers only prove that every path runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass


@dataclass(frozen=True)
class Shapes:
    hidden: int = 4096  # Llama-3-8B
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    inter: int = 14336
    vocab: int = 128256
    layers: int = 32
    row_tokens: int = 16384  # row-wise kernels: 128 MiB per [T, H] bf16 tensor, far past L2
    prefill_seqs: tuple = (4, 2048)  # attention prefill: requests x tokens
    decode: tuple = (64, 2048)  # attention decode: batch x context
    long_decode: tuple = (1, 16384)  # flash-decoding: batch x context
    experts: int = 8  # Mixtral-8x7B-shaped MoE
    top_k: int = 2
    moe_tokens: tuple = (64, 4096)
    e2e_prefill: tuple = (4, 1024)
    e2e_context: int = 1024
    e2e_batch: int = 64
    block_size: int = 16
    warmup: int = 3
    iters: int = 10
    # references: an fp8 pool of this many blocks, the request's blocks from this id on
    pool_blocks: int = 140_000
    high_block: int = 131_072
    high_reqs: tuple = (4, 2048)  # requests x context in the high blocks
    ref_long: tuple = (1, 32768)  # split-KV decode: batch x context
    mixed_prefill: tuple = ((512, 8192), (512, 4096))  # (query rows, context) of the prefill chunks
    mixed_decode: tuple = (30, 1024, 8192)  # decode rows, context range
    wide: tuple = (2, 16384, 256, 4096, 50.0)  # batch, context, head size, sliding window, soft-cap
    f32_decode: tuple = (4, 2048)
    linear_tokens: tuple = (1, 16, 2048)
    moe_wide: tuple = (64, 8, 2048, 1408, (16, 2048))  # experts, top-k, hidden, intermediate, tokens
    stall_context: int = 8192  # compiles: one request decoding to this context
    stall_batches: tuple = (1, 2, 3, 5, 8, 13, 16, 31, 32, 48, 64)
    memory_seqs: int = 256  # memory: max_num_seqs (every batch size up to it captured)


SMOKE = Shapes(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, vocab=128, layers=2, row_tokens=8,
               prefill_seqs=(2, 20), decode=(3, 40), long_decode=(1, 70), experts=4, moe_tokens=(4, 12),
               e2e_prefill=(2, 9), e2e_context=20, e2e_batch=3, warmup=1, iters=1,
               pool_blocks=48, high_block=32, high_reqs=(2, 40), ref_long=(1, 90), mixed_prefill=((17, 40),),
               mixed_decode=(2, 10, 50), wide=(1, 80, 32, 24, 5.0), f32_decode=(2, 30), linear_tokens=(1, 5),
               moe_wide=(8, 3, 32, 16, (5,)), stall_context=40, stall_batches=(1, 3), memory_seqs=4)


SECTION_NAMES = ("peaks", "references", "conformance", "attention", "compiles", "e2e", "memory", "engine",
                 "primitives", "tune")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes in Triton's interpreter (automatic without a GPU)")
    p.add_argument("--skip", action="append", default=[],
                   help="skip a section: " + ", ".join(SECTION_NAMES))
    p.add_argument("--tune", action="store_true",
                   help="also sweep the attention and int4-linear launch parameters (a few minutes on a GPU)")
    p.add_argument("--only", action="append", default=[], help="run only this section (repeatable)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                   help="stop starting sections (and tune sweeps their configurations) this many seconds after "
                        "the start, so a run under a hard time limit still ends in time to write what it has")
    p.add_argument("--write-config", default=None, metavar="DIR",
                   help="with the tune section: write its best tiles as DIR/<device>.json, the file the cuda "
                        "kernels look up (copy it to infer/backends/cuda/configs/)")
    args = p.parse_args()
    if args.write_config and not (args.tune or "tune" in args.only):
        p.error("--write-config writes the tune section's results: add --tune (or --only tune)")
    return args


ARGS = parse_args()
START = time.perf_counter()
_HAS_GPU = False
try:
    import torch

    _HAS_GPU = torch.cuda.is_available()
except ImportError:
    pass
SMOKE_MODE = ARGS.smoke or not _HAS_GPU
if SMOKE_MODE:
    # Before any `@triton.jit` runs: the decorator picks interpreter or GPU once.
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from infer.backends.cuda.attention import default_num_splits, paged_attention  # noqa: E402
from infer.backends.cuda.graphs import DecodeGraphs  # noqa: E402
from infer.core.lowering import lower  # noqa: E402
from infer.core.model_runner import ModelRunner  # noqa: E402
from infer.core.models.llama import build_llama  # noqa: E402
from infer.primitives.types import AttentionMetadata  # noqa: E402
from infer.dispatch import Ops
from infer.registry import get_backend  # noqa: E402

S = SMOKE if SMOKE_MODE else Shapes()
CUDA = get_backend("cuda")
TORCH = get_backend("torch", device=CUDA.device)
DEV = CUDA.device
DT = torch.bfloat16
RESULTS: dict = {"mode": "smoke (Triton interpreter, CPU)" if SMOKE_MODE else "gpu", "sections": {}}
PEAK = {"copy_GBps": None, "bf16_TFLOPs": None}


def sync():
    if DEV.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, warmup=None, iters=None) -> float:
    """Mean seconds per call after warm-up (which also compiles the kernels)."""
    for _ in range(S.warmup if warmup is None else warmup):
        fn()
    sync()
    n = S.iters if iters is None else iters
    start = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - start) / n


def rate(seconds: float, nbytes: float = 0.0, flops: float = 0.0) -> str:
    parts = [f"{seconds * 1e3:9.3f} ms"]
    if nbytes:
        gbps = nbytes / seconds / 1e9
        share = f" ({gbps / PEAK['copy_GBps']:4.0%} of copy)" if PEAK["copy_GBps"] else ""
        parts.append(f"{gbps:8.1f} GB/s{share}")
    if flops:
        tf = flops / seconds / 1e12
        share = f" ({tf / PEAK['bf16_TFLOPs']:4.0%} of mm peak)" if PEAK["bf16_TFLOPs"] else ""
        parts.append(f"{tf:7.2f} TFLOP/s{share}")
    return "  ".join(parts)


def rnd(*shape, scale=1.0, dtype=DT):
    return (torch.randn(*shape, device=DEV, dtype=torch.float32) * scale).to(dtype)


# -- 1. peaks ---------------------------------------------------------------------------
def section_peaks(out):
    n = (1 << 30) // 2 if not SMOKE_MODE else 1 << 16  # 1 GiB of bf16
    a, b = torch.empty(n, dtype=DT, device=DEV), torch.empty(n, dtype=DT, device=DEV)
    t = timed(lambda: b.copy_(a))
    PEAK["copy_GBps"] = 2 * a.numel() * a.element_size() / t / 1e9
    m = 8192 if not SMOKE_MODE else 128
    x, y = rnd(m, m), rnd(m, m)
    t = timed(lambda: x @ y)
    PEAK["bf16_TFLOPs"] = 2 * m**3 / t / 1e12
    out.update(PEAK)
    print(f"  copy bandwidth {PEAK['copy_GBps']:.4g} GB/s (read+write), bf16 matmul {PEAK['bf16_TFLOPs']:.4g} TFLOP/s")


# -- 2. references at real sizes ---------------------------------------------------------
class Checks:
    """Results against the torch backend's: the largest difference over the reference's
    largest magnitude. Every check is printed and kept; the section fails at the end
    if any was over its tolerance (one bad case does not hide the others)."""

    def __init__(self, out: dict):
        self.out = out.setdefault("checks", {})
        self.failed: list[str] = []

    def __call__(self, label: str, got, want, tol: float) -> float:
        pairs = zip(got, want) if isinstance(got, (tuple, list)) else ((got, want),)
        err = 0.0
        for g, w in pairs:
            g, w = g.float(), w.float()
            err = max(err, ((g - w).abs().max() / w.abs().max().clamp_min(1e-6)).item())
        ok = err <= tol  # False for nan
        self.out[label] = dict(rel_err=err, tol=tol, ok=ok)
        print(f"  {'ok  ' if ok else 'FAIL'} {label}: max |diff| {err:.1e} of max |ref| (tolerance {tol:.0e})")
        if not ok:
            self.failed.append(label)
        return err

    def done(self) -> None:
        if self.failed:
            raise AssertionError(f"{len(self.failed)} result(s) differ from torch's: {', '.join(self.failed)}")


def _meta(q_lens, seq_lens, first_block: int = 0, num_blocks: int | None = None, seed: int = 0) -> AttentionMetadata:
    """Host metadata of requests adding `q_lens` tokens to reach `seq_lens`; their blocks drawn
    without repeats from ids [first_block, num_blocks)."""
    bs = S.block_size
    q_lens, seq_lens = np.asarray(q_lens, np.int32), np.asarray(seq_lens, np.int32)
    per = -(-seq_lens // bs)
    num_blocks = num_blocks if num_blocks is not None else first_block + int(per.sum())
    ids = first_block + np.random.default_rng(seed).permutation(num_blocks - first_block)[: int(per.sum())]
    table = np.zeros((len(per), int(per.max())), np.int32)
    for b, (lo, n) in enumerate(zip(np.cumsum(per) - per, per)):
        table[b, :n] = ids[lo:lo + n]
    slots = np.concatenate([table[b, pos // bs].astype(np.int64) * bs + pos % bs
                            for b, pos in enumerate(np.arange(s - q, s) for q, s in zip(q_lens, seq_lens))])
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return AttentionMetadata(qsl, seq_lens, table, slots, int(q_lens.max()), int(seq_lens.max()), bs)


def _attention_pair(q, cache, meta, **kw):
    """(cuda, torch) attention of the same inputs, each through its backend's metadata."""
    scale = q.shape[-1] ** -0.5
    got = CUDA.attention(q, cache, CUDA.prepare_metadata(meta), scale, **kw)
    want = TORCH.attention(q, cache, Ops(TORCH).prepare_metadata(meta), scale, **kw)
    return got, want


def section_references(out):
    from infer.primitives.types import Fp8Weight, Int4GroupWeight, Int8GroupWeight

    chk = Checks(out)
    D, hk, hq, bs = S.head_dim, S.kv_heads, S.heads, S.block_size
    # fp8 KV pool whose request blocks sit past 2^31 bytes of one cache plane: kv_write's and
    # attention's offsets must be int64. The torch backend writes the same tokens into a
    # compact pool; the codes must be equal, byte for byte.
    b, c = S.high_reqs
    meta = _meta([c] * b, [c] * b, S.high_block, S.pool_blocks, seed=1)
    pool = CUDA.allocate_kv_cache(S.pool_blocks, bs, hk, D, "fp8")
    k, v = rnd(b * c, hk, D), rnd(b * c, hk, D)
    scales = (0.05, 0.04)  # |x| < 5 -> codes under 100 of e4m3's 448
    CUDA.kv_write(k, v, pool, CUDA.asarray(meta.slot_mapping), scales)
    used = torch.as_tensor(meta.block_table[meta.block_table >= S.high_block].astype(np.int64), device=DEV)
    compact = TORCH.allocate_kv_cache(used.numel(), bs, hk, D, "fp8")
    flat = {int(blk): i for i, blk in enumerate(used.tolist())}
    cslots = np.array([flat[s // bs] * bs + s % bs for s in meta.slot_mapping.tolist()], np.int64)
    TORCH.kv_write(k, v, compact, TORCH.asarray(cslots), scales)
    wrong = int((pool[:, used] != compact).sum())
    stray = int(pool[:, : S.high_block].count_nonzero())
    offset = S.high_block * pool[0].stride(0) * pool.element_size()
    print(f"  fp8 pool of {S.pool_blocks:,} blocks ({pool.numel() / 2**30:.1f} GiB), {b} requests in blocks >= "
          f"{S.high_block:,} (byte offsets from {offset / 2**30:.2f} GiB): {wrong} codes differ from torch's, "
          f"{stray} bytes written below")
    out["fp8_pool"] = dict(blocks=S.pool_blocks, wrong_codes=wrong, stray_bytes=stray)
    if wrong or stray:
        chk.failed.append("fp8 kv_write into high blocks")
    q = rnd(b, hq, D)
    got, want = _attention_pair(q, pool, _meta([1] * b, [c] * b, S.high_block, S.pool_blocks, seed=1), kv_scales=scales)
    chk(f"fp8 decode {b}x{c} in blocks >= {S.high_block:,}", got, want, 2e-2)
    qp = rnd(b * c, hq, D)
    got, want = _attention_pair(qp, pool, meta, kv_scales=scales)
    chk(f"fp8 prefill {b}x{c} in blocks >= {S.high_block:,}", got, want, 2e-2)
    del pool, compact
    if DEV.startswith("cuda"):
        torch.cuda.empty_cache()

    # Long context: the decode splits its key range (flash-decoding) and combines.
    b, c = S.ref_long
    m = _meta([1] * b, [c] * b)
    cache = CUDA.allocate_kv_cache(int(m.block_table.max()) + 1, bs, hk, D, "bfloat16").normal_()
    got, want = _attention_pair(rnd(b, hq, D), cache, m)
    chk(f"split-KV decode {b}x{c}", got, want, 2e-2)
    # A mixed step: prefill chunks late in long contexts beside decode rows.
    rng = np.random.default_rng(2)
    n_dec, lo, hi = S.mixed_decode
    q_lens = [q for q, _ in S.mixed_prefill] + [1] * n_dec
    seq_lens = [s for _, s in S.mixed_prefill] + rng.integers(lo, hi, n_dec).tolist()
    m = _meta(q_lens, seq_lens, seed=3)
    cache = CUDA.allocate_kv_cache(int(m.block_table.max()) + 1, bs, hk, D, "bfloat16").normal_()
    got, want = _attention_pair(rnd(sum(q_lens), hq, D), cache, m)
    chk(f"mixed step: {len(S.mixed_prefill)} prefill chunks + {n_dec} decode rows", got, want, 2e-2)
    # Head size 256 with a sliding window and a soft-cap (Gemma-2-like), decode split and prefill.
    b, c, d, window, cap = S.wide
    for label, q_len in (("decode", 1), ("prefill chunk", min(512, c // 4))):
        m = _meta([q_len] * b, [c] * b, seed=4)
        cache = CUDA.allocate_kv_cache(int(m.block_table.max()) + 1, bs, hk, d, "bfloat16").normal_()
        got, want = _attention_pair(rnd(b * q_len, hq, d), cache, m, sliding_window=window, soft_cap=cap)
        chk(f"head {d}, window {window}, soft-cap {cap}: {label} {b}x{c}", got, want, 2e-2)
    # float32 end to end (the FMA-unit tiles).
    b, c = S.f32_decode
    for label, q_len in (("decode", 1), ("prefill", min(256, c))):
        m = _meta([q_len] * b, [c] * b, seed=5)
        cache = CUDA.allocate_kv_cache(int(m.block_table.max()) + 1, bs, hk, D, "float32").normal_()
        got, want = _attention_pair(rnd(b * q_len, hq, D, dtype=torch.float32), cache, m)
        chk(f"float32 attention {label} {b}x{c}", got, want, 1e-4)
    del cache
    # Quantized linears at a Llama-3-8B down_proj (N=4096, K=14336), the torch backend as reference.
    H, I = S.hidden, S.inter
    codes = torch.randint(0, 256, (H, I // 2), dtype=torch.uint8, device=DEV)
    big = 128 if I % 128 == 0 else I  # GPTQ/AWQ's group size (smoke shapes: one group per row)
    weights = {
        "int4 g32": Int4GroupWeight(codes, rnd(H, I // 32, dtype=torch.float32, scale=0.01),
                                    rnd(H, I // 32, dtype=torch.float32, scale=0.01), 32, dtype="bfloat16"),
        f"int4 g{big}": Int4GroupWeight(codes, rnd(H, I // big, dtype=torch.float32, scale=0.01),
                                        rnd(H, I // big, dtype=torch.float32, scale=0.01), big, dtype="bfloat16"),
        "int8 g32": Int8GroupWeight(torch.randint(-127, 128, (H, I), dtype=torch.int8, device=DEV),
                                    rnd(H, I // 32, dtype=torch.float32, scale=0.001), 32, dtype="bfloat16"),
        "fp8 per-row": Fp8Weight(torch.randn(H, I, device=DEV).to(torch.float8_e4m3fn).view(torch.uint8),
                                 rnd(H, dtype=torch.float32, scale=0.01).abs(), dtype="bfloat16"),
    }
    for name, w in weights.items():
        ref_w = TORCH.prepare_weight(w)
        for t in S.linear_tokens:
            x = rnd(t, I)
            chk(f"linear {name} T={t}", CUDA.linear(x, w), TORCH.linear(x, ref_w), 2e-2)
    x = rnd(16, I, dtype=torch.float32)
    w32 = Int4GroupWeight(codes, weights["int4 g32"].scales, weights["int4 g32"].offsets, 32, dtype="float32")
    chk("linear int4 g32 float32 T=16", CUDA.linear(x, w32), TORCH.linear(x, TORCH.prepare_weight(w32)), 1e-4)
    # MoE with many experts (Qwen/DeepSeek-like): 64 experts, top-8.
    e, top, h, inter, tokens = S.moe_wide
    w13, w2 = rnd(e, 2 * inter, h, scale=h**-0.5), rnd(e, h, inter, scale=inter**-0.5)
    for t in tokens:
        xm, logits = rnd(t, h), rnd(t, e)
        chk(f"moe {e} experts top-{top} T={t}", CUDA.moe(xm, logits, w13, w2, top, True),
            TORCH.moe(xm, logits, w13, w2, top, True), 3e-2)
    chk.done()


# -- 3. conformance ---------------------------------------------------------------------
def section_conformance(out):
    from infer.testing import run_conformance

    # Smoke: bf16 only, the dtype the interpreter gets wrong unless the kernels widen it.
    dtypes = ["float16", "bfloat16"]
    if SMOKE_MODE:
        dtypes = ["bfloat16"]
    report = run_conformance(CUDA, dtypes=dtypes)
    for r in report.results:
        if r.status not in ("pass", "skip"):
            print(f"  {r.status.upper()} {r.case.id}: {r.detail[:300]}")
    print(f"  {report.summary()}")
    out.update(passed=report.count("pass"), failed=report.count("fail"), errors=report.count("error"))
    if not report.ok:
        raise AssertionError("conformance failed on the device")
    # fp8 KV codes of every bf16 value under scales that are not powers of two, where an
    # approximate division moves values across ties between codes: the contract's codes exactly.
    from infer.primitives.fp8 import e4m3_encode

    x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(-1, 8, 128)
    # Every bf16 value that divides without overflow (those past 448 saturate).
    x = torch.where(x.float().abs() < 1e30, x, 0.0).to(DEV)
    cache = CUDA.allocate_kv_cache(x.shape[0] // 16, 16, 8, 128, "fp8")
    wrong = 0
    for k_scale, v_scale in ((0.9, 1.0 / 3.0), (0.37, 2.5)):
        CUDA.kv_write(x, x, cache, torch.arange(x.shape[0], device=DEV), (k_scale, v_scale))
        xf = x.float().cpu().numpy()
        for i, s in ((0, k_scale), (1, v_scale)):
            got = cache[i].reshape(x.shape).cpu().numpy()
            wrong += int((got != e4m3_encode(xf / np.float32(s))).sum())
    print(f"  fp8 KV codes of all {x.numel():,} bf16 values, scales 0.9, 1/3, 0.37, 2.5: {wrong} differ from "
          "the contract")
    out["fp8_code_mismatches"] = wrong
    if wrong:
        raise AssertionError(f"kv_write wrote {wrong} fp8 codes that differ from the contract's")


# -- 9. primitives ------------------------------------------------------------------------
def _decode_meta(batch: int, context: int, q_len: int = 1, shuffle: bool = True) -> AttentionMetadata:
    """Host metadata: `batch` requests each adding `q_len` tokens to reach `context`."""
    bs = S.block_size
    per = -(-context // bs)
    blocks = np.random.default_rng(0).permutation(batch * per) if shuffle else np.arange(batch * per)
    table = blocks.reshape(batch, per).astype(np.int32)
    pos = np.arange(context - q_len, context)
    slots = np.concatenate([table[b, pos // bs].astype(np.int64) * bs + pos % bs for b in range(batch)])
    return AttentionMetadata(np.arange(batch + 1, dtype=np.int32) * q_len, np.full(batch, context, np.int32), table,
                             slots, q_len, context, bs)


def section_primitives(out):
    H, T, I, D = S.hidden, S.row_tokens, S.inter, S.head_dim
    rows = []

    chk = Checks(out)

    def row(name, fn_cuda, fn_torch, nbytes=0.0, flops=0.0, tol=2e-2, check=None):
        """Time both; then compare their results (`check()` -> (cuda, torch) for a primitive
        that works in place, run on fresh inputs; else the two calls' return values)."""
        t_c = timed(fn_cuda)
        t_t = timed(fn_torch)
        print(f"  {name:34s} cuda {rate(t_c, nbytes, flops)}   torch {t_t * 1e3:9.3f} ms  (x{t_t / t_c:.2f})")
        got, want = check() if check is not None else (fn_cuda(), fn_torch())
        err = chk(name, got, want, tol)
        rows.append(dict(name=name, cuda_ms=t_c * 1e3, torch_ms=t_t * 1e3, GBps=nbytes / t_c / 1e9 if nbytes else None,
                         TFLOPs=flops / t_c / 1e12 if flops else None, max_rel_diff=err))

    x, r, w = rnd(T, H), rnd(T, H), rnd(H)
    row(f"rms_norm+residual T={T} H={H}", lambda: CUDA.rms_norm(x, w, 1e-5, r), lambda: TORCH.rms_norm(x, w, 1e-5, r),
        nbytes=4 * T * H * 2)
    q, k = rnd(T, S.heads, D), rnd(T, S.kv_heads, D)
    pos = torch.randint(0, 4096, (T,), device=DEV)
    cs = rnd(4096, D, dtype=torch.float32)
    row(f"rotary neox T={T}", lambda: CUDA.rotary(q, k, pos, cs, True), lambda: TORCH.rotary(q, k, pos, cs, True),
        nbytes=2 * (q.numel() + k.numel()) * 2 + T * D * 4,  # (it may work in place: compare on fresh copies)
        check=lambda: (CUDA.rotary(q.clone(), k.clone(), pos, cs, True), TORCH.rotary(q.clone(), k.clone(), pos, cs, True)))
    gu = rnd(T // 4, 2 * I)
    row(f"act_and_mul silu T={T // 4} I={I}", lambda: CUDA.act_and_mul(gu, "silu"), lambda: TORCH.act_and_mul(gu, "silu"),
        nbytes=3 * (T // 4) * I * 2)
    kk, vv = rnd(T, S.kv_heads, D), rnd(T, S.kv_heads, D)
    cache = CUDA.allocate_kv_cache(T // S.block_size + 1, S.block_size, S.kv_heads, D, "bfloat16")
    slots = torch.randperm(T, device=DEV)
    ref_cache = torch.zeros_like(cache)
    row(f"kv_write T={T}", lambda: CUDA.kv_write(kk, vv, cache, slots), lambda: TORCH.kv_write(kk, vv, ref_cache, slots),
        nbytes=4 * kk.numel() * 2, tol=0.0, check=lambda: (cache, ref_cache))
    for t in S.moe_tokens:
        xm, logits = rnd(t, H), rnd(t, S.experts)
        w13, w2 = rnd(S.experts, 2 * I, H, scale=H**-0.5), rnd(S.experts, H, I, scale=I**-0.5)
        flops = 2 * t * S.top_k * 3 * H * I
        row(f"moe E={S.experts} top{S.top_k} T={t}", lambda: CUDA.moe(xm, logits, w13, w2, S.top_k, True),
            lambda: TORCH.moe(xm, logits, w13, w2, S.top_k, True), nbytes=(w13.numel() + w2.numel()) * 2, flops=flops,
            tol=3e-2)
    # quantized linear (Q4_1-style int4 with offsets), a down_proj of the model: the weight is read once
    from infer.primitives.types import Int4GroupWeight

    qw = Int4GroupWeight(torch.randint(0, 256, (H, I // 2), dtype=torch.uint8, device=DEV),
                         rnd(H, I // 32, dtype=torch.float32, scale=0.01), rnd(H, I // 32, dtype=torch.float32, scale=0.01),
                         32, dtype=str(DT).removeprefix("torch."))
    qw_torch = TORCH.prepare_weight(qw)
    for t in (1, 16) + (() if SMOKE_MODE else (2048,)):  # decode, a batch, a prefill chunk
        xq = rnd(t, I)
        row(f"linear int4 g32 T={t} N={H} K={I}", lambda: CUDA.linear(xq, qw), lambda: TORCH.linear(xq, qw_torch),
            nbytes=H * I // 2 + 2 * H * (I // 32) * 4, flops=2 * t * H * I)
    n, L = S.prefill_seqs
    meta = _decode_meta(n, L, q_len=L)
    cache = CUDA.allocate_kv_cache(n * (-(-L // S.block_size)), S.block_size, S.kv_heads, D, "bfloat16")
    cache.normal_()
    qp = rnd(n * L, S.heads, D)
    mc, mt = CUDA.prepare_metadata(meta), Ops(TORCH).prepare_metadata(meta)
    row(f"attention prefill {n}x{L}", lambda: CUDA.attention(qp, cache, mc, D**-0.5), lambda: TORCH.attention(qp, cache, mt, D**-0.5),
        flops=4 * n * S.heads * D * L * (L + 1) / 2)
    out["rows"] = rows
    chk.done()


# -- 4. attention decode targets ----------------------------------------------------------
def section_attention(out):
    D = S.head_dim
    chk = Checks(out)
    for (b, c), label, kv in ((S.decode, "decode", "bfloat16"), (S.long_decode, "long decode", "bfloat16"),
                              (S.decode, "decode fp8", "fp8"), (S.long_decode, "long decode fp8", "fp8")):
        meta = _decode_meta(b, c)
        cache = CUDA.allocate_kv_cache(b * (-(-c // S.block_size)), S.block_size, S.kv_heads, D, kv)
        if kv == "fp8":  # e4m3 codes of normal values, read with scales (k 0.5, v 2)
            cache.copy_(torch.randn(cache.shape, device=cache.device).to(torch.float8_e4m3fn).view(torch.uint8))
        else:
            cache.normal_()
        scales = (0.5, 2.0) if kv == "fp8" else None
        q = rnd(b, S.heads, D)
        m = CUDA.prepare_metadata(meta)
        nbytes = 2 * b * c * S.kv_heads * D * cache.element_size() + 2 * q.numel() * 2
        # The interpreter never splits by itself (no SMs to fill): force it so the path runs.
        splits = 3 if SMOKE_MODE else default_num_splits(q.device, b, S.kv_heads, 1, c)

        def run(n, scales=scales, cache=cache, q=q, m=m):
            return paged_attention(q, cache, m, D**-0.5, kv_scales=scales, num_splits=n)

        t_auto = timed(lambda: run(splits))
        t_one = timed(lambda: run(1))
        diff = (run(splits).float() - run(1).float()).abs().max().item()
        chk(f"{label} B={b} ctx={c} against torch", run(splits),
            TORCH.attention(q, cache, Ops(TORCH).prepare_metadata(meta), D**-0.5, kv_scales=scales), 2e-2)
        share = nbytes / t_auto / 1e9 / PEAK["copy_GBps"] if PEAK["copy_GBps"] else float("nan")
        print(f"  {label} B={b} ctx={c}: {splits} split(s) {rate(t_auto, nbytes)}; one pass {t_one * 1e3:.3f} ms; "
              f"max |diff| {diff:.1e}")
        out[label] = dict(batch=b, context=c, splits=splits, ms=t_auto * 1e3, ms_one_pass=t_one * 1e3,
                          share_of_copy=share, split_vs_one_pass_max_diff=diff)
        if diff > 2e-2 * (4 if kv == "fp8" else 1):  # fp8: v_scale 2 and values up to 448
            raise AssertionError(f"split-KV and one-pass attention differ by {diff} ({label})")
    if not SMOKE_MODE:
        share = out["decode"]["share_of_copy"]
        print(f"  target: decode B=64 ctx=2048 >= 70% of copy bandwidth: {share:.0%} -> {'MET' if share >= 0.7 else 'MISSED'}")
        ratio = out["decode fp8"]["ms"] / out["decode"]["ms"]
        print(f"  fp8 KV: decode B=64 ctx=2048 in {ratio:.2f}x the time of bf16")
    chk.done()


# -- 5. compiles over a growing context -------------------------------------------------------
def _compiled_variants() -> int | None:
    """Kernel variants the attention kernels hold compiled (None under the interpreter)."""
    from infer.backends.cuda import attention as cuda_attention

    total = 0
    for kernel in (cuda_attention._paged_attention_kernel, cuda_attention._combine_splits_kernel):
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            return None
        total += sum(len(entry[0]) for entry in caches.values())
    return total


def section_compiles(out):
    """Eager decode as a server runs it without graphs: one request's context grows a token per
    step, then batches of many sizes. Each new specialisation of a kernel is a compile (~1 s
    cold on a GPU) stalling that step; count them and the slow steps."""
    D, hk, hq, bs = S.head_dim, S.kv_heads, S.heads, S.block_size
    top = S.stall_context
    per = -(-top // bs)
    batch_max = max(S.stall_batches)
    cache = CUDA.allocate_kv_cache(batch_max * per, bs, hk, D, "bfloat16").normal_()
    table = np.random.default_rng(6).permutation(batch_max * per).astype(np.int32).reshape(batch_max, per)
    q = rnd(batch_max, hq, D)

    def step(b: int, c: int) -> float:
        pos = c - 1
        meta = AttentionMetadata(np.arange(b + 1, dtype=np.int32), np.full(b, c, np.int32), table[:b, : -(-c // bs)],
                                 table[:b, pos // bs].astype(np.int64) * bs + pos % bs, 1, c, bs)
        start = time.perf_counter()
        CUDA.attention(q[:b], cache, CUDA.prepare_metadata(meta), D**-0.5)
        sync()
        return time.perf_counter() - start

    before = _compiled_variants()
    step(1, 1)  # the first variant is not a stall of the growing context
    base = _compiled_variants()
    start = time.perf_counter()
    times = np.array([step(1, c) for c in range(2, top + 1)])
    single = time.perf_counter() - start
    after_single = _compiled_variants()
    batch_times = np.array([step(b, c) for b in S.stall_batches for c in (top // 4, top // 2, top)])
    after = _compiled_variants()
    stall = max(0.05, 20 * float(np.median(times)))  # a step this much slower than usual compiled something
    stalls = int((times > stall).sum()) + int((batch_times > stall).sum())
    new = None if base is None else dict(single=after_single - base, batches=after - after_single,
                                         before_check=base - before)
    print(f"  one request, context 2..{top}: {single:.1f} s for {top - 1} steps (median "
          f"{np.median(times) * 1e3:.2f} ms, worst {times.max() * 1e3:.0f} ms); batches {list(S.stall_batches)} at "
          f"3 contexts: worst {batch_times.max() * 1e3:.0f} ms")
    print(f"  kernel variants compiled: {new if new is not None else 'n/a (interpreter)'}; steps over "
          f"{stall * 1e3:.0f} ms: {stalls}")
    out.update(context=top, seconds_single=single, median_ms=float(np.median(times)) * 1e3,
               worst_ms=float(times.max()) * 1e3, worst_batch_ms=float(batch_times.max()) * 1e3, compiled=new,
               stall_steps=stalls)
    if new is not None:
        total = new["single"] + new["batches"]
        print(f"  target: <= 4 compiles over the growing context and the batches: {total} -> "
              f"{'MET' if total <= 4 else 'MISSED'}")


# -- 6. end to end --------------------------------------------------------------------------
class RandomWeightsRunner(ModelRunner):
    """A ModelRunner whose parameters are drawn on the device (no checkpoint, no host copy)."""

    def _load_param(self, name, weights):
        shape = self.program.graph.params[name].shape
        scale = 1.0 if "norm" in name else 0.02
        t = torch.randn(*shape, device=self.backend.device, dtype=torch.float32) * scale
        return (t + 1.0 if "norm" in name else t).to(DT)


def llama_config() -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": S.hidden,
            "intermediate_size": S.inter, "num_attention_heads": S.heads, "num_key_value_heads": S.kv_heads,
            "head_dim": S.head_dim, "num_hidden_layers": S.layers, "vocab_size": S.vocab, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu"}


def section_e2e(out):
    program = lower(build_llama(llama_config()))
    runner = RandomWeightsRunner(program, CUDA, Ops(CUDA), {}, "bfloat16", 8192)
    weight_bytes = sum(int(np.prod(p.shape)) * 2 for p in program.graph.params.values())
    n, L = S.e2e_prefill
    c, B = S.e2e_context, S.e2e_batch
    per_seq = -(-(max(L, c) + 1) // S.block_size)
    runner.allocate_kv_caches(max(n, B) * per_seq + 1, S.block_size)
    print(f"  model: {S.layers} layers, hidden {S.hidden}, {weight_bytes / 1e9:.2f} GB of bf16 weights")

    def step(meta, ids=None):
        t = meta.num_tokens
        ids = np.random.default_rng(1).integers(0, S.vocab, t) if ids is None else ids
        positions = np.concatenate([np.arange(s - (e - b), s) for s, b, e in
                                    zip(meta.seq_lens, meta.query_start_loc[:-1], meta.query_start_loc[1:])])
        last = (meta.query_start_loc[1:] - 1).astype(np.int64)
        return lambda: runner.forward(CUDA.asarray(ids), CUDA.asarray(positions), CUDA.asarray(last),
                                      CUDA.prepare_metadata(meta)).logits

    t = timed(step(_decode_meta(n, L, q_len=L, shuffle=False)), warmup=1, iters=max(1, S.iters // 3))
    print(f"  prefill {n}x{L}: {t * 1e3:.1f} ms, {n * L / t:,.0f} tokens/s")
    out["prefill_tokens_per_s"] = n * L / t
    # Off a GPU the same static buffers and padding run eagerly: every path but the capture itself.
    graphs = DecodeGraphs(runner.forward, CUDA.device, max_model_len=8192, block_size=S.block_size, batch_sizes=(1, 4, B),
                          use_graphs=DEV.startswith("cuda"))
    graphs.capture()
    taken = (f"captured for batch {sorted(graphs.graphs)}" if graphs.graphs
             else f"not taken ({DEV}): static buffers run eagerly")
    print(f"  CUDA graphs: {taken}")
    for b in sorted({1, 3, B}):  # 3 is padded to a captured 4
        meta = _decode_meta(b, c, shuffle=False)
        ids = np.random.default_rng(2).integers(0, S.vocab, b)
        positions = np.full(b, c - 1)
        eager = step(meta, ids)
        t_e = timed(eager)
        t_g = timed(lambda: graphs.forward(ids, positions, meta).logits)
        # Replays use the split count of the captured capacity, eager that of this
        # context: equal up to bf16 rounding, while a broken replay is off by O(1).
        want = eager().float()
        diff = ((graphs.forward(ids, positions, meta).logits.float() - want).abs().max() / want.abs().max()).item()
        kv_bytes = 2 * S.layers * b * c * S.kv_heads * S.head_dim * 2
        floor = (weight_bytes + kv_bytes) / (PEAK["copy_GBps"] * 1e9) if PEAK["copy_GBps"] else float("nan")
        best = min(t_e, t_g)
        print(f"  decode B={b} ctx={c}: eager {t_e * 1e3:.2f} ms, graph {t_g * 1e3:.2f} ms (max logit diff {diff:.1e} of max |logit|); "
              f"{b / best:,.0f} tokens/s; roofline {floor * 1e3:.2f} ms -> {floor / best:.0%} of it")
        out[f"decode_b{b}"] = dict(eager_ms=t_e * 1e3, graph_ms=t_g * 1e3, roofline_share=floor / best,
                                   tokens_per_s=b / best, graph_vs_eager_max_diff=diff)
        if diff > 0.1:
            raise AssertionError(f"CUDA-graph logits differ from eager by {diff:.2f} of max |logit| at batch {b}")
    if not SMOKE_MODE:
        share = out["decode_b1"]["roofline_share"]
        print(f"  target: batch-1 decode >= 80% of the HBM roofline: {share:.0%} -> {'MET' if share >= 0.8 else 'MISSED'}")


# -- 7. memory: gpu_memory_utilization sizing with every graph captured -------------------------
def section_memory(out):
    """The engine as `infer serve` sizes it on a GPU: KV pool from gpu_memory_utilization=0.9
    after profiling, then decode graphs for every batch size up to max_num_seqs. The captured
    graphs' memory comes after the sizing, so this is where a too-tight budget shows."""
    import tempfile

    from infer.core.config import graph_batch_sizes
    from infer.core.llm import LLM
    from infer.core.sampling_params import SamplingParams

    seqs = S.memory_seqs
    with tempfile.TemporaryDirectory() as path:
        vocab = _random_checkpoint("llama", path)
        if DEV.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            free0, total = torch.cuda.mem_get_info()
        start = time.perf_counter()
        extra = {} if DEV.startswith("cuda") else dict(kv_cache_memory=64 << 20)  # smoke: no device memory to size by
        llm = LLM(path, backend="cuda", dtype="bfloat16", skip_tokenizer_init=True, max_num_seqs=seqs,
                  max_model_len=2048, gpu_memory_utilization=0.9, show_progress=False, **extra)
        startup = time.perf_counter() - start
        engine = llm.engine
        want = graph_batch_sizes(seqs)
        got = sorted(engine.worker.decode_graphs.graphs) if engine.worker.decode_graphs is not None else []
        blocks = engine.cache_config.num_blocks
        print(f"  startup {startup:.1f} s: {blocks:,} KV blocks of {engine.cache_config.block_size} tokens; "
              f"graphs captured for {len(got)} of {len(want)} batch sizes")
        out.update(startup_s=startup, kv_blocks=blocks, graphs_captured=len(got), graphs_wanted=len(want))
        rng = np.random.default_rng(8)
        new = 32 if not SMOKE_MODE else 2
        prompts = [{"prompt_token_ids": rng.integers(3, vocab, int(n)).tolist()}
                   for n in rng.integers(16, 256 if not SMOKE_MODE else 20, seqs)]
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True), use_tqdm=False)
        sync()
        seconds = time.perf_counter() - start
        done = sum(len(o.outputs[0].token_ids) == new for o in outs)
        print(f"  {seqs} requests x {new} tokens: {done} complete in {seconds:.2f} s ({seqs * new / seconds:,.0f} tok/s)")
        out.update(requests_complete=done, tokens_per_s=seqs * new / seconds)
        if DEV.startswith("cuda"):
            peak = torch.cuda.max_memory_reserved()
            used = total - torch.cuda.mem_get_info()[0]
            print(f"  device {total / 2**30:.1f} GiB, {(total - free0) / 2**30:.2f} GiB in use before; peak reserved "
                  f"{peak / 2**30:.2f} GiB = {peak / total:.1%}, in use after {used / total:.1%} (budget 90%)")
            out.update(peak_reserved_share=peak / total, in_use_share=used / total)
            if used / total > 0.93:
                raise AssertionError(f"the engine uses {used / total:.1%} of the device against a 90% budget")
        del llm, engine
        gc.collect()
    if got != list(want) and DEV.startswith("cuda"):
        raise AssertionError(f"decode graphs captured for {got}, wanted every size of {list(want)}")
    if done != seqs:
        raise AssertionError(f"{seqs - done} of {seqs} requests did not complete")


def _random_checkpoint(kind: str, path: str) -> int:
    """Save a random bf16 model of `kind` ('llama': ~1B dense; 'mixtral': a small
    8-expert top-2 MoE) as transformers writes it; returns its vocabulary size."""
    import transformers

    if kind == "llama":
        dims = (2048, 8, 16, 4, 5632) if not SMOKE_MODE else (64, 2, 4, 2, 96)
        extra, cls = {}, (transformers.LlamaConfig, transformers.LlamaForCausalLM)
    else:
        dims = (1024, 4, 16, 4, 2048) if not SMOKE_MODE else (64, 2, 4, 2, 48)
        extra, cls = dict(num_local_experts=8, num_experts_per_tok=2), (transformers.MixtralConfig,
                                                                        transformers.MixtralForCausalLM)
    h, layers, heads, kv, inter = dims
    vocab = 32000 if not SMOKE_MODE else 128
    cfg = cls[0](hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                 intermediate_size=inter, vocab_size=vocab, max_position_embeddings=2048, **extra)
    torch.manual_seed(0)
    cls[1](cfg).to(torch.bfloat16).save_pretrained(path)
    return vocab


def _agreement(want: list[list[int]], got: list[list[int]]) -> float:
    """Share of `want`'s tokens that `got` matches up to each request's first difference (it changes the rest)."""
    same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(want, got)]
    return sum(same) / sum(len(x) for x in want)


def section_engine(out):
    """LLMEngine on the cuda backend, a random dense and a random MoE model saved by
    transformers (no hub), one batch of greedy requests, three ways: --enforce-eager;
    the graphs' static buffers and padding run eagerly (use_graphs=False); the
    engine's CUDA graphs. The last two run the same kernels on the same inputs, so
    their tokens (and MoE expert counts) must be equal; eager ones may part at a
    near-tie (its split count follows each step's context, not the capacity)."""
    import tempfile

    from infer.core.config import graph_batch_sizes
    from infer.core.llm import LLM
    from infer.core.sampling_params import SamplingParams

    batch, new = (32, 64) if not SMOKE_MODE else (3, 4)
    for kind in ("llama", "mixtral"):
        res, got, load = out.setdefault(kind, {}), {}, {}
        with tempfile.TemporaryDirectory() as path:
            vocab = _random_checkpoint(kind, path)
            rng = np.random.default_rng(3)
            prompts = [{"prompt_token_ids": rng.integers(3, vocab, int(n)).tolist()}
                       for n in rng.integers(8, 200 if not SMOKE_MODE else 20, batch)]
            params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
            # The dense model also runs with an fp8 KV cache, static buffers against graphs.
            for mode in ("eager", "static", "graphs", *(("fp8 static", "fp8 graphs") if kind == "llama" else ())):
                llm = LLM(path, backend="cuda", dtype="bfloat16", skip_tokenizer_init=True, max_num_seqs=batch,
                          max_model_len=512, enforce_eager=not mode.endswith("graphs"), show_progress=False,
                          kv_cache_memory=2 << 30, kv_cache_dtype="fp8" if mode.startswith("fp8") else "auto")
                engine = llm.engine
                graphs_mode = mode.endswith("graphs")
                if graphs_mode and engine.worker.decode_graphs is None and not SMOKE_MODE:
                    raise AssertionError(f"the engine captured no decode graphs on the GPU ({mode})")
                if mode.endswith("static") or engine.worker.decode_graphs is None and graphs_mode:  # smoke: no CUDA graph
                    engine.worker.decode_graphs = DecodeGraphs(engine.worker.runner.forward, engine.backend.device, engine.max_model_len,
                                                        engine.cache_config.block_size, graph_batch_sizes(batch),
                                                        use_graphs=False)
                    engine.worker.decode_graphs.capture()
                llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # warm-up
                if engine.expert_load is not None:
                    engine.expert_load.reset()
                sync()
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                sync()
                seconds = time.perf_counter() - start
                replays = engine.worker.decode_graphs.replays if engine.worker.decode_graphs is not None else 0
                got[mode] = [o.outputs[0].token_ids for o in outs]
                if engine.expert_load is not None:
                    load[mode] = engine.expert_load.snapshot().tokens_per_expert
                print(f"  {kind} {mode}: {batch} requests x {new} tokens in {seconds:.2f} s, "
                      f"{batch * new / seconds:,.0f} tok/s ({replays} steps through the graphs' buffers)")
                res[mode] = dict(seconds=seconds, tokens_per_s=batch * new / seconds, replays=replays)
                if mode != "eager" and replays == 0:
                    raise AssertionError("no decode step went through the graphs")
                del llm, engine
                gc.collect()  # the engine's reference cycles hold its KV pool until collected
                if DEV.startswith("cuda"):
                    torch.cuda.empty_cache()
        res["eager_agreement"] = _agreement(got["eager"], got["graphs"])
        print(f"  {kind}: graphs x{res['graphs']['tokens_per_s'] / res['eager']['tokens_per_s']:.2f} the speed of "
              f"eager; greedy tokens equal to eager's before the first difference: {res['eager_agreement']:.1%}")
        if "fp8 graphs" in got:
            res["fp8_agreement"] = _agreement(got["graphs"], got["fp8 graphs"])
            print(f"  {kind}: fp8 KV graphs x{res['fp8 graphs']['tokens_per_s'] / res['graphs']['tokens_per_s']:.2f} "
                  f"the speed of bf16 KV graphs; greedy tokens equal before the first difference: "
                  f"{res['fp8_agreement']:.1%}")
        for prefix in ("", "fp8 ")[: 2 if "fp8 graphs" in got else 1]:
            if got[prefix + "graphs"] != got[prefix + "static"]:
                bad = sum(a != b for a, b in zip(got[prefix + "graphs"], got[prefix + "static"]))
                raise AssertionError(f"{kind}: {bad} of {batch} requests differ between CUDA-graph replays and the "
                                     f"same padded steps run eagerly ({prefix or 'bf16 '}KV cache)")
        if load and not np.array_equal(load["graphs"], load["static"]):
            raise AssertionError(f"{kind}: expert counts differ between replays and eager padded steps")


# -- 10. tile sweep (opt-in: --tune) ---------------------------------------------------------
def _compiled_kernels(kernels) -> set:
    """The compiled variants the Triton kernels hold now (empty under the interpreter)."""
    held = set()
    for kernel in kernels:
        for entry in getattr(kernel, "device_caches", {}).values():
            held.update(entry[0].values())
    return held


def _sweep(label, run, default, configs, kernels=()):
    """Time `run(config)` for the default and each alternative; an alternative that
    fails to build (shared memory), spills registers (in a variant of `kernels` that
    it compiled) or changes the result is skipped."""
    from infer.backends.cuda import tuned

    ref = run(default).float()
    scale = ref.abs().max().clamp_min(1e-6)
    t_default = timed(lambda: run(default))
    best_t, best, tried = t_default, default, []
    for cfg in configs:
        if out_of_time(margin=10.0):  # keep the time to print and write what was found
            tried.append(dict(config=cfg, error="not tried: past --deadline"))
            continue
        held = _compiled_kernels(kernels)
        try:
            diff = ((run(cfg).float() - ref).abs().max() / scale).item()
        except Exception as exc:  # noqa: BLE001  (a config the compiler rejects)
            tried.append(dict(config=cfg, error=f"{type(exc).__name__}: {str(exc)[:80]}"))
            continue
        spilling = [k for k in _compiled_kernels(kernels) - held if tuned.spills(k)]
        if spilling:
            tried.append(dict(config=cfg, error=f"spills registers ({tuned.registers(spilling[0])})"))
            continue
        if diff > 2e-2:
            tried.append(dict(config=cfg, error=f"result off by {diff:.1e} of max"))
            continue
        t = timed(lambda: run(cfg))
        tried.append(dict(config=cfg, ms=t * 1e3))
        if t < best_t:
            best_t, best = t, cfg
    ok = sum("ms" in r for r in tried)
    RESULTS["sections"].setdefault("tune (so far)", {})[label] = dict(default=default, best=best, best_ms=best_t * 1e3)
    write_json()  # each sweep as it finishes
    print(f"  {label}: default {t_default * 1e3:.3f} ms {default}; best {best_t * 1e3:.3f} ms {best} "
          f"(x{t_default / best_t:.2f}; {ok} of {len(configs)} alternatives ran)")
    return dict(default=default, default_ms=t_default * 1e3, best=best, best_ms=best_t * 1e3, tried=tried)


def section_tune(out):
    """Sweep the launch parameters of the attention and quantized-linear kernels
    (their defaults are guesses made without a GPU) at Llama-3-8B shapes."""
    import itertools

    from infer.backends.cuda import quant_linear
    from infer.backends.cuda import attention as cuda_attention
    from infer.backends.cuda.attention import launch_config
    from infer.backends.cuda.launch import next_pow2
    from infer.primitives.types import Int4GroupWeight

    D = S.head_dim
    gp = next_pow2(S.heads // S.kv_heads)
    trim = (lambda c: c[:2]) if SMOKE_MODE else (lambda c: c)
    dev = torch.device(DEV)

    def grid(rows, tiles, warps, stages):
        return trim([dict(rows=r, tile_n=t, num_warps=w, num_stages=st)
                     for r, t, w, st in itertools.product(rows, tiles, warps, stages)])

    cases = (("attention decode", S.decode, 1, (16, 32)), ("attention long decode", S.long_decode, 1, (16, 32)),
             ("attention prefill", S.prefill_seqs, None, (32, 64, 128)))
    for label, (b, c), q_len, rows in cases:
        q_len = q_len or c
        meta = _decode_meta(b, c, q_len=q_len)
        cache = CUDA.allocate_kv_cache(b * (-(-c // S.block_size)), S.block_size, S.kv_heads, D, "bfloat16")
        cache.normal_()
        q = rnd(b * q_len, S.heads, D)
        m = CUDA.prepare_metadata(meta)
        # What the kernel uses now (a tuned file's, if the device has one) against the built-in guess and the grid.
        split = default_num_splits(dev, b, S.kv_heads, meta.max_query_len, meta.max_seq_len) > 1
        default = launch_config(DT, meta.max_query_len, gp, split, dev, D)
        guess = launch_config(DT, meta.max_query_len, gp)
        configs = [cfg for cfg in [guess, *grid(rows, (32, 64, 128), (4, 8), (2, 3))] if cfg != default]
        configs = [cfg for i, cfg in enumerate(configs) if cfg not in configs[:i]]
        out[label] = _sweep(f"{label} {b}x{c}", lambda cfg: paged_attention(q, cache, m, D**-0.5, config=cfg),
                            default, configs, kernels=(cuda_attention._paged_attention_kernel,))
    H, I = S.hidden, S.inter
    w = Int4GroupWeight(torch.randint(0, 256, (H, I // 2), dtype=torch.uint8, device=DEV),
                        rnd(H, I // 32, dtype=torch.float32, scale=0.01), rnd(H, I // 32, dtype=torch.float32, scale=0.01),
                        32, dtype=str(DT).removeprefix("torch."))
    for t, space in ((1, itertools.product((16,), (16, 32, 64, 128), (64, 128, 256), (2, 4))),
                     (2048 if not SMOKE_MODE else 40, itertools.product((64, 128), (64, 128), (32, 64), (4, 8)))):
        x = rnd(t, I)
        default = quant_linear.tiles(t, DT, dev)
        configs = trim([cfg for cfg in dict.fromkeys([quant_linear.tiles(t, DT), *space]) if cfg != default])
        out[f"int4 linear T={t}"] = _sweep(f"int4 linear g32 T={t} N={H} K={I}",
                                           lambda cfg: quant_linear.linear(x, w, cfg), default, configs,
                                           kernels=(quant_linear._quant_linear_kernel,))
    best = {k: v["best"] for k, v in out.items()}
    print("  best: " + json.dumps(best, default=str))
    if ARGS.write_config:
        _write_config(out, ARGS.write_config)


# tune-section label -> (kernel, kind) of the tuned-config file (`infer/backends/cuda/tuned.py`)
_CONFIG_KEYS = {"attention decode": ("attention", "decode"), "attention long decode": ("attention", "decode_split"),
                "attention prefill": ("attention", "prefill"), "int4 linear T=1": ("quant_linear", "decode")}


def _write_config(tune_out: dict, folder: str) -> None:
    from infer.backends.cuda import tuned
    from infer.backends.cuda.launch import next_pow2

    name = tuned.device_name(DEV)
    # The attention tiles were measured at this head size and this many query heads per KV head.
    group_pad = next_pow2(S.heads // S.kv_heads)
    data: dict = {"attention": {"head_dim": S.head_dim, "group_pad": group_pad}, "quant_linear": {}, "measured": {
        "device": name, "torch": torch.__version__, "triton": __import__("triton").__version__,
        "date": time.strftime("%Y-%m-%d"), "mode": RESULTS["mode"], "ms": {}}}
    for label, res in tune_out.items():
        kernel, kind = _CONFIG_KEYS.get(label) or (("quant_linear", "prefill") if label.startswith("int4 linear")
                                                   else (None, None))
        if kernel is None:
            continue
        data[kernel][kind] = list(res["best"]) if kernel == "quant_linear" else dict(res["best"])
        data["measured"]["ms"][f"{kernel}.{kind}"] = dict(default=res["default_ms"], best=res["best_ms"])
    tuned.validate(data, "(about to be written)")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, tuned.file_name(name))
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"  tuned config written: {path}")


# In order of what a short device session needs most: yardsticks, correctness at real sizes,
# the conformance suite, the targets, compile stalls, the engine, per-primitive timings, tuning.
SECTIONS = {"peaks": section_peaks, "references": section_references, "conformance": section_conformance,
            "attention": section_attention, "compiles": section_compiles, "e2e": section_e2e,
            "memory": section_memory, "engine": section_engine, "primitives": section_primitives,
            "tune": section_tune}
# Seconds a section may take on an H100/H200, kernel compiles included (guesses, generous): with
# --deadline, a section starts only if that much time is left. tune's sweeps stop by themselves.
assert tuple(SECTIONS) == SECTION_NAMES
SECTION_SECONDS = {"peaks": 15, "references": 90, "conformance": 150, "attention": 45, "compiles": 90, "e2e": 120,
                   "memory": 120, "engine": 180, "primitives": 90, "tune": 30}


def out_of_time(margin: float = 0.0) -> bool:
    """Past --deadline (less `margin` seconds)?"""
    return ARGS.deadline is not None and time.perf_counter() - START > ARGS.deadline - margin


def write_json() -> None:
    if ARGS.json:  # after every section: a run killed at its time limit keeps what it finished
        with open(ARGS.json, "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


def main() -> int:
    name = torch.cuda.get_device_name() if DEV.startswith("cuda") else "cpu (Triton interpreter)"
    import triton

    print(f"gpu_check: {RESULTS['mode']}; device {name}; torch {torch.__version__}, triton {triton.__version__}")
    ok, skipped = True, []
    for sec, fn in SECTIONS.items():
        wanted = sec in ARGS.only if ARGS.only else sec not in ARGS.skip and (sec != "tune" or ARGS.tune)
        if not wanted:
            continue
        if out_of_time(margin=0 if SMOKE_MODE else SECTION_SECONDS[sec]):
            skipped.append(sec)
            RESULTS["sections"][sec] = {"status": "skipped: past --deadline"}
            continue
        t = time.perf_counter()
        print(f"[{sec}]")
        out: dict = {}
        try:
            fn(out)
            out["status"] = "ok"
        except Exception as exc:  # report and go on: one broken section must not hide the others
            ok = False
            out["status"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(limit=3)
        out["seconds"] = time.perf_counter() - t
        RESULTS["sections"][sec] = out
        print(f"  ({out['seconds']:.1f} s)")
        write_json()
        gc.collect()  # a section's runner (closures referring back to it) is a reference cycle
        if DEV.startswith("cuda"):
            torch.cuda.empty_cache()
    if skipped:
        print(f"past --deadline {ARGS.deadline:.0f} s: skipped {', '.join(skipped)}")
    print(f"gpu_check {'passed' if ok else 'FAILED'} in {time.perf_counter() - START:.1f} s")
    write_json()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
