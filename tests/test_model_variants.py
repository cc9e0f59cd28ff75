"""Llama options the tiny model zoo leaves off, through graph -> lowering ->
runner against transformers' logits: MLP biases, attention biases."""

from __future__ import annotations

import pytest
from tiny_models import assert_logits_match_through_chunks, random_model

from infer.core.lowering import lower
from infer.core.model_runner import ModelRunner
from infer.core.models.llama import build_llama
from infer.dispatch import Ops
from infer.registry import get_backend


@pytest.mark.parametrize("bias", [dict(mlp_bias=True), dict(attention_bias=True)], ids=["mlp_bias", "attention_bias"])
def test_llama_with_biases_gives_transformers_logits(bias):
    model, config, weights = random_model("LlamaConfig", "LlamaForCausalLM", hidden_size=64, num_attention_heads=2,
                                          num_key_value_heads=1, intermediate_size=96, num_hidden_layers=1,
                                          vocab_size=97, max_position_embeddings=128, **bias)
    backend = get_backend("torch")
    runner = ModelRunner(lower(build_llama(config)), backend, Ops(backend), weights, "float32", 128)
    assert_logits_match_through_chunks(model, runner, backend, config["vocab_size"])
