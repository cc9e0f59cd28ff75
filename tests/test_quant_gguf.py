"""GGUF block types kept quantized: every handle stands for exactly gguf-py's `dequantize`.

The blocks are random bytes (every code, every sub-block scale and min bit
pattern) with their fp16 super-block scales set to finite values that include
the extremes (65504, the smallest subnormal, zero, negatives): gguf-py is an
oracle nobody here wrote, and the comparison is bit for bit in float32, for
the contract's definition (`primitives.dequant`) and the torch backend's.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from infer.core.loader import quant_gguf
from infer.primitives.dequant import dequantize
from infer.primitives.types import Int4GroupWeight, Int8GroupWeight, Mxfp4Weight

# Byte offsets of each type's fp16 fields within a block.
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
               "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
               "MXFP4": ()}
EXTREMES = np.array([65504.0, -65504.0, 2.0**-24, -(2.0**-24), 0.0, 6.1e-5, 1.0, -0.0137], np.float16)


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, bytes per row] uint8: random blocks whose fp16 scales are finite (half of them extreme)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    for at in FP16_FIELDS[type_name]:
        values = (rng.standard_normal(b.shape[:2]) * 0.02).astype(np.float16)
        extreme = rng.random(b.shape[:2]) < 0.5
        values[extreme] = rng.choice(EXTREMES, int(extreme.sum()))
        b[..., at:at + 2] = values[..., None].view(np.uint8)
    if type_name == "MXFP4":  # E8M0 exponents: the subnormal-producing 0 and 1, up to where 12 * 2^e fits float32
        b[..., 0] = np.where(rng.random(b.shape[:2]) < 0.5, rng.integers(0, 252, b.shape[:2]),
                             rng.choice(np.array([0, 1, 2, 251], np.uint8), b.shape[:2]))
    return b.reshape(rows, -1)


def oracle(raw: np.ndarray, type_name: str) -> np.ndarray:
    return gguf.dequantize(raw, gguf.GGMLQuantizationType[type_name]).astype(np.float32)


@pytest.mark.parametrize("type_name", quant_gguf.KEPT_TYPES)
def test_every_kept_type_dequantizes_bit_for_bit_like_gguf_py(type_name):
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]
    rows, cols = 6, 2 * max(block, 256)  # two super-blocks a row: every 32- or 256-value block layout
    raw = random_blocks(type_name, rows, cols)
    want = oracle(raw, type_name)
    assert np.isfinite(want).all()
    h = quant_gguf.to_handle(raw, type_name, rows, cols)
    assert (h.out_features, h.in_features) == (rows, cols)
    np.testing.assert_array_equal(dequantize(h).astype(np.float32), want, err_msg=type_name)
    from infer.backends.torch_native.quant_linear import dequantize as torch_dequantize

    th = dataclasses.replace(h, **{f: torch.from_numpy(np.ascontiguousarray(getattr(h, f)))
                                   for f in ("qweight", "scales", "offsets") if getattr(h, f, None) is not None})
    np.testing.assert_array_equal(torch_dequantize(th).numpy(), want, err_msg=f"torch {type_name}")
    # Rows are independent: a row slice of the raw tensor is that slice of the matrix.
    part = quant_gguf.to_handle(raw[2:5], type_name, 3, cols)
    np.testing.assert_array_equal(dequantize(part).astype(np.float32), want[2:5])


@pytest.mark.parametrize("type_name,kind,group,offsets", [
    ("Q4_K", Int4GroupWeight, 32, True), ("Q2_K", Int4GroupWeight, 16, True),
    ("Q5_0", Int8GroupWeight, 32, False), ("Q5_1", Int8GroupWeight, 32, True), ("Q5_K", Int8GroupWeight, 32, True),
    ("Q6_K", Int8GroupWeight, 16, False), ("Q3_K", Int8GroupWeight, 16, False),
    ("IQ4_XS", Int8GroupWeight, 32, False), ("MXFP4", Mxfp4Weight, 32, False)])
def test_each_type_takes_the_handle_its_arithmetic_allows(type_name, kind, group, offsets):
    """The table in quant_gguf's docstring (and docs/quantization.md): the kind, group and bytes kept."""
    raw = random_blocks(type_name, 2, 256)
    h = quant_gguf.to_handle(raw, type_name, 2, 256)
    assert type(h) is kind and h.group_size == group and (getattr(h, "offsets", None) is not None) == offsets


