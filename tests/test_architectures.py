"""The dense architectures beyond the Llama family (Gemma 2/3, Phi-3, Granite,
OLMo 2, SmolLM3, GLM-4) end to end: a tiny random model saved by transformers
as an HF directory, served by `LLM`, gives transformers' greedy tokens.
(`test_model_logits` compares their logits step by step through the runner.)"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from tiny_models import add_gguf_shape, make_model, meta_for, random_model

from infer.core.llm import LLM
from infer.core.lowering import lower
from infer.core.model_runner import ModelRunner
from infer.core.models.llama import build_llama
from infer.core.sampling_params import SamplingParams
from infer.dispatch import Ops
from infer.registry import get_backend

NEW = ["gemma2", "gemma3", "phi3", "granite", "olmo2", "smollm3", "glm4"]
VOCAB = 211
_rng = np.random.default_rng(3)
PROMPTS = [_rng.integers(3, VOCAB, n).tolist() for n in (21, 5, 37)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _greedy(model, prompt, n=10):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> (transformers model in float32, HF directory)."""
    out = {}
    for kind in NEW:
        model, _, _ = make_model(kind)
        path = tmp_path_factory.mktemp(f"tiny-{kind}")
        model.save_pretrained(path)
        out[kind] = (model, str(path))
    return out


def _llm(path, leak_check, **kw):
    # max_model_len 256: Phi-3's LongRoPE picks its short factors (the tiny config's original length)
    llm = LLM(path, skip_tokenizer_init=True, max_num_seqs=4, max_model_len=256, **kw)
    leak_check.append(llm.engine)
    return llm


def _generate(llm, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend", ["torch", "cpu_ref"])
@pytest.mark.parametrize("kind", NEW)
def test_greedy_tokens_equal_transformers(saved, kind, backend, leak_check):
    model, path = saved[kind]
    llm = _llm(path, leak_check, backend=backend, dtype="float32")
    assert _generate(llm) == [_greedy(model, p) for p in PROMPTS]


@pytest.mark.parametrize("kind", ["phi3", "granite", "smollm3", "glm4", "gemma2", "gemma3", "olmo2"])
def test_bfloat16_greedy_tokens_equal_transformers_in_bfloat16(saved, kind, leak_check):
    """bf16 on the torch backend (its native fused decode nodes where the CPU has AVX512-BF16:
    partial and GPT-J rotary, layers without rope, q/k norms per head and over all heads,
    soft-capped attention, GeGLU, multipliers around them) against
    transformers computing in bf16 too."""
    model, path = saved[kind]
    llm = _llm(path, leak_check, backend="torch", dtype="bfloat16")
    # A copy: a round trip of the shared fixture through bf16 would round its weights and rope
    # buffers for the float32 tests after this one.
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    reference = [_greedy(bf16, p) for p in PROMPTS]
    assert _generate(llm) == reference


def test_longrope_uses_long_factors_when_the_served_context_passes_the_original():
    """Phi-3's LongRoPE with max_model_len past original_max_position_embeddings: every position
    rotates by the long factors, as transformers does for a sequence longer than the original
    length, and the cos/sin scale follows max_position_embeddings / original."""
    model, config, weights = random_model(
        "Phi3Config", "Phi3ForCausalLM", hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=96, num_hidden_layers=2, vocab_size=97, pad_token_id=0, max_position_embeddings=64,
        original_max_position_embeddings=16, sliding_window=None,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0] * 16, "long_factor": [1.0 + 0.7 * i for i in range(16)]})
    backend = get_backend("torch")
    runner = ModelRunner(lower(build_llama(config)), backend, Ops(backend), weights, "float32", 64)
    runner.allocate_kv_caches(num_blocks=4, block_size=16)
    ids = np.random.default_rng(0).integers(0, 97, 30)
    got = runner.forward(backend.asarray(ids), backend.asarray(np.arange(30)), backend.asarray(np.arange(30)),
                         runner.prepare_metadata(meta_for([(0, 30)], 16, [[1, 3]]))).logits
    with torch.no_grad():
        want = model(torch.from_numpy(ids)[None]).logits[0].numpy()
    np.testing.assert_allclose(backend.to_numpy(got), want, atol=1e-4)


