"""MoE checkpoints: per-expert tensors on disk, one fused tensor per layer in memory.

Hub checkpoints (and transformers 5's own `save_pretrained`) store every
expert's projections apart: Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2``,
Qwen-MoE's ``mlp.experts.{e}.gate_proj/up_proj/down_proj``. transformers 5
holds them fused, and so does infer's graph:

    {layer}.mlp.experts.gate_up_proj  [E, 2I, H]   expert e: [gate_e; up_e]
    {layer}.mlp.experts.down_proj     [E, H, I]

`fuse_experts` wraps a checkpoint so it shows the fused names (and Mixtral's
``block_sparse_moe`` as ``mlp``, as transformers renames it); a checkpoint
already in the fused layout passes through unchanged. Either way the weights
dict the engine gets is the one ``model.state_dict()`` has in transformers 5.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from .errors import CorruptCheckpointError

_EXPERT = re.compile(r"^(?P<layer>.+)\.(?:block_sparse_moe|mlp)\.experts\.(?P<e>\d+)\."
                     r"(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_ROLE = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


class FusedExperts:
    """A checkpoint whose per-expert tensors read as transformers 5's fused ones."""

    def __init__(self, ckpt: Any, pieces: dict[str, dict[str, dict[int, str]]], names: list[str]):
        self._ckpt = ckpt
        self._pieces = pieces  # fused name -> role -> expert -> stored name
        self._renamed = {n.replace(".block_sparse_moe.", ".mlp."): n for n in ckpt.names if ".block_sparse_moe." in n}
        self.names = names

    def __getattr__(self, attr: str) -> Any:  # format, path, config, chat_template, tokenizer ...
        return getattr(self._ckpt, attr)

    def _stored(self, name: str) -> list[str]:
        if name in self._pieces:
            return [n for by_expert in self._pieces[name].values() for n in by_expert.values()]
        return [self._renamed.get(name, name)]

    def nbytes(self, name: str) -> int:
        return sum(self._ckpt.nbytes(n) for n in self._stored(name))

    def read(self, name: str) -> np.ndarray:
        if name not in self._pieces:
            return self._ckpt.read(self._renamed.get(name, name))
        roles = self._pieces[name]
        experts = sorted(next(iter(roles.values())))
        # gate_up: each expert's gate rows, then its up rows (transformers' Concatenate(dim=1)).
        order = [r for r in ("gate", "up", "down") if r in roles]
        parts = [np.concatenate([self._ckpt.read(roles[r][e]) for r in order]) for e in experts]
        return np.stack(parts)


    def read_slice(self, name: str, axis: int, start: int, stop: int) -> np.ndarray:
        """[start, stop) along `axis` of a (fused) tensor, reading only the experts' pieces it covers."""
        if name not in self._pieces:
            return slice_of(self._ckpt, self._renamed.get(name, name), axis, start, stop)
        roles = self._pieces[name]
        experts = sorted(next(iter(roles.values())))
        order = [r for r in ("gate", "up", "down") if r in roles]
        if axis == 0:
            return np.stack([self.read_expert(roles, order, e) for e in experts[start:stop]])
        parts = []
        for e in experts:
            if axis > 1:  # inside every role's rows: slice each, then stack the roles as `read` does
                parts.append(np.concatenate([slice_of(self._ckpt, roles[r][e], axis - 1, start, stop) for r in order]))
                continue
            pieces, offset = [], 0
            for r in order:  # rows [start, stop) of gate rows then up rows
                rows = _rows(self._ckpt, roles[r][e])
                lo, hi = max(start - offset, 0), min(stop - offset, rows)
                if lo < hi:
                    pieces.append(slice_of(self._ckpt, roles[r][e], 0, lo, hi))
                offset += rows
            parts.append(np.concatenate(pieces))
        return np.stack(parts)

    def read_expert(self, roles: dict[str, dict[int, str]], order: list[str], expert: int) -> np.ndarray:
        return np.concatenate([self._ckpt.read(roles[r][expert]) for r in order])


def _rows(ckpt: Any, name: str) -> int:
    return ckpt.shape(name)[0] if hasattr(ckpt, "shape") else ckpt.read(name).shape[0]


