"""Tiny random Mixtral, Qwen2-MoE and Qwen3-MoE models through graph ->
lowering -> runner, and through the engine from a saved HF directory, must
give transformers' own logits and greedy tokens on every in-tree CPU backend."""

from __future__ import annotations

import inspect
import shutil

import numpy as np
import pytest
import torch

from infer.core.llm import LLM
from infer.core.loader import CorruptCheckpointError, load_model
from infer.core.lowering import lower
from infer.core.model_runner import ModelRunner
from infer.core.models.deepseek import build_deepseek
from infer.core.models.moe import build_moe
from infer.core.sampling_params import SamplingParams
from infer.dispatch import Ops
from infer.registry import get_backend

from tiny_models import assert_logits_match_through_chunks
from tiny_moe_models import MOE_MODELS, fused_layout, make_moe_model, save_moe_model

BACKENDS = ["torch", "cpu_ref"]
VOCAB = 211


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("kind", list(MOE_MODELS))
def test_logits_match_transformers_through_prefill_chunks_and_decode(kind, backend_name):
    model, config, weights = make_moe_model(kind)
    backend = get_backend(backend_name)
    build = build_deepseek if kind.startswith("deepseek") else build_moe
    runner = ModelRunner(lower(build(config)), backend, Ops(backend), weights, "float32", 256)
    assert_logits_match_through_chunks(model, runner, backend, VOCAB)


PROMPT_LENS, NEW_TOKENS = (30, 9, 17), 32


@pytest.fixture(scope="module", params=list(MOE_MODELS))
def saved_model(request, tmp_path_factory):
    """(HF directory as transformers writes it, the transformers model,
    prompts, and per prompt transformers' greedy tokens and routing)."""
    directory = tmp_path_factory.mktemp(request.param)
    model = save_moe_model(request.param, directory)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in PROMPT_LENS]
    return directory, model, prompts, [_greedy_and_routing(model, p, NEW_TOKENS) for p in prompts]


def _greedy_and_routing(model, prompt: list[int], n: int) -> tuple[list[int], dict[int, np.ndarray]]:
    """transformers' greedy continuation of `prompt`, and how its router sent
    each token the engine runs (the prompt and all but the last new token)."""
    routed: dict[int, np.ndarray] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)  # gpt-oss: router
        if gate is None or not hasattr(gate, "top_k"):
            continue  # a dense layer

        def hook(_mod, _inp, out, i=i, num=gate.num_experts):
            routed[i] = routed.get(i, 0) + np.bincount(out[2].flatten().numpy(), minlength=num)

        hooks.append(gate.register_forward_hook(hook))
    # transformers renamed `past_key_values` to `cache` (argument and output) within 5.x.
    cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    tokens, cache, step = [], None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):  # runs the prompt, then each new token but the last
            out = model(step, use_cache=True, **{cache_name: cache})
            cache = getattr(out, cache_name)
            tokens.append(int(out.logits[0, -1].argmax()))
            step = torch.tensor([[tokens[-1]]])
    for h in hooks:
        h.remove()
    return tokens, routed


def test_loader_fuses_per_expert_tensors_into_transformers_layout(saved_model):
    directory, model, _, _ = saved_model
    loaded = load_model(directory, load_tokenizer=False)
    want = fused_layout(model.config.model_type, {k: v.numpy() for k, v in model.state_dict().items()})
    assert set(loaded.weights) == set(want)
    for name, w in want.items():
        np.testing.assert_array_equal(loaded.weights[name], w, err_msg=name)


def test_fused_expert_slices_equal_the_same_cut_of_the_fused_tensor(saved_model):
    """A tensor-parallel rank reads part of a fused expert tensor from the per-expert files:
    experts (axis 0), the fused gate/up rows (axis 1) or the input columns (axis 2)."""
    from infer.core.loader import open_checkpoint

    directory, _, _, _ = saved_model
    ckpt = open_checkpoint(directory)
    fused = [n for n in ckpt.names if n.endswith("experts.gate_up_proj")]
    assert fused
    whole = ckpt.read(fused[0])
    for axis, lo, hi in ((0, 1, 3), (1, 2, whole.shape[1] - 2), (2, 4, 12)):
        cut = (slice(None),) * axis + (slice(lo, hi),)
        np.testing.assert_array_equal(ckpt.read_slice(fused[0], axis, lo, hi), whole[cut], err_msg=f"axis {axis}")