def test_olmo2_refuses_tensor_parallelism_that_splits_its_heads_unevenly():
    """OLMo 2's q/k norms span all heads: the ranks gather them whole, which takes an even
    split (TP=2 runs: `test_distributed`); 4 query heads over 3 ranks are refused with why."""
    from infer.core.parallel import shard_graph

    _, config, _ = make_model("olmo2")
    assert shard_graph(build_llama(config), 1, 2).config.num_heads == 4
    with pytest.raises(ValueError, match=r"needs 3 to divide num_attention_heads \(4\)"):
        shard_graph(build_llama(config), 0, 3)


@pytest.mark.parametrize("rope,served", [
    ({"rope_type": "default", "rope_theta": 10000.0}, 256),
    ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, 256),
    ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}, 256),
    ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}, 256),
    # gpt-oss: the correction range kept fractional
    ({"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
      "truncate": False, "original_max_position_embeddings": 64}, 256),
    # DeepSeek: the attention factor from mscale / mscale_all_dim
    ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
      "original_max_position_embeddings": 64}, 256),
    ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, 256),  # within max_position_embeddings
    ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, 1000),  # past it: a larger base
    ({"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
      "short_factor": [1.0 + 0.05 * i for i in range(16)], "long_factor": [1.5 + 0.3 * i for i in range(16)]}, 64),
    ({"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
      "short_factor": [1.0 + 0.05 * i for i in range(16)], "long_factor": [1.5 + 0.3 * i for i in range(16)]}, 1000),
], ids=["default", "linear", "llama3", "yarn", "yarn-untruncated", "yarn-mscale", "dynamic", "dynamic-long", "longrope-short", "longrope-long"])
def test_rope_tables_equal_transformers_rope_functions(rope, served):
    """Each rope type's cos/sin table equals what transformers' own rope function gives for a
    sequence of the served length (`max_model_len`)."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from infer.core.rope import cos_sin_cache

    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=8, max_position_embeddings=256,
                                   rope_parameters=dict(rope))
    kind = rope["rope_type"]
    fn = ROPE_INIT_FUNCTIONS.get(kind) if kind != "default" else None
    inv_freq, scale = fn(cfg, None, seq_len=served) if fn else (1.0 / 10000.0 ** (torch.arange(0, 32, 2).float() / 32), 1.0)
    positions = torch.arange(served).float()
    angles = positions[:, None] * inv_freq[None, :].float()
    want = torch.cat([angles.cos() * scale, angles.sin() * scale], dim=1).numpy()
    config = cfg.to_dict()
    got = cos_sin_cache(config, 32, served)
    np.testing.assert_allclose(got, want, atol=2e-4)


# -- GGUF files written as llama.cpp's converter writes them ------------------------------------------
def _assert_gguf_matches(llm, model):
    """Greedy tokens equal transformers', and so does each chosen token's log-probability (atol 5e-5):
    tokens alone can survive a wrong rotary on one layer of a tiny random model."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        tokens = list(out.outputs[0].token_ids)
        assert tokens == _greedy(model, prompt)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
        want = torch.log_softmax(logits.double(), -1)[torch.arange(len(tokens)), torch.tensor(tokens)].numpy()
        got = np.array([step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens)])
        np.testing.assert_allclose(got, want, atol=5e-5)


