"""Lowering: graph nodes -> a flat program of meta-primitive calls.

Each node expands into primitives unless the backend says it runs the whole
node itself (`Backend.fuses`), in which case one ``fused_<op>`` call stands
for it. Besides the primitives, the program uses view ops every tensor type
has (``split`` columns, ``reshape``, ``rows`` = integer row gather); they move
no arithmetic and map to standard ONNX ops. A tensor-parallel rank adds two
more made of elementwise tensor operators every tensor type has, the id range
check of a vocabulary shard (``vocab_ids``: local ids and a mask; ``mask_rows``:
zero the masked rows), exported as ops of the ``infer`` domain. The graph's
elementwise nodes (`ELEMENTWISE_OPS`) are of that kind too: ``add`` (a + b),
``scale`` (x times a constant; with ``rounded``, the constant rounded to the
model dtype first, as Gemma multiplies) and
``soft_cap`` (``cap * tanh(x / cap)``, in x's dtype), exported as ONNX's Add,
Mul and Div/Tanh/Mul.

On a tensor-parallel graph (`core/parallel.py`) every node in `Graph.partial`
is followed by an ``all_reduce`` over the ``tp`` group, and lm_head's logits
by an ``all_gather`` along the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .graph import Graph, Node

ELEMENTWISE_OPS = ("add", "scale", "soft_cap")
VIEW_OPS = ("split", "reshape", "rows", "merge_rows", "vocab_ids", "mask_rows") + ELEMENTWISE_OPS
TP_GROUP = "tp"  # the process group collectives of a tensor-parallel graph run on


@dataclass(slots=True)
class Call:
    primitive: str  # a meta-primitive, a view op, or "fused_<node op>"
    node: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: dict[str, str] = field(default_factory=dict)  # role -> graph Param name
    attrs: dict[str, Any] = field(default_factory=dict)
    shapes: tuple[tuple, ...] = ()  # symbolic output shapes ("T" = flattened tokens)
    layer: int | None = None
    # A fused call: the primitive calls it stands for (what runs when the backend declines a step).
    expansion: tuple["Call", ...] = ()


@dataclass
class Program:
    graph: Graph
    calls: list[Call]

    def primitive_calls(self) -> list[Call]:
        """The calls with each fused call replaced by the primitives it stands for."""
        return [e for c in self.calls for e in (c.expansion or (c,))]

    def dead_after(self, outputs: tuple[str, ...] = ("logits",)) -> list[tuple[str, ...]]:
        """For each call, the values no later call reads: freeing them as soon
        as they die keeps one layer's temporaries alive, not every layer's."""
        live, dead = set(outputs), [()] * len(self.calls)
        for i in range(len(self.calls) - 1, -1, -1):
            c = self.calls[i]
            writes, reads = set(c.outputs), set(c.inputs)
            dead[i] = tuple(sorted((writes | reads) - live))
            live = (live - writes) | reads
        return dead

    def format(self) -> str:
        """The program as text: one call per line, with output shapes."""
        lines = [f"# {self.graph.architecture}: {len(self.calls)} calls, {self.graph.num_layers} layers"]
        for c in self.calls:
            outs = ", ".join(f"%{o}: [{', '.join(map(str, s))}]" for o, s in zip(c.outputs, c.shapes))
            args = [f"%{i}" for i in c.inputs]
            args += [f"{role}={name}{list(self.graph.params[name].shape)}" for role, name in c.params.items()]
            args += [f"{k}={v}" for k, v in c.attrs.items() if v is not None]
            lines.append(f"{outs} = {c.primitive}({', '.join(args)})")
        return "\n".join(lines)


def lower(graph: Graph, fuses=lambda op, attrs: False) -> Program:
    """Expand `graph`; `fuses(op, attrs)` says whether the backend runs a node whole."""
    calls: list[Call] = []
    for node in graph.nodes:
        # Latent attention is its own fused node (a backend's fused attention knows only per-head K and V).
        op = "mla_attention" if node.op == "attention" and node.attrs.get("mla") else node.op
        # A node with LoRA adapters runs as primitives.
        if fuses(op, node.attrs) and not any(r.endswith("_lora_a") for r in node.params):
            shape = _node_output_shape(graph, node)
            expansion = tuple(_EXPANSIONS[node.op](graph, node)) if node.op in _EXPANSIONS else ()
            calls.append(Call(f"fused_{op}", node.name, node.inputs, node.outputs, node.params, node.attrs,
                              (shape,) * len(node.outputs), node.layer, expansion))
        elif node.op in _EXPANSIONS:
            calls.extend(_EXPANSIONS[node.op](graph, node))
        elif node.op in ELEMENTWISE_OPS:
            cfg = graph.config
            shape = ("S", cfg.vocab_size) if node.inputs[0] == "logits" else ("T", cfg.hidden_size)
            calls.append(Call(node.op, node.name, node.inputs, node.outputs, {}, dict(node.attrs), (shape,), node.layer))
        else:
            raise ValueError(f"node {node.name}: no lowering for {node.op!r} and the backend does not fuse it")
        if node.name in graph.partial:
            calls.append(Call("all_reduce", node.name, node.outputs[:1], node.outputs[:1], {}, {"group": TP_GROUP},
                              (("T", graph.config.hidden_size),), node.layer))
    return Program(graph, calls)


def _layer_norm(g: Graph, n: Node) -> list[Call]:
    shape = ("T", g.params[n.params["weight"]].shape[0])
    return [Call("layer_norm", n.name, n.inputs, n.outputs, n.params, {"eps": n.attrs["eps"]},
                 (shape,) * len(n.outputs), n.layer)]


def _encoder_attention(g: Graph, n: Node) -> list[Call]:
    """q, k, v from one projection, attention within each sequence (no cache), the output projection."""
    a, p, name, L = n.attrs, n.params, n.name, n.layer
    hq, hk, d = a["num_heads"], a["num_kv_heads"], a["head_dim"]
    v = f"{name}."
    calls = [
        Call("linear", name, n.inputs[:1], (v + "qkv",), _pick(p, weight="qkv_proj", bias="qkv_bias"), {},
             (("T", (hq + 2 * hk) * d),), L),
        Call("split", name, (v + "qkv",), (v + "q", v + "k", v + "v"), {}, {"sizes": (hq * d, hk * d, hk * d)},
             (("T", hq * d), ("T", hk * d), ("T", hk * d)), L),
    ]
    for t, heads in (("q", hq), ("k", hk), ("v", hk)):
        calls.append(Call("reshape", name, (v + t,), (v + t + "3",), {}, {"shape": (-1, heads, d)}, (("T", heads, d),), L))
    return calls + [
        Call("encoder_attention", name, (v + "q3", v + "k3", v + "v3"), (v + "o3",), {}, {"scale": a["scale"]},
             (("T", hq, d),), L),
        Call("reshape", name, (v + "o3",), (v + "o",), {}, {"shape": (-1, hq * d)}, (("T", hq * d),), L),
        Call("linear", name, (v + "o",), n.outputs, _pick(p, weight="o_proj", bias="o_bias"), {},
             (("T", g.config.hidden_size),), L),
    ]


def _ffn(g: Graph, n: Node) -> list[Call]:
    p, name, L = n.params, n.name, n.layer
    inter = g.params[p["up_proj"]].shape[0]
    return [
        Call("linear", name, n.inputs, (name + ".up",), _pick(p, weight="up_proj", bias="up_bias"), {},
             (("T", inter),), L),
        Call("activation", name, (name + ".up",), (name + ".act",), {}, {"kind": n.attrs["act"]}, (("T", inter),), L),
        Call("linear", name, (name + ".act",), n.outputs, _pick(p, weight="down_proj", bias="down_bias"), {},
             (("T", g.config.hidden_size),), L),
    ]


def _pool(g: Graph, n: Node) -> list[Call]:
    rows = "T" if n.attrs["method"] == "all" else "B"
    return [Call("pool", n.name, n.inputs, n.outputs, {}, {"method": n.attrs["method"]},
                 ((rows, g.config.hidden_size),), n.layer)]


def _classifier(g: Graph, n: Node) -> list[Call]:
    """A sequence classifier's head on pooled rows: an optional dense layer and activation, then the scores."""
    p, name = n.params, n.name
    x, calls = n.inputs[0], []
    if "dense" in p:
        width = g.params[p["dense"]].shape[0]
        calls += [Call("linear", name, (x,), (name + ".dense",), _pick(p, weight="dense", bias="dense_bias"), {},
                       (("B", width),), n.layer),
                  Call("activation", name, (name + ".dense",), (name + ".act",), {}, {"kind": n.attrs["act"]},
                       (("B", width),), n.layer)]
        x = name + ".act"
    labels = g.params[p["out_proj"]].shape[0]
    return calls + [Call("linear", name, (x,), n.outputs, _pick(p, weight="out_proj", bias="out_bias"), {},
                         (("B", labels),), n.layer)]


