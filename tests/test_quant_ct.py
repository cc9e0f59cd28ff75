"""compressed-tensors checkpoints (llm-compressor's format) of a tiny random Llama, written by the
compressed-tensors package itself (its ModelCompressor packs the files), loaded by infer kept
quantized and checked against transformers' forward on the matrices the package's own
decompression gives back.

W8A8 also quantizes activations per token at run time; its oracle is transformers' forward
with that fake quantization applied to every quantized projection's input by hooks written
here (vLLM's definition, which infer's contract takes: s = max|x| / 127, codes clipped to
+-127; compressed-tensors' own fake quantization divides by 127.5 instead).
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (QuantizationConfig, apply_quantization_config,  # noqa: E402
                                             preset_name_to_scheme)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

from infer.core.loader import LoaderError, load_model  # noqa: E402
from infer.core.lowering import lower  # noqa: E402
from infer.core.model_runner import ModelRunner  # noqa: E402
from infer.core.models.llama import build_llama  # noqa: E402
from infer.dispatch import Ops  # noqa: E402
from infer.registry import get_backend  # noqa: E402

from tiny_models import make_model, meta_for  # noqa: E402

VOCAB = 211
# (preset, group size override, weight kind infer keeps, act_quant)
SCHEMES = {
    "w4a16_group": ("W4A16", 32, "int4_group", None),
    "w4a16_asym": ("W4A16_ASYM", 32, "int4_group", None),
    "w4a16_channel": ("W4A16", "channel", "int4_group", None),
    "w8a16_group": ("W8A16", 32, "int8_group", None),
    "w8a8": ("W8A8", None, "int8_group", "int8_token"),
    "fp8_tensor": ("FP8", None, "fp8", None),
    "fp8_dynamic": ("FP8_DYNAMIC", None, "fp8", None),
}


def _calibrate(model) -> None:
    """Weight scales and zero points from each weight's min/max, through the package's calculate_qparams
    (llm-compressor's minmax observer does the same)."""
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        w, args = module.weight.data, module.quantization_scheme.weights
        if args.strategy == "group":
            g = w.view(w.shape[0], -1, args.group_size)
            lo, hi = g.amin(-1), g.amax(-1)
        elif args.strategy == "channel":
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        scale, zero = calculate_qparams(lo, hi, args)
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(
                module.weight_zero_point.shape)
        if hasattr(module, "input_scale"):  # static fp8 activations: a plausible calibrated scale
            module.input_scale.data.fill_(0.01)


def write_ct_checkpoint(path, scheme: str, ignore=("lm_head",), edit_config=None):
    """(the float model, state dict of the matrices the package decompresses) after saving `scheme`."""
    preset, group, _, _ = SCHEMES[scheme]
    model, _, _ = make_model("llama3")
    original = copy.deepcopy(model)
    qscheme = preset_name_to_scheme(preset, ["Linear"])
    if group == "channel":
        qscheme.weights.strategy, qscheme.weights.group_size = "channel", None
    elif group is not None:
        qscheme.weights.group_size = group
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": qscheme}, ignore=list(ignore)))
    _calibrate(model)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    if edit_config is not None:
        config = json.loads((path / "config.json").read_text())
        edit_config(config["quantization_config"])
        (path / "config.json").write_text(json.dumps(config))
    compressor.decompress_model(model)
    keys = original.state_dict().keys()
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k in keys}
    return original, state


def run_infer(path, backend_name: str, ids: np.ndarray, dtype: str = "float32") -> tuple[np.ndarray, set]:
    m = load_model(path, load_weights=False, load_tokenizer=False)
    backend = get_backend(backend_name)
    runner = ModelRunner(lower(build_llama(m.config)), backend, Ops(backend), m.lazy_weights(quantized=True),
                         dtype, 256)
    handles = {key[0]: h for key, h in runner._handles.items()}  # keyed (name, lora slot)
    runner.allocate_kv_caches(num_blocks=4, block_size=16)
    meta = meta_for([(0, len(ids))], 16, [[0, 1, 2, 3]])
    rows = np.arange(len(ids))
    out = runner.forward(backend.asarray(ids), backend.asarray(rows), backend.asarray(rows),
                         runner.prepare_metadata(meta)).logits
    return backend.to_numpy(out).astype(np.float32), handles


