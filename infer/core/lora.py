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
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

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
    def cache_key(self) -> str:
        """Names the adapter in prefix-cache hashes: another path or id is another adapter."""
        return json.dumps([self.lora_name, self.lora_int_id, self.lora_path])


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
    """Read and check a PEFT adapter directory (see the module doc); LoRAError names what is wrong."""
    try:
        return _load_adapter(Path(path), name, max_rank, num_layers)
    except LoRAError:
        raise
    except (OSError, ValueError) as exc:  # unreadable files, bad JSON, a corrupt or odd safetensors file
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {path}: {exc}") from None


def _load_adapter(root: Path, name: str, max_rank: int, num_layers: int | None) -> Adapter:
    from .loader.safetensors_file import read_header, read_tensor

    cfg_file, weights_file = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not cfg_file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: {cfg_file} not found (a PEFT directory has adapter_config.json and "
                        "adapter_model.safetensors)")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("peft_type", "LORA").upper() != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, what in (("use_dora", "DoRA adapters"), ("modules_to_save", "modules_to_save")):
        if cfg.get(key):
            raise LoRAError(f"LoRA adapter {name!r}: {what} ({key}={cfg[key]!r}) are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {name!r}: bias={cfg['bias']!r} is not supported (only 'none')")
    if not weights_file.is_file():
        bin_file = root / "adapter_model.bin"
        hint = " (adapter_model.bin found: save it with safe_serialization=True)" if bin_file.is_file() else ""
        raise LoRAError(f"LoRA adapter {name!r}: {weights_file} not found{hint}")
    tensors = {key: read_tensor(entry) for key, entry in read_header(weights_file).items()}  # BF16 read exactly
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
        # PEFT's rule: a pattern names the module's full name or a dotted suffix of it.
        full = f"model.layers.{layer}.{'mlp' if TARGETS[module][0] == 'mlp' else 'self_attn'}.{module}"
        a_alpha = next((float(v) for pat, v in alpha_pattern.items() if pat == full or re.match(rf".*\.{pat}$", full)),
                       alpha)
        scale = a_alpha / (math.sqrt(r) if rslora else r)
        adapter.weights[(layer, module)] = (a, b * np.float32(scale))
        top = max(top, r)
    adapter.rank = top
    return adapter


# -- the graph --------------------------------------------------------------------------
def _projections(g: Graph, node) -> list[tuple[str, tuple[int, ...], int]]:
    """(role prefix, output slices, input size) of a node's LoRA targets."""
    params = g.params
    if node.op == "attention":
        hq, hk, d = node.attrs["num_heads"], node.attrs["num_kv_heads"], node.attrs["head_dim"]
        return [("qkv", (hq * d, hk * d, hk * d), params[node.params["qkv_proj"]].shape[1]),
                ("o", (params[node.params["o_proj"]].shape[0],), params[node.params["o_proj"]].shape[1])]
    inter = params[node.params["down_proj"]].shape[1]
    return [("gate_up", (inter, inter), params[node.params["gate_up_proj"]].shape[1]),
            ("down", (params[node.params["down_proj"]].shape[0],), inter)]


def _targets(g: Graph):
    """The decoder layers' attention and dense MLP nodes (not an MoE's shared expert)."""
    return [n for n in g.nodes if n.op in ("attention", "mlp") and n.layer is not None
            and (n.op == "attention" or n.name.endswith(".mlp"))]


def lora_targets(g: Graph) -> dict[tuple[int, str], tuple[int, int]]:
    """(layer, target module) -> (input size, output size) of a whole (unsharded) graph:
    what an adapter's A [r, in] and B [out, r] must fit."""
    out = {}
    for node in _targets(g):
        for prefix, slices, k in _projections(g, node):
            for module, (_, fused, i) in TARGETS.items():
                if fused == prefix:
                    out[(node.layer, module)] = (k, slices[i])
    return out


