"""Multi-LoRA serving: PEFT adapters over one base model, mixed in one batch.

* `LoRARequest` names an adapter (vLLM's fields) for a request.
* `load_adapter` reads a PEFT directory (``adapter_config.json`` +
  ``adapter_model.safetensors``) into per-layer, per-projection (A, B) pairs,
  B already scaled (``lora_alpha / r``, or ``/ sqrt(r)`` with rslora), and
  refuses what the runtime cannot apply (other target modules, DoRA, biases,
  modules_to_save, a rank above ``max_lora_rank``).
* `add_lora` gives every attention and MLP node of a graph stacked adapter
  weights: ``[max_loras + 1, P*R, K]`` A and ``[max_loras + 1, N, R]`` B per
  projection (q/k/v and gate/up as slices of the fused ones); lowering then
  follows each projection with the `lora` primitive. Slot 0 is no adapter.
* `LoRAManager` keeps adapters in host memory (LRU of ``max_cpu_loras``) and
  puts the ones a step uses into device slots (LRU of ``max_loras``), writing
  the slot's rows of every stack.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .graph import Graph

# Target module -> (graph node kind, fused projection, slice index within it).
TARGETS = {
    "q_proj": ("attention", "qkv", 0), "k_proj": ("attention", "qkv", 1), "v_proj": ("attention", "qkv", 2),
    "o_proj": ("attention", "o", 0),
    "gate_proj": ("mlp", "gate_up", 0), "up_proj": ("mlp", "gate_up", 1), "down_proj": ("mlp", "down", 0),
}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.\w+)?\.weight$")


class LoRAError(ValueError):
    """An adapter the runtime cannot serve (a clear reason in the message)."""


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request (vLLM's `LoRARequest`): a unique name and a
    positive int id, and the PEFT directory it is read from."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not self.lora_name:
            raise ValueError("LoRARequest needs a lora_name")
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be >= 1, got {self.lora_int_id}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass
class Adapter:
    """One adapter in host memory: (layer, target module) -> (A [r, K], B [N, r] scaled)."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_adapter(path: str | Path, name: str, max_rank: int, num_layers: int | None = None) -> Adapter:
    """Read and check a PEFT adapter directory (see the module doc)."""
    from safetensors.numpy import load_file

    root = Path(path)
    cfg_file, weights_file = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not cfg_file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: {cfg_file} not found (a PEFT directory has adapter_config.json and "
                        "adapter_model.safetensors)")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("peft_type", "LORA").upper() != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, bad, what in (("use_dora", True, "DoRA adapters"), ("modules_to_save", None, "modules_to_save")):
        value = cfg.get(key)
        if (bad is True and value) or (bad is None and value):
            raise LoRAError(f"LoRA adapter {name!r}: {what} ({key}={value!r}) are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {name!r}: bias={cfg['bias']!r} is not supported (only 'none')")
    if not weights_file.is_file():
        bin_file = root / "adapter_model.bin"
        hint = " (adapter_model.bin found: save it with safe_serialization=True)" if bin_file.is_file() else ""
        raise LoRAError(f"LoRA adapter {name!r}: {weights_file} not found{hint}")
    tensors = load_file(str(weights_file))
    alpha, rslora = float(cfg.get("lora_alpha", cfg.get("r", 8))), bool(cfg.get("use_rslora", False))
    alpha_pattern = cfg.get("alpha_pattern") or {}
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of a decoder layer's "
                            f"{'/'.join(TARGETS)} projection; other modules are not supported")
        layer, module, ab = int(m.group(1)), m.group(3), m.group(4)
        if module not in TARGETS:
            raise LoRAError(f"LoRA adapter {name!r}: target module {module!r} ({key}) is not supported; "
                            f"supported: {', '.join(TARGETS)}")
        if num_layers is not None and layer >= num_layers:
            raise LoRAError(f"LoRA adapter {name!r}: {key} is for layer {layer}, the model has {num_layers}")
        pairs.setdefault((layer, module), {})[ab] = np.asarray(value, dtype=np.float32)
    if not pairs:
        raise LoRAError(f"LoRA adapter {name!r}: {weights_file} holds no LoRA weights")
    adapter, top = Adapter(name, str(root), 0), 0
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_{''.join(ab)} only")
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != r:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {module}: A {a.shape} and B {b.shape} do not pair")
        if r > max_rank:
            raise LoRAError(f"LoRA adapter {name!r}: rank {r} ({module}, layer {layer}) exceeds max_lora_rank="
                            f"{max_rank}; raise --max-lora-rank")
        a_alpha = next((float(v) for pat, v in alpha_pattern.items() if re.search(pat, f"layers.{layer}.{module}")
                        or pat == module), alpha)
        scale = a_alpha / (math.sqrt(r) if rslora else r)
        adapter.weights[(layer, module)] = (a, b * np.float32(scale))
        top = max(top, r)
    adapter.rank = top
    return adapter


