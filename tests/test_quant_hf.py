"""AWQ, GPTQ and fp8 HF checkpoints of a tiny random Llama, written here by a
reference quantizer, loaded back through the loader and run by the model runner.

Two oracles: transformers' forward on the matrices the checkpoint stands for
(the dequantized weights: must agree to fp32 rounding, which checks the
unpacking exactly), and transformers' forward on the original float model
(must agree within what the quantization step allows, justified below).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from infer.core.loader import LoaderError, load_model
from infer.core.lowering import lower
from infer.core.model_runner import ModelRunner
from infer.core.models.llama import build_llama
from infer.dispatch import Ops
from infer.registry import get_backend

from tiny_models import make_model, meta_for

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GROUP = 32
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_int4(w: np.ndarray, sym: bool):
    """[N, K] -> q, zeros, scales (K-major [K, N] / [K/G, N], as AWQ/GPTQ store them) and the dequantized [N, K]."""
    n, k = w.shape
    g = w.reshape(n, k // GROUP, GROUP).astype(np.float64)
    if sym:  # GPTQ sym: zero fixed at 8, scale from the largest magnitude
        scales = np.abs(g).max(-1) * 2 / 15
        zeros = np.full(scales.shape, 8)
    else:
        lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
        scales = (hi - lo) / 15
    scales = scales.astype(np.float16).astype(np.float64)  # stored as fp16: quantize with the stored scale
    if not sym:
        zeros = np.clip(np.round(-lo / scales), 0, 15)
    q = np.clip(np.round(g / scales[..., None]) + zeros[..., None], 0, 15).astype(np.int64)
    deq = ((q - zeros[..., None]) * scales[..., None]).reshape(n, k).astype(np.float32)
    return q.reshape(n, k).T, zeros.astype(np.int64).T, scales.T.astype(np.float16), deq


def pack_along_last(v: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """[R, C] 4-bit values -> [R, C/8] int32, column 8c + order[i] in bits 4i."""
    v = v.reshape(v.shape[0], -1, 8).astype(np.uint32)
    out = np.zeros(v.shape[:2], np.uint32)
    for i, j in enumerate(order):
        out |= v[..., j] << np.uint32(4 * i)
    return out.view(np.int32)


def awq_tensors(base: str, w: np.ndarray) -> tuple[dict, np.ndarray]:
    q, z, s, deq = quantize_int4(w, sym=False)
    return {f"{base}.qweight": pack_along_last(q, AWQ_ORDER), f"{base}.qzeros": pack_along_last(z, AWQ_ORDER),
            f"{base}.scales": s}, deq


def gptq_tensors(base: str, w: np.ndarray, sym: bool) -> tuple[dict, np.ndarray]:
    q, z, s, deq = quantize_int4(w, sym)
    k = q.shape[0]
    qweight = pack_along_last(np.ascontiguousarray(q.T)).T  # along K: k = 8r + j in bits 4j of row r
    return {f"{base}.qweight": np.ascontiguousarray(qweight), f"{base}.qzeros": pack_along_last((z - 1) & 0xF),
            f"{base}.scales": s, f"{base}.g_idx": (np.arange(k) // GROUP).astype(np.int32)}, deq


def fp8_tensors(base: str, w: np.ndarray, per_channel: bool) -> tuple[dict, np.ndarray]:
    wt = torch.from_numpy(w)
    amax = wt.abs().amax(dim=1, keepdim=True) if per_channel else wt.abs().max()
    scale = (amax / 448.0).float()
    q = (wt / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    deq = (q.float() * scale).numpy()
    return {f"{base}.weight": q, f"{base}.weight_scale": scale.reshape(-1) if per_channel else scale.reshape(())}, deq


def write_checkpoint(tmp_path, method: str, **kw):
    model, config, weights = make_model("llama3")
    tensors, deq_weights = {}, dict(weights)
    for name, w in weights.items():
        base = name.removesuffix(".weight")
        if not name.endswith(".weight") or base.rsplit(".", 1)[-1] not in PROJ:
            tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
            continue
        if method == "awq":
            parts, deq = awq_tensors(base, w)
        elif method.startswith("gptq"):
            parts, deq = gptq_tensors(base, w, sym=method == "gptq_sym")
        else:
            parts, deq = fp8_tensors(base, w, per_channel=method == "fp8_channel" or "mlp" in base)
        tensors.update({k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(v))
                        for k, v in parts.items()})
        deq_weights[name] = deq
    qconfig = {"awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
               "gptq_sym": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True},
               "gptq_asym": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False},
               }.get(method, {"quant_method": "fp8", "activation_scheme": "dynamic"})
    config = dict(config, quantization_config=qconfig, torch_dtype="float32")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return model, deq_weights


def run_infer(path, backend_name: str, ids: np.ndarray) -> np.ndarray:
    m = load_model(path, load_weights=False, load_tokenizer=False)
    backend = get_backend(backend_name)
    runner = ModelRunner(lower(build_llama(m.config)), backend, Ops(backend), m.lazy_weights(quantized=True),
                         "float32", 256)
    kinds = {h.kind for h in runner._handles.values()}
    assert kinds - {"dense"}, f"nothing stayed quantized: {kinds}"
    runner.allocate_kv_caches(num_blocks=4, block_size=16)
    meta = meta_for([(0, len(ids))], 16, [[0, 1, 2, 3]])
    rows = np.arange(len(ids))
    out = runner.forward(backend.asarray(ids), backend.asarray(rows), backend.asarray(rows), runner.prepare_metadata(meta)).logits
    return backend.to_numpy(out)


def hf_logits(model, ids, state=None) -> np.ndarray:
    if state is not None:
        model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()})
    with torch.no_grad():
        return model(torch.from_numpy(ids)[None]).logits[0].numpy()


@pytest.mark.parametrize("backend_name", ["torch", "cpu_ref"])
@pytest.mark.parametrize("method", ["awq", "gptq_sym", "gptq_asym", "fp8_tensor", "fp8_channel"])
def test_quantized_checkpoint_logits(tmp_path, method, backend_name):
    model, deq_weights = write_checkpoint(tmp_path, method)
    ids = np.random.default_rng(1).integers(0, 211, 20)
    got = run_infer(tmp_path, backend_name, ids)
    want_float = hf_logits(model, ids)
    # Exactly the checkpoint's matrices: fp32 rounding only.
    np.testing.assert_allclose(got, hf_logits(model, ids, deq_weights), atol=1e-4, rtol=1e-4)
    # Against the unquantized model. Weights are N(0, 0.08); int4 with groups
    # of 32 gives steps of ~range/15 ~ 0.04, a uniform rounding error of
    # ~0.012 rms (15% of a weight); e4m3's 3 mantissa bits give ~2-4%. Each
    # projection's output inherits that relative error and two layers add
    # up, so logits move by roughly that share of their spread. Measured:
    # 0.09-0.11 of the spread for int4, 0.03 for fp8; the bounds are ~3x
    # that and far below the spread itself (AWQ read with the nibble order
    # wrong gives 1.0 of the spread).
    bound = 0.1 if method.startswith("fp8") else 0.3
    spread = want_float.std()
    rms = float(np.sqrt(((got - want_float) ** 2).mean()))
    assert rms < bound * spread, f"rms logit error {rms / spread:.3f} of the spread"


def test_quantization_none_loads_the_dequantized_matrices(tmp_path):
    """``quantization='none'`` (the loader's float path) reads the same matrices, dequantized."""
    model, deq_weights = write_checkpoint(tmp_path, "gptq_asym")
    m = load_model(tmp_path, load_weights=False, load_tokenizer=False)
    weights = m.lazy_weights(quantized=False)
    name = "model.layers.1.mlp.down_proj.weight"
    np.testing.assert_allclose(weights[name], deq_weights[name], rtol=1e-6, atol=1e-7)
    assert "model.layers.1.mlp.down_proj.qweight" not in weights


def _with_kv_scales(tmp_path, scales):
    """The fp8 checkpoint of the tiny Llama with `scales(layer) -> {name: value}` added to each attention."""
    write_checkpoint(tmp_path, "fp8_tensor")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    layers = json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers):
        for name, value in scales(i).items():
            tensors[f"model.layers.{i}.self_attn.{name}"] = torch.tensor(value, dtype=torch.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))


