"""A model graph cut into pipeline stages, and its lowered program as text and as
ONNX: what another stage, a reader or another runtime sees of it."""

from __future__ import annotations

import re

import pytest
from tiny_models import make_model

from infer.core.lowering import lower
from infer.core.models.llama import build_llama
from infer.core.onnx_export import to_onnx


@pytest.fixture(scope="module")
def qwen2():
    """qkv projections with a bias: linear calls with two parameters."""
    return lower(build_llama(make_model("qwen2")[1]))


def test_values_are_named_once_each_first_plainly_then_name_dot_version(qwen2):
    model = to_onnx(qwen2)
    assert [o.name for o in model.graph.output] == ["logits"]  # written once: no version suffix
    written = [name for node in model.graph.node for name in node.output]
    assert len(written) == len(set(written))
    assert not [name for name in written if re.search(r"\.(0|-\d+)$", name)]
    assert "kv_cache.0.1" in written  # the cache input is kv_cache.0; the first kv_write makes version 1


def test_a_node_takes_its_weight_before_its_other_parameters(qwen2):
    model = to_onnx(qwen2)
    with_bias = [c for c in qwen2.primitive_calls() if c.primitive == "linear" and "bias" in c.params]
    assert with_bias
    nodes = {n.name: n for n in model.graph.node}
    for c in with_bias:
        node = next(n for name, n in nodes.items() if name.startswith(f"{c.node}/"))
        assert list(node.input[-2:]) == [c.params["weight"], c.params["bias"]], node.name


def test_program_text_shows_each_calls_set_attributes_only(qwen2):
    text = qwen2.format()
    lines = text.splitlines()[1:]
    assert len(lines) == len(qwen2.calls)
    assert any("rms_norm(" in line and "eps=" in line for line in lines)
    assert "=None" not in text


@pytest.mark.parametrize("first, end", [(1, 1), (1, 0), (-1, 1), (0, 99)])
def test_a_pipeline_stage_must_hold_at_least_one_layer_of_the_model(first, end):
    graph = build_llama(make_model("qwen2")[1])
    with pytest.raises(ValueError, match="outside 0.."):
        graph.stage(first, end)
