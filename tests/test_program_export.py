"""A model graph cut into pipeline stages, and its lowered program as text and as
ONNX: what another stage, a reader or another runtime sees of it."""

from __future__ import annotations

import re

import numpy as np
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


# -- the exported file runs: onnx's reference evaluator, the infer ops written here in NumPy --------
# Each op as its docstring in infer.primitives defines it; the oracle is transformers' forward.

def _infer_ops():
    from onnx.reference.op_run import OpRun

    class Op(OpRun):
        op_domain = "infer"
        op_schema = None  # not the standard op of the same name (Attention)

        def outputs(self, *values):
            return values[:len(self.onnx_node.output)]

    class Embedding(Op):
        def _run(self, ids, table):
            return (table[ids],)

    class Linear(Op):
        def _run(self, x, w, b=None):
            return ((x @ w.T + (0 if b is None else b)).astype(np.float32),)

    class RmsNorm(Op):
        def _run(self, x, *rest, eps=None):
            *residual, w = rest
            x = x + residual[0] if residual else x
            normed = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * w
            return self.outputs(normed.astype(np.float32), x)

    class ActAndMul(Op):
        def _run(self, x, kind=None):
            assert kind == "silu"
            gate, up = np.split(x, 2, axis=-1)
            return ((gate / (1 + np.exp(-gate)) * up).astype(np.float32),)

    class Rotary(Op):
        def _run(self, q, k, positions, cache, neox_style=None, rotary_dim=None):
            assert neox_style
            half = rotary_dim // 2
            cos, sin = cache[positions, :half][:, None, :], cache[positions, half:][:, None, :]

            def rotate(x):
                x = x.copy()
                a, b = x[..., :half].copy(), x[..., half:rotary_dim].copy()
                x[..., :half], x[..., half:rotary_dim] = a * cos - b * sin, b * cos + a * sin
                return x

            return rotate(q), rotate(k)

    class KvWrite(Op):
        def _run(self, k, v, cache, slots):
            cache = cache.copy()
            flat = cache.reshape(2, -1, *cache.shape[3:])
            flat[0, slots], flat[1, slots] = k, v
            return (cache,)

    class Attention(Op):
        def _run(self, q, cache, qsl, seq_lens, block_table, slots, scale=None):
            out = np.zeros_like(q)
            bs, group = cache.shape[2], q.shape[1] // cache.shape[3]
            for b in range(len(seq_lens)):
                rows, n = slice(qsl[b], qsl[b + 1]), int(seq_lens[b])
                pos = np.arange(n)
                keys = cache[:, block_table[b][pos // bs], pos % bs]  # [2, n, hk, d]
                k, v = np.repeat(keys[0], group, axis=1), np.repeat(keys[1], group, axis=1)
                scores = np.einsum("thd,shd->hts", q[rows], k) * scale
                q_pos = n - (qsl[b + 1] - qsl[b]) + np.arange(qsl[b + 1] - qsl[b])
                scores = np.where(pos[None, None, :] <= q_pos[None, :, None], scores, -np.inf)
                p = np.exp(scores - scores.max(-1, keepdims=True))
                out[rows] = np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), v)
            return (out,)

    return [Embedding, Linear, RmsNorm, ActAndMul, Rotary, KvWrite, Attention]


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "granite", "olmo2"])  # granite: Mul nodes; olmo2: Add nodes
def test_the_exported_model_computes_transformers_logits(kind):
    """Split/Reshape/Gather run as ONNX defines them, the infer ops as NumPy here: the file's wiring
    (which value feeds which op, split axis, reshapes, versions of the KV cache) gives the model."""
    import torch
    from onnx.reference import ReferenceEvaluator

    from infer.core.rope import cos_sin_cache

    model, config, weights = make_model(kind)
    program = lower(build_llama(config))
    cfg, bs = program.graph.config, 16
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 21)
    t = len(ids)
    feeds = {"input_ids": ids, "positions": np.arange(t), "sample_rows": np.arange(t),
             "query_start_loc": np.array([0, t]), "seq_lens": np.array([t]), "block_table": np.array([[2, 0]]),
             "slot_mapping": np.concatenate([2 * bs + np.arange(bs), np.arange(t - bs)])}
    feeds |= {p.name: np.concatenate([weights[s] for s in p.sources]).astype(np.float32)
              for p in program.graph.params.values()}
    feeds |= {f"kv_cache.{i}": np.zeros((2, 3, bs, cfg.num_kv_heads, cfg.head_dim), np.float32)
              for i in range(program.graph.num_layers)}
    feeds[f"cos_sin_cache.{cfg.rotary_dim}"] = cos_sin_cache(config, cfg.rotary_dim, 64)
    feeds = {k: v.astype(np.int64) if v.dtype.kind == "i" else v for k, v in feeds.items()}
    (logits,) = ReferenceEvaluator(to_onnx(program, block_size=bs), new_ops=_infer_ops()).run(None, feeds)
    with torch.no_grad():
        want = model(torch.from_numpy(ids)[None]).logits[0].numpy()
    np.testing.assert_allclose(logits, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3", "mistral", "gemma2", "granite", "olmo2"])
def test_each_calls_symbolic_shapes_agree_with_its_parameters_and_inputs(kind):
    """The shapes the program text prints: a linear's output is [T, its weight's rows], a split's
    pieces add up to its input, a reshape keeps the element count (with T = 7 tokens, S = 3 sampled)."""
    program = lower(build_llama(make_model(kind)[1]))
    shapes, params = {}, program.graph.params

    def size(shape):
        return int(np.prod([7 if d == "T" else 3 if d == "S" else 7 * int(d[2:]) if str(d).startswith("T*") else d
                            for d in shape]))

    for c in program.primitive_calls():
        shapes.update(zip(c.outputs, c.shapes))
        if c.primitive == "linear":
            rows = shapes[c.inputs[0]][0] if c.inputs[0] in shapes else "T"  # "S" after the sampled rows
            assert c.shapes == ((rows, params[c.params["weight"]].shape[0]),), c
        elif c.primitive == "split":
            assert ("T", sum(s[1] for s in c.shapes)) == shapes[c.inputs[0]] and \
                [s[1] for s in c.shapes] == list(c.attrs["sizes"]), c
        elif c.primitive in ("reshape", "scale", "soft_cap"):
            assert size(c.shapes[0]) == size(shapes[c.inputs[0]]), c


def test_the_infer_domain_is_at_version_1_over_onnx_opset_21(qwen2):
    assert {(o.domain, o.version) for o in to_onnx(qwen2).opset_import} == {("", 21), ("infer", 1)}


def test_gemma_exports_a_rope_table_per_variant_and_its_soft_caps():
    """Gemma 3's local layers read their own cos/sin input; Gemma 2's final soft-cap is Div, Tanh, Mul."""
    g3 = to_onnx(lower(build_llama(make_model("gemma3")[1])))
    tables = sorted(i.name for i in g3.graph.input if i.name.startswith("cos_sin_cache"))
    assert tables == ["cos_sin_cache.32", "cos_sin_cache.32.sliding_attention"]
    rotary = [n for n in g3.graph.node if n.op_type == "Rotary"]
    assert [n.input[3] for n in rotary] == ["cos_sin_cache.32.sliding_attention", "cos_sin_cache.32"]
    g2 = to_onnx(lower(build_llama(make_model("gemma2")[1])))
    ops = [n.op_type for n in g2.graph.node]
    assert ops[-3:] == ["Div", "Tanh", "Mul"] and ops.count("Mul") == 2  # the embedding scale and the cap