def per_token_int8(x: torch.Tensor) -> torch.Tensor:
    """vLLM's dynamic per-token int8 fake quantization (float64)."""
    x = x.double()
    amax = x.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return (torch.round(x / s).clamp(-127, 127) * s).float()


def hf_logits(model, state, ids: np.ndarray, act_quant: bool = False) -> np.ndarray:
    model.load_state_dict(state)
    hooks = []
    if act_quant:
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                hooks.append(module.register_forward_pre_hook(lambda _m, args: (per_token_int8(args[0]),)))
    try:
        with torch.no_grad():
            return model(torch.from_numpy(ids)[None]).logits[0].numpy()
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("backend_name", ["cpu_ref", "torch"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_checkpoint_logits_match_the_decompressed_model(tmp_path, scheme, backend_name):
    original, state = write_ct_checkpoint(tmp_path, scheme)
    ids = np.random.default_rng(1).integers(0, VOCAB, 20)
    got, handles = run_infer(tmp_path, backend_name, ids)
    _, _, kind, act_quant = SCHEMES[scheme]
    projections = {n: h for n, h in handles.items() if n != "lm_head"}
    assert {h.kind for h in projections.values()} == {kind}
    assert {getattr(h, "act_quant", None) for h in projections.values()} == {act_quant}
    assert handles["lm_head"].kind == "dense"  # in the ignore list
    want = hf_logits(original, state, ids, act_quant=act_quant is not None)
    # The same matrices (and the same activation codes): float32 rounding only, except that a
    # code at a rounding tie may land one step apart; W8A8's bound allows a few such steps.
    tol = 2e-3 if act_quant else 1e-4
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend_name", ["cpu_ref", "torch"])
def test_w8a8_differs_from_its_weights_alone(tmp_path, backend_name):
    """The activation quantization is applied: the logits are not the weight-only model's."""
    original, state = write_ct_checkpoint(tmp_path, "w8a8")
    ids = np.random.default_rng(2).integers(0, VOCAB, 12)
    got, _ = run_infer(tmp_path, backend_name, ids)
    weight_only = hf_logits(original, state, ids)
    quantized = hf_logits(original, state, ids, act_quant=True)
    assert np.abs(weight_only - quantized).max() > 20 * np.abs(got - quantized).max()


# cpu_ref keeps quantized weights for 16-bit activations only (`keeps_quantized`): in float32 it
# serves the dequantized matrices, without W8A8's activation quantization (docs/quantization.md).
@pytest.mark.parametrize("backend_name, dtype", [("cpu_ref", "bfloat16"), ("torch", "float32"), ("torch", "bfloat16")])
@pytest.mark.parametrize("scheme", ["w4a16_asym", "w8a8"])
def test_llm_decodes_what_transformers_does(tmp_path, scheme, backend_name, dtype):
    """Through `LLM` (prefill then decode steps, the torch backend's fused decode layers where
    they take the weights): the greedy tokens of transformers on the decompressed model (W8A8:
    with its activations fake-quantized per token)."""
    from infer import LLM, SamplingParams

    original, state = write_ct_checkpoint(tmp_path, scheme)
    llm = LLM(str(tmp_path), backend=backend_name, dtype=dtype, skip_tokenizer_init=True)
    prompt = [5, 17, 42, 99, 3]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, temperature=0.0))
    tokens = list(out[0].outputs[0].token_ids)
    ids = np.array(prompt + tokens)
    # Each chosen token is transformers' argmax, or within bf16 rounding of it.
    logits = hf_logits(original, state, ids, act_quant=SCHEMES[scheme][3] is not None)[len(prompt) - 1:-1]
    chosen = logits[np.arange(len(tokens)), tokens]
    margin = 0.0 if dtype == "float32" else 0.05 * logits.std()
    assert np.all(chosen >= logits.max(axis=1) - margin - 1e-4), (chosen, logits.max(axis=1))



