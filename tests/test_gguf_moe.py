"""GGUF files of the MoE architectures (Mixtral, Qwen2/3-MoE, gpt-oss, DeepSeek V2/V3), written
as llama.cpp's converter writes them (gguf-py's own tensor-name map; experts stacked per
layer, gpt-oss's interleaved gate/up split, DeepSeek's kv_b_proj split into k_b and v_b),
load to transformers' tokens."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from infer import LLM, SamplingParams
from infer.core.loader.gguf_file import GGUFCheckpoint
from tiny_moe_models import COMMON, MOE_MODELS
from tiny_models import add_gguf_shape, random_model


_rng = np.random.default_rng(5)
PROMPTS = [_rng.integers(3, COMMON["vocab_size"], n).tolist() for n in (19, 4, 33)]


def _tiny(kind: str, **override):
    cfg_cls, model_cls, extra = MOE_MODELS[kind]
    model, _, _ = random_model(cfg_cls, model_cls, norms_near_one=True, **(COMMON | extra | override))
    with torch.no_grad():  # wider weights still: the SwiGLU clamp at 7 bites
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(2.5)
    if kind == "deepseek_v3":  # a selection bias that changes the choice (the buffer starts at zero)
        gen = torch.Generator().manual_seed(1)
        for layer in model.model.layers[1:]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(torch.randn(bias.shape, generator=gen) * 0.2)
    return model


def _writer(model, path, arch, head_dim: int, **shape):
    c = model.config
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    add_gguf_shape(w, c, head_dim, **shape)
    rope = c.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    return w


def _add(w, names, name, value):
    w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(value))


def _add_experts(w, names, name, value) -> bool:
    """transformers 5's fused experts as the converter stacks them: gate_up [E, 2I, H] (gate rows,
    then up rows) split into ffn_gate_exps and ffn_up_exps, down [E, H, I] as ffn_down_exps."""
    if name.endswith("mlp.experts.gate_up_proj"):
        inter = value.shape[1] // 2
        _add(w, names, name.replace("gate_up_proj", "gate_proj.weight"), value[:, :inter])
        _add(w, names, name.replace("gate_up_proj", "up_proj.weight"), value[:, inter:])
    elif name.endswith("mlp.experts.down_proj"):
        _add(w, names, name + ".weight", value)
    else:
        return False
    return True


def _close(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_deepseek_gguf(model, path, legacy: bool = False, drop: tuple[str, ...] = ()) -> str:
    """DeepseekV2Model: MLA as MQA (one KV head, key_length = rank + rope) with the per-head
    `*_mla` lengths, kv_b_proj split into k_b (transposed) and v_b, experts stacked, the
    gating function as the hub configs' `scoring_func` gives it (softmax for V2, sigmoid for
    V3). `legacy`: what converters before the MLA split wrote (kv_b whole, per-head lengths).
    `drop`: GGUF tensor names left out (a damaged file)."""
    c = model.config
    v3 = c.model_type == "deepseek_v3"
    arch = gguf.MODEL_ARCH.DEEPSEEK2
    heads, rank, nope, rope, v = (c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
                                  c.v_head_dim)
    if legacy:
        w = _writer(model, path, arch, nope + rope, kv_heads=heads, value_dim=v)
    else:
        w = _writer(model, path, arch, rank + rope, kv_heads=1, value_dim=rank)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v)
    w.add_vocab_size(c.vocab_size)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if c.n_group:
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if c.q_lora_rank:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(rank)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    if c.norm_topk_prob and v3:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope)
    if c.rope_parameters.get("mscale_all_dim"):
        w.add_rope_scaling_yarn_log_mul(0.1 * c.rope_parameters["mscale_all_dim"])
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    if drop:
        add_tensor = w.add_tensor
        w.add_tensor = lambda n, *a, **k: None if n in drop else add_tensor(n, *a, **k)
    for name, value in model.state_dict().items():
        value = value.float().numpy()
        if (name == "lm_head.weight" and c.tie_word_embeddings) or _add_experts(w, names, name, value):
            continue
        if name.endswith("e_score_correction_bias"):
            _add(w, names, name.replace("e_score_correction_bias", "e_score_correction.bias"), value)
        elif name.endswith("kv_b_proj.weight") and not legacy:
            k_b, v_b = np.split(value.reshape(heads, nope + v, rank), [nope], axis=1)
            _add(w, names, name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(0, 2, 1))
            _add(w, names, name.replace("kv_b_proj", "v_b_proj"), v_b)
        else:
            _add(w, names, name, value)
    _close(w)
    return str(path)


def write_gpt_oss_gguf(model, path, mxfp4: bool = False) -> str:
    """GptOssModel: the window, the expert width, YaRN; sinks as `attn_sinks.weight`; the
    interleaved [E, H, 2I] gate/up transposed and split into gate (even) and up (odd) rows,
    its bias alike; down transposed to [E, H, I]. `mxfp4`: expert weights in MXFP4, as the
    hub checkpoints store them."""
    c = model.config
    arch = gguf.MODEL_ARCH.GPT_OSS
    w = _writer(model, path, arch, c.head_dim)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_sliding_window(c.sliding_window)
    w.add_expert_feed_forward_length(c.intermediate_size)
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)

    def experts(name, value):
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        if mxfp4:
            w.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(value), gguf.GGMLQuantizationType.MXFP4),
                         raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            w.add_tensor(gguf_name, np.ascontiguousarray(value))

    for name, value in model.state_dict().items():
        value = value.float().numpy()
        if name.endswith("experts.gate_up_proj"):
            value = value.transpose(0, 2, 1)
            experts(name.replace("gate_up_proj", "gate_proj.weight"), value[:, 0::2])
            experts(name.replace("gate_up_proj", "up_proj.weight"), value[:, 1::2])
        elif name.endswith("experts.gate_up_proj_bias"):
            _add(w, names, name.replace("gate_up_proj_bias", "gate_proj.bias"), value[:, 0::2])
            _add(w, names, name.replace("gate_up_proj_bias", "up_proj.bias"), value[:, 1::2])
        elif name.endswith("experts.down_proj"):
            experts(name + ".weight", value.transpose(0, 2, 1))
        elif name.endswith("experts.down_proj_bias"):
            _add(w, names, name.replace("down_proj_bias", "down_proj.bias"), value)
        elif name.endswith("self_attn.sinks"):
            _add(w, names, name + ".weight", value)
        else:
            _add(w, names, name, value)
    _close(w)
    return str(path)


def write_routed_gguf(model, path) -> str:
    """Mixtral (LlamaModel: q/k rows permuted into llama.cpp's rotary layout), Qwen2-MoE and
    Qwen3-MoE: experts stacked per layer, the expert widths and counts as metadata."""
    from test_loader import llama_cpp_permute

    c = model.config
    arch = {"mixtral": gguf.MODEL_ARCH.LLAMA, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
            "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE}[c.model_type]
    w = _writer(model, path, arch, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    w.add_expert_count(getattr(c, "num_local_experts", None) or c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if arch != gguf.MODEL_ARCH.LLAMA:
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == gguf.MODEL_ARCH.QWEN2MOE:
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    for name, value in model.state_dict().items():
        value = value.float().numpy()
        if _add_experts(w, names, name, value):
            continue
        if arch == gguf.MODEL_ARCH.LLAMA and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            _add(w, names, name, llama_cpp_permute(value, heads))
        else:
            _add(w, names, name, value)
    _close(w)
    return str(path)


def _mxfp4_round_trip(model) -> None:
    """The model's expert weights replaced by their MXFP4 values (gguf-py's quantize, then its
    dequantize: the oracle for what a file of them holds)."""
    with torch.no_grad():
        for layer in model.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                stored = p.detach().float().numpy().transpose(0, 2, 1)  # quantized along the input dim
                q = gguf.quants.quantize(np.ascontiguousarray(stored), gguf.GGMLQuantizationType.MXFP4)
                back = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.MXFP4).transpose(0, 2, 1)
                p.copy_(torch.from_numpy(np.ascontiguousarray(back)))


def _assert_matches(path, model, leak_check, **engine):
    """Greedy tokens equal transformers', and each chosen token's log-probability too (atol 5e-5)."""
    llm = LLM(path, backend=engine.pop("backend", "torch"), dtype="float32", skip_tokenizer_init=True,
              max_model_len=128, show_progress=False, **engine)
    leak_check.append(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        tokens = list(out.outputs[0].token_ids)
        with torch.no_grad():
            ids = torch.tensor([prompt])
            want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                                  pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
            assert tokens == want
            logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
        want_lp = torch.log_softmax(logits.double(), -1)[torch.arange(len(tokens)), torch.tensor(tokens)].numpy()
        got = np.array([step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens)])
        np.testing.assert_allclose(got, want_lp, atol=5e-5)


@pytest.mark.parametrize("kind,legacy", [("deepseek_v3", False), ("deepseek_v2", True),
                                         ("deepseek_v2_groups", False)])
def test_deepseek_gguf_written_like_llama_cpp_gives_transformers_tokens(kind, legacy, tmp_path, leak_check):
    model = _tiny(kind)
    _assert_matches(write_deepseek_gguf(model, tmp_path / f"{kind}.gguf", legacy), model, leak_check)


@pytest.mark.parametrize("backend", ["torch", "cpu_ref"])
def test_gpt_oss_gguf_written_like_llama_cpp_gives_transformers_tokens(backend, tmp_path, leak_check):
    # llama.cpp fixes the SwiGLU clamp at 7 for gpt-oss (the file has no key for it)
    model = _tiny("gpt_oss", swiglu_limit=7.0)
    _assert_matches(write_gpt_oss_gguf(model, tmp_path / "gpt_oss.gguf"), model, leak_check, backend=backend)


def test_gpt_oss_gguf_with_mxfp4_experts_loads_their_values(tmp_path, leak_check):
    model = _tiny("gpt_oss", swiglu_limit=7.0, intermediate_size=64)  # MXFP4 blocks of 32 along both inputs
    path = write_gpt_oss_gguf(model, tmp_path / "gpt_oss_mxfp4.gguf", mxfp4=True)
    _mxfp4_round_trip(model)
    _assert_matches(path, model, leak_check)
    # kept as stored, 4.25 bits a value, through `moe` (gate and up joined per expert)
    from infer.primitives.types import Mxfp4Weight

    experts = {n: t for n, t in leak_check[-1].worker.runner.tensors.items() if n.endswith((".w13", ".w2"))}
    assert experts and all(isinstance(t, Mxfp4Weight) for t in experts.values())


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_routed_moe_gguf_written_like_llama_cpp_gives_transformers_tokens(kind, tmp_path, leak_check):
    # Mixtral as a llama file: llama.cpp stores no window for it; its qwen2moe has no dense layers.
    model = _tiny(kind, **{"mixtral": {"sliding_window": None}, "qwen2_moe": {"mlp_only_layers": []}}.get(kind, {}))
    _assert_matches(write_routed_gguf(model, tmp_path / f"{kind}.gguf"), model, leak_check)


def test_gguf_config_of_deepseek_v3_is_its_transformers_config(tmp_path):
    """What the metadata says maps back to the fields transformers' config holds."""
    model = _tiny("deepseek_v3")
    cfg = GGUFCheckpoint(Path(write_deepseek_gguf(model, tmp_path / "m.gguf"))).config
    c = model.config
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["topk_method"] == "noaux_tc"
    for key in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_routed_experts",
                "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace",
                "routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group", "num_attention_heads"):
        assert cfg[key] == getattr(c, key), key
    assert cfg["rope_scaling"]["mscale_all_dim"] == pytest.approx(c.rope_parameters["mscale_all_dim"])


