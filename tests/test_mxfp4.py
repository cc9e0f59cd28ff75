"""MXFP4 (OCP microscaling FP4): the contract's values against the spec as ml_dtypes
implements it, torch's and the loader's forms against the contract, and a gpt-oss
checkpoint in transformers' ``quant_method: mxfp4`` layout against transformers' own
dequantization and forward pass, its experts kept in 4 bits through `moe`."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from infer import LLM
from infer.backends.torch_native import mxfp4 as torch_mxfp4
from infer.core import quant_params
from infer.primitives.dequant import dequantize
from infer.primitives.types import Mxfp4Weight
from tiny_moe_models import COMMON, MOE_MODELS
from tiny_models import random_model

ALL_BYTES = np.arange(256, dtype=np.uint8)
EXPONENTS = np.array([0, 1, 2, 100, 120, 126, 127, 128, 140, 200, 250, 254, 255], np.uint8)


def spec_values(qweight: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 values by ml_dtypes' float4_e2m1fn and float8_e8m0fnu (low nibble first)."""
    codes = np.stack([qweight & 15, qweight >> 4], axis=-1).reshape(*qweight.shape[:-1], -1)
    values = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    scale = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    return values * np.repeat(scale, 32, axis=-1)


def _every_code_and_exponent() -> tuple[np.ndarray, np.ndarray]:
    """[len(EXPONENTS), 256] bytes: each row every byte value (every code pair), 16 blocks of 32."""
    q = np.tile(ALL_BYTES, (len(EXPONENTS), 1))
    return q, np.repeat(EXPONENTS[:, None], 16, axis=1)


def test_the_contract_values_are_the_ocp_spec():
    q, s = _every_code_and_exponent()
    np.testing.assert_array_equal(dequantize(Mxfp4Weight(q, s)), spec_values(q, s))


def test_torch_dequantizes_like_the_contract_and_its_int8_groups_are_the_same_matrix():
    q, s = _every_code_and_exponent()
    finite = EXPONENTS < 254  # 6 * 2^127 and beyond overflow float32
    q, s = q[finite], s[finite]
    want = dequantize(Mxfp4Weight(q, s))
    got = torch_mxfp4.dequantize(torch.from_numpy(q), torch.from_numpy(s)).double().numpy()
    np.testing.assert_array_equal(got, want)
    groups = torch_mxfp4.as_int8_groups(Mxfp4Weight(torch.from_numpy(q), torch.from_numpy(s)))
    assert groups.group_size == 32 and groups.qweight.dtype == torch.int8
    np.testing.assert_array_equal(dequantize(dataclasses_numpy(groups)), want)
    # the host's form of the same conversion (K-quant mixes fuse MXFP4 beside int8 parts)
    np.testing.assert_array_equal(dequantize(quant_params.mxfp4_as_int8(Mxfp4Weight(q, s))), want)


def dataclasses_numpy(handle):
    import dataclasses

    return dataclasses.replace(handle, qweight=handle.qweight.numpy(), scales=handle.scales.numpy())


def test_stacks_of_experts_fuse_slice_and_refuse_cut_blocks():
    rng = np.random.default_rng(0)
    a = Mxfp4Weight(rng.integers(0, 256, (3, 4, 32), np.uint8), rng.integers(100, 130, (3, 4, 2), np.uint8))
    b = Mxfp4Weight(rng.integers(0, 256, (3, 2, 32), np.uint8), rng.integers(100, 130, (3, 2, 2), np.uint8))
    fused = quant_params.concat_rows([a, b])
    assert quant_params.shape_of(fused) == (3, 6, 64)
    np.testing.assert_array_equal(dequantize(fused), np.concatenate([dequantize(a), dequantize(b)], axis=1))
    rows = quant_params.slice_handle(fused, 1, 2, 5)
    np.testing.assert_array_equal(dequantize(rows), dequantize(fused)[:, 2:5])
    cols = quant_params.slice_handle(fused, 2, 32, 64)
    np.testing.assert_array_equal(dequantize(cols), dequantize(fused)[:, :, 32:])
    with pytest.raises(ValueError, match="32-wide blocks"):
        quant_params.slice_handle(fused, 2, 16, 48)


# -- a gpt-oss checkpoint as transformers' mxfp4 integration reads it ---------------------------

def _quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., N, K] float -> (blocks [..., N, K/32, 16], scales [..., N, K/32]): per block of 32 the
    exponent that puts its largest magnitude within E2M1's 6, each value its nearest code."""
    *lead, n, k = w.shape
    blocks = w.reshape(*lead, n, k // 32, 32).astype(np.float64)
    amax = np.abs(blocks).max(axis=-1)
    e = np.clip(np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127, 127).astype(np.int64)
    scaled = blocks / np.ldexp(1.0, e)[..., None]
    grid = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    codes = np.abs(scaled[..., None] - grid).argmin(axis=-1).astype(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (e + 127).astype(np.uint8)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    """A tiny gpt-oss saved with MXFP4 experts (transformers' names and layout: blocks and scales
    per projection, rows output features, gate/up rows interleaved), and the float model whose
    experts are transformers' own dequantization of those blocks: the reference."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg_cls, model_cls, extra = MOE_MODELS["gpt_oss"]
    model, _, _ = random_model(cfg_cls, model_cls, norms_near_one=True,
                               **(COMMON | extra | {"intermediate_size": 64, "swiglu_limit": 7.0}))
    directory = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    model.save_pretrained(directory)
    state = load_file(directory / "model.safetensors")
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stored = state.pop(name)  # [E, in, out] in transformers' module
        blocks, scales = _quantize_mxfp4(np.ascontiguousarray(stored.transpose(0, 2, 1)))
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        back = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
        with torch.no_grad():
            model.get_parameter(name).copy_(back)
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory), model


@pytest.mark.parametrize("backend", ["torch", "cpu_ref"])
def test_gpt_oss_with_mxfp4_experts_gives_transformers_tokens_kept_in_4_bits(gpt_oss_mxfp4, backend, leak_check):
    from test_gguf_moe import _assert_matches

    path, model = gpt_oss_mxfp4
    _assert_matches(path, model, leak_check, backend=backend)  # tokens, and logprobs within 5e-5
    experts = {n: t for n, t in leak_check[-1].worker.runner.tensors.items() if n.endswith((".w13", ".w2"))}
    # cpu_ref keeps no quantized weight for float32 activations (Backend.keeps_quantized): dense there
    kept = backend == "torch"
    assert experts and all(isinstance(t, Mxfp4Weight) == kept for t in experts.values())


def test_mxfp4_experts_load_dequantized_with_quantization_none(gpt_oss_mxfp4, leak_check):
    path, _ = gpt_oss_mxfp4
    llm = LLM(path, backend="torch", dtype="float32", skip_tokenizer_init=True, max_model_len=64,
              quantization="none", show_progress=False)
    leak_check.append(llm.engine)
    experts = [t for n, t in llm.engine.worker.runner.tensors.items() if n.endswith(".w13")]
    assert experts and all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in experts)