def _fp8_kv_runner(path, backend_name="torch"):
    m = load_model(path, load_weights=False, load_tokenizer=False)
    backend = get_backend(backend_name)
    return ModelRunner(lower(build_llama(m.config)), backend, Ops(backend), m.lazy_weights(quantized=True),
                       "float32", 256, kv_cache_dtype="fp8"), backend


@pytest.mark.parametrize("names", [("k_scale", "v_scale"), ("k_proj.output_scale", "v_proj.output_scale")])
def test_fp8_kv_scales_come_from_the_checkpoint(tmp_path, names):
    _with_kv_scales(tmp_path, lambda i: {names[0]: 0.5 + i, names[1]: 0.25 * (i + 1)})
    runner, backend = _fp8_kv_runner(tmp_path)
    assert runner.kv_scales == [(0.5 + i, 0.25 * (i + 1)) for i in range(len(runner.kv_scales))]
    # The cache holds codes of k / k_scale and v / v_scale: against a run with unit scales,
    # layer 1's decoded values are smaller by its scales (up to e4m3's rounding).
    (tmp_path / "plain").mkdir()
    write_checkpoint(tmp_path / "plain", "fp8_tensor")  # the same weights (seeded), no KV scales
    unit, _ = _fp8_kv_runner(tmp_path / "plain")
    assert set(unit.kv_scales) == {(1.0, 1.0)}
    ids = np.arange(1, 9)
    rows = np.arange(len(ids))
    decoded = []
    for r in (runner, unit):
        r.allocate_kv_caches(num_blocks=4, block_size=16)
        r.forward(backend.asarray(ids), backend.asarray(rows), backend.asarray(rows[-1:]),
                  r.prepare_metadata(meta_for([(0, len(ids))], 16, [[0, 1, 2, 3]])))
        decoded.append(backend.kv_cache_to_numpy(r.kv_caches[1]))
    for i, scale in enumerate(runner.kv_scales[1]):
        scaled, plain = decoded[0][i], decoded[1][i]
        big = np.abs(plain) > 0.05  # clear of e4m3's subnormals
        assert big.sum() > 20
        np.testing.assert_allclose(scaled[big] * scale, plain[big], rtol=0.15)