def _node_output_shape(graph: Graph, node: Node) -> tuple:
    cfg = graph.config
    return ("S", cfg.vocab_size) if node.op == "lm_head" else ("T", cfg.hidden_size)


def _embedding(g: Graph, n: Node) -> list[Call]:
    shape = (("T", g.config.hidden_size),)
    if g.tp_size == 1:
        return [Call("embedding", n.name, n.inputs, n.outputs, n.params, {}, shape, n.layer)]
    # A vocabulary shard: ids outside this rank's rows look up row 0 and come out as zero rows.
    rows = g.params[n.params["table"]].shape[0]
    ids, valid, looked_up = n.name + ".local_ids", n.name + ".valid", n.name + ".rows"
    return [
        Call("vocab_ids", n.name, n.inputs, (ids, valid), {}, {"start": g.tp_rank * rows, "size": rows},
             (("T",), ("T",)), n.layer),
        Call("embedding", n.name, (ids,), (looked_up,), n.params, {}, shape, n.layer),
        Call("mask_rows", n.name, (looked_up, valid), n.outputs, {}, {}, shape, n.layer),
    ]


def _rms_norm(g: Graph, n: Node) -> list[Call]:
    shape = ("T", g.params[n.params["weight"]].shape[0])
    return [Call("rms_norm", n.name, n.inputs, n.outputs, n.params, {"eps": n.attrs["eps"]},
                 (shape,) * len(n.outputs), n.layer)]


