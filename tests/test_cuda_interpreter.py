"""The `cuda` backend's Triton kernels, run on the CPU by Triton's interpreter.

TRITON_INTERPRET=1 has to be set before `@triton.jit` runs, and setting it in
this process would also make `cuda` available (and first in `--backend auto`)
to every other test sharing the pytest or xdist worker process. So each check
runs in a fresh subprocess with the variable set: the conformance groups
through `run_conformance` (what `infer conformance` runs), the rest as
`check_*` functions of this module imported by the child.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from infer.backends.cuda.backend import NATIVE  # imports no kernel module

HERE = Path(__file__).parent
# Conformance split into groups of similar cost so xdist's two workers share it.
GROUPS = {
    "attention": ["attention"],
    "kv_write_moe": ["kv_write", "copy_blocks", "read_write_blocks", "moe"],
    "lora": ["lora"],
    # The row-wise kernels, and the primitives `cuda` takes from `torch` by declaration.
    "rowwise_and_fallbacks": ["rms_norm", "rotary", "act_and_mul", "embedding", "linear", "sample", "all_reduce",
                              "mla_kv_write", "mla_attention", "layer_norm", "activation", "encoder_attention",
                              "pool", "all_gather"],
}

_CONFORMANCE = """
import json, sys
from infer.testing import run_conformance
report = run_conformance("cuda", primitives=sys.argv[1:])
print(json.dumps({"device": report.device, "results": [
    [r.case.id, r.case.primitive, r.status, r.provider, r.detail] for r in report.results]}))