def test_load_report_names_the_scheme(tmp_path):
    write_ct_checkpoint(tmp_path, "w8a8")
    m = load_model(tmp_path, load_weights=False, load_tokenizer=False)
    ckpt = m.checkpoint
    assert ckpt.stored_type("model.layers.0.self_attn.q_proj.weight") == "ct:int-quantized int8-channel-sym-a8-token"
    assert ckpt.stored_type("lm_head.weight") in ("F32", "float32")
    write_ct_checkpoint(tmp_path / "w4", "w4a16_asym")
    ckpt = load_model(tmp_path / "w4", load_weights=False, load_tokenizer=False).checkpoint
    assert ckpt.stored_type("model.layers.1.mlp.down_proj.weight") == "ct:pack-quantized int4-group32-asym"


def test_quantization_none_reads_the_decompressed_matrices(tmp_path):
    _, state = write_ct_checkpoint(tmp_path, "w4a16_group")
    weights = load_model(tmp_path, load_weights=False, load_tokenizer=False).lazy_weights(quantized=False)
    name = "model.layers.1.mlp.gate_proj.weight"
    np.testing.assert_allclose(weights[name], state[name].numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("edit, message", [
    (lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), "actorder 'group'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="block", block_structure=[128, 128]),
     "weight strategy 'block'"),
    (lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
     "sparse-24-bitmask"),
    (lambda q: q["config_groups"]["group_0"].update(format="nvfp4-pack-quantized"), "nvfp4-pack-quantized"),
    (lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False), "static activations"),
    (lambda q: q["config_groups"]["group_0"]["input_activations"].update(strategy="tensor"), "tensor dynamic"),
    (lambda q: q.update(transform_config={"config_groups": {"r": {}}}), "transforms"),
    (lambda q: q["config_groups"]["group_0"].update(targets=["re:.*q_proj$"]), "no config group's targets"),
])
def test_unsupported_schemes_are_refused_by_name(tmp_path, edit, message):
    write_ct_checkpoint(tmp_path, "w8a8", edit_config=edit)
    with pytest.raises(LoaderError, match=message):
        load_model(tmp_path, load_weights=False, load_tokenizer=False)


def test_fp8_block_checkpoint_is_refused(tmp_path):
    def block(q):
        q["config_groups"]["group_0"]["weights"].update(strategy="block", block_structure=[128, 128])

    write_ct_checkpoint(tmp_path, "fp8_dynamic", edit_config=block)
    with pytest.raises(LoaderError, match="block"):
        load_model(tmp_path, load_weights=False, load_tokenizer=False)


# -- the conformance cases of W8A8 catch what they exist to catch ------------------
INT8_TOKEN_CASES = {"int8_token_one_token", "int8_token_t5_bias", "int8_token_t40", "int8_token_zero_row_t7_n40"}


def _mutant(linear):
    from infer.backends.cpu_ref import CpuRefBackend

    return type("Mutant", (CpuRefBackend,), {"name": "mutant", "linear": staticmethod(linear)})


def _ignores_act_quant(x, weight):
    import dataclasses

    from infer.backends.cpu_ref import quant

    return quant.linear(x, dataclasses.replace(weight, act_quant=None) if hasattr(weight, "act_quant") else weight)


def _rounds_half_away(x, weight):
    from infer.backends.cpu_ref import quant
    from infer.primitives.types import Int8GroupWeight, round_to_dtype

    if not isinstance(weight, Int8GroupWeight) or weight.act_quant is None:
        return quant.linear(x, weight)
    x64 = np.asarray(x, np.float64)
    amax = np.abs(x64).max(axis=1) if x64.shape[1] else np.zeros(x64.shape[0])
    s = np.where(amax > 0, amax / 127, 1.0)[:, None]
    v = x64 / s
    xq = np.clip(np.sign(v) * np.floor(np.abs(v) + 0.5), -127, 127) * s
    y = xq @ (weight.qweight.astype(np.float64) * weight.scales).T
    return round_to_dtype(y if weight.bias is None else y + weight.bias, weight.dtype)