def _write_gguf(model, path):
    """convert_hf_to_gguf.py for Gemma 2/3, Granite, OLMo 2, Phi-3, SmolLM3 and GLM-4, with gguf-py's
    own tensor-name map.
    Gemma: norm weights stored as 1 + w, the tied lm_head left out, soft-caps and the window as
    metadata, Gemma 3's global rope base and linear scaling. Granite (a LlamaModel): q/k rows
    permuted into llama.cpp's rotary layout, the multipliers as `*_scale` keys. OLMo 2: as stored.
    Phi-3: fused qkv and gate/up as stored, LongRoPE's factors as tensors. SmolLM3 (a LlamaModel):
    q/k permuted, nothing about its layers without rope. GLM-4: the rotated dims."""
    import gguf

    from test_loader import llama_cpp_permute

    c = model.config
    arch = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
            "granite": gguf.MODEL_ARCH.GRANITE, "olmo2": gguf.MODEL_ARCH.OLMO2, "phi3": gguf.MODEL_ARCH.PHI3,
            "smollm3": gguf.MODEL_ARCH.SMOLLM3, "glm4": gguf.MODEL_ARCH.GLM4}[c.model_type]
    gemma = arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    add_gguf_shape(w, c, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    if arch == gguf.MODEL_ARCH.GRANITE:
        w.add_attention_scale(c.attention_multiplier)
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_logit_scale(c.logits_scaling)
    if arch == gguf.MODEL_ARCH.PHI3:  # Phi3MiniModel: rotated dims, the window (0: none), LongRoPE's factors
        rope = c.rope_parameters
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * c.hidden_size) // c.num_attention_heads)
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_sliding_window(c.sliding_window or 0)
        scale = c.max_position_embeddings / rope["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"])))
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    if arch == gguf.MODEL_ARCH.GLM4:  # Glm4Model: the rotated part of each head
        w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters.get("partial_rotary_factor", 0.5)))
    if not gemma:
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    elif arch == gguf.MODEL_ARCH.GEMMA2:
        w.add_sliding_window(c.sliding_window)
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    else:
        w.add_sliding_window(c.sliding_window)
        full = c.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    for name, value in model.state_dict().items():
        if name == "lm_head.weight" and (gemma or c.tie_word_embeddings):
            continue
        value = value.float().numpy()
        if gemma and name.endswith("norm.weight"):
            value = value + 1
        if arch in (gguf.MODEL_ARCH.GRANITE, gguf.MODEL_ARCH.SMOLLM3) and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            value = llama_cpp_permute(value, heads)
        base, suffix = name.rsplit(".", 1)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


# llama.cpp fixes what GGUF does not store: Gemma 2 alternates windowed and full layers, Gemma 3
# windows five layers of six with a local rope base of 10000, and both scale attention by
# head_dim (query_pre_attn_scalar = head_dim) below 27B. The tiny models follow those rules.
GGUF_GEMMA = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=6, attn_logit_softcapping=1.5, final_logit_softcapping=2.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
        num_hidden_layers=7, sliding_window=5,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}


@pytest.mark.parametrize("kind", list(GGUF_GEMMA))
def test_gemma_gguf_written_like_llama_cpp_gives_transformers_tokens(kind, tmp_path, leak_check):
    cfg_cls, model_cls, extra = GGUF_GEMMA[kind]
    model, _, _ = random_model(cfg_cls, model_cls, **{**dict(intermediate_size=160, num_hidden_layers=2,
                                                             vocab_size=VOCAB, pad_token_id=0,
                                                             max_position_embeddings=256), **extra})
    if kind == "gemma3":  # the default pattern: layers 0-4 windowed, 5 full, 6 windowed
        assert model.config.layer_types[4:] == ["sliding_attention", "full_attention", "sliding_attention"]
    path = _write_gguf(model, tmp_path / f"{kind}.gguf")
    _assert_gguf_matches(_llm(path, leak_check, backend="torch", dtype="float32"), model)


@pytest.mark.parametrize("kind", ["granite", "olmo2", "phi3", "smollm3", "glm4"])
def test_gguf_written_like_llama_cpp_gives_transformers_tokens(saved, kind, tmp_path, leak_check):
    model, _ = saved[kind]
    if kind == "smollm3":  # llama.cpp's fixed rule, which the file cannot state: every 4th layer without rope
        model, _, _ = random_model("SmolLM3Config", "SmolLM3ForCausalLM", hidden_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=160, num_hidden_layers=4,
                                   vocab_size=VOCAB, pad_token_id=0, max_position_embeddings=256)
        assert model.config.no_rope_layers == [1, 1, 1, 0]
    _assert_gguf_matches(_llm(_write_gguf(model, tmp_path / f"{kind}.gguf"), leak_check, backend="torch",
                              dtype="float32"), model)