def add_lora(g: Graph, max_loras: int, max_rank: int) -> None:
    """Stacked adapter weights (zeros: every slot empty) on each decoder layer's attention
    and dense MLP node; `lowering` applies them after each projection. On a tensor-parallel
    rank's graph the stacks take the rank's shapes (`parallel.shard_adapter` cuts adapters
    to them): a row-parallel projection's adapter output is a partial sum, reduced with the
    projection's."""
    for node in _targets(g):
        for prefix, slices, k in _projections(g, node):
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
            if f"{prefix}_lora_a" in node.params:
                out[(node.layer, prefix)] = (node.params[f"{prefix}_lora_a"], node.params[f"{prefix}_lora_b"],
                                             node.attrs[f"{prefix}_lora_slices"])
    return out


# -- adapters in host memory and device slots ------------------------------------------------
class LoRAManager:
    """Adapters by name, their host copies and the device slots.

    Everything is keyed by the `LoRARequest` itself (name, id and path), so an
    adapter loaded again under an old name is a different adapter: requests still
    running on the old one finish with it, and prefix-cache blocks never mix
    (`LoRARequest.cache_key`). An adapter some live request uses stays in host
    memory (`acquire`/`release`), so a step never reads a file; the others are
    kept up to ``max_cpu_loras``, least recently used out first.
    """

    def __init__(self, targets: dict[tuple[int, str], tuple[int, int]], num_layers: int, max_loras: int,
                 max_rank: int, max_cpu_loras: int | None, write: Callable[[int, Adapter], None]):
        """`targets`: `lora_targets` of the whole model; `write(slot, adapter)` puts an
        adapter into a device slot on every rank (`Worker.write_lora`)."""
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if max_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_rank}")
        self.targets, self.write, self.max_loras, self.max_rank = targets, write, max_loras, max_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.num_layers = num_layers
        self.known: dict[str, LoRARequest] = {}  # by name: what new requests may use
        self.users: dict[LoRARequest, int] = {}  # live requests per adapter
        self.host: OrderedDict[LoRARequest, Adapter] = OrderedDict()
        self.slots: list[LoRARequest | None] = [None] * max_loras  # slot i + 1 holds slots[i]
        self._slot_use: OrderedDict[int, None] = OrderedDict((i, None) for i in range(max_loras))
        self._unloaded: set[LoRARequest] = set()  # never registered again (a new load has a new id)
        self.loads = 0  # adapters written into a device slot

    # -- names -----------------------------------------------------------------
    def register(self, request: LoRARequest, adapter: Adapter | None = None) -> Adapter:
        """Know an adapter by its name (one name, one adapter); read and check it now (or
        take `adapter`, read already) so a bad one fails its request, not a later step."""
        old = self.known.get(request.lora_name)
        if old is not None and old != request:
            raise LoRAError(f"LoRA adapter {request.lora_name!r} is already loaded from {old.lora_path!r} "
                            f"(id {old.lora_int_id}); unload it first or use another name")
        for other in self.known.values():
            if other.lora_int_id == request.lora_int_id and other.lora_name != request.lora_name:
                raise LoRAError(f"lora_int_id {request.lora_int_id} is taken by adapter {other.lora_name!r}")
        if request in self._unloaded:
            raise LoRAError(f"LoRA adapter {request.lora_name!r} was unloaded")
        if request not in self.host:
            adapter = adapter or load_adapter(request.lora_path, request.lora_name, self.max_rank, self.num_layers)
            self.check(adapter)
        if request not in self.host:
            self.host[request] = adapter
        self.host.move_to_end(request)
        self.known[request.lora_name] = request
        self._trim_host(keep=request)
        return self.host[request]

    def unregister(self, name: str) -> LoRARequest:
        """Forget an adapter for new requests; running ones finish with it."""
        request = self.known.pop(name)
        self._unloaded.add(request)
        if not self.users.get(request):
            self._drop(request)
        return request

    def next_id(self) -> int:
        """An adapter id no adapter of this engine has had (loaded or still in use)."""
        return max((r.lora_int_id for r in (*self.known.values(), *self.users, *self._unloaded)), default=0) + 1

    def acquire(self, request: LoRARequest) -> None:
        """A request now runs with the adapter: it stays in host memory until `release`."""
        self.users[request] = self.users.get(request, 0) + 1

    def release(self, request: LoRARequest) -> None:
        left = self.users[request] - 1
        if left:
            self.users[request] = left
            return
        del self.users[request]
        if self.known.get(request.lora_name) != request:  # unloaded meanwhile: its last request ended
            self._drop(request)
        else:
            self._trim_host()

    def _drop(self, request: LoRARequest) -> None:
        self.host.pop(request, None)
        if request in self.slots:
            self.slots[self.slots.index(request)] = None  # its rows stay until another adapter takes the slot

    def _trim_host(self, keep: LoRARequest | None = None) -> None:
        """Host copies beyond max_cpu_loras go, least recently used first, but not those in
        use (nor `keep`, just registered for a request about to use it)."""
        for request in list(self.host):
            if len(self.host) <= self.max_cpu_loras:
                break
            if not self.users.get(request) and request != keep:
                self.host.pop(request)

    def check(self, adapter: Adapter) -> None:
        """LoRAError unless every projection of the adapter fits the model's."""
        for (layer, module), (a, b) in adapter.weights.items():
            shape = self.targets.get((layer, module))
            if shape is None:
                raise LoRAError(f"LoRA adapter {adapter.name!r}: the model has no {module} in layer {layer}")
            k, n = shape
            if a.shape[1] != k or b.shape[0] != n:
                raise LoRAError(f"LoRA adapter {adapter.name!r}: layer {layer} {module} has A {tuple(a.shape)} and B "
                                f"{tuple(b.shape)}, this model needs [r, {k}] and [{n}, r]: an adapter of another "
                                "base model")

    # -- steps --------------------------------------------------------------------
    def activate(self, requests: set[LoRARequest]) -> dict[LoRARequest, int]:
        """Put every adapter of a step (at most max_loras) into a device slot; their slot ids."""
        if len(requests) > self.max_loras:
            raise ValueError(f"a step uses {len(requests)} LoRA adapters, max_loras is {self.max_loras}")
        out = {r: self.slots.index(r) + 1 for r in requests if r in self.slots}
        for request in requests - set(out):
            free = next(i for i in self._slot_use if self.slots[i] not in requests)
            adapter = self.host.get(request)
            if adapter is None:  # not acquired (the engine acquires): read it now
                adapter = self.host[request] = load_adapter(request.lora_path, request.lora_name, self.max_rank,
                                                            self.num_layers)
                self.check(adapter)
            self.slots[free] = None  # while its rows are rewritten
            self.write(free + 1, adapter)
            self.loads += 1
            self.slots[free] = request
            out[request] = free + 1
        for slot in out.values():
            self._slot_use.move_to_end(slot - 1)
        return out