def _attention(g: Graph, n: Node) -> list[Call]:
    if n.attrs.get("mla"):
        return _mla_attention(g, n)
    a, p, name, L = n.attrs, n.params, n.name, n.layer
    hq, hk, d = a["num_heads"], a["num_kv_heads"], a["head_dim"]
    x, positions = n.inputs
    v = f"{name}."  # value-name prefix keeps each layer's temporaries apart
    calls = [
        Call("linear", name, (x,), (v + "qkv",), _pick(p, weight="qkv_proj", bias="qkv_bias"), {},
             (("T", (hq + 2 * hk) * d),), L),
        *_lora(n, "qkv", x, v + "qkv", (hq + 2 * hk) * d),
        Call("split", name, (v + "qkv",), (v + "q", v + "k", v + "v"), {}, {"sizes": (hq * d, hk * d, hk * d)},
             (("T", hq * d), ("T", hk * d), ("T", hk * d)), L),
    ]
    whole = "q_norm" in p and a.get("qk_norm") == "whole"
    if whole:
        # OLMo 2 normalises q and k over the whole projection (all heads) before rotary;
        # under tensor parallelism each rank gathers the ranks' heads (an even split,
        # checked by `parallel.shard_graph`), normalises them whole and keeps its own.
        for t, heads in (("q", hq), ("k", hk)):
            width, src, out = heads * d, v + t, v + t + "n"
            full = width * g.tp_size
            if g.tp_size > 1:
                calls.append(Call("all_gather", name, (src,), (v + t + "g",), {}, {"dim": -1, "group": TP_GROUP},
                                  (("T", full),), L))
                src, out = v + t + "g", v + t + "gn"
            calls.append(Call("rms_norm", name, (src,), (out,), {"weight": p[f"{t}_norm"]}, {"eps": a["eps"]},
                              (("T", full),), L))
            if g.tp_size > 1:
                lo = g.tp_rank * width
                calls.append(Call("split", name, (out,), (v + t + ".before", v + t + "n", v + t + ".after"), {},
                                  {"sizes": (lo, width, full - lo - width)},
                                  (("T", lo), ("T", width), ("T", full - lo - width)), L))
    for t, heads in (("q", hq), ("k", hk), ("v", hk)):
        src = v + t + ("n" if whole and t != "v" else "")
        calls.append(Call("reshape", name, (src,), (v + t + "3",), {}, {"shape": (-1, heads, d)}, (("T", heads, d),), L))
    if "q_norm" in p and not whole:
        # Qwen3 and Gemma 3 normalise each head's q and k over head_dim before rotary.
        for t, heads in (("q", hq), ("k", hk)):
            calls += [
                Call("reshape", name, (v + t + "3",), (v + t + "2",), {}, {"shape": (-1, d)}, ((f"T*{heads}", d),), L),
                Call("rms_norm", name, (v + t + "2",), (v + t + "n",), {"weight": p[f"{t}_norm"]}, {"eps": a["eps"]},
                     ((f"T*{heads}", d),), L),
                Call("reshape", name, (v + t + "n",), (v + t + "3",), {}, {"shape": (-1, heads, d)}, (("T", heads, d),), L),
            ]
    if a["rotary_dim"]:  # SmolLM3's layers without rope have none
        calls.append(Call("rotary", name, (v + "q3", v + "k3", positions), (v + "q3", v + "k3"), {},
                          {"rotary_dim": a["rotary_dim"], "neox_style": a["neox_style"]}, (("T", hq, d), ("T", hk, d)), L))
    calls += [
        Call("kv_write", name, (v + "k3", v + "v3"), (), {}, {}, (), L),
        Call("attention", name, (v + "q3",), (v + "o3",), _pick(p, sinks="sinks"),
             {"scale": a["scale"], "sliding_window": a["sliding_window"], "soft_cap": a["soft_cap"]}, (("T", hq, d),), L),
        Call("reshape", name, (v + "o3",), (v + "o",), {}, {"shape": (-1, hq * d)}, (("T", hq * d),), L),
        Call("linear", name, (v + "o",), n.outputs, _pick(p, weight="o_proj", bias="o_bias"), {},
             (("T", g.config.hidden_size),), L),
        *_lora(n, "o", v + "o", n.outputs[0], g.config.hidden_size),
    ]
    return calls


