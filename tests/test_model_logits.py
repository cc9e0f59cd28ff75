"""Tiny random transformers models run through graph -> lowering -> runner must
give transformers' own logits, on every in-tree CPU backend."""

from __future__ import annotations

import pytest

from infer.core.lowering import lower
from infer.core.model_runner import ModelRunner
from infer.core.models.llama import build_llama
from infer.dispatch import Ops
from infer.registry import get_backend

from tiny_models import MODELS, assert_logits_match_through_chunks, make_model


@pytest.mark.parametrize("backend_name", ["torch", "cpu_ref"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_logits_match_transformers_through_prefill_chunks_and_decode(kind, backend_name):
    model, config, weights = make_model(kind)
    backend = get_backend(backend_name)
    runner = ModelRunner(lower(build_llama(config)), backend, Ops(backend), weights, "float32", 256)
    assert_logits_match_through_chunks(model, runner, backend, config["vocab_size"])