@pytest.mark.parametrize("linear, dtypes", [
    (_ignores_act_quant, ("fp32", "fp16")),  # bf16's tolerance is wider than some cases' difference
    # 16-bit inputs put x / s on half steps: ties decide codes there; float32's are never ties.
    (_rounds_half_away, ("fp16",)),
])
def test_conformance_cases_catch_a_wrong_act_quant(linear, dtypes):
    from infer.testing import run_conformance

    report = run_conformance(_mutant(linear)(), primitives=["linear"])
    failed = {r.case.id for r in report.results if r.status == "fail"}
    must = {f"linear-{c}-{d}" for c in INT8_TOKEN_CASES for d in dtypes}
    assert must <= failed and all("int8_token" in c for c in failed), sorted(failed)


# -- ascend: W8A8 through npu_dynamic_quant + npu_quant_matmul (their emulation) ------------
def test_npu_w8a8_emulation_matches_the_contract():
    from infer.primitives.act_quant import quantize_per_token
    from infer.testing.npu_emulation import NpuOpError
    from infer.testing.npu_emulation import w8a8_ops as W

    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((6, 96)).astype(np.float32)).to(torch.bfloat16)
    x[2] = 0
    q, s = W.npu_dynamic_quant(x)
    want_q, want_s = quantize_per_token(x.float().numpy())
    np.testing.assert_array_equal(q.numpy(), want_q)
    np.testing.assert_allclose(s.numpy()[[0, 1, 3, 4, 5]], want_s[[0, 1, 3, 4, 5]], rtol=1e-7)
    assert s[2] == 0  # the op's scale for an all-zero row; its codes are 0 either way
    w = torch.from_numpy(rng.integers(-128, 128, (96, 40), dtype=np.int8))
    scale = torch.rand(40) * 0.01
    y = W.npu_quant_matmul(q, w, scale, pertoken_scale=s, output_dtype=torch.bfloat16)
    exact = (q.numpy().astype(np.int64) @ w.numpy().astype(np.int64)) * s.numpy()[:, None] * scale.numpy()
    np.testing.assert_allclose(y.float().numpy(), exact, rtol=8e-3, atol=1e-6)
    with pytest.raises(NpuOpError, match="11264"):
        W.npu_dynamic_quant(torch.zeros(2, 11265, dtype=torch.float16))
    with pytest.raises(NpuOpError, match="float16/bfloat16"):
        W.npu_dynamic_quant(torch.zeros(2, 8))
    with pytest.raises(NpuOpError, match="pertoken_scale"):
        W.npu_quant_matmul(q, w, scale, output_dtype=torch.float16)


def test_ascend_w8a8_linear_calls_the_npu_pair_and_matches_cpu_ref(monkeypatch):
    from infer.backends.cpu_ref import quant as ref
    from infer.testing.npu_emulation import installed
    from infer.testing.quant_inputs import handle, host_fields

    rng = np.random.default_rng(4)
    fields = host_fields(rng, 40, 128, "int8_token")
    x = rng.standard_normal((9, 128)).astype(np.float32)
    with installed() as mod:
        from infer.backends.ascend import AscendBackend

        calls = []
        real = mod.npu_quant_matmul
        monkeypatch.setattr(mod, "npu_quant_matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
        backend = AscendBackend()
        w = backend.prepare_weight(handle(fields, backend.asarray, None, "float16"))
        got = backend.linear(backend.asarray(x, "float16"), w).float().numpy()
    want = ref.linear(np.asarray(x.astype(np.float16), np.float32), handle(fields, np.asarray, None, "float16"))
    assert calls
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=2e-3)