def test_loader_reads_a_checkpoint_already_in_the_fused_layout(saved_model, tmp_path):
    from safetensors.torch import save_file

    directory, model, _, _ = saved_model
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = load_model(tmp_path, load_tokenizer=False)
    want = fused_layout(model.config.model_type, {k: v.numpy() for k, v in state.items()})
    assert set(loaded.weights) == set(want)
    for name, w in want.items():
        np.testing.assert_array_equal(loaded.weights[name], w, err_msg=name)


def test_a_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    save_moe_model("mixtral", tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CorruptCheckpointError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj"):
        load_model(tmp_path, load_tokenizer=False)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_greedy_generation_matches_transformers_in_mixed_batches(saved_model, backend_name, leak_check):
    directory, _, prompts, reference = saved_model
    # A 16-token step budget: prompts prefill in chunks while earlier ones decode.
    llm = LLM(str(directory), backend=backend_name, skip_tokenizer_init=True, max_num_batched_tokens=16,
              max_num_seqs=4, max_model_len=128, show_progress=False)
    leak_check.append(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, (tokens, _) in zip(outs, reference):
        assert list(out.outputs[0].token_ids) == tokens
    # Every token the engine ran was routed as transformers routed it.
    want = {layer: sum(routed[layer] for _, routed in reference) for layer in reference[0][1]}
    snap = llm.engine.expert_load.snapshot()
    assert snap.layers == tuple(sorted(want))
    np.testing.assert_array_equal(snap.tokens_per_expert, np.stack([want[k] for k in snap.layers]))
    assert snap.steps > NEW_TOKENS  # chunked prefill took steps of its own


def test_dense_models_have_no_expert_load(tmp_path):
    from tiny_models import make_model

    model, _, _ = make_model("qwen2")
    model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), backend="torch", skip_tokenizer_init=True, max_model_len=64, show_progress=False)
    assert llm.engine.expert_load is None


def test_gpt_oss_bfloat16_greedy_tokens_equal_transformers_in_bfloat16(tmp_path, leak_check):
    """gpt-oss in bf16 on the torch backend (attention sinks on the explicit-score path,
    biased experts with the clamped SwiGLU) against transformers computing in bf16 too."""
    model = save_moe_model("gpt_oss", tmp_path)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in PROMPT_LENS]
    bf16 = model.to(torch.bfloat16)
    want = [_greedy_and_routing(bf16, p, 12)[0] for p in prompts]
    llm = LLM(str(tmp_path), backend="torch", dtype="bfloat16", skip_tokenizer_init=True, max_num_seqs=4,
              max_model_len=128, show_progress=False)
    leak_check.append(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want


@pytest.mark.parametrize("kind", ["gpt_oss", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v2_groups",
                                  "deepseek_v3"])
def test_moe_bfloat16_tokens_are_transformers_best_in_bfloat16(kind, tmp_path, leak_check):
    """The MoE models in bf16 on the torch backend against transformers computing in bf16 too.
    On a CPU with AVX512-BF16 decode steps run each sparse layer's `moe` in one native call
    (routing, biased experts, gpt-oss's clamped SwiGLU, shared experts), gpt-oss's attention
    with its sinks and biases and DeepSeek's latent attention as fused native nodes; elsewhere
    the torch ops (sinks on the explicit-score path).

    Two bf16 computations in different orders part at near-ties, in the router's top-k too
    (torch's own ops do against transformers here: an expert flips, and that step's logits
    move by ~0.1-0.5), so transformers scores infer's tokens teacher-forced: over a model's
    48 steps, 90% must be within 0.05 of transformers' best logprob and have infer's logprob
    within 0.05 of transformers', and the medians stay under 0.02 (a wrong scale, routing
    rule or activation moves every step by more). DeepSeek's routers part most: transformers
    computes their logits in float32, infer in the model's dtype."""
    model = save_moe_model(kind, tmp_path)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in PROMPT_LENS]
    bf16 = model.to(torch.bfloat16)
    llm = LLM(str(tmp_path), backend="torch", dtype="bfloat16", skip_tokenizer_init=True, max_num_seqs=4,
              max_model_len=128, show_progress=False)
    leak_check.append(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    gaps, diffs = [], []
    for prompt, out in zip(prompts, outs):
        ids = list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = bf16(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
        want = torch.log_softmax(logits, dim=-1)
        chosen = want[torch.arange(len(ids)), torch.tensor(ids)]
        gaps.append(want.max(dim=-1).values - chosen)
        diffs.append((torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, ids)]) - chosen).abs())
    gaps, diffs = torch.cat(gaps), torch.cat(diffs)
    assert (gaps <= 0.05).float().mean() >= 0.9 and gaps.median() <= 0.02, (kind, gaps)
    assert (diffs <= 0.05).float().mean() >= 0.9 and diffs.median() <= 0.02, (kind, diffs)