# -- the graph --------------------------------------------------------------------------
def _projections(g: Graph, node) -> list[tuple[str, str, tuple[int, ...], int]]:
    """(role prefix, weight role, output slices, input size) of a node's LoRA targets."""
    params = g.params
    if node.op == "attention":
        hq, hk, d = node.attrs["num_heads"], node.attrs["num_kv_heads"], node.attrs["head_dim"]
        return [("qkv", "qkv_proj", (hq * d, hk * d, hk * d), params[node.params["qkv_proj"]].shape[1]),
                ("o", "o_proj", (params[node.params["o_proj"]].shape[0],), params[node.params["o_proj"]].shape[1])]
    inter = params[node.params["down_proj"]].shape[1]
    return [("gate_up", "gate_up_proj", (inter, inter), params[node.params["gate_up_proj"]].shape[1]),
            ("down", "down_proj", (params[node.params["down_proj"]].shape[0],), inter)]


def add_lora(g: Graph, max_loras: int, max_rank: int) -> None:
    """Stacked adapter weights (zeros: every slot empty) on each decoder layer's attention
    and dense MLP node; `lowering` applies them after each projection."""
    if g.tp_size > 1:
        raise LoRAError("LoRA adapters are not supported with tensor_parallel_size > 1 yet")
    for node in g.nodes:
        if node.op not in ("attention", "mlp") or node.layer is None:
            continue
        if node.op == "mlp" and not node.name.endswith(".mlp"):
            continue  # an MoE's shared expert: not a LoRA target
        for prefix, _, slices, k in _projections(g, node):
            slots, p = max_loras + 1, len(slices)
            a = g.param(f"{node.name}.{prefix}_lora_a", (slots, p * max_rank, k), (), zeros=True)
            b = g.param(f"{node.name}.{prefix}_lora_b", (slots, sum(slices), max_rank), (), zeros=True)
            node.params[f"{prefix}_lora_a"], node.params[f"{prefix}_lora_b"] = a, b
            node.attrs[f"{prefix}_lora_slices"] = slices


def lora_stacks(g: Graph) -> dict[tuple[int, str], tuple[str, str, tuple[int, ...]]]:
    """(layer, fused projection) -> (A param, B param, output slices) of a graph `add_lora` changed."""
    out = {}
    for node in g.nodes:
        for prefix in ("qkv", "o", "gate_up", "down"):
            if f"{prefix}_lora_a" in node.params and (node.op == "attention") == (prefix in ("qkv", "o")):
                out[(node.layer, prefix)] = (node.params[f"{prefix}_lora_a"], node.params[f"{prefix}_lora_b"],
                                             node.attrs[f"{prefix}_lora_slices"])
    return out


