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


def fuse_experts(ckpt: Any) -> Any:
    """`ckpt` itself when it holds no per-expert tensors, else a `FusedExperts` view of it."""
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
