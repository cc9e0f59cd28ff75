"""The model graph: high-level nodes over named values and parameters.

Architectures build a `Graph` from a transformers config (see `core/models/`);
`core/lowering.py` expands each node into meta-primitive calls. The graph is
shaped for later parallelism without touching the builders:

- every parameter says how it shards across tensor-parallel ranks (`shard`:
  column, row, vocab or replicated, and for fused projections the `parts` that
  are sharded separately, e.g. q/k/v inside qkv);
- every node of a decoder layer carries its `layer` index, so pipeline stages
  are contiguous layer ranges (`Graph.stage`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Node kinds and the parameters (roles) each takes.
NODE_KINDS: dict[str, tuple[str, ...]] = {
    "embedding": ("table",),
    "rms_norm": ("weight",),  # residual-fused when it has two inputs
    # All but the projections optional; *_lora_a/b: stacked LoRA adapters (`core/lora.py`).
    "attention": ("qkv_proj", "qkv_bias", "o_proj", "o_bias", "q_norm", "k_norm", "sinks",
                  "qkv_lora_a", "qkv_lora_b", "o_lora_a", "o_lora_b",
                  # multi-head latent attention (attrs["mla"]: DeepSeek)
                  "q_proj", "q_a_kv_a_proj", "q_a_norm", "q_b_proj", "kv_a_proj", "kv_a_norm", "kv_b_proj"),
    "mlp": ("gate_up_proj", "gate_up_bias", "down_proj", "down_bias",
            "gate_up_lora_a", "gate_up_lora_b", "down_lora_a", "down_lora_b"),
    # inputs: x, and a shared expert's output when it has one
    "moe": ("router", "router_bias", "w13", "w13_bias", "w2", "w2_bias", "shared_gate", "routing_bias"),
    "lm_head": ("weight",),
    # Encoders and pooling heads (`models/bert.py`, `models/pooling.py`).
    "layer_norm": ("weight", "bias"),  # residual-fused when it has two inputs
    "encoder_attention": ("qkv_proj", "qkv_bias", "o_proj", "o_bias"),  # bidirectional, no KV cache
    "ffn": ("up_proj", "up_bias", "down_proj", "down_bias"),  # ungated MLP: act(x @ up) @ down
    "pool": (),  # one row per sequence (attrs["method"]): the output ``pooled`` [B, H]
    "classifier": ("dense", "dense_bias", "out_proj", "out_bias"),  # [act(x @ dense)] @ out_proj
    # Vision towers and the language model's image rows (`models/llava.py`).
    "linear": ("weight", "bias"),  # x @ weight.T (+ bias): a patch embedding over unfolded patches
    "rows": (),  # inputs x, rows: x[rows] (the features a tower's projector reads)
    "merge_rows": (),  # inputs x, rows, values: x with x[rows] = values (image features into token embeddings)
    # Elementwise steps between nodes (`lowering.ELEMENTWISE_OPS`): no parameters.
    "add": (),  # inputs a, b: a + b (OLMo 2's residual stream)
    "scale": (),  # x * attrs["factor"] (Gemma's embedding scale, Granite's multipliers)
    "soft_cap": (),  # cap * tanh(x / cap) (Gemma 2's final logits)
}

SHARDS = ("replicated", "column", "row", "vocab")


@dataclass(slots=True)
class Param:
    """A weight the graph needs, and where it comes from in a checkpoint.

    ``sources`` are checkpoint tensor names concatenated along dim 0 (q, k, v
    into one qkv projection); ``parts`` are the row counts of those pieces, so
    a column shard takes the same fraction of each.
    """

    name: str
    shape: tuple[int, ...]
    sources: tuple[str, ...]
    shard: str = "replicated"
    parts: tuple[int, ...] = ()
    optional: bool = False
    # Added to the checkpoint values at load (Gemma's norms store w for a weight of 1 + w).
    offset: float = 0.0
    # Set by `parallel.shard_graph` on a tensor-parallel rank: per source, None
    # (read whole) or (axis, ((start, stop), ...)), the pieces of it this rank
    # reads, concatenated along that axis; then `pad_rows` zero rows appended
    # (a vocabulary shard padded to the common size). `zeros`: this rank holds
    # zeros of `shape` and reads nothing (a row-parallel bias off rank 0).
    slices: tuple = ()
    pad_rows: int = 0
    zeros: bool = False
    # The checkpoint tensor read in this shape (before `pad_rows`): a convolution kernel whose stride
    # is its size as the weight of a linear over unfolded patches.
    reshape: bool = False

    def __post_init__(self):
        if self.shard not in SHARDS:
            raise ValueError(f"param {self.name}: shard must be one of {SHARDS}, got {self.shard!r}")


@dataclass(slots=True)
class Node:
    op: str
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: dict[str, str] = field(default_factory=dict)  # role -> Param name
    attrs: dict[str, Any] = field(default_factory=dict)
    layer: int | None = None

    def __post_init__(self):
        if self.op not in NODE_KINDS:
            raise ValueError(f"node {self.name}: unknown op {self.op!r} (known: {', '.join(NODE_KINDS)})")
        unknown = set(self.params) - set(NODE_KINDS[self.op])
        if unknown:
            raise ValueError(f"node {self.name}: {self.op} takes no params {sorted(unknown)}")


@dataclass
class Graph:
    """Nodes in execution order. Inputs: ``input_ids`` [T], ``positions`` [T]
    (an encoder with token types: ``token_type_ids`` [T]); the output is
    ``logits`` [S, vocab] for the S rows that are sampled, or for a pooling
    model ``pooled`` [B, D], one row per sequence."""

    architecture: str
    config: Any  # the normalised ModelConfig of core/models
    nodes: list[Node] = field(default_factory=list)
    params: dict[str, Param] = field(default_factory=dict)
    num_layers: int = 0
    # Tensor parallelism (`parallel.shard_graph`): this rank, the group size,
    # and the nodes whose first output is this rank's partial sum (lowering
    # follows each with an all_reduce).
    tp_rank: int = 0
    tp_size: int = 1
    partial: frozenset[str] = frozenset()
    # A vision-language model: the encoder graph (tower and projector) whose output fills the
    # language model's image rows, and the placeholder token those rows hold.
    encoder: "Graph | None" = None
    image_token_id: int | None = None
    # An encoder graph: the name of its output (else logits / pooled), and what its inputs are made from.
    output: str | None = None
    encoder_inputs: dict = field(default_factory=dict)

    def kv_heads(self) -> int:
        """KV heads of this rank's attention (the model's, unless sharded)."""
        return next((n.attrs["num_kv_heads"] for n in self.nodes if n.op == "attention"), self.config.num_kv_heads)

    def param(self, name: str, shape: tuple[int, ...], sources: tuple[str, ...] | str, **kw: Any) -> str:
        if isinstance(sources, str):
            sources = (sources,)
        self.params[name] = Param(name, tuple(int(s) for s in shape), tuple(sources), **kw)
        return name

    def add(self, op: str, name: str, inputs, outputs, params=None, layer=None, **attrs) -> Node:
        node = self.make_node(op, name, inputs, outputs, params, layer, **attrs)
        self.nodes.append(node)
        return node

    def make_node(self, op: str, name: str, inputs, outputs, params=None, layer=None, **attrs) -> Node:
        return Node(op, name, tuple(inputs), tuple(outputs), dict(params or {}), attrs, layer)

    def stage(self, first_layer: int, end_layer: int) -> Graph:
        """The nodes of layers [first_layer, end_layer), plus the embedding when
        the stage starts at 0 and the head when it ends at num_layers: a
        pipeline-parallel stage."""
        if not 0 <= first_layer < end_layer <= self.num_layers:
            raise ValueError(f"stage [{first_layer}, {end_layer}) outside 0..{self.num_layers}")

        # Nodes outside the layers belong to the first stage before the first layer
        # (the embedding and its scaling), to the last one after.
        first = next((i for i, n in enumerate(self.nodes) if n.layer is not None), len(self.nodes))

        def keep(i: int, n: Node) -> bool:
            if n.layer is not None:
                return first_layer <= n.layer < end_layer
            return first_layer == 0 if i < first else end_layer == self.num_layers

        nodes = [n for i, n in enumerate(self.nodes) if keep(i, n)]
        used = {p for n in nodes for p in n.params.values()}
        params = {k: v for k, v in self.params.items() if k in used}
        return Graph(self.architecture, self.config, nodes, params, self.num_layers, self.tp_rank, self.tp_size,
                     frozenset(n.name for n in nodes) & self.partial)