def test_joined_gguf_tensors_slice_like_the_whole(tmp_path):
    """A tensor the file stores in parts (stacked gate/up experts, k_b/v_b) reads and slices
    (tensor parallelism's shards) as the same cut of the whole."""
    model = _tiny("deepseek_v3")
    ckpt = GGUFCheckpoint(Path(write_deepseek_gguf(model, tmp_path / "m.gguf")))
    state = model.state_dict()
    for name, axis in (("model.layers.1.mlp.experts.gate_up_proj", 1), ("model.layers.2.self_attn.kv_b_proj.weight", 0)):
        whole = ckpt.read(name)
        np.testing.assert_array_equal(whole, state[name].numpy())
        half = whole.shape[axis] // 2
        np.testing.assert_array_equal(ckpt.read_slice(name, axis, half, whole.shape[axis]),
                                      np.take(whole, range(half, whole.shape[axis]), axis=axis))
        assert ckpt.nbytes(name) == whole.nbytes


def test_a_gguf_missing_one_part_of_a_split_tensor_names_it(tmp_path):
    from infer.core.loader.errors import CorruptCheckpointError

    path = write_deepseek_gguf(_tiny("deepseek_v3"), tmp_path / "m.gguf", drop=("blk.1.ffn_up_exps.weight",))
    with pytest.raises(CorruptCheckpointError, match=r"blk\.1\.ffn_up_exps\.weight is missing"):
        GGUFCheckpoint(Path(path))


def test_a_sigmoid_routed_deepseek_gguf_without_selection_biases_is_refused(tmp_path):
    from infer.core.loader.errors import LoaderError

    path = write_deepseek_gguf(_tiny("deepseek_v3"), tmp_path / "m.gguf",
                               drop=("blk.1.exp_probs_b.bias", "blk.2.exp_probs_b.bias"))
    with pytest.raises(LoaderError, match="exp_probs_b selection biases"):
        GGUFCheckpoint(Path(path))