def _mla_attention(g: Graph, n: Node) -> list[Call]:
    """DeepSeek's latent attention (`models/deepseek.py`): queries per head, the latent
    and rope key of each token, rope on the rope parts, then the latent is cached and
    attended (`mla_kv_write`, `mla_attention`)."""
    a, p, name, L = n.attrs, n.params, n.name, n.layer
    h, nope, rope, r, vd = a["num_heads"], a["qk_nope_head_dim"], a["rotary_dim"], a["kv_lora_rank"], a["v_head_dim"]
    x, positions = n.inputs
    v = f"{name}."
    qw = h * (nope + rope)
    if "q_proj" in p:
        calls = [Call("linear", name, (x,), (v + "q",), {"weight": p["q_proj"]}, {}, (("T", qw),), L),
                 Call("linear", name, (x,), (v + "kva",), {"weight": p["kv_a_proj"]}, {}, (("T", r + rope),), L)]
    else:  # q's and the latent's down-projections as one linear (both read x)
        qr = g.params[p["q_a_kv_a_proj"]].shape[0] - r - rope
        calls = [
            Call("linear", name, (x,), (v + "qakva",), {"weight": p["q_a_kv_a_proj"]}, {}, (("T", qr + r + rope),), L),
            Call("split", name, (v + "qakva",), (v + "qa", v + "kva"), {}, {"sizes": (qr, r + rope)},
                 (("T", qr), ("T", r + rope)), L),
            Call("rms_norm", name, (v + "qa",), (v + "qan",), {"weight": p["q_a_norm"]}, {"eps": a["eps"]},
                 (("T", qr),), L),
            Call("linear", name, (v + "qan",), (v + "q",), {"weight": p["q_b_proj"]}, {}, (("T", qw),), L),
        ]
    calls += [
        Call("reshape", name, (v + "q",), (v + "q2",), {}, {"shape": (-1, nope + rope)}, ((f"T*{h}", nope + rope),), L),
        Call("split", name, (v + "q2",), (v + "qn2", v + "qp2"), {}, {"sizes": (nope, rope)},
             ((f"T*{h}", nope), (f"T*{h}", rope)), L),
        Call("reshape", name, (v + "qn2",), (v + "qn",), {}, {"shape": (-1, h, nope)}, (("T", h, nope),), L),
        Call("reshape", name, (v + "qp2",), (v + "qp",), {}, {"shape": (-1, h, rope)}, (("T", h, rope),), L),
        Call("split", name, (v + "kva",), (v + "c", v + "kp"), {}, {"sizes": (r, rope)}, (("T", r), ("T", rope)), L),
        Call("rms_norm", name, (v + "c",), (v + "cn",), {"weight": p["kv_a_norm"]}, {"eps": a["eps"]}, (("T", r),), L),
        Call("reshape", name, (v + "kp",), (v + "kp3",), {}, {"shape": (-1, 1, rope)}, (("T", 1, rope),), L),
        Call("rotary", name, (v + "qp", v + "kp3", positions), (v + "qp", v + "kp3"), {},
             {"rotary_dim": rope, "neox_style": a["neox_style"]}, (("T", h, rope), ("T", 1, rope)), L),
        Call("reshape", name, (v + "kp3",), (v + "kpr",), {}, {"shape": (-1, rope)}, (("T", rope),), L),
        Call("mla_kv_write", name, (v + "cn", v + "kpr"), (), {}, {}, (), L),
        Call("mla_attention", name, (v + "qn", v + "qp"), (v + "o3",), {"kv_b_proj": p["kv_b_proj"]},
             {"scale": a["scale"], "v_head_dim": vd}, (("T", h, vd),), L),
        Call("reshape", name, (v + "o3",), (v + "o",), {}, {"shape": (-1, h * vd)}, (("T", h * vd),), L),
        Call("linear", name, (v + "o",), n.outputs, {"weight": p["o_proj"]}, {}, (("T", g.config.hidden_size),), L),
    ]
    return calls


