"""Eager decode compiles a small, fixed number of attention variants however the
batch and the context grow, and tuned tiles that spill registers can be told apart.

Every distinct Triton specialisation (constexprs, and the 1 / multiple-of-16
classes of the int arguments it specialises on) is a compile of ~1 s on a GPU,
in the middle of serving. The launches are recorded, not run, through the stand-in
driver and JIT cache hook of `test_cuda_compile` (sm_90, no GPU), with the split
count an H200 (132 SMs) would choose. Run in a subprocess: the driver and hook are
process-wide.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

HERE = Path(__file__).parent
H200_SMS = 132


def _child(function: str) -> str:
    from test_cuda_compile import _child as run

    return run(function, "test_cuda_recompiles").strip().splitlines()[-1]


def test_decoding_to_8k_tokens_at_batches_1_to_64_compiles_two_attention_variants_and_one_combine():
    counts = json.loads(_child("count_decode_variants"))
    # One variant without splits, one with; the combine once, whatever the split count.
    assert counts == {"_paged_attention_kernel": 2, "_combine_splits_kernel": 1}, counts


def test_the_spill_check_flags_a_too_large_tile_and_passes_the_default_for_gqa_128():
    out = json.loads(_child("spill_figures"))
    assert out["too_large"]["spills"] and out["too_large"]["n_spills"] > 0, out
    for kind in ("default", "default_split", "default_mixed"):
        assert not out[kind]["spills"] and out[kind]["n_spills"] == 0, out


# -- run in the child ---------------------------------------------------------------------
@functools.cache
def _cache(kv_heads, head_dim, block_size):
    import torch

    # Never read (launches are recorded, not run), so one block is as good as a context's worth.
    return torch.zeros(2, 1, block_size, kv_heads, head_dim, dtype=torch.bfloat16)


def _decode(attention, q_heads, kv_heads, head_dim, seq_lens, q_lens=None, block_size=16, **kw):
    """One eager step as the runtime builds it: the block table as wide as the longest
    request's blocks, the split count (unless `kw` gives one) what `default_num_splits`
    picks. `q_lens` default to one query per request (decode)."""
    import torch

    from infer.primitives.types import AttentionMetadata

    b, q_lens = len(seq_lens), q_lens or [1] * len(seq_lens)
    width = max(-(-s // block_size) for s in seq_lens)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(qsl, torch.tensor(seq_lens, dtype=torch.int32), torch.zeros(b, width, dtype=torch.int32),
                             torch.zeros(int(qsl[-1]), dtype=torch.int64), max(q_lens), max(seq_lens), block_size)
    cache = _cache(kv_heads, head_dim, block_size)
    attention.paged_attention(torch.zeros(int(qsl[-1]), q_heads, head_dim, dtype=torch.bfloat16), cache, meta, 0.1,
                              **kw)


def count_decode_variants():
    """Distinct specialisations per kernel: one request decoding from 1 to 8192 tokens, then
    batches of 1..64 requests at mixed contexts (Llama-3-8B's 32 query / 8 KV heads, d 128)."""
    import random

    import torch
    from test_cuda_compile import _record_launches

    specs = _record_launches()
    from infer.backends.cuda import attention

    choose = attention.default_num_splits
    attention._num_sms = lambda device: H200_SMS
    attention.default_num_splits = lambda device, *a: choose(torch.device("cuda"), *a)
    for n in range(1, 8193):
        _decode(attention, 32, 8, 128, [n])
    rng = random.Random(0)
    for b in range(1, 65):
        for _ in range(8):
            _decode(attention, 32, 8, 128, [rng.randint(1, 8192) for _ in range(b)])
    counts: dict[str, int] = {}
    for name, _ in specs:
        counts[name] = counts.get(name, 0) + 1
    print(json.dumps(counts))


def spill_figures():
    """Registers and spills on sm_90, read from the cubin without a GPU, at 128 query heads
    per KV head and head size 128: tiles too large for the registers at that group, and the
    built-in tiles (decode, decode split, mixed prefill)."""
    import triton
    from test_cuda_compile import _record_launches
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    specs = _record_launches()
    from infer.backends.cuda import attention, tuned

    def compile_one(q_heads, head_dim, **kw):
        specs.clear()
        _decode(attention, q_heads, 1, head_dim, **kw)
        (fn, c), = [v for (name, _), v in specs.items() if name == "_paged_attention_kernel"]
        src = ASTSource(fn, c["signature"], c["constants"], c["configs"][0])
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=c["num_warps"], num_stages=c["num_stages"]))
        figures = tuned.registers(kernel)
        return dict(n_regs=figures.n_regs, n_spills=figures.n_spills, spills=tuned.spills(kernel),
                    num_warps=c["num_warps"], block_q=c["constants"][fn.arg_names.index("BLOCK_Q"),])

    # Decode tiles fit for 4 query heads per KV head (4 warps), given 128: 128 score rows.
    too_large = dict(rows=16, tile_n=64, num_warps=4, num_stages=3)
    out = {"too_large": compile_one(128, 128, seq_lens=[300], config=too_large),
           "default": compile_one(128, 128, seq_lens=[300]),
           "default_split": compile_one(128, 128, seq_lens=[300], num_splits=2),
           "default_mixed": compile_one(128, 128, seq_lens=[300, 40], q_lens=[1, 40])}
    print(json.dumps(out))