"""


def _interpreted(args: list[str], timeout: int = 600) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, *args], cwd=HERE, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    return res.stdout


def _check(name: str) -> None:
    _interpreted(["-c", f"import test_cuda_interpreter as t; t.{name}()"])


@pytest.mark.parametrize("group", list(GROUPS))
def test_cuda_conforms_to_cpu_ref_in_the_interpreter(group):
    out = json.loads(_interpreted(["-c", _CONFORMANCE, *GROUPS[group]]).strip().splitlines()[-1])
    assert out["device"] == "cpu"
    results = out["results"]
    assert {r[1] for r in results} == set(GROUPS[group])
    bad = [r for r in results if r[2] != "pass"]
    assert not bad, "\n".join(f"{cid}: {status}: {detail}" for cid, _, status, _, detail in bad)
    # The kernels, not the torch fallback, must be what passed (fp8 KV caches included).
    # Dense linear is torch's (cuBLAS) by declaration: only quantized weights must reach the kernel.
    dense_linear = lambda cid: cid.startswith("linear-") and not any(q in cid for q in ("int4", "int8", "fp8", "mxfp4"))  # noqa: E731
    wrong = {r[0]: r[3] for r in results if r[1] in NATIVE and r[3] != "cuda" and not dense_linear(r[0])}
    if "linear" in GROUPS[group]:  # the quantized cases exist (and, by `wrong` above, the kernel served them all)
        assert sum(r[1] == "linear" and not dense_linear(r[0]) for r in results) >= 40
    for prim in ("kv_write", "attention"):  # fp8 caches exist (and were the kernels')
        if prim in GROUPS[group]:
            assert sum(r[1] == prim and "fp8_" in r[0] for r in results) >= 2
    if "sample" in GROUPS[group]:  # structured-output cases exist (and were the bitmask kernel's)
        assert sum(r[0].startswith("sample-bitmask_") for r in results) >= 5
    assert not wrong, f"served by another backend: {wrong}"


def test_backend_is_available_in_interpreter_mode_with_a_note():
    _check("check_availability")


def test_quantized_linear_decodes_every_fp8_code_and_int4_nibble():
    _check("check_fp8_every_code_and_int4_nibble_order")


def test_fp8_kv_cache_stores_the_contracts_codes_and_reads_every_code_exactly():
    _check("check_fp8_cache_codes_and_values")


def test_a_tuned_config_file_sets_the_tiles_and_a_bad_one_is_refused():
    _check("check_tuned_config_file")


def test_split_kv_decoding_matches_one_pass_and_the_reference():
    _check("check_split_kv")


def test_padding_requests_write_nothing_and_read_nothing():
    _check("check_padding_requests")


def test_token_bitmask_kernel_matches_torch_and_leaves_the_logits_alone():
    _check("check_token_bitmask")


def test_tiny_llama_greedy_tokens_match_torch_and_transformers():
    _check("check_tiny_llama_greedy")


def test_fp8_checkpoint_kv_scales_through_the_engine_match_torch():
    _check("check_fp8_checkpoint_with_kv_scales_greedy")


def test_decode_forward_never_waits_for_the_device_so_a_cuda_graph_can_hold_it():
    _check("check_decode_forward_has_no_host_sync")


def test_gpu_check_script_runs_every_section_on_toy_shapes(tmp_path):
    from infer.backends.cuda import tuned  # imports no kernel module

    # Conformance is skipped: the parametrized test above runs all of it.
    out = _interpreted([str(HERE.parent / "benchmarks" / "gpu_check.py"), "--smoke", "--skip", "conformance", "--tune",
                        "--write-config", str(tmp_path)])
    assert "gpu_check passed" in out
    # The tune section's best tiles, as the file the kernels would look up on that device ("cpu" here).
    written = json.loads((tmp_path / "cpu.json").read_text())
    tuned.validate(written, "gpu_check's file")
    assert set(written["attention"]) == {"head_dim", "group_pad", "decode", "decode_split", "prefill"}
    assert set(written["quant_linear"]) == {"decode", "prefill"}
    # Every result at the sizes it runs is compared with the torch backend's.
    assert "FAIL" not in out and out.count("ok   ") >= 30, out
    for line in ("[references]", "fp8 pool of 48 blocks", "codes differ", "mixed step", "head 32, window 24",
                 "float32 attention", "linear fp8 per-row", "moe 8 experts top-3", "[compiles]", "[memory]",
                 "requests x 2 tokens: 4 complete", "decode fp8 B=3 ctx=40 against torch",
                 "[primitives]", "[attention]", "decode fp8 B=3", "[e2e]", "CUDA graphs: not taken (cpu)", "decode B=3",
                 "[engine]", "llama graphs:", "llama fp8 graphs:", "mixtral graphs:", "[tune]", "int4 linear g32 T=40",
                 "best: {"):
        assert line in out, out


def test_gpu_check_past_its_deadline_skips_sections_and_still_writes_its_json(tmp_path):
    res = tmp_path / "r.json"
    out = _interpreted([str(HERE.parent / "benchmarks" / "gpu_check.py"), "--smoke", "--only", "peaks", "--only",
                        "attention", "--deadline", "0", "--json", str(res)])
    assert "past --deadline 0 s: skipped peaks, attention" in out and "gpu_check passed" in out
    assert {k: v["status"] for k, v in json.loads(res.read_text())["sections"].items()} == {
        "peaks": "skipped: past --deadline", "attention": "skipped: past --deadline"}


def test_without_the_variable_or_a_gpu_cuda_is_unavailable_with_the_reason():
    import torch

    from infer.backends.cuda.backend import CudaBackend

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET"):
        pytest.skip("this host has a GPU or runs everything interpreted")
    ok = CudaBackend.is_available()
    assert not ok and "TRITON_INTERPRET=1" in ok.reason and "no CUDA GPU" in ok.reason


# -- checks run inside the interpreted child process -----------------------------------
def _attention_case(reqs, dtype="float32", **kw):
    from infer.testing.inputs import attention

    return attention(np.random.default_rng(7), dtype, reqs, **kw)


def _run_attention(backend, x, dtype, num_splits):
    from infer.backends.cuda.attention import paged_attention

    scales = x.get("kv_scales")
    cache = backend.allocate_kv_cache(*x["cache_shape"], "fp8" if scales else dtype)
    if len(x["cached_slots"]):
        backend.kv_write(backend.asarray(x["cached_k"], dtype), backend.asarray(x["cached_v"], dtype), cache,
                         backend.asarray(x["cached_slots"]), scales)
    meta = backend.prepare_metadata(x["meta"])
    backend.kv_write(backend.asarray(x["new_k"], dtype), backend.asarray(x["new_v"], dtype), cache, meta.slot_mapping,
                     scales)
    sinks = None if x.get("sinks") is None else backend.asarray(x["sinks"], dtype)
    out = paged_attention(backend.asarray(x["q"], dtype), cache, meta, x["scale"], x["sliding_window"], x["soft_cap"],
                          scales, num_splits=num_splits, sinks=sinks)
    return backend.to_numpy(out)


def _reference_attention(x):
    from infer.backends.cpu_ref import CpuRefBackend

    ref = CpuRefBackend()
    scales = x.get("kv_scales")
    cache = ref.allocate_kv_cache(*x["cache_shape"], "fp8" if scales else "float32")
    ref.kv_write(x["cached_k"], x["cached_v"], cache, x["cached_slots"], scales)
    ref.kv_write(x["new_k"], x["new_v"], cache, x["meta"].slot_mapping, scales)
    return ref.attention(x["q"], cache, x["meta"], x["scale"], x["sliding_window"], x["soft_cap"], scales, x.get("sinks"))


def check_availability():
    from infer.backends.cuda.backend import INTERPRETER_NOTE, CudaBackend
    from infer.registry import get_backend

    ok = CudaBackend.is_available()
    assert ok and ok.reason == INTERPRETER_NOTE
    assert get_backend("cuda").device == "cpu"
    # Interpreter mode is for testing: asked for by name it runs, `auto` passes it over.
    assert get_backend("auto").name == "torch"
    import contextlib
    import io

    from infer.cli import main

    os.environ["COLUMNS"] = "400"  # one table line per backend, however the parent's terminal was sized
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        main(["backends"])
    (row,) = [line for line in text.getvalue().splitlines() if line.startswith("│ cuda")]
    assert f"yes ({INTERPRETER_NOTE})" in row and "│ cpu " in row, text.getvalue()


def check_fp8_every_code_and_int4_nibble_order():
    """Each finite e4m3fn code decodes to torch's float8 value, and int4 nibbles are read low
    first: x = identity rows makes the kernel's output the dequantized weight itself."""
    import torch

    from infer.backends.cuda.quant_linear import linear
    from infer.primitives.types import Fp8Weight, Int4GroupWeight

    from infer.backends.cuda import quant_linear

    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)  # 254 finite codes
    q = codes.repeat(2)[:256].view(2, 128)
    eye = torch.eye(128)
    for native in (True, False):  # the hardware conversion (sm_89+) and the integer decode (A100)
        quant_linear.native_fp8 = lambda device, native=native: native
        for scales in (torch.tensor([0.5, 2.0]), torch.tensor([3.0]), torch.tensor([0.37, 1.9])):
            got = linear(eye, Fp8Weight(q, scales)).t()
            want = q.view(torch.float8_e4m3fn).float() * scales.view(-1, 1)
            assert torch.equal(got, want), (native, (got - want).abs().max())
    nib = torch.arange(64 * 32, dtype=torch.int64).view(32, 64) % 16
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).to(torch.uint8)
    scales, offsets = torch.rand(32, 2) + 0.5, torch.randn(32, 2)
    got = linear(torch.eye(64), Int4GroupWeight(packed, scales, offsets, 32)).t()
    want = nib.float() * scales.repeat_interleave(32, 1) + offsets.repeat_interleave(32, 1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def check_fp8_cache_codes_and_values():
    """kv_write's e4m3 codes equal the contract's (`e4m3_encode`) for every finite float16
    value, each tie between neighbouring codes and its two neighbours, subnormals, values
    past +-448 and NaN, with scale 1 and 0.9 (a division that must be correctly rounded);
    attention reads every finite code back as its exact value, through both decodes."""
    import torch

    from infer.backends.cuda import CudaBackend
    from infer.backends.cuda.attention import paged_attention
    from infer.primitives.fp8 import e4m3_decode, e4m3_encode
    from infer.primitives.types import AttentionMetadata

    backend = CudaBackend()
    values = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    pos = e4m3_decode(np.arange(0x7F, dtype=np.uint8)).astype(np.float64)
    ties = (pos[1:] + pos[:-1]) / 2
    extra = np.concatenate([ties, np.nextafter(ties, 0), np.nextafter(ties, np.inf), [449, 464, 465, 1e30, np.inf]])
    x = np.concatenate([values[np.isfinite(values)], extra, -extra]).astype(np.float32)
    x = np.concatenate([x, np.zeros(-len(x) % 128, np.float32)]).reshape(-1, 1, 128)
    x[-1, 0, :2] = [0.02197265625, np.nan]  # / 0.9, correctly rounded, is a tie: the contract's code is 0x0C
    cache = backend.allocate_kv_cache(len(x) // 16 + 1, 16, 1, 128, "fp8")
    backend.kv_write(torch.from_numpy(x), torch.from_numpy(x), cache, torch.arange(len(x)), (1.0, 0.9))
    codes = cache.view(2, -1, 128)[:, : len(x)].numpy()
    np.testing.assert_array_equal(codes[0], e4m3_encode(x[:, 0]))
    np.testing.assert_array_equal(codes[1], e4m3_encode(x[:, 0] / np.float32(0.9)))
    assert codes[1, -1, 0] == 0x0C and codes[0, -1, 1] == 0x7F
    # One key, so each output row is that key's V row: every finite code, times v_scale.
    finite = np.array([c if c & 0x7F != 0x7F else 0 for c in range(256)], np.uint8).reshape(2, 128)
    cache = backend.allocate_kv_cache(1, 16, 2, 128, "fp8")
    cache[1, 0, 0] = torch.from_numpy(finite)
    meta = backend.prepare_metadata(AttentionMetadata(np.array([0, 1], np.int32), np.array([1], np.int32),
                                                      np.zeros((1, 1), np.int32), np.array([-1]), 1, 1, 16))
    from infer.backends.cuda import attention

    for native in (True, False):  # the hardware conversion (sm_89+) and the integer decode (A100)
        attention.native_fp8 = lambda device, native=native: native
        for dtype in (torch.float32, torch.float16):
            out = paged_attention(torch.randn(1, 4, 128).to(dtype), cache, meta, 0.1, kv_scales=(3.0, 2.0))
            want = np.repeat(e4m3_decode(finite) * 2.0, 2, axis=0)  # query heads 0,1 read KV head 0; 2,3 head 1
            np.testing.assert_array_equal(out[0].float().numpy(),
                                          want.astype(np.float16 if dtype == torch.float16 else np.float32))


def check_tuned_config_file():
    """A device's tuned-config file (here named by INFER_CUDA_CONFIG) sets the tiles the
    kernels launch with for fp16/bf16, results unchanged; float32 keeps the built-in
    tiles; a malformed file is refused with its path and what is wrong."""
    import json
    import tempfile

    import pytest
    import torch

    from infer.backends.cuda import CudaBackend, attention, quant_linear, tuned
    from infer.primitives.types import Int4GroupWeight

    cpu = torch.device("cpu")
    builtin = {q: attention.launch_config(torch.float16, q, 4) for q in (1, 5)}
    cfg = {"attention": {"head_dim": 64, "decode": {"rows": 32, "tile_n": 32, "num_warps": 2, "num_stages": 2},
                         "prefill": {"rows": 16, "tile_n": 128, "num_warps": 8, "num_stages": 1}},
           "quant_linear": {"decode": [16, 64, 64, 2], "prefill": [32, 16, 32, 8]}, "measured": {"note": "test"}}
    launches = []

    class Spy:  # records each launch's constexprs and options, then launches
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append(kw)
                return self.kernel[grid](*args, **kw)
            return launch

    attention._paged_attention_kernel = Spy(attention._paged_attention_kernel)
    quant_linear._quant_linear_kernel = Spy(quant_linear._quant_linear_kernel)
    backend = CudaBackend()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "tuned.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        os.environ[tuned.ENV] = path
        assert attention.launch_config(torch.bfloat16, 1, 4, False, cpu, 64) == cfg["attention"]["decode"]
        assert attention.launch_config(torch.bfloat16, 1, 4, True, cpu, 64) == builtin[1]  # no decode_split entry
        assert attention.launch_config(torch.bfloat16, 1, 4, False, cpu, 128) == builtin[1]  # measured at 64 only
        # No group_pad: measured at gpu_check's 32 query / 8 KV heads (4 per KV head) only.
        assert attention.launch_config(torch.bfloat16, 1, 16, False, cpu, 64) == \
            attention.launch_config(torch.bfloat16, 1, 16)
        assert attention.launch_config(torch.float32, 7, 4, False, cpu, 64) == \
            attention.launch_config(torch.float32, 7, 4)
        assert quant_linear.tiles(40, torch.float16, cpu) == (32, 16, 32, 8)
        assert quant_linear.tiles(1, torch.float32, cpu) == quant_linear.tiles(1, torch.float32)
        for reqs, kind in (([(1, 40), (1, 7)], "decode"), ([(5, 30), (1, 9)], "prefill")):
            x = _attention_case(reqs=reqs, dtype="float16", hq=8, d=64)
            launches.clear()
            got = _run_attention(backend, x, "float16", 1)
            np.testing.assert_allclose(got, _reference_attention(x), atol=2e-3, rtol=2e-3)
            want = cfg["attention"][kind]
            assert [(k["TILE"], k["num_warps"], k["num_stages"]) for k in launches] == \
                [(want["tile_n"], want["num_warps"], want["num_stages"])], launches
            assert launches[0]["BLOCK_Q"] == max(1, want["rows"] // 4)  # hq 8 / hk 2: GROUP_PAD 4
        # A list of entries, one per (head_dim, group_pad): each applies at its own shape only.
        wide = {"rows": 16, "tile_n": 32, "num_warps": 8, "num_stages": 2}
        with open(path := os.path.join(d, "shapes.json"), "w") as f:
            json.dump({"attention": [cfg["attention"], {"head_dim": 64, "group_pad": 16, "decode": wide}]}, f)
        os.environ[tuned.ENV] = path
        assert attention.launch_config(torch.bfloat16, 1, 16, False, cpu, 64) == wide
        assert attention.launch_config(torch.bfloat16, 1, 4, False, cpu, 64) == cfg["attention"]["decode"]
        assert attention.launch_config(torch.bfloat16, 1, 8, False, cpu, 64) == builtin[1]
        assert attention.launch_config(torch.bfloat16, 5, 16, False, cpu, 64) == \
            attention.launch_config(torch.bfloat16, 5, 16)  # no prefill entry at 16
        os.environ[tuned.ENV] = os.path.join(d, "tuned.json")
        w = Int4GroupWeight(torch.randint(0, 256, (48, 32), dtype=torch.uint8), torch.rand(48, 2) * 0.1,
                            torch.randn(48, 2) * 0.1, 32)
        for t, tile in ((3, cfg["quant_linear"]["decode"]), (20, cfg["quant_linear"]["prefill"])):
            x = torch.randn(t, 64).half()
            launches.clear()
            got = quant_linear.linear(x, w)
            want = x.float() @ (((w.qweight.view(48, 32, 1) >> torch.tensor([0, 4], dtype=torch.uint8)) & 15)
                                .reshape(48, 64).float() * w.scales.repeat_interleave(32, 1)
                                + w.offsets.repeat_interleave(32, 1)).t()
            torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
            assert [(k["BLOCK_T"], k["BLOCK_N"], k["BLOCK_K"], k["num_warps"]) for k in launches] == [tuple(tile)]
        # Refused: an unknown kind, no head_dim, a tile under 16, too many warps, not an object, not JSON.
        decode = cfg["attention"]["decode"]
        for i, (bad, words) in enumerate((
                ({"attention": {"head_dim": 64, "decoded": decode}}, "attention.decoded: unknown"),
                ({"attention": {"decode": decode}}, "attention.head_dim"),
                ({"quant_linear": {"decode": [8, 64, 64, 4]}}, "16..512"),
                ({"attention": {"head_dim": 64, "decode": {**decode, "num_warps": 64}}}, "up to 32"),
                ({"attention": []}, "must be an object"), ("{not json", "not JSON"),
                ({"attention": {"head_dim": 64, "group_pad": 6, "decode": decode}}, "group_pad"),
                ({"attention": [{"head_dim": 64, "decode": decode}, {"head_dim": 64, "group_pad": 4}]},
                 r"attention\[1\]: a second entry"))):
            bad_path = os.path.join(d, f"bad{i}.json")  # each file is parsed once, by path
            with open(bad_path, "w") as f:
                f.write(bad if isinstance(bad, str) else json.dumps(bad))
            os.environ[tuned.ENV] = bad_path
            with pytest.raises(tuned.TunedConfigError, match=words) as err:
                attention.launch_config(torch.float16, 1, 4, False, cpu, 64)
            assert bad_path in str(err.value)
        for missing in (os.path.join(d, "missing.json"), d):  # no file; a folder
            os.environ[tuned.ENV] = missing
            with pytest.raises(tuned.TunedConfigError, match="no such file"):
                quant_linear.tiles(1, torch.float16, cpu)
    del os.environ[tuned.ENV]  # read at each lookup: back to the built-in tiles at once
    assert attention.launch_config(torch.float16, 5, 4, False, cpu, 64) == builtin[5]  # no file for "cpu"


def check_split_kv():
    from infer.backends.cuda import CudaBackend, attention

    backend = CudaBackend()
    # Long decode contexts, one of them empty of history, plus a window and GQA 4, sinks; fp8 caches
    # (partials carry v_scale) through the hardware conversion and through the A100's integer decode.
    fp8 = dict(reqs=[(1, 150), (2, 70)], hq=8, d=64, kv_scales=(0.37, 1.9))
    for kw, native in ((dict(reqs=[(1, 150), (1, 70), (1, 1)], hq=8, d=64), True),
                       (dict(reqs=[(1, 150), (1, 97)], hq=8, d=64, sliding_window=40), True),
                       (dict(reqs=[(3, 140), (1, 66)], hq=4, hk=1, d=128, soft_cap=4.0), True),
                       # sinks: split 0 alone carries a head's sink into the combine
                       (dict(reqs=[(1, 150), (1, 97), (1, 0)], hq=8, d=64, sliding_window=60, sinks=2.0), True),
                       (fp8, True), (fp8, False)):
        attention.native_fp8 = lambda device, native=native: native
        for dtype, tol in (("float32", 1e-5), ("float16", 2e-3))[: 1 if "soft_cap" in kw else 2]:
            x = _attention_case(dtype=dtype, **kw)
            want = _reference_attention(x)
            one = _run_attention(backend, x, dtype, 1)
            for splits in (3,):
                got = _run_attention(backend, x, dtype, splits)
                np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=f"{kw} {dtype} splits={splits}")
                np.testing.assert_allclose(got, one, atol=tol, rtol=tol)
    # A mixed step at the default count (4, as if a GPU had picked it): the one-query requests
    # split, each split at least MIN_SPLIT_TOKENS (64 here: two fp32 tiles), so the 70- and
    # 1-token ones leave splits empty (no output row written, none read by the combine); the
    # 4-query request does not split and writes its rows itself.
    attention.default_num_splits = lambda *a: 4
    attention.MIN_SPLIT_TOKENS = 64
    x = _attention_case(reqs=[(1, 150), (4, 90), (1, 70), (1, 1)], hq=4, hk=1, d=32)
    np.testing.assert_allclose(_run_attention(backend, x, "float32", None), _reference_attention(x), atol=1e-5,
                               rtol=1e-5)


def check_padding_requests():
    """A decode batch padded as a CUDA graph pads it: extra 1-token requests with
    seq_len 0 and slot -1 leave the cache untouched and get zero output."""
    from infer.backends.cuda import CudaBackend
    from infer.primitives.types import AttentionMetadata

    backend = CudaBackend()
    x = _attention_case(reqs=[(1, 20), (1, 5)], hq=4, d=64)
    want = _reference_attention(x)
    m = x["meta"]
    pad = 3
    padded = AttentionMetadata(
        np.arange(len(m.seq_lens) + pad + 1, dtype=np.int32), np.append(m.seq_lens, [0] * pad).astype(np.int32),
        np.vstack([m.block_table, np.zeros((pad, m.block_table.shape[1]), np.int32)]),
        np.append(m.slot_mapping, [-1] * pad).astype(np.int64), 1, m.max_seq_len, m.block_size)
    cache = backend.allocate_kv_cache(*x["cache_shape"], "float32")
    backend.kv_write(backend.asarray(x["cached_k"]), backend.asarray(x["cached_v"]), cache, backend.asarray(x["cached_slots"]))
    before = cache.clone()
    meta = backend.prepare_metadata(padded)
    junk = np.full((pad, *x["new_k"].shape[1:]), 7.0, np.float32)
    k, v = np.concatenate([x["new_k"], junk]), np.concatenate([x["new_v"], junk])
    backend.kv_write(backend.asarray(k), backend.asarray(v), cache, meta.slot_mapping)
    changed = (cache != before).any(dim=(0, 2, 3, 4)).nonzero().flatten().tolist()
    written = sorted({int(s) // m.block_size for s in m.slot_mapping})
    assert set(changed) <= set(written), (changed, written)
    assert not (cache == 7.0).any()
    q = np.concatenate([x["q"], np.ones((pad, *x["q"].shape[1:]), np.float32)])
    for splits in (1, 2):
        from infer.backends.cuda.attention import paged_attention

        out = backend.to_numpy(paged_attention(backend.asarray(q), cache, meta, x["scale"], num_splits=splits))
        np.testing.assert_allclose(out[: len(x["q"])], want, atol=1e-5, rtol=1e-5)
        assert not out[len(x["q"]):].any()


def check_token_bitmask():
    """The kernel gives torch's `apply_token_bitmask` on vocabularies that end mid-word and
    mid-block, rows strided in memory and words with the sign bit set, as a new tensor; the
    backend's `sample` launches it exactly when a bitmask is given."""
    from dataclasses import replace

    import torch

    from infer.backends.cuda import CudaBackend, bitmask
    from infer.backends.torch_native.sampling import apply_token_bitmask, sample as torch_sample
    from infer.testing.inputs import sample as sample_inputs

    gen = torch.Generator().manual_seed(0)
    for b, v, width in ((3, 1000, 1000), (3, 100, 100), (3, 100, 130), (1, 2049, 2049)):
        x = torch.randn(b, width, generator=gen)[:, :v]
        words = torch.randint(-(2**31), 2**31, (b, -(-v // 32)), dtype=torch.int32, generator=gen)
        before = x.clone()
        got = bitmask.apply_token_bitmask(x, words)
        assert torch.equal(got, apply_token_bitmask(x, words)), (b, v, width)
        assert torch.equal(x, before) and got.data_ptr() != x.data_ptr()
        assert got.isinf().any() and not got.isinf().all()

    launches = []
    kernel = bitmask._token_bitmask_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    bitmask._token_bitmask_kernel = Spy()
    backend = CudaBackend()
    x = sample_inputs(np.random.default_rng(0), "float32", temperature=[0.0, 0.0, 1.0], b=3, v=100, bitmask="one")
    logits, params = torch.from_numpy(x["logits"]), backend.prepare_sampling(x["params"])
    before = logits.clone()
    got = backend.sample(logits, params)
    assert launches == [(3, 1)]
    assert torch.equal(logits, before)  # no penalty copied the logits first: the mask must not write them
    assert torch.equal(got.token_ids, torch_sample(logits, params).token_ids)
    backend.sample(logits, replace(params, token_bitmask=None))
    assert launches == [(3, 1)]


def _greedy_tokens(path, name, prompts, params, kv_cache_dtype="auto", kv_scales=None):
    """Greedy tokens of backend `name` ('cuda_padded': cuda through the decode graphs'
    static buffers, batches padded to 1, 2 or 4, run eagerly as a graph would replay them).
    `kv_scales`: the per-layer (k_scale, v_scale) the engine must have read."""
    from infer.backends.cuda.graphs import DecodeGraphs
    from infer.core.llm import LLM

    # A small token budget so prompts are chunked and prefill mixes with decode.
    llm = LLM(path, backend=name.removesuffix("_padded"), skip_tokenizer_init=True, max_num_seqs=4,
              max_num_batched_tokens=16, kv_cache_dtype=kv_cache_dtype)
    engine = llm.engine
    assert engine.worker.ops.provider("attention", kv_cache_dtype=kv_cache_dtype).name == name.removesuffix("_padded")
    assert kv_scales is None or engine.worker.runner.kv_scales == kv_scales, engine.worker.runner.kv_scales
    assert engine.worker.decode_graphs is None  # interpreter mode captures nothing
    if name == "cuda_padded":
        engine.worker.decode_graphs = DecodeGraphs(engine.worker.runner.forward, engine.backend.device, engine.max_model_len, engine.cache_config.block_size,
                                            (1, 2, 4), use_graphs=False)
        engine.worker.decode_graphs.capture()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert name != "cuda_padded" or engine.worker.decode_graphs.replays > 0
    if params.logprobs is not None:  # tokens and their log-probabilities
        return [(c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
                for c in (o.outputs[0] for o in outs)]
    return [o.outputs[0].token_ids for o in outs]


def check_tiny_llama_greedy():
    import tempfile

    import torch
    from tiny_models import make_model

    from infer.core.sampling_params import SamplingParams

    model, _, _ = make_model("llama3")  # GQA 3:1, head_dim 64, llama3 rope
    rng = np.random.default_rng(0)
    # Across a block boundary, short, exactly one block, one token.
    prompts = [rng.integers(3, 211, n).tolist() for n in (21, 5, 16, 1)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        got = {name: _greedy_tokens(path, name, prompts, params) for name in ("cuda", "torch", "cuda_padded")}
        # An fp8 cache: the cuda kernels (eager and padded) against torch's fp8 path.
        fp8 = {name: _greedy_tokens(path, name, prompts, params, "fp8") for name in ("cuda", "torch", "cuda_padded")}
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               do_sample=False, max_new_tokens=6, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert got["cuda"] == got["torch"] == got["cuda_padded"] == want, got
    assert fp8["cuda"] == fp8["torch"] == fp8["cuda_padded"], fp8


def check_fp8_checkpoint_with_kv_scales_greedy():
    """An fp8 checkpoint (fp8 weights) with per-layer k_scale/v_scale that are not powers of
    two, through the engine: cuda (eager and padded graph buffers) gives torch's greedy tokens
    and their log-probabilities (which a scale left out would move)."""
    import tempfile
    from pathlib import Path

    from test_quant_hf import _with_kv_scales

    from infer.core.sampling_params import SamplingParams

    def scales(i):
        return {"k_scale": 0.37 + 0.2 * i, "v_scale": 1.3 / (i + 1)}

    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 211, n).tolist() for n in (19, 4, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    with tempfile.TemporaryDirectory() as path:
        _with_kv_scales(Path(path), scales)
        layers = json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"]
        want_scales = [tuple(float(np.float32(v)) for v in scales(i).values()) for i in range(layers)]
        got = {name: _greedy_tokens(path, name, prompts, params, "fp8", want_scales)
               for name in ("cuda", "torch", "cuda_padded")}
    for name in ("cuda", "cuda_padded"):
        assert [t for t, _ in got[name]] == [t for t, _ in got["torch"]], got
        np.testing.assert_allclose([lp for _, lps in got[name] for lp in lps],
                                   [lp for _, lps in got["torch"] for lp in lps], rtol=1e-4, atol=1e-4, err_msg=name)


# Ops after which the host needs a device value (a sync on a GPU, an error inside a
# CUDA-graph capture): scalar reads (.item(), int(t), bool(t)) and data-dependent shapes.
_HOST_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
                  "equal", "is_nonzero", "repeat_interleave"}


def check_decode_forward_has_no_host_sync():
    """A decode step of a dense and of an MoE model, from `DecodeGraphs`' static buffers,
    dispatches no op that reads a device value on the host (Triton's own interpreter aside)."""
    import traceback

    import torch
    from tiny_models import make_model
    from tiny_moe_models import make_moe_model
    from torch.utils._python_dispatch import TorchDispatchMode

    from infer.backends.cuda.graphs import DecodeGraphs
    from infer.core.lowering import lower
    from infer.core.model_runner import ModelRunner
    from infer.core.models.llama import build_llama
    from infer.core.models.moe import build_moe
    from infer.dispatch import Ops
    from infer.registry import get_backend

    class HostSyncs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.found, self.ops = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name.split("::")[-1]
            bool_index = name == "index" and any(getattr(i, "dtype", None) == torch.bool for i in args[1] if i is not None)
            if name in _HOST_SYNC_OPS or bool_index:
                stack = traceback.format_stack()
                if not any("triton/runtime/interpreter" in frame for frame in stack):
                    self.found.append(f"{name}:\n" + "".join(stack[-8:-1]))
            self.ops += 1
            return func(*args, **(kwargs or {}))

    backend = get_backend("cuda")
    for build, (_, config, weights), kv in ((build_llama, make_model("llama3"), "auto"),
                                            (build_llama, make_model("llama3"), "fp8"),
                                            (build_moe, make_moe_model("mixtral"), "auto")):
        runner = ModelRunner(lower(build(config)), backend, Ops(backend), weights, "float32", 256, kv_cache_dtype=kv)
        assert runner.ops.provider("attention", dtype="float32", kv_cache_dtype=kv).name == "cuda"
        runner.allocate_kv_caches(num_blocks=8, block_size=16)
        graphs = DecodeGraphs(runner.forward, backend.device, 256, 16, (1, 2, 4), use_graphs=False)
        graphs.capture()  # the first forward validates its arguments: not what a graph holds
        spy = HostSyncs()
        with spy:
            runner.forward(*graphs._inputs(4))
        assert spy.ops > 50, spy.ops  # the spy saw the forward
        assert not spy.found, "\n".join(spy.found)
