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