def test_a_lattice_i_quant_has_no_handle_and_a_bad_row_length_is_refused():
    assert quant_gguf.to_handle(np.zeros((1, 66), np.uint8), "IQ2_XXS", 1, 256) is None
    with pytest.raises(ValueError, match="whole blocks of 256"):
        quant_gguf.to_handle(np.zeros((1, 144), np.uint8), "Q4_K", 1, 128)


# -- a whole model stored in a K-quant mix, against transformers ------------------------------------

# Per layer, the types a K-quant mix could write, chosen so that fused weights mix kinds and groups:
# layer 0's q/k/v are int4 G32 + int8 G32 + int8 G16 (fused as int8 G16 with offsets) beside an
# int4 o, its gate/up int4 G16 + int8 G16; layer 1's q/k/v int8 with and without offsets, its
# gate/up both Q4_K (int4 kept); IQ2_XXS (no exact affine form) is dequantized at load and named
# in the report. Q8_0 is the embedding.
MIX = {0: {"q_proj": "Q4_K", "k_proj": "Q5_0", "v_proj": "Q6_K", "o_proj": "Q4_K", "gate_proj": "Q2_K",
           "up_proj": "Q3_K", "down_proj": "Q5_K"},
       1: {"q_proj": "Q5_1", "k_proj": "IQ4_XS", "v_proj": "IQ4_NL", "o_proj": "MXFP4", "gate_proj": "Q4_K",
           "up_proj": "Q4_K", "down_proj": "IQ2_XXS"}}
FP16_FIELDS["IQ2_XXS"] = (0,)


def model_blocks(type_name: str, rows: int, cols: int, seed: int, std: float = 0.03) -> np.ndarray:
    """Random blocks whose matrix has about `std` spread: gguf-py's dequantization is linear in
    the fp16 scales, so they are set to 1-ish, measured, then scaled."""
    b = random_blocks(type_name, rows, cols, seed).reshape(rows, cols // gguf.GGML_QUANT_SIZES[
        gguf.GGMLQuantizationType[type_name]][0], -1)
    rng = np.random.default_rng(seed + 1)
    if type_name == "MXFP4":
        b[..., 0] = rng.integers(118, 121, b.shape[:2])
        return b.reshape(rows, -1)
    fields = [(at, rng.uniform(0.5, 1.5, b.shape[:2]).astype(np.float16)) for at in FP16_FIELDS[type_name]]
    for at, v in fields:
        b[..., at:at + 2] = v[..., None].view(np.uint8)
    spread = oracle(b.reshape(rows, -1), type_name).std()
    for at, v in fields:
        b[..., at:at + 2] = (v.astype(np.float32) * (std / spread)).astype(np.float16)[..., None].view(np.uint8)
    return b.reshape(rows, -1)


@pytest.fixture(scope="module")
def k_quant_mix(tmp_path_factory):
    from test_loader import tiny_model, write_gguf

    from infer.core.loader.gguf_file import unpermute_rows

    model = tiny_model("llama", hidden_size=256, intermediate_size=512, head_dim=64)
    raw, c = {}, model.config
    params = dict(model.named_parameters())
    seed = 0
    for layer, types in MIX.items():
        for proj, type_name in types.items():
            part = "self_attn" if proj[0] in "qkvo" else "mlp"
            name = f"model.layers.{layer}.{part}.{proj}.weight"
            rows, cols = params[name].shape
            blocks = model_blocks(type_name, rows, cols, seed := seed + 7)
            w = oracle(blocks, type_name).reshape(rows, cols)
            heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}.get(proj)
            if heads:  # the file holds llama.cpp's permuted rows
                w = unpermute_rows(w, heads)
            with torch.no_grad():
                params[name].copy_(torch.from_numpy(w))
            raw[name] = (blocks, gguf.GGMLQuantizationType[type_name])
    emb = model_blocks("Q8_0", c.vocab_size, c.hidden_size, 3, std=1.0)
    out = model_blocks("Q4_K", c.vocab_size, c.hidden_size, 5)
    with torch.no_grad():
        params["model.embed_tokens.weight"].copy_(torch.from_numpy(oracle(emb, "Q8_0").reshape(c.vocab_size, -1)))
        params["lm_head.weight"].copy_(torch.from_numpy(oracle(out, "Q4_K").reshape(c.vocab_size, -1)))
    raw["model.embed_tokens.weight"] = (emb, gguf.GGMLQuantizationType.Q8_0)
    raw["lm_head.weight"] = (out, gguf.GGMLQuantizationType.Q4_K)
    return model, write_gguf(model, "llama", tmp_path_factory.mktemp("mix") / "mix.gguf", raw=raw)