def write_slot(runner, graph: Graph, slot: int, adapter: Adapter, max_rank: int) -> None:
    """Write an adapter (cut to this rank's shapes) into `slot` of every stack of a runner's
    graph; its layers without a stack (another pipeline stage's) are skipped."""
    for (layer, prefix), (a_name, b_name, slices) in lora_stacks(graph).items():
        p, r = len(slices), max_rank
        k = graph.params[a_name].shape[2]
        a = np.zeros((p * r, k), np.float32)
        b = np.zeros((sum(slices), r), np.float32)
        bounds = np.cumsum((0,) + tuple(slices))
        for module, (_, fused, i) in TARGETS.items():
            pair = adapter.weights.get((layer, module)) if fused == prefix else None
            if pair is not None:
                pa, pb = pair
                a[i * r : i * r + pa.shape[0]] = pa
                b[bounds[i] : bounds[i + 1], : pa.shape[0]] = pb
        runner.assign_slot(a_name, slot, a)
        runner.assign_slot(b_name, slot, b)


def parse_lora_modules(items) -> list[LoRARequest]:
    """``--lora-modules`` entries (`EngineArgs.lora_modules`): ``name=path``, vLLM's JSON
    ``{"name": ..., "path": ...}`` (ids in order), or LoRARequests as they are."""
    out: list[LoRARequest] = []
    for item in items or ():
        if isinstance(item, LoRARequest):
            out.append(item)
            continue
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
