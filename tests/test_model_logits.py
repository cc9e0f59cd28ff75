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


def test_the_first_forward_after_each_kv_allocation_validates_its_calls(monkeypatch):
    """The first step after the caches are (re)allocated runs every primitive through its argument
    checks (a backend's shape mistake is named there); later steps skip them."""
    import numpy as np

    from infer import dispatch
    from infer.primitives.types import AttentionMetadata

    checked = []
    real = dispatch.CHECKS["linear"]
    monkeypatch.setitem(dispatch.CHECKS, "linear", lambda *a, **k: (checked.append(1), real(*a, **k))[1])
    _, config, weights = make_model("llama3")
    backend = get_backend("torch")
    runner = ModelRunner(lower(build_llama(config)), backend, Ops(backend), weights, "float32", 256)
    per_forward = sum(c.primitive == "linear" for c in runner.program.primitive_calls())
    meta = AttentionMetadata(np.array([0, 1], np.int32), np.array([1], np.int32), np.zeros((1, 1), np.int32),
                             np.zeros(1, np.int64), 1, 1, 16)

    def forward():
        runner.forward(backend.asarray(np.array([3])), backend.asarray(np.array([0])), backend.asarray(np.array([0])),
                       runner.prepare_metadata(meta))

    for _ in range(2):
        runner.allocate_kv_caches(num_blocks=2, block_size=16)
        checked.clear()
        forward()
        assert len(checked) == per_forward > 0
        forward()
        forward()
        assert len(checked) == per_forward


def test_vocab_parallel_embedding_view_ops_zero_the_rows_of_other_shards():
    """A tensor-parallel rank holding vocabulary rows [4, 8): its ids shifted into the shard
    (others read row 0), then the rows of ids outside it zeroed (the all_reduce sums shards)."""
    import torch

    from infer.core.lowering import Call
    from infer.core.model_runner import _bind_view

    env = {"ids": torch.tensor([0, 5, 7, 8, 4])}
    _bind_view(Call("vocab_ids", "embed", ("ids",), ("local", "valid"), attrs={"start": 4, "size": 4}))(env)
    assert env["local"].tolist() == [0, 1, 3, 0, 0] and env["valid"].tolist() == [False, True, True, False, True]
    env["rows"] = torch.arange(1.0, 6.0)[:, None].repeat(1, 3)
    _bind_view(Call("mask_rows", "embed", ("rows", "valid"), ("masked",)))(env)
    assert env["masked"].tolist() == [[0.0] * 3, [2.0] * 3, [3.0] * 3, [0.0] * 3, [5.0] * 3]