@pytest.mark.parametrize("backend_name", ["cpu_ref", "torch"])
def test_a_k_quant_mix_loads_kept_quantized_with_transformers_logits(k_quant_mix, backend_name, caplog):
    """Every projection kept quantized (fused q/k/v and gate/up of different types included), the
    lattice I-quant dequantized and named; float32 logits equal transformers' on the same matrices."""
    from test_quant import _logits

    from infer.core.loader import load_model
    from infer.core.lowering import lower
    from infer.core.model_runner import ModelRunner
    from infer.core.models.llama import build_llama
    from infer.dispatch import Ops
    from infer.registry import get_backend

    model, path = k_quant_mix
    m = load_model(path, load_weights=False)
    backend = get_backend(backend_name)
    weights = m.lazy_weights(quantized=True)
    runner = ModelRunner(lower(build_llama(m.config)), backend, Ops(backend), weights, "float32", 256)
    kinds = {w: h.kind for (w, _), h in runner._handles.items()}
    assert kinds == {"layers.0.qkv_proj": "int8_group", "layers.0.o_proj": "int4_group",
                     "layers.0.gate_up_proj": "int8_group", "layers.0.down_proj": "int8_group",
                     "layers.1.qkv_proj": "int8_group",
                     # MXFP4 is its own kind (torch prepares inside it the int8 groups it equals)
                     "layers.1.o_proj": "mxfp4",
                     "layers.1.gate_up_proj": "int4_group", "layers.1.down_proj": "dense", "lm_head": "int4_group"}
    report = weights.report()
    assert report[0] == "warning: dequantized at load (no kept form here for these types): IQ2_XXS"
    assert "Q4_K 5 (" in report[1] and "Q6_K 1 (" in report[1] and "IQ2_XXS 1 (" in report[2]
    runner.allocate_kv_caches(num_blocks=4, block_size=16)
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, 20)
    got = _logits(runner, backend, ids)
    with torch.no_grad():
        want = model(torch.from_numpy(ids)[None]).logits[0].numpy()
    print(f"max |logit| {np.abs(want).max():.3f}, max error {np.abs(got - want).max():.2e}")
    np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_k_quant_mix_decodes_through_the_fused_native_layers_as_its_primitives(k_quant_mix, dtype, leak_check,
                                                                               monkeypatch):
    """Decode steps of the mix on torch: both layers' attention blocks (an int8 qkv in groups of
    16 with offsets beside an int4 o; int8 with and without offsets) and layer 0's MLP run as
    one native call each; layer 1's MLP (a dense IQ2_XXS down beside int4 gate/up) runs its
    primitives. The greedy tokens equal a run with every fused node declined (the primitives,
    through the same kernels)."""
    from test_dispatch import table

    from infer.backends.torch_native.backend import TorchBackend
    from infer.backends.torch_native.native import ops as nops
    from infer.core.llm import LLM
    from infer.core.sampling_params import SamplingParams
    from infer.primitives.types import Support

    if nops.int8_prepare(torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 1), None, 32) is None:
        pytest.skip("the fused int8 layers need the integer int8 GEMM (AVX512-VNNI)")
    _, path = k_quant_mix
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(3, 43))}  # a prefill past every fused kernel's rows
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(TorchBackend, "fuses", lambda self, op, **attrs: Support(False, "test"))
        llm = LLM(str(path), backend="torch", dtype=dtype, skip_tokenizer_init=True, trace_dispatch=True,
                  max_num_seqs=1, max_model_len=256)
        leak_check.append(llm.engine)
        runs.append((llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids,
                     table(llm.engine.dispatch_trace)))
    (tokens, trace), (plain, plain_trace) = runs
    # One prefill (declined: its primitives run) and seven decode steps.
    assert trace[("attention", "fused_attention")] == {"torch:fused": 2 * 7, "declined": 2}
    assert trace[("mlp", "fused_mlp")] == {"torch:fused": 7, "declined": 2 + 7}
    assert not any(call.startswith("fused_") for _, call in plain_trace)
    assert tokens == plain
