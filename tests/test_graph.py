"""Graph building, lowering, pipeline stages, ONNX export and rope tables."""

from __future__ import annotations

import math

import numpy as np
import pytest

from infer.core.graph import Graph
from infer.core.lowering import lower
from infer.core.models.llama import build_llama
from infer.core.onnx_export import to_onnx
from infer.core.rope import inv_frequencies, rope_parameters
from infer.primitives import PRIMITIVES

from tiny_models import make_model


@pytest.fixture(scope="module")
def qwen3():
    return build_llama(make_model("qwen3")[1])


def test_lowered_program_uses_only_primitives_and_view_ops(qwen3):
    prog = lower(qwen3)
    assert {c.primitive for c in prog.calls} <= set(PRIMITIVES) | {"split", "reshape", "rows"}
    # One kv_write and one attention per layer, reading that layer's cache.
    assert [c.layer for c in prog.calls if c.primitive == "attention"] == [0, 1]


def test_a_backend_that_fuses_a_node_gets_one_call_for_it(qwen3):
    prog = lower(qwen3, fuses=lambda op, attrs: op == "mlp")
    assert [c.primitive for c in prog.calls].count("fused_mlp") == 2
    assert "act_and_mul" not in {c.primitive for c in prog.calls}
    # Each fused call keeps the primitives it stands for (what runs when the backend declines a step).
    fused = next(c for c in prog.calls if c.primitive == "fused_mlp")
    assert [e.primitive for e in fused.expansion] == ["linear", "act_and_mul", "linear"]
    unfused = lower(qwen3)
    assert [(c.primitive, c.inputs, c.outputs) for c in prog.primitive_calls()] == \
        [(c.primitive, c.inputs, c.outputs) for c in unfused.calls]


def test_params_say_how_they_shard_for_tensor_parallelism(qwen3):
    p = qwen3.params
    assert p["layers.0.qkv_proj"].shard == "column" and p["layers.0.qkv_proj"].parts == (320, 64, 64)
    assert p["layers.0.o_proj"].shard == "row" and p["layers.0.down_proj"].shard == "row"
    assert p["embed_tokens"].shard == "vocab"


def test_pipeline_stages_split_by_layer(qwen3):
    first, last = qwen3.stage(0, 1), qwen3.stage(1, 2)
    assert first.nodes[0].op == "embedding" and all(n.layer == 0 for n in first.nodes[1:])
    assert last.nodes[-1].op == "lm_head" and "embed_tokens" not in last.params
    assert len(first.nodes) + len(last.nodes) == len(qwen3.nodes)
    with pytest.raises(ValueError, match="outside"):
        qwen3.stage(1, 3)


def test_onnx_export_passes_the_checker_with_infer_domain_ops(qwen3):
    model = to_onnx(lower(qwen3))
    domains = {n.domain for n in model.graph.node}
    assert domains == {"infer", ""}
    assert {n.op_type for n in model.graph.node if n.domain == "infer"} >= {"Attention", "KvWrite", "Linear", "Rotary"}


def test_unknown_node_kinds_are_refused():
    g = Graph("X", None)
    with pytest.raises(ValueError, match="unknown op"):
        g.add("convolution", "c", ["a"], ["b"])


def test_a_node_kind_without_a_lowering_is_refused(monkeypatch):
    """A kind added to the graph vocabulary before its lowering is not silently dropped."""
    from infer.core import graph as graph_module
    from infer.core.lowering import lower

    monkeypatch.setitem(graph_module.NODE_KINDS, "convolution", ())
    g = Graph("X", None)
    g.add("convolution", "c", ["a"], ["b"])
    with pytest.raises(ValueError, match="no lowering for 'convolution' and the backend does not fuse it"):
        lower(g)


@pytest.mark.parametrize("params", [
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    # the first frequency's wavelength (2 pi) is exactly old length / low_freq_factor: on the boundary
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 4096 / math.pi,
     "high_freq_factor": 4 * 4096 / math.pi, "original_max_position_embeddings": 8192},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 2048},
    {"rope_type": "default", "rope_theta": 1000000.0},
])
def test_rope_frequencies_match_transformers(params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=8192, rope_parameters=params)
    kind = params["rope_type"]
    if kind == "default":
        expect, factor = 1.0 / 1e6 ** (np.arange(0, 64, 2) / 64), 1.0
    else:
        inv, factor = ROPE_INIT_FUNCTIONS[kind](cfg, None)
        expect = inv.numpy()
    d = cfg.to_dict()
    ours, our_factor = inv_frequencies(rope_parameters(d), 64, d["max_position_embeddings"])
    np.testing.assert_allclose(ours, expect, rtol=1e-6)
    assert our_factor == pytest.approx(factor)


def test_old_style_rope_scaling_is_read():
    p = rope_parameters({"rope_theta": 5.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert p["rope_type"] == "linear" and p["rope_theta"] == 5.0
    with pytest.raises(ValueError, match="not supported"):
        rope_parameters({"rope_scaling": {"rope_type": "su"}})