# -- adapters in host memory and device slots ------------------------------------------------
class LoRAManager:
    """Adapters known by name, their host copies (LRU) and the device slots (LRU)."""

    def __init__(self, runner, graph: Graph, max_loras: int, max_rank: int, max_cpu_loras: int | None = None):
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if max_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_rank}")
        self.runner, self.max_loras, self.max_rank = runner, max_loras, max_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.num_layers = graph.num_layers
        self.stacks = lora_stacks(graph)
        self.known: dict[str, LoRARequest] = {}
        # Unloaded while requests may still run with them: they finish with the adapter.
        self.retired: dict[str, LoRARequest] = {}
        self._lock = threading.RLock()  # the engine thread steps; a server thread loads and unloads
        self.host: OrderedDict[str, Adapter] = OrderedDict()
        self.slots: list[str | None] = [None] * max_loras  # slot i + 1 holds slots[i]
        self._slot_use: OrderedDict[int, None] = OrderedDict((i, None) for i in range(max_loras))
        self.loads = 0  # adapters written into a device slot

    # -- names -----------------------------------------------------------------
    def register(self, request: LoRARequest, adapter: Adapter | None = None) -> Adapter:
        """Know an adapter by its name (the same name must keep its path and id); load it
        now (or take `adapter`, read already) so a bad adapter fails its request, not a
        later step."""
        with self._lock:
            old = self.known.get(request.lora_name)
            if old is not None and (old.lora_path, old.lora_int_id) != (request.lora_path, request.lora_int_id):
                raise LoRAError(f"LoRA adapter {request.lora_name!r} is already loaded from {old.lora_path!r} "
                                f"(id {old.lora_int_id}); unload it first or use another name")
            for other in self.known.values():
                if other.lora_int_id == request.lora_int_id and other.lora_name != request.lora_name:
                    raise LoRAError(f"lora_int_id {request.lora_int_id} is taken by adapter {other.lora_name!r}")
            if old is None and request.lora_name in self.retired:  # a new adapter under a retired name
                del self.retired[request.lora_name]
                self.host.pop(request.lora_name, None)
                self._evict_slot(request.lora_name)
            if adapter is not None:
                self.host[request.lora_name] = adapter
            adapter = self._host(request)
            self.known[request.lora_name] = request
            return adapter

    def unregister(self, name: str) -> None:
        """Forget an adapter for new requests; running ones finish with it."""
        with self._lock:
            if name not in self.known:
                raise KeyError(name)
            self.retired[name] = self.known.pop(name)

    def _evict_slot(self, name: str) -> None:
        if name in self.slots:
            self.slots[self.slots.index(name)] = None  # its rows stay until another adapter takes the slot

    def _host(self, request: LoRARequest) -> Adapter:
        adapter = self.host.get(request.lora_name)
        if adapter is None:
            adapter = load_adapter(request.lora_path, request.lora_name, self.max_rank, self.num_layers)
            self.host[request.lora_name] = adapter
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(request.lora_name)
        return adapter

    # -- steps --------------------------------------------------------------------
    def activate(self, names: set[str]) -> dict[str, int]:
        """Put every adapter of a step (at most max_loras) into a device slot; their slot ids."""
        if len(names) > self.max_loras:
            raise ValueError(f"a step uses {len(names)} LoRA adapters, max_loras is {self.max_loras}")
        with self._lock:
            out = {}
            for name in names:
                if name in self.slots:
                    out[name] = self.slots.index(name) + 1
            for name in names - set(out):
                free = next(i for i in self._slot_use if self.slots[i] not in names)
                request = self.known.get(name) or self.retired[name]
                self._write_slot(free + 1, self._host(request))
                self.slots[free] = name
                out[name] = free + 1
            for slot in out.values():
                self._slot_use.move_to_end(slot - 1)
            return out

    def _write_slot(self, slot: int, adapter: Adapter) -> None:
        runner, r = self.runner, self.max_rank
        for (layer, prefix), (a_name, b_name, slices) in self.stacks.items():
            p = len(slices)
            k = runner.program.graph.params[a_name].shape[2]
            a = np.zeros((p * r, k), np.float32)
            b = np.zeros((sum(slices), r), np.float32)
            bounds = np.cumsum((0,) + tuple(slices))
            for module, (kind, fused, i) in TARGETS.items():
                pair = adapter.weights.get((layer, module)) if fused == prefix else None
                if pair is None:
                    continue
                pa, pb = pair
                rank = pa.shape[0]
                if pa.shape[1] != k or pb.shape[0] != bounds[i + 1] - bounds[i]:
                    raise LoRAError(f"LoRA adapter {adapter.name!r}: layer {layer} {module} has A {pa.shape} and "
                                    f"B {pb.shape}, the model needs [r, {k}] and [{bounds[i + 1] - bounds[i]}, r]")
                a[i * r : i * r + rank] = pa
                b[bounds[i] : bounds[i + 1], :rank] = pb
            runner.assign_slot(a_name, slot, a)
            runner.assign_slot(b_name, slot, b)
        self.loads += 1


def parse_lora_modules(items: list[str] | None) -> list[LoRARequest]:
    """``--lora-modules`` entries: ``name=path`` or vLLM's JSON ``{"name": ..., "path": ...}``."""
    out: list[LoRARequest] = []
    for item in items or ():
        if item.lstrip().startswith("{"):
            spec: Any = json.loads(item)
            name, path = spec.get("name"), spec.get("path")
        else:
            name, _, path = item.partition("=")
        if not name or not path:
            raise ValueError(f"--lora-modules takes name=path (or JSON with name and path), got {item!r}")
        out.append(LoRARequest(name, len(out) + 1, path))
    names = [r.lora_name for r in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names must be unique, got {names}")
    return out