def _mlp(g: Graph, n: Node) -> list[Call]:
    p, name, L = n.params, n.name, n.layer
    inter = g.params[p["down_proj"]].shape[1]
    return [
        Call("linear", name, n.inputs, (name + ".gate_up",), _pick(p, weight="gate_up_proj", bias="gate_up_bias"), {},
             (("T", 2 * inter),), L),
        *_lora(n, "gate_up", n.inputs[0], name + ".gate_up", 2 * inter),
        Call("act_and_mul", name, (name + ".gate_up",), (name + ".act",), {}, {"kind": n.attrs["act"]}, (("T", inter),), L),
        Call("linear", name, (name + ".act",), n.outputs, _pick(p, weight="down_proj", bias="down_bias"), {},
             (("T", g.config.hidden_size),), L),
        *_lora(n, "down", name + ".act", n.outputs[0], g.config.hidden_size),
    ]


def _lora(n: Node, prefix: str, x: str, y: str, width: int) -> list[Call]:
    """The `lora` call after a projection, when the node carries adapters for it."""
    if f"{prefix}_lora_a" not in n.params:
        return []
    slices = n.attrs[f"{prefix}_lora_slices"]
    return [Call("lora", n.name, (x, y), (y,), {"lora_a": n.params[f"{prefix}_lora_a"], "lora_b": n.params[f"{prefix}_lora_b"]},
                 {"output_slices": slices if len(slices) > 1 else None}, (("T", width),), n.layer)]


