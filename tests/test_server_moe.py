"""An MoE model behind `infer serve`: its expert load reaches /metrics."""

from __future__ import annotations

import pytest
import torch
import transformers

from server_harness import Server, make_tokenizer

TOP_K, EXPERTS, LAYERS = 2, 4, 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    tok = make_tokenizer()
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=48,
                                     num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                     num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                     max_position_embeddings=256, eos_token_id=tok.eos_token_id)
    model = transformers.MixtralForCausalLM(cfg).eval()
    for p in model.parameters():  # a router far from uniform, so experts get different loads
        p.data.normal_(0, 0.2)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    srv = Server(["--model", str(path), "--served-model-name", "moe", "--backend", "torch",
                  "--kv-cache-memory", str(1 << 22)])
    yield srv
    assert srv.stop() == 0


def expert_series(samples: dict[str, float], family: str) -> dict[tuple[str, ...], float]:
    """{label values after model_name: value} of one family for model 'moe'."""
    out = {}
    for key, value in samples.items():
        name, _, labels = key.partition("{")
        if name == family and 'model_name="moe"' in labels:
            pairs = dict(p.split("=", 1) for p in labels.rstrip("}").split(","))
            out[tuple(v.strip('"') for k, v in sorted(pairs.items()) if k != "model_name")] = value
    return out


def test_every_token_the_model_ran_is_counted_top_k_times_per_layer(server):
    prompts = [[5, 17, 42, 99, 7], [3, 3, 3], list(range(20, 40))]
    max_tokens = 6
    with server.client() as c:
        for ids in prompts:
            r = c.post("/v1/completions", json={"model": "moe", "prompt": ids, "max_tokens": max_tokens,
                                                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == max_tokens
    samples = server.metrics()
    tokens = expert_series(samples, "infer:moe_expert_tokens_total")
    # Each request runs its prompt and every generated token but the last through the model.
    ran = sum(len(ids) + max_tokens - 1 for ids in prompts)
    for layer in range(LAYERS):
        per_expert = [tokens.get((str(e), str(layer)), 0.0) for e in range(EXPERTS)]
        assert sum(per_expert) == ran * TOP_K, (layer, per_expert)
    imbalance = expert_series(samples, "infer:moe_expert_imbalance")
    for layer in range(LAYERS):
        counts = [tokens.get((str(e), str(layer)), 0.0) for e in range(EXPERTS)]
        assert imbalance[(str(layer),)] == pytest.approx(max(counts) / (sum(counts) / EXPERTS))

