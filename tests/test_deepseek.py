"""DeepSeek V2/V3 beyond what the MoE suite checks for every MoE model (logits,
greedy tokens and routing against transformers, TP=2 in test_distributed): the
latent cache's size, and what is refused."""

from __future__ import annotations

import pytest
from tiny_moe_models import MOE_MODELS, save_moe_model

from infer.core.llm import LLM


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek-v3")
    save_moe_model("deepseek_v3", path)
    return str(path)


def test_the_cache_holds_one_latent_per_token_not_keys_and_values_per_head(v3_dir, leak_check):
    llm = LLM(v3_dir, skip_tokenizer_init=True, backend="torch", dtype="float32", max_model_len=128)
    leak_check.append(llm.engine)
    c = MOE_MODELS["deepseek_v3"][2]
    layers, heads = c["num_hidden_layers"], c["num_attention_heads"]
    latent = c["kv_lora_rank"] + c["qk_rope_head_dim"]
    per_token = llm.engine.worker.runner.kv_cache_bytes_per_block(1)
    assert per_token == 4 * latent * layers  # float32: 160 bytes a layer
    mha = 4 * heads * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"]) * layers
    assert mha / per_token == pytest.approx(4 * (16 + 8 + 12) / 40)
    assert llm.engine.worker.runner.kv_caches[0].shape[-2:] == (1, latent // 2)


def test_an_fp8_cache_and_an_uneven_head_split_are_refused_with_the_reason(v3_dir):
    with pytest.raises(ValueError, match="caches latents .* no fp8 form"):
        LLM(v3_dir, skip_tokenizer_init=True, backend="torch", dtype="float32", max_model_len=128,
            kv_cache_dtype="fp8")
    from infer.core.models.deepseek import build_deepseek
    from infer.core.parallel import shard_graph
    import json
    import pathlib

    config = json.loads((pathlib.Path(v3_dir) / "config.json").read_text())
    with pytest.raises(ValueError, match="splits its 4 heads evenly over the ranks; tensor_parallel_size=3"):
        shard_graph(build_deepseek(config), 0, 3)


def test_an_unknown_routing_method_is_named(v3_dir):
    import json
    import pathlib

    from infer.core.models.deepseek import build_deepseek

    config = json.loads((pathlib.Path(v3_dir) / "config.json").read_text())
    with pytest.raises(ValueError, match="routing 'weird' is not supported"):
        build_deepseek({**config, "topk_method": "weird"})


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_latent_attention_as_one_native_call_gives_what_its_primitives_give(kind, tmp_path, monkeypatch, leak_check):
    """bf16 decode steps (on a CPU with AVX512-BF16): the torch backend's fused latent
    attention node (q LoRA or not, the latent written and read in place, absorbed per head)
    gives its primitives' tokens, and log-probabilities within bf16 rounding; prompts past
    its row limit run the primitives."""
    from collections import Counter

    from infer.backends.torch_native import TorchBackend, fused, native
    from infer.core.sampling_params import SamplingParams
    from infer.primitives.backend import Support

    if native.library() is None or not native.bf16_dot():
        pytest.skip(f"no AVX512-BF16 native kernels here ({native.status()}): the primitives serve bf16")
    save_moe_model(kind, tmp_path)
    # 50 prefill rows (the kernel's: causal within each request), then a prompt past its 64 rows
    prompts = [{"prompt_token_ids": [5, 17, 99, 3]}, {"prompt_token_ids": [42] * 9},
               {"prompt_token_ids": list(range(3, 40))}]
    long_prompt = [{"prompt_token_ids": list(range(100, 170))}]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    served = Counter()
    real = fused.native.mla_block

    def counted(*a):
        out = real(*a)
        served.update(["served" if out is not None else "declined"])
        return out

    def generate():
        llm = LLM(str(tmp_path), backend="torch", dtype="bfloat16", skip_tokenizer_init=True, max_num_seqs=3)
        leak_check.append(llm.engine)
        outs = llm.generate(prompts, params, use_tqdm=False) + llm.generate(long_prompt, params, use_tqdm=False)
        calls = {c.primitive for c in llm.engine.worker.runner.program.calls}
        return calls, [(o.outputs[0].token_ids, [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
                       for o in outs]

    monkeypatch.setattr(fused.native, "mla_block", counted)
    calls, got = generate()
    assert "fused_mla_attention" in calls and "mla_attention" not in calls
    # 3 layers x (one prefill and 7 decode steps of the three, 7 decode steps of the long one); its
    # 70-row prefill ran the primitives
    assert served == {"served": 3 * (8 + 7)}, served
    monkeypatch.setattr(TorchBackend, "fuses", lambda self, op, **attrs: Support(False, "off for this test"))
    calls, want = generate()
    assert "fused_mla_attention" not in calls
    for (got_ids, got_lp), (want_ids, want_lp) in zip(got, want):
        assert got_ids == want_ids
        assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) <= 0.05