def test_one_kv_scale_serves_k_and_v(tmp_path):
    _with_kv_scales(tmp_path, lambda i: {"kv_scale": 2.0})
    runner, _ = _fp8_kv_runner(tmp_path, "cpu_ref")
    assert set(runner.kv_scales) == {(2.0, 2.0)}


def test_half_a_kv_scale_pair_is_passed_over_for_a_whole_one(tmp_path):
    _with_kv_scales(tmp_path, lambda i: {"k_scale": 9.0, "k_proj.output_scale": 0.5, "v_proj.output_scale": 0.75})
    runner, _ = _fp8_kv_runner(tmp_path, "cpu_ref")
    assert set(runner.kv_scales) == {(0.5, 0.75)}


def test_kv_scales_on_some_layers_only_are_refused(tmp_path):
    _with_kv_scales(tmp_path, lambda i: {"k_scale": 1.5, "v_scale": 1.5} if i == 0 else {})
    with pytest.raises(ValueError, match="for 1 of"):
        _fp8_kv_runner(tmp_path)


def test_no_kv_scales_means_1_with_a_warning(tmp_path, caplog):
    write_checkpoint(tmp_path, "fp8_tensor")
    with caplog.at_level("WARNING", logger="infer"):
        runner, _ = _fp8_kv_runner(tmp_path)
    assert set(runner.kv_scales) == {(1.0, 1.0)}
    assert "no k_scale/v_scale" in caplog.text


@pytest.mark.parametrize("native_kernels", [True, False])
def test_auto_keeps_int4_weights_in_float32_only_with_an_exact_kernel(tmp_path, monkeypatch, native_kernels):
    """quantization='auto' with float32 activations keeps the AWQ weights quantized on the torch
    backend when its native GEMVs (exact to float32 rounding) are there, and dequantizes them
    at load when they are not; both give the dequantized model's greedy tokens."""
    from infer import LLM, SamplingParams
    from infer.backends.torch_native import native

    write_checkpoint(tmp_path, "awq")
    if not native_kernels:
        monkeypatch.setattr(native, "library", lambda: None)
    elif native.library() is None:
        pytest.skip(f"native kernels: {native.status()}")
    llm = LLM(str(tmp_path), backend="torch", dtype="float32", skip_tokenizer_init=True, max_num_seqs=2)
    kinds = {h.kind for h in llm.engine.worker.runner._handles.values()}
    assert ("int4_group" in kinds) == native_kernels, kinds
    prompts = [{"prompt_token_ids": [5, 17, 99, 3]}, {"prompt_token_ids": [42] * 9}]
    out = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    ref = LLM(str(tmp_path), backend="torch", dtype="float32", skip_tokenizer_init=True, max_num_seqs=2,
              quantization="none")
    want = ref.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in want]


@pytest.mark.parametrize("method,dtype,seqs", [("awq", "float32", 2), ("awq", "bfloat16", 1), ("awq", "bfloat16", 2),
                                               ("dense", "bfloat16", 1), ("dense", "bfloat16", 2),
                                               ("glm4", "bfloat16", 2), ("smollm3", "bfloat16", 2),
                                               ("gpt_oss", "bfloat16", 2)])