def slice_of(ckpt: Any, name: str, axis: int, start: int, stop: int) -> np.ndarray:
    """A checkpoint tensor's [start, stop) along `axis`, read partially where the checkpoint can."""
    if hasattr(ckpt, "read_slice"):
        return ckpt.read_slice(name, axis, start, stop)
    return np.ascontiguousarray(ckpt.read(name)[(slice(None),) * axis + (slice(start, stop),)])


class InterleavedExperts:
    """gpt-oss's expert tensors in the fused layout above.

    Its checkpoints (and transformers' module) store ``experts.gate_up_proj``
    as [E, H, 2I] with gate and up columns interleaved (gate at even columns),
    ``gate_up_proj_bias`` [E, 2I] interleaved alike, and ``down_proj`` as
    [E, I, H]: this view reads them as [E, 2I, H] gate rows then up rows,
    [E, 2I] gate biases then up biases, and [E, H, I].
    """

    _GATE_UP = re.compile(r"\.mlp\.experts\.gate_up_proj(_bias)?$")
    _DOWN = re.compile(r"\.mlp\.experts\.down_proj$")

    def __init__(self, ckpt: Any):
        self._ckpt = ckpt
        self.names = list(ckpt.names)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._ckpt, attr)

    def nbytes(self, name: str) -> int:
        return self._ckpt.nbytes(name)

    def read(self, name: str) -> np.ndarray:
        x = self._ckpt.read(name)
        if self._GATE_UP.search(name):
            x = x if name.endswith("_bias") else x.transpose(0, 2, 1)  # [E, 2I, H], rows interleaved
            return np.ascontiguousarray(np.concatenate([x[:, 0::2], x[:, 1::2]], axis=1))
        if self._DOWN.search(name):
            return np.ascontiguousarray(x.transpose(0, 2, 1))
        return x

    def shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self._ckpt.shape(name))
        if (self._GATE_UP.search(name) and not name.endswith("_bias")) or self._DOWN.search(name):
            return (shape[0], shape[2], shape[1])
        return shape

    def read_slice(self, name: str, axis: int, start: int, stop: int) -> np.ndarray:
        if self._GATE_UP.search(name) or self._DOWN.search(name):  # the whole tensor, reordered, then cut
            return np.ascontiguousarray(self.read(name)[(slice(None),) * axis + (slice(start, stop),)])
        return slice_of(self._ckpt, name, axis, start, stop)


def fuse_experts(ckpt: Any) -> Any:
    """`ckpt` itself when it holds no per-expert tensors, else a `FusedExperts` view of it
    (an `InterleavedExperts` one for gpt-oss)."""
    if (getattr(ckpt, "config", None) or {}).get("architectures", [""])[0] == "GptOssForCausalLM":
        return InterleavedExperts(ckpt)
    found: dict[str, dict[str, dict[str, dict[int, str]]]] = {}
    names: list[str] = []
    for n in ckpt.names:
        m = _EXPERT.match(n)
        if m is None:
            names.append(n.replace(".block_sparse_moe.", ".mlp."))
            continue
        role = _ROLE[m["proj"]]
        fused = f"{m['layer']}.mlp.experts." + ("down_proj" if role == "down" else "gate_up_proj")
        if fused not in found:
            found[fused] = {}
            names.append(fused)  # where its first expert was, so the order stays the checkpoint's
        found[fused].setdefault(role, {})[int(m["e"])] = n
    if not found:
        return ckpt
    for fused, roles in found.items():
        experts = [sorted(r) for r in roles.values()]
        want = ({"gate", "up"} if fused.endswith("gate_up_proj") else {"down"})
        if set(roles) != want or any(e != list(range(len(experts[0]))) for e in experts):
            raise CorruptCheckpointError(
                f"{ckpt.path}: the per-expert tensors of {fused} are incomplete (have {sorted(roles)} for experts "
                f"{experts[0][:4]}...); every expert needs its gate, up and down projection; re-download the checkpoint")
    return FusedExperts(ckpt, found, names)
