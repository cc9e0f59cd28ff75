"""Tensor-parallel sharding of a model graph (Megatron-style, as vLLM does it).

`shard_graph(graph, rank, size)` gives rank `rank`'s graph of a group of
`size` ranks: every parameter knows which pieces of which checkpoint tensor
this rank reads (`Param.slices`), attention nodes see this rank's heads, and
`Graph.partial` names the nodes whose output is a partial sum that lowering
follows with an `all_reduce`:

- column-parallel (output features split): q/k/v and gate/up, each part of a
  fused projection split on its own; MoE expert ``w13`` the same way inside
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
- KV heads split across ranks, or replicated when there are fewer KV heads
  than ranks (rank r serves KV head ``r * kv_heads // size``, which is the
  one its query heads read);
- norms, the router and the shared-expert gate replicated.
"""

from __future__ import annotations

import dataclasses

from .graph import Graph, Node, Param


def _cut(n: int, rank: int, size: int, what: str) -> tuple[int, int]:
    if n % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide {what}={n}")
    step = n // size
    return rank * step, (rank + 1) * step


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """One rank's attention heads."""

    num_heads: int  # query heads on this rank
    first_head: int
    num_kv_heads: int
    first_kv_head: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadLayout:
        q0, q1 = _cut(num_heads, rank, size, "num_attention_heads")
        if num_kv_heads >= size:
            k0, k1 = _cut(num_kv_heads, rank, size, "num_key_value_heads")
            return cls(q1 - q0, q0, k1 - k0, k0)
        if size % num_kv_heads:
            raise ValueError(f"tensor_parallel_size={size} is larger than num_key_value_heads={num_kv_heads} and not "
                             "a multiple of it, so KV heads cannot be replicated evenly")
        return cls(q1 - q0, q0, 1, rank * num_kv_heads // size)


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
            roles.setdefault(name, role)
    params = {name: _shard_param(p, roles.get(name, ""), heads, d, rank, size) for name, p in graph.params.items()}
    nodes = []
    for node in graph.nodes:
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
        q, kv = heads.num_heads * d, heads.num_kv_heads * d
        ranges = [(heads.first_head * d, heads.first_head * d + q), (heads.first_kv_head * d, heads.first_kv_head * d + kv),
                  (heads.first_kv_head * d, heads.first_kv_head * d + kv)]
        return _pieces(p, 0, ranges)
    if role in ("o_bias", "down_bias"):  # row-parallel bias: rank 0 adds it once
        return p if rank == 0 else dataclasses.replace(p, zeros=True, sources=())
    if p.shard == "replicated":
        return p
    if p.shard == "column":
        axis = 0 if len(p.shape) == 1 else len(p.shape) - 2
        parts = p.parts or (p.shape[axis],)
        return _pieces(p, axis, [_cut(n, rank, size, f"{p.name} output features") for n in parts])
    if p.shard == "row":
        axis = len(p.shape) - 1
        lo, hi = _cut(p.shape[axis], rank, size, f"{p.name} input features")
        return _pieces(p, axis, [(lo, hi)])
    # vocab: rows in ceil(V / size) blocks, the last ones padded with zero rows
    vocab = p.shape[0]
    per_rank = -(-vocab // size)
    lo, hi = min(rank * per_rank, vocab), min((rank + 1) * per_rank, vocab)
    out = _pieces(p, 0, [(lo, hi)])
    return dataclasses.replace(out, shape=(per_rank,) + p.shape[1:], pad_rows=per_rank - (hi - lo))


def _pieces(p: Param, axis: int, ranges: list[tuple[int, int]]) -> Param:
    """`p` reading ``ranges`` (one per part, in the parts' own coordinates) along `axis`."""
    parts = p.parts or (p.shape[axis],)
    if len(ranges) != len(parts):
        raise ValueError(f"param {p.name}: {len(ranges)} ranges for {len(parts)} parts")
    if len(p.sources) == len(parts):  # one checkpoint tensor per part (q, k, v): each sliced on its own
        slices = tuple((axis, ((lo, hi),)) for lo, hi in ranges)
    elif len(p.sources) == 1:  # one tensor holding every part (an expert's gate rows then up rows)
        offsets = [sum(parts[:i]) for i in range(len(parts))]
        slices = ((axis, tuple((o + lo, o + hi) for o, (lo, hi) in zip(offsets, ranges))),)
    else:
        raise ValueError(f"param {p.name}: {len(p.sources)} sources for {len(parts)} parts")
    shape = list(p.shape)
    shape[axis] = sum(hi - lo for lo, hi in ranges)
    local_parts = tuple(hi - lo for lo, hi in ranges) if p.parts else ()
    return dataclasses.replace(p, shape=tuple(shape), parts=local_parts, slices=slices)
