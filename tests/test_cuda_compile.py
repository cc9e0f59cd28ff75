"""Every Triton kernel of the `cuda` backend compiles with Triton's real
compiler for H100/H200 (sm_90) and A100 (sm_80), ahead of time on the CPU.

The interpreter runs programs the compiler would reject (loop-carried type
changes, dot shapes under 16, tiles that overflow shared memory), so the
interpreted conformance run alone cannot say the kernels will build on a GPU.
Here the wrappers run against a stand-in driver that only names the target;
a JIT cache hook records each specialisation (signature, constexprs, launch
options) instead of launching, and each one is compiled to a cubin with
ptxas. Run in a subprocess: the stand-in driver and the hook are process-wide.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
# Per-block opt-in shared memory, bytes.
SHARED_LIMIT = {90: 232448, 80: 166912}


def _child(function: str, module: str = "test_cuda_compile") -> str:
    """stdout of ``module.function()`` run in a fresh interpreter (compiler, not interpreter mode)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run([sys.executable, "-c", f"import {module} as t; t.{function}()"], cwd=HERE, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{res.stdout[-4000:]}\n{res.stderr[-6000:]}"
    return res.stdout


def test_every_kernel_variant_compiles_for_sm90_and_sm80_within_shared_memory():
    res_stdout = _child("compile_all")
    compiled = [line for line in res_stdout.splitlines() if line.startswith("compiled ")]
    kernels = {line.split()[1] for line in compiled}
    assert kernels == {"_paged_attention_kernel", "_combine_splits_kernel", "_kv_write_kernel", "_rms_norm_kernel",
                       "_rotary_kernel", "_act_and_mul_kernel", "_gating_kernel", "_grouped_gemm_kernel",
                       "_quant_linear_kernel", "_token_bitmask_kernel"}, res_stdout


def test_quantized_linear_reads_codes_with_wide_loads_and_each_group_scale_once():
    """A decode GEMV streams the weight: its codes must come in wide loads (an int4 byte
    read alone, or twice, once per nibble, halves what the memory system can deliver) and
    each group's scale (and offset) once per group, not once per code. On sm_90, for each
    int4/int8 variant: no 8-bit global loads, and the loads of 4 bytes or less, which is
    where scales land, number at most one per thread per group tile per pipeline stage."""
    variants = [json.loads(line) for line in _child("quant_linear_loads").splitlines() if line.startswith("{")]
    assert {(v["kind"], v["x"], v["block_t"] > 16) for v in variants} >= \
        {(k, x, p) for k in (0, 1) for x in ("bf16", "fp16") for p in (False, True)}
    for v in variants:
        threads = 32 * v["num_warps"]
        groups = v["block_n"] * max(1, v["block_k"] // v["group"])  # scales per tile
        budget = v["num_stages"] * (2 if v["kind"] == 0 else 1) * math.ceil(groups / threads)
        budget += math.ceil(v["block_n"] / threads) if v["bias"] else 0
        assert v["byte_loads"] == 0, v
        assert v["loads_by_width"].get("16", 0) + v["loads_by_width"].get("8", 0) > 0, v  # codes and x: wide
        assert sum(n for w, n in v["loads_by_width"].items() if int(w) <= 4) <= budget, v


# -- run in the child ---------------------------------------------------------------------
def _record_launches():
    """Make `kernel[grid](...)` record its specialisation instead of compiling and launching."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class TargetOnlyDriver:
        # All JITFunction.run asks a driver before it compiles.
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    driver.set_active(TargetOnlyDriver())
    specs = {}

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        specs[(fn.name, str(key))] = (fn.jit_function, compile)
        return True  # handled: JITFunction.run neither compiles nor launches

    knobs.runtime.jit_cache_hook = hook
    return specs


def _launch_every_variant():
    """One launch per kernel variant that differs in what the compiler sees:
    dtype where it changes the tiles (fp32 doubles shared memory), each
    attention shape class (GQA 4 d128, GQA 7 d80 padded, MQA 32 d64), decode
    and prefill tiles, window/soft-cap, flash-decoding splits, fp8 caches."""
    import torch

    from infer.backends.cuda import activation, attention, bitmask, kv_write, moe, norm, quant_linear, rotary
    from infer.primitives.types import AttentionMetadata, Fp8Weight, Int4GroupWeight, Int8GroupWeight

    def meta(q_lens, seq_lens):
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        return AttentionMetadata(qsl, torch.tensor(seq_lens, dtype=torch.int32), torch.zeros(len(q_lens), 8, dtype=torch.int32),
                                 torch.zeros(int(qsl[-1]), dtype=torch.int64), max(q_lens), max(seq_lens), 16)

    decode, mixed = meta([1, 1], [40, 7]), meta([5, 1], [20, 9])
    bf16 = torch.bfloat16
    cases = [  # dtype, (hq, hk, d), metadata, extra arguments
        (bf16, (32, 8, 128), decode, {}), (bf16, (32, 8, 128), decode, {"num_splits": 8}),
        (bf16, (32, 8, 128), mixed, {"sliding_window": 8, "soft_cap": 5.0}), (bf16, (28, 4, 80), mixed, {}),
        (bf16, (32, 1, 64), decode, {}), (bf16, (32, 1, 64), mixed, {}), (torch.float16, (32, 8, 128), mixed, {}),
        (torch.float32, (32, 8, 128), mixed, {}), (torch.float32, (32, 8, 128), decode, {"num_splits": 8}),
        # fp8 (uint8) caches: decoded in registers to the query's dtype
        (bf16, (32, 8, 128), decode, {"kv_scales": (0.5, 2.0)}), (bf16, (32, 8, 128), mixed, {"kv_scales": (1.0, 1.0)}),
        (torch.float16, (32, 8, 128), decode, {"kv_scales": (1.0, 1.0), "num_splits": 8}),
    ]
    # quantized linear: each weight kind, bias or not, decode and prefill tiles, bf16 and fp32
    n, k = 256, 512
    weights = [Int4GroupWeight(torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // 32), torch.zeros(n, k // 32), 32),
               Int8GroupWeight(torch.zeros(n, k, dtype=torch.int8), torch.zeros(n, k // 32), 32, bias=torch.zeros(n)),
               Fp8Weight(torch.zeros(n, k, dtype=torch.uint8), torch.zeros(n)),
               Fp8Weight(torch.zeros(n, k, dtype=torch.uint8), torch.zeros(1))]
    for native in (False, True):  # fp8 decoded with integer ops (A100) or the hardware conversion (sm_89+)
        attention.native_fp8 = quant_linear.native_fp8 = lambda device, native=native: native
        for dtype, (hq, hk, d), m, kw in cases:
            if native and "kv_scales" not in kw:
                continue
            cache = torch.zeros(2, 8, 16, hk, d, dtype=torch.uint8 if "kv_scales" in kw else dtype)
            attention.paged_attention(torch.zeros(m.num_tokens, hq, d, dtype=dtype), cache, m, 0.1, **kw)
        for w in weights:
            if native and not isinstance(w, Fp8Weight):
                continue
            for dtype, t in ((bf16, 1), (bf16, 64), (torch.float32, 64)):
                quant_linear.linear(torch.zeros(t, k, dtype=dtype), w)
    for cache_dtype, scales in ((bf16, None), (torch.uint8, (0.5, 2.0))):
        kv_write.kv_write(torch.zeros(3, 8, 128, dtype=bf16), torch.zeros(3, 8, 128, dtype=bf16),
                          torch.zeros(2, 8, 16, 8, 128, dtype=cache_dtype), torch.zeros(3, dtype=torch.int64), scales)
    x = torch.zeros(4, 4096, dtype=bf16)
    norm.rms_norm(x, torch.zeros(4096, dtype=bf16), 1e-5)
    norm.rms_norm(x, torch.zeros(4096, dtype=bf16), 1e-5, x.clone())
    for neox in (True, False):
        rotary.rotary(torch.zeros(2, 32, 128, dtype=bf16), torch.zeros(2, 8, 128, dtype=bf16),
                      torch.zeros(2, dtype=torch.int64), torch.zeros(64, 128), neox)
    for kind in activation.KINDS:
        activation.act_and_mul(torch.zeros(2, 2 * 14336, dtype=bf16), kind)
    bitmask.apply_token_bitmask(torch.zeros(4, 151936), torch.zeros(4, 4748, dtype=torch.int32))
    # moe's steps one by one: with launches recorded, not run, the gating
    # kernel's output is garbage that the alignment must not see.
    moe.route(torch.zeros(64, 8, dtype=bf16), 2, True)
    for dtype, block_m in ((bf16, 16), (bf16, 64), (torch.float32, 64)):  # decode and prefill tiles
        x, w13, w2 = torch.zeros(64, 256, dtype=dtype), torch.zeros(8, 256, 256, dtype=dtype), torch.zeros(8, 256, 128, dtype=dtype)
        pairs, experts, _ = moe.align(torch.zeros(128, dtype=torch.int32), 8, block_m)
        h = torch.zeros(128, 128, dtype=dtype)
        moe._gemm(h, x, w13, pairs, experts, None, 128, 128, 2, True, block_m)
        moe._gemm(torch.zeros(128, 256), h, w2, pairs, experts, torch.zeros(128), 128, 256, 1, False, block_m)


def _global_loads(ptx: str) -> tuple[int, dict[str, int]]:
    """(8-bit-element `ld.global`s, every global load and async copy counted by bytes per thread)."""
    widths: dict[str, int] = {}
    byte_loads = 0
    for op in re.findall(r"\bld\.global[\w.:]*", ptx):
        vec = re.search(r"\.v(\d)\b", op)
        bits = int(re.search(r"\.[bfsu](8|16|32|64|128)\b", op).group(1))
        byte_loads += bits == 8
        width = str((int(vec.group(1)) if vec else 1) * bits // 8)
        widths[width] = widths.get(width, 0) + 1
    copy = r"\bcp\.async\.c[ag]\.shared\.global[\w.:]*\s+\[[^]]*\],\s*\[[^]]*\],\s*(0x[0-9a-f]+|\d+)"
    for size in re.findall(copy, ptx):
        width = str(int(size, 0))
        widths[width] = widths.get(width, 0) + 1
    return byte_loads, widths


def quant_linear_loads():
    """Print, per int4/int8 quantized-linear variant compiled for sm_90, its global loads."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    specs = _record_launches()
    from infer.backends.cuda import quant_linear
    from infer.primitives.types import Int4GroupWeight, Int8GroupWeight

    n, k = 256, 512
    codes = torch.zeros(n, k // 2, dtype=torch.uint8)
    for w in (Int4GroupWeight(codes, torch.zeros(n, k // 32), torch.zeros(n, k // 32), 32),
              Int4GroupWeight(codes, torch.zeros(n, k // 128), torch.zeros(n, k // 128), 128),  # AWQ/GPTQ's usual group
              Int8GroupWeight(torch.zeros(n, k, dtype=torch.int8), torch.zeros(n, k // 32), 32, bias=torch.zeros(n))):
        for dtype in (torch.bfloat16, torch.float16):
            for t in (1, 64):  # decode and prefill tiles
                quant_linear.linear(torch.zeros(t, k, dtype=dtype), w)
    for fn, c in specs.values():
        const = {fn.arg_names[i[0]]: v for i, v in c["constants"].items()}
        src = ASTSource(fn, c["signature"], c["constants"], c["configs"][0])
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=c["num_warps"], num_stages=c["num_stages"]))
        byte_loads, widths = _global_loads(kernel.asm["ptx"])
        print(json.dumps({"kind": const["KIND"], "group": const["GROUP"], "x": c["signature"]["x_ptr"].lstrip("*"),
                          "block_t": const["BLOCK_T"], "block_n": const["BLOCK_N"], "block_k": const["BLOCK_K"],
                          "bias": const["HAS_BIAS"], "num_warps": c["num_warps"], "num_stages": c["num_stages"],
                          "byte_loads": byte_loads, "loads_by_width": widths}))


def compile_all():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    specs = _record_launches()
    _launch_every_variant()
    for (name, _), (fn, c) in specs.items():
        # Hopper and the A100, except variants that decode fp8 with the conversion sm_89+ has.
        constants = {fn.arg_names[k[0]]: v for k, v in c["constants"].items()}
        archs = (90,) if constants.get("FP8_NATIVE") else (90, 80)
        for arch in archs:
            limit = SHARED_LIMIT[arch]
            src = ASTSource(fn, c["signature"], c["constants"], c["configs"][0])
            kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                    options=dict(num_warps=c["num_warps"], num_stages=c["num_stages"]))
            shared = kernel.metadata.shared
            assert shared <= limit, f"{name} needs {shared} B of shared memory on sm_{arch} (limit {limit})"
            assert "cubin" in kernel.asm
        print(f"compiled {name} ({c['num_warps']} warps, {c['num_stages']} stages) shared={shared}")
