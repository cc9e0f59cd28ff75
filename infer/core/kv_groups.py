"""KV cache groups: how layers with different attention spans share one pool.

A model whose layers all read the whole context keeps one block table per
request, and a block holds a token range of every layer. When some layers
only read a sliding window (Gemma 2/3, gpt-oss, Mistral's first releases),
their blocks behind the window are dead weight; to free them, those layers
need block tables of their own. vLLM's hybrid KV cache manager is the model
followed here:

* layers are split by their window into groups of the same number of layers
  G (the smallest count of any window kind, so each kind fills whole groups;
  a kind's last group may hold fewer);
* the pool's unit is a page: `block_size` tokens of G layers. The cache is G
  tensors of pages; the layer at position j of its group reads and writes
  tensor j, with its group's block table, so pages of different groups never
  overlap while every group draws from one pool;
* a request holds one block table per group; a windowed group gives back
  the blocks its window has moved past (`BlockManager`).

A model with one kind of layer keeps one group of all its layers: the layout
and block tables are those of the plain cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class KVCacheGroups:
    """windows      per group: the sliding window of its layers, None for full attention.
    layer_group  layer -> its group (an index into `windows`).
    layer_slot   layer -> the cache tensor it uses (its position in its group).
    num_slots    cache tensors: the layers of the largest group."""

    windows: tuple[int | None, ...]
    layer_group: Mapping[int, int]
    layer_slot: Mapping[int, int]
    num_slots: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def is_hybrid(self) -> bool:
        """More than one block table per request, or one that frees blocks behind a window."""
        return self.num_groups > 1 or self.windows[0] is not None

    def describe(self) -> str:
        kinds = {}
        for w in self.windows:
            kinds[w] = kinds.get(w, 0) + 1
        return ", ".join(f"{n} {'full' if w is None else f'window-{w}'} group{'s' * (n > 1)}" for w, n in kinds.items()) \
            + f" of {self.num_slots} layer{'s' * (self.num_slots > 1)}"


def blocks_for(windows: tuple[int | None, ...], num_tokens: int, block_size: int, chunk: int) -> int:
    """Most blocks one request of `num_tokens` tokens holds at once over groups with
    these windows, computing at most `chunk` tokens a step: a full group holds the
    whole context, a windowed one its window and the step's tokens."""
    whole = -(-num_tokens // block_size)
    return sum(whole if w is None else min(whole, -(-(w - 1 + chunk) // block_size) + 1) for w in windows)


def plan_kv_groups(layer_windows: Mapping[int, int | None], hybrid: bool = True) -> KVCacheGroups:
    """Groups for layers with the given windows (layer -> window or None), full
    groups first. `hybrid=False` (or one kind of layer without a window): one
    full group of every layer, the plain cache."""
    layers = sorted(layer_windows)
    kinds = sorted({layer_windows[i] for i in layers}, key=lambda w: (w is not None, w or 0))
    if not hybrid or kinds == [None] or not layers:
        return KVCacheGroups((None,), {i: 0 for i in layers}, {i: j for j, i in enumerate(layers)}, max(1, len(layers)))
    by_kind = {w: [i for i in layers if layer_windows[i] == w] for w in kinds}
    size = min(len(v) for v in by_kind.values())
    windows: list[int | None] = []
    layer_group, layer_slot = {}, {}
    for w, members in by_kind.items():
        for start in range(0, len(members), size):
            for j, layer in enumerate(members[start : start + size]):
                layer_group[layer], layer_slot[layer] = len(windows), j
            windows.append(w)
    return KVCacheGroups(tuple(windows), layer_group, layer_slot, size)
