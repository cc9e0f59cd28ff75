"""Quantized weights: the formats against independent references (gguf-py's
quantize/dequantize, torch's fp8 cast, transformers' forward), and the
conformance cases' power to catch a wrong quantized kernel."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from infer.backends.cpu_ref.backend import CpuRefBackend
from infer.backends.cpu_ref.quant import dequantize
from infer.backends.torch_native import quant_linear
from infer.core.loader.gguf_file import unpermute_rows
from infer.core.loader.quant_gguf import permute_rows, to_handle
from infer.core.lowering import lower
from infer.core.model_runner import ModelRunner
from infer.core.quant_params import concat_rows
from infer.core.models.llama import build_llama
from infer.primitives.fp8 import E4M3_MAX, e4m3_decode, e4m3_encode
from infer.primitives.types import Fp8Weight, Int4GroupWeight, Int8GroupWeight
from infer.dispatch import Ops
from infer.registry import get_backend
from infer.testing.cases import all_cases
from infer.testing.conformance import run_case

from tiny_models import make_model, meta_for

GGML_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def _ggml(type_name: str, rows: int = 6, cols: int = 96, seed: int = 0):
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    qtype = GGMLQuantizationType[type_name]
    blocks = quants.quantize(w, qtype)
    return blocks, np.asarray(quants.dequantize(blocks, qtype), dtype=np.float64)


@pytest.mark.parametrize("type_name", GGML_TYPES)
def test_gguf_tensor_kept_quantized_stands_for_what_gguf_py_dequantizes(type_name):
    blocks, want = _ggml(type_name)
    handle = to_handle(blocks, type_name, *want.shape)
    np.testing.assert_array_equal(dequantize(handle), want)
    torch_handle = type(handle)(**{f: (torch.from_numpy(np.asarray(v)) if isinstance(v, np.ndarray) else v)
                                   for f, v in ((f, getattr(handle, f)) for f in handle.__dataclass_fields__)
                                   if f != "kind"})
    np.testing.assert_array_equal(quant_linear.dequantize(torch_handle).numpy(), want.astype(np.float32))


@pytest.mark.parametrize("type_name", GGML_TYPES)
def test_qk_rows_unpermuted_on_packed_rows_equal_unpermuted_floats(type_name):
    blocks, want = _ggml(type_name, rows=24, cols=64)
    handle = permute_rows(to_handle(blocks, type_name, 24, 64), lambda a: unpermute_rows(a, 3))
    np.testing.assert_array_equal(dequantize(handle), unpermute_rows(want, 3))


def test_fp8_encoding_is_torchs_saturated_e4m3fn_cast():
    rng = np.random.default_rng(0)
    finite = e4m3_decode(np.arange(256, dtype=np.uint8))
    finite = finite[np.isfinite(finite)]
    midpoints = (np.sort(finite)[1:] + np.sort(finite)[:-1]) / 2  # ties: round to the even code
    x = np.concatenate([rng.standard_normal(20000) * 30, finite, midpoints, [500.0, -1e4, 1e-9]]).astype(np.float32)
    want = torch.from_numpy(np.clip(x, -E4M3_MAX, E4M3_MAX)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(e4m3_encode(x), want)


class IgnoresInt4Offsets(CpuRefBackend):
    name = "mutant"

    def linear(self, x, weight):
        if weight.kind == "int4_group":
            weight = type(weight)(weight.qweight, weight.scales, weight.offsets * 0, weight.group_size,
                                  weight.bias, weight.dtype)
        return CpuRefBackend.linear(x, weight)


class Fp8PerTensorAsFirstChannel(CpuRefBackend):
    name = "mutant"

    def linear(self, x, weight):
        if weight.kind == "fp8" and weight.scales.size > 1:
            weight = type(weight)(weight.qweight, weight.scales[:1], weight.bias, weight.dtype)
        return CpuRefBackend.linear(x, weight)


@pytest.mark.parametrize("mutant, must_fail", [
    (IgnoresInt4Offsets, "linear-int4_t5_bias-fp32"),
    (Fp8PerTensorAsFirstChannel, "linear-fp8_t5_bias-fp32"),
])
def test_conformance_catches_a_wrong_quantized_linear(mutant, must_fail):
    case = next(c for c in all_cases() if c.id == must_fail)
    assert run_case(mutant(), case).status == "fail"


def _logits(runner, backend, ids):
    meta = meta_for([(0, len(ids))], 16, [[0, 1, 2, 3]])
    rows = np.arange(len(ids))
    out = runner.forward(backend.asarray(ids), backend.asarray(rows), backend.asarray(rows), runner.prepare_metadata(meta)).logits
    return backend.to_numpy(out)


@pytest.mark.parametrize("backend_name", ["torch", "cpu_ref"])
def test_online_fp8_tiny_llama_logits_close_to_transformers(backend_name):
    model, config, weights = make_model("llama3")
    backend = get_backend(backend_name)
    runner = ModelRunner(lower(build_llama(config)), backend, Ops(backend), dict(weights), "float32", 256,
                         quantization="fp8")
    # Online fp8 covers the attention and MLP projections only: lm_head (and the embedding) stay dense.
    kinds = {weight: h.kind for (weight, _), h in runner._handles.items()}
    assert kinds == {n: "dense" if n == "lm_head" else "fp8" for n in kinds}
    assert {n.split(".")[-1] for n in kinds} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    assert isinstance(runner.tensors["embed_tokens"], type(backend.asarray(np.zeros(1, np.float32))))
    runner.allocate_kv_caches(num_blocks=4, block_size=16)
    ids = np.random.default_rng(1).integers(0, 211, 20)
    got = _logits(runner, backend, ids)
    with torch.no_grad():
        want = model(torch.from_numpy(ids)[None]).logits[0].numpy()
    # e4m3 keeps 3 mantissa bits: each weight is off by at most 2**-4 of its
    # magnitude (uniform-ish, ~2**-4/sqrt(3) rms), so each projection's output
    # is off by ~3.6% rms of its size, and two layers of them compound to a
    # few percent of the logits' spread. 10% of that spread bounds it with
    # margin; the dense run agrees to 1e-4.
    spread = want.std()
    err = np.abs(got - want)
    print(f"fp8 logits: max err {err.max() / spread:.3f}, rms err {np.sqrt((err**2).mean()) / spread:.3f} of the spread")
    assert err.max() < 0.25 * spread and np.sqrt((err**2).mean()) < 0.1 * spread, (err.max(), spread)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


class Fp8KvIgnoresScales(CpuRefBackend):
    name = "mutant"

    def kv_write(self, k, v, kv_cache, slot_mapping, scales=None):
        return CpuRefBackend.kv_write(k, v, kv_cache, slot_mapping, None)


class Fp8KvAttentionIgnoresScales(CpuRefBackend):
    name = "mutant"

    def attention(self, q, kv_cache, meta, scale, sliding_window=None, soft_cap=None, kv_scales=None):
        return CpuRefBackend.attention(q, kv_cache, meta, scale, sliding_window, soft_cap)


@pytest.mark.parametrize("mutant, must_fail", [
    (Fp8KvIgnoresScales, "kv_write-fp8_scattered-fp32"),
    (Fp8KvAttentionIgnoresScales, "attention-fp8_kv_mixed_gqa3_d64-fp32"),
])
def test_conformance_catches_a_wrong_fp8_kv_cache(mutant, must_fail):
    case = next(c for c in all_cases() if c.id == must_fail)
    assert run_case(mutant(), case).status == "fail"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    model, _, _ = make_model("llama3")
    path = tmp_path_factory.mktemp("tiny-llama3-quant")
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("backend_name", ["torch", "cpu_ref"])
def test_fp8_kv_cache_holds_twice_the_tokens_and_keeps_greedy_tokens(tiny_dir, backend_name):
    from infer.core.llm import LLM
    from infer.core.sampling_params import SamplingParams

    model, path = tiny_dir
    runs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(str(path), backend=backend_name, skip_tokenizer_init=True, max_num_seqs=4,
                  kv_cache_memory=1 << 20, kv_cache_dtype=kv)
        prompts = [{"prompt_token_ids": list(np.random.default_rng(i).integers(0, 211, 12))} for i in range(3)]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        runs[kv] = (llm.engine.cache_config.num_blocks, [o.outputs[0].token_ids for o in outs])
    assert runs["fp8"][0] == 4 * runs["auto"][0]  # float32 model: 4 bytes -> 1 per value
    # e4m3 K/V (3 mantissa bits) perturb scores a little; greedy tokens of this
    # model sit far enough apart that nearly all survive it.
    same = np.mean([a == b for x, y in zip(runs["auto"][1], runs["fp8"][1]) for a, b in zip(x, y)])
    assert same >= 0.8, runs


def _int8(rows: int, group_size: int, cols: int = 64):
    rng = np.random.default_rng(rows)
    return Int8GroupWeight(rng.integers(-127, 128, (rows, cols)).astype(np.int8),
                           rng.random((rows, cols // group_size), dtype=np.float32), group_size)


def _fp8(rows: int, cols: int = 64):
    return Fp8Weight(np.random.default_rng(rows).integers(0, 120, (rows, cols)).astype(np.uint8), np.ones(rows, np.float32))


def _int4(rows: int, group_size: int, cols: int = 64):
    rng = np.random.default_rng(rows + 100)
    return Int4GroupWeight(rng.integers(0, 256, (rows, cols // 2)).astype(np.uint8),
                           rng.random((rows, cols // group_size), dtype=np.float32),
                           -rng.random((rows, cols // group_size), dtype=np.float32), group_size)


def _offsets(w: Int8GroupWeight) -> Int8GroupWeight:
    return dataclasses.replace(w, offsets=-np.abs(w.scales) * 16)


@pytest.mark.parametrize("parts, kind, group", [
    ([_int8(4, 32), _int8(2, 64)], Int8GroupWeight, 32),
    ([_int4(4, 32), _int4(2, 32), _int8(2, 16)], Int8GroupWeight, 16),  # a K-quant mix: Q4_K q/k, Q6_K v
    ([_int8(4, 32), _offsets(_int8(2, 32)), _int8(3, 32)], Int8GroupWeight, 32),  # Q8_0 beside Q5_1
    ([_int4(4, 64), _int4(2, 32)], Int4GroupWeight, 32),
    ([_int8(4, 32), _fp8(2)], np.ndarray, None), ([_fp8(4), _int4(2, 32)], np.ndarray, None),
    ([_int8(4, 32), np.ones((2, 64), np.float32)], np.ndarray, None),  # a float part (a type with no kept form)
    ([_int8(4, 16), _int8(2, 32)], Int8GroupWeight, 16),
], ids=["group-sizes", "int4-int8-g16", "some-offsets", "int4-groups", "int8-fp8", "fp8-int4", "float-part",
        "g16-g32"])
def test_fusing_weights_of_different_formats_keeps_exactly_their_matrix(parts, kind, group):
    """q/k/v (gate/up) of different block types (what K-quant mixes write) fuse into one
    handle standing for exactly the parts' matrices, or one float32 matrix where no kept
    form holds them all."""
    fused = concat_rows(parts, "model.layers.0.self_attn.qkv_proj.weight")
    want = np.concatenate([dequantize(p) if not isinstance(p, np.ndarray) else p for p in parts]).astype(np.float32)
    assert isinstance(fused, kind)
    if kind is np.ndarray:
        np.testing.assert_array_equal(fused, want)
        return
    assert fused.group_size == group
    np.testing.assert_array_equal(dequantize(fused).astype(np.float32), want)


def test_fusing_groups_that_do_not_divide_each_other_dequantizes_with_a_warning(caplog):
    parts = [_int8(4, 32, cols=96), _int8(2, 48, cols=96)]
    with caplog.at_level("WARNING", logger="infer"):
        fused = concat_rows(parts, "qkv")
    assert isinstance(fused, np.ndarray) and "qkv: its parts are stored as int8_group, int8_group" in caplog.text
    np.testing.assert_array_equal(fused, np.concatenate([dequantize(p) for p in parts]).astype(np.float32))


def test_fusing_quantized_weights_concatenates_every_per_row_field():
    parts = [_int8(4, 32), _int8(2, 32), _int8(3, 32)]
    fused = concat_rows(parts)
    assert isinstance(fused, Int8GroupWeight) and fused.group_size == 32 and fused.bias is None
    np.testing.assert_array_equal(fused.qweight, np.concatenate([p.qweight for p in parts]))
    np.testing.assert_array_equal(fused.scales, np.concatenate([p.scales for p in parts]))
    assert concat_rows(parts[:1]) is parts[0]
    # int8 has no offsets: the bias after them is still fused
    with_bias = [dataclasses.replace(p, bias=np.full(p.out_features, i, np.float32)) for i, p in enumerate(parts)]
    np.testing.assert_array_equal(concat_rows(with_bias).bias, np.concatenate([p.bias for p in with_bias]))


@pytest.mark.parametrize("start, stop", [(0, 48), (16, 64), (16, 48)], ids=["stop", "start", "both"])
def test_a_column_shard_that_splits_a_group_is_refused(start, stop):
    """A tensor-parallel cut of input columns must fall on group boundaries at both ends:
    the shard keeps whole groups' scales, so a cut inside a group would pair columns with the wrong scale."""
    from infer.core.quant_params import slice_handle

    with pytest.raises(ValueError, match="splits the 32-wide groups"):
        slice_handle(_int8(4, 32), 1, start, stop)


def test_to_backend_moves_every_field_of_a_handle_without_offsets():
    """int8 handles have no offsets: the bias after them still goes to the backend."""
    from infer.core.quant_params import to_backend
    from infer.registry import get_backend

    w = dataclasses.replace(_int8(4, 32), bias=np.arange(4, dtype=np.float32))
    moved = to_backend(w, get_backend("torch"), "float32", (4, 64), "w")
    assert isinstance(moved.qweight, torch.Tensor) and isinstance(moved.scales, torch.Tensor)
    assert isinstance(moved.bias, torch.Tensor) and moved.bias.tolist() == [0.0, 1.0, 2.0, 3.0]