def _moe(g: Graph, n: Node) -> list[Call]:
    """Router logits from a linear, then the `moe` primitive; with a shared
    expert (its own earlier `mlp` node), its output and gate logits ride
    along so the primitive's combine adds them."""
    p, name, L, a = n.params, n.name, n.layer, n.attrs
    e = g.params[p["router"]].shape[0]
    h = g.config.hidden_size
    x = n.inputs[0]
    calls = [Call("linear", name, (x,), (name + ".router_logits",), _pick(p, weight="router", bias="router_bias"), {},
                  (("T", e),), L)]
    ins = (x, name + ".router_logits")
    if len(n.inputs) > 1:
        ins += (n.inputs[1],)
        if "shared_gate" in p:
            calls.append(Call("linear", name, (x,), (name + ".shared_gate_logits",), {"weight": p["shared_gate"]}, {},
                              (("T", 1),), L))
            ins += (name + ".shared_gate_logits",)
    attrs = {"top_k": a["top_k"], "renormalize": a["renormalize"]}
    if a.get("activation") not in (None, "silu"):  # gpt-oss's clamped SwiGLU
        attrs.update(activation=a["activation"], swiglu_alpha=a["swiglu_alpha"], swiglu_limit=a["swiglu_limit"])
    attrs.update({k: a[k] for k in ("routed_scaling_factor", "scoring_func", "expert_groups") if a.get(k) is not None})
    calls.append(Call("moe", name, ins, (n.outputs[0], name + ".tokens_per_expert"),
                      _pick(p, w13="w13", w2="w2", w13_bias="w13_bias", w2_bias="w2_bias", routing_bias="routing_bias"),
                      attrs, (("T", h), (e,)), L))
    return calls


def _lm_head(g: Graph, n: Node) -> list[Call]:
    x, rows = n.inputs
    return [
        # Only the rows that sample a token reach the (large) vocabulary GEMM.
        Call("rows", n.name, (x, rows), (n.name + ".x",), {}, {}, (("S", g.config.hidden_size),), n.layer),
        Call("linear", n.name, (n.name + ".x",), n.outputs if g.tp_size == 1 else (n.name + ".shard",),
             {"weight": n.params["weight"]}, {}, (("S", g.params[n.params["weight"]].shape[0]),), n.layer),
    ] + (_gather_logits(g, n) if g.tp_size > 1 else [])


def _gather_logits(g: Graph, n: Node) -> list[Call]:
    """The ranks' vocabulary shards side by side; the padding of the last shard cut off."""
    vocab, padded = g.config.vocab_size, g.params[n.params["weight"]].shape[0] * g.tp_size
    gathered = n.outputs if padded == vocab else (n.name + ".gathered",)
    calls = [Call("all_gather", n.name, (n.name + ".shard",), gathered, {}, {"dim": -1, "group": TP_GROUP},
                  (("S", padded),), n.layer)]
    if padded != vocab:
        calls.append(Call("split", n.name, gathered, n.outputs + (n.name + ".padding",), {},
                          {"sizes": (vocab, padded - vocab)}, (("S", vocab), ("S", padded - vocab)), n.layer))
    return calls


def _linear(g: Graph, n: Node) -> list[Call]:
    return [Call("linear", n.name, n.inputs, n.outputs, _pick(n.params, weight="weight", bias="bias"), {},
                 (("T", g.params[n.params["weight"]].shape[0]),), n.layer)]


def _rows(g: Graph, n: Node) -> list[Call]:
    return [Call("rows", n.name, n.inputs, n.outputs, {}, {}, (("M", g.config.hidden_size),), n.layer)]


def _merge_rows(g: Graph, n: Node) -> list[Call]:
    """x[rows] = values, in x (a fresh embedding output); a step without images (rows None) passes x on."""
    return [Call("merge_rows", n.name, n.inputs, n.outputs, {}, {}, (("T", g.config.hidden_size),), n.layer)]


def _pick(params: dict[str, str], **roles: str) -> dict[str, str]:
    return {k: params[r] for k, r in roles.items() if r in params}


_EXPANSIONS = {
    "embedding": _embedding,
    "rms_norm": _rms_norm,
    "attention": _attention,
    "mlp": _mlp,
    "moe": _moe,
    "lm_head": _lm_head,
    "layer_norm": _layer_norm,
    "encoder_attention": _encoder_attention,
    "ffn": _ffn,
    "pool": _pool,
    "classifier": _classifier,
    "linear": _linear,
    "rows": _rows,
    "merge_rows": _merge_rows,
}
