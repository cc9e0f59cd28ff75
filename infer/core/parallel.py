"""Tensor-parallel sharding of a model graph (Megatron-style, as vLLM does it).

`shard_graph(graph, rank, size)` gives rank `rank`'s graph of a group of
`size` ranks: every parameter knows which pieces of which checkpoint tensor
this rank reads (`Param.slices`), attention nodes see this rank's heads, and
`Graph.partial` names the nodes whose output is a partial sum that lowering
follows with an `all_reduce`:

- column-parallel (output features split): q/k/v and gate/up, each part of a
  fused projection split on its own (unevenly when the size does not divide
  it: the first ranks take one more head or row); MoE expert ``w13`` the same way inside
  every expert (tensor parallel inside experts, not expert parallel: every rank
  keeps every expert, so routing skew cannot load one rank more than another,
  and the `moe` primitive runs unchanged on the shard);
- row-parallel (input features split): o and down (and expert ``w2``); their
  output is a partial sum, reduced once per block; a row-parallel bias is
  added on rank 0 only (zeros elsewhere), so the sum counts it once;
- vocabulary-parallel: the embedding table and lm_head are split by rows,
  padded to ``ceil(V / size)`` rows per rank. The embedding looks up only the
  ids in this rank's range (others give zero rows) and the all_reduce adds the
  ranks' rows; lm_head's logits are all-gathered along the vocabulary;
- KV heads: each rank keeps the KV heads its query heads read, so they are
  split when there are at least as many as ranks and replicated when fewer
  (see `HeadLayout`);
- OLMo 2's q/k norms over all heads: each rank all-gathers q and k, normalises
  them whole (the norm weights replicated) and keeps its own heads (lowering);
  this takes heads split evenly, none replicated;
- attention sinks follow their query heads; expert biases follow their rows
  (``w13_bias`` split like ``w13``, ``w2_bias`` on rank 0 only);
- norms, the router and the shared-expert gate replicated.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .graph import Graph, Node, Param


def _cut(n: int, rank: int, size: int) -> tuple[int, int]:
    """Rank `rank`'s range of `n` items split `size` ways, the first ranks one more when uneven."""
    per, extra = divmod(n, size)
    lo = rank * per + min(rank, extra)
    return lo, lo + per + (rank < extra)


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """One rank's attention heads: a contiguous range of query heads, and the
    checkpoint KV head each of its local KV heads is read from."""

    num_heads: int  # query heads on this rank
    first_head: int
    kv_heads: tuple[int, ...]

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadLayout:
        """Query heads split as evenly as the count allows (the first ranks get one more
        when `size` does not divide them). Each rank keeps the KV heads its query heads
        read, so a KV head shared by two ranks is on both. Attention pairs query head j
        with KV head ``j // group`` locally; where the rank's heads do not form equal
        groups (an uneven split), every query head gets its own copy of its KV head."""
        if size > num_heads:
            raise ValueError(f"tensor_parallel_size={size} is larger than num_attention_heads={num_heads}")
        q0, q1 = _cut(num_heads, rank, size)
        group = num_heads // num_kv_heads
        kv = tuple(range(q0 // group, (q1 - 1) // group + 1))
        served = [sum(1 for q in range(q0, q1) if q // group == k) for k in kv]
        if len(set(served)) != 1:  # unequal local groups: one KV copy per query head
            kv = tuple(q // group for q in range(q0, q1))
        return cls(q1 - q0, q0, kv)


def max_kv_heads(num_heads: int, num_kv_heads: int, size: int) -> int:
    """The most KV heads any rank holds (what sizes every rank's KV cache alike)."""
    return max(HeadLayout.of(num_heads, num_kv_heads, r, size).num_kv_heads for r in range(size))


def shard_graph(graph: Graph, rank: int, size: int) -> Graph:
    """Rank `rank`'s part of `graph` in a tensor-parallel group of `size`."""
    if size == 1:
        return graph
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} outside 0..{size - 1}")
    cfg = graph.config
    heads = HeadLayout.of(cfg.num_heads, cfg.num_kv_heads, rank, size)
    d = cfg.head_dim
    roles: dict[str, str] = {}
    for node in graph.nodes:
        for role, name in node.params.items():
            # Latent attention (DeepSeek): heads split by even row / column cuts of its projections
            # (each head's rows are contiguous), the latent's projections and norms replicated.
            roles.setdefault(name, "" if node.attrs.get("mla") else role)
        if node.attrs.get("mla") and cfg.num_heads % size:
            raise ValueError(f"{graph.architecture}'s latent attention splits its {cfg.num_heads} heads evenly "
                             f"over the ranks; tensor_parallel_size={size} does not divide them")
    params = {name: _shard_param(p, roles.get(name, ""), heads, d, rank, size) for name, p in graph.params.items()}
    nodes = []
    for node in graph.nodes:
        if (node.op == "attention" and node.attrs.get("qk_norm") == "whole" and "q_norm" in node.params
                and (cfg.num_heads % size or cfg.num_kv_heads % size)):
            # The ranks' q and k are gathered whole for their norms (lowering), which needs every
            # rank to hold its own equal share of the heads, none replicated.
            raise ValueError(f"{graph.architecture} normalises q and k over all heads at once, which under tensor "
                             f"parallelism needs {size} to divide num_attention_heads ({cfg.num_heads}) and "
                             f"num_key_value_heads ({cfg.num_kv_heads})")
        if node.op == "attention":
            node = dataclasses.replace(node, attrs={**node.attrs, "num_heads": heads.num_heads,
                                                     "num_kv_heads": heads.num_kv_heads})
        nodes.append(node)
    return Graph(graph.architecture, cfg, nodes, params, graph.num_layers, rank, size, _partial_nodes(nodes))


def _partial_nodes(nodes: list[Node]) -> frozenset[str]:
    """Nodes whose first output is a per-rank partial sum: the embedding, each
    attention block, MLP and MoE, except an MLP that feeds an MoE node (a
    shared expert: the MoE adds it to its own partial sum, reduced once)."""
    fed_to_moe = {v for n in nodes if n.op == "moe" for v in n.inputs[1:]}
    return frozenset(n.name for n in nodes
                     if n.op in ("embedding", "attention", "moe") or (n.op == "mlp" and n.outputs[0] not in fed_to_moe))


def _shard_param(p: Param, role: str, heads: HeadLayout, d: int, rank: int, size: int) -> Param:
    if role in ("qkv_proj", "qkv_bias"):
        q = [(heads.first_head * d, (heads.first_head + heads.num_heads) * d)]
        kv = _merge([(k * d, (k + 1) * d) for k in heads.kv_heads])
        return _pieces(p, 0, [q, kv, kv])
    if role == "o_proj":  # the input columns of this rank's query heads
        return _pieces(p, 1, [[(heads.first_head * d, (heads.first_head + heads.num_heads) * d)]])
    if role == "sinks":  # one per query head: this rank's heads
        return _pieces(p, 0, [[(heads.first_head, heads.first_head + heads.num_heads)]])
    if role == "w13_bias":  # [E, 2I]: each expert's gate and up biases split like its rows
        return _pieces(p, 1, [[_cut(n, rank, size)] for n in p.parts])
    if role in ("o_bias", "down_bias", "w2_bias"):  # row-parallel bias: rank 0 adds it once
        return p if rank == 0 else dataclasses.replace(p, zeros=True, sources=())
    if p.shard == "replicated":
        return p
    if p.shard == "column":
        axis = 0 if len(p.shape) == 1 else len(p.shape) - 2
        parts = p.parts or (p.shape[axis],)
        return _pieces(p, axis, [[_cut(n, rank, size)] for n in parts])
    if p.shard == "row":
        axis = len(p.shape) - 1
        return _pieces(p, axis, [[_cut(p.shape[axis], rank, size)]])
    # vocab: rows in ceil(V / size) blocks, the last ones padded with zero rows
    vocab = p.shape[0]
    per_rank = -(-vocab // size)
    lo, hi = min(rank * per_rank, vocab), min((rank + 1) * per_rank, vocab)
    out = _pieces(p, 0, [[(lo, hi)]])
    return dataclasses.replace(out, shape=(per_rank,) + p.shape[1:], pad_rows=per_rank - (hi - lo))


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent ranges joined (one read instead of several); repeats are kept."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def _pieces(p: Param, axis: int, ranges: list[list[tuple[int, int]]]) -> Param:
    """`p` reading, for each of its parts, the ranges (in the part's own
    coordinates, concatenated in order) along `axis`."""
    parts = p.parts or (p.shape[axis],)
    if len(ranges) != len(parts):
        raise ValueError(f"param {p.name}: ranges for {len(ranges)} parts, it has {len(parts)}")
    if len(p.sources) == len(parts):  # one checkpoint tensor per part (q, k, v): each sliced on its own
        slices = tuple((axis, tuple(r)) for r in ranges)
    elif len(p.sources) == 1:  # one tensor holding every part (an expert's gate rows then up rows)
        offsets = [sum(parts[:i]) for i in range(len(parts))]
        slices = ((axis, tuple((o + lo, o + hi) for o, r in zip(offsets, ranges) for lo, hi in r)),)
    else:
        raise ValueError(f"param {p.name}: {len(p.sources)} sources for {len(parts)} parts")
    sizes = tuple(sum(hi - lo for lo, hi in r) for r in ranges)
    shape = list(p.shape)
    shape[axis] = sum(sizes)
    return dataclasses.replace(p, shape=tuple(shape), parts=sizes if p.parts else (), slices=slices)


def shard_adapter(adapter, cfg, rank: int, size: int):
    """Rank `rank`'s cut of a LoRA adapter (`core/lora.py`), matching its projections'
    shards: a column-parallel projection (q/k/v, gate/up) keeps B's rows of this rank's
    outputs (A whole), a row-parallel one (o, down) A's columns of this rank's inputs
    (B whole), so its output is a partial sum like the projection's."""
    heads = HeadLayout.of(cfg.num_heads, cfg.num_kv_heads, rank, size)
    d = cfg.head_dim
    q = np.arange(heads.first_head * d, (heads.first_head + heads.num_heads) * d)
    kv = np.concatenate([np.arange(k * d, (k + 1) * d) for k in heads.kv_heads])
    weights = {}
    for (layer, module), (a, b) in adapter.weights.items():
        if module == "q_proj":
            b = b[q]
        elif module in ("k_proj", "v_proj"):
            b = b[kv]
        elif module == "o_proj":
            a = a[:, q]
        elif module in ("gate_proj", "up_proj"):
            b = b[slice(*_cut(b.shape[0], rank, size))]
        elif module == "down_proj":
            a = a[:, slice(*_cut(a.shape[1], rank, size))]
        weights[(layer, module)] = (a, b)
    return dataclasses.replace(adapter, weights=weights)