def test_fused_decode_nodes_give_what_their_primitives_give(tmp_path, monkeypatch, method, dtype, seqs):
    """The torch backend's native attention block and MLP (int4 weights, or dense bf16 ones
    on a CPU with AVX512-BF16; decode-sized steps) run the kernels the nodes' primitives
    run, in the same order: the same tokens and the same log-probabilities, bit for bit, as
    with the nodes expanded. Dense bf16 models beyond Llama: GLM-4 (q/k/v biases, half the
    dims rotated), SmolLM3 (every second layer without rope), gpt-oss (attention sinks, q/k/v
    and o biases, a windowed layer; its MoE feed-forward is not a fused node)."""
    from collections import Counter

    from infer import LLM, SamplingParams
    from infer.backends.torch_native import TorchBackend, fused, native
    from infer.primitives.backend import Support

    if native.library() is None:
        pytest.skip(f"native kernels: {native.status()}")
    if method != "awq" and not native.bf16_dot():
        pytest.skip("no AVX512-BF16: dense bf16 layers run their primitives")
    if method == "gpt_oss":
        from tiny_moe_models import save_moe_model

        save_moe_model(method, tmp_path)
    elif method != "awq":
        make_model("llama3" if method == "dense" else method)[0].save_pretrained(tmp_path)
    else:
        write_checkpoint(tmp_path, method)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3]}, {"prompt_token_ids": [42] * 9}]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)

    def generate():
        llm = LLM(str(tmp_path), backend="torch", dtype=dtype, skip_tokenizer_init=True, max_num_seqs=seqs)
        out = llm.generate(prompts, params, use_tqdm=False)
        return llm, [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in out]

    served = Counter()  # the calls the kernels served (None: declined, the primitives ran)

    def counted(*a, _real, _name):
        out = _real(*a)
        served.update([_name] if out is not None else [])
        return out

    for name in ("attention_block", "mlp"):  # fused.native: the kernels' Python side
        real = getattr(fused.native, name)
        monkeypatch.setattr(fused.native, name, lambda *a, _real=real, _name=name: counted(*a, _real=_real, _name=_name))
    llm, got = generate()
    fused_nodes = {"fused_attention"} | (set() if method == "gpt_oss" else {"fused_mlp"})
    assert {c.primitive for c in llm.engine.worker.runner.program.calls} >= fused_nodes
    assert served["attention_block"] >= 2 * 7, served  # 2 layers, 7+ decode steps
    assert method == "gpt_oss" or served["mlp"] >= 2 * 7, served
    monkeypatch.setattr(TorchBackend, "fuses", lambda self, op, **attrs: Support(False, "off for this test"))
    llm, want = generate()
    assert not any(c.primitive.startswith("fused_") for c in llm.engine.worker.runner.program.calls)
    assert got == want


def test_a_shard_of_a_quantized_weight_is_read_dequantized(tmp_path):
    """read_slice of a quantized projection dequantizes the whole matrix, then cuts it; a float
    tensor of the same checkpoint is cut as stored."""
    from infer.core.loader.load import open_checkpoint
    from infer.core.loader.quant_hf import QuantizedHF

    _, deq = write_checkpoint(tmp_path, "fp8_channel")
    ckpt = open_checkpoint(str(tmp_path))
    assert isinstance(ckpt, QuantizedHF)
    name = next(n for n in deq if n.endswith("q_proj.weight"))
    np.testing.assert_allclose(ckpt.read_slice(name, 0, 2, 5), deq[name][2:5], rtol=1e-6)
    np.testing.assert_allclose(ckpt.read_slice(name, 1, 3, 9), deq[name][:, 3:9], rtol=1e-6)
    norm = next(n for n in deq if n.endswith("input_layernorm.weight"))
    np.testing.assert_array_equal(ckpt.read_slice(norm, 0, 1, 4), deq[norm][1:4])


def test_awq_packings_other_than_gemm_are_refused(tmp_path):
    """AWQ's GEMV packing orders the nibbles differently: refused by name, not misread."""
    write_checkpoint(tmp_path, "awq")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoaderError, match="AWQ version 'gemv'"):
        load_model(tmp_path, load_tokenizer=False).lazy_weights(quantized=True)["model.layers.0.self_attn.q_proj.weight"]


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_per_channel_int4_group_size_minus_one_is_one_group_per_row(method):
    """``group_size: -1`` (per-channel AWQ/GPTQ): one scale and zero per output row."""
    from infer.core.loader.quant_hf import awq_handle, gptq_handle
    from infer.primitives.dequant import dequantize

    rng = np.random.default_rng(3)
    n, k = 16, 64
    q = rng.integers(0, 16, (k, n))
    zeros = rng.integers(0, 16, (1, n))
    scales = rng.uniform(0.01, 0.1, (1, n)).astype(np.float16)
    want = ((q - zeros) * scales.astype(np.float32)).T
    if method == "awq":
        handle = awq_handle(pack_along_last(q, AWQ_ORDER), pack_along_last(zeros, AWQ_ORDER), scales, -1)
    else:
        qweight = np.ascontiguousarray(pack_along_last(np.ascontiguousarray(q.T)).T)
        handle = gptq_handle(qweight, pack_along_last((zeros - 1) & 0xF), scales, np.zeros(k, np.int32), -1, True)
    assert handle.group_size == k and handle.scales.shape == (n, 1)
    np.testing.assert_allclose(dequantize(handle), want, rtol=1e-6, atol=1e-6)
