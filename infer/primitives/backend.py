"""What a backend is: the declarations the core reads and the plumbing it calls.

A backend subclasses `Backend`, sets the class attributes, and implements each
primitive it supports as a method named after it (see `spec.py` for the
signatures). Primitives it does not implement, or declines through
`supports(...)`, are served by the backend named in `fallback`, whose tensors
must be the same type (``torch`` for any torch device). Nothing here is
optional-by-monkey-patch: overrides are methods, found by name.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import numpy as np

from .spec import PRIMITIVES
from .types import AttentionMetadata, AttentionPlan, SamplingTensors, Support, WeightHandle

# Bumped when a hook, a primitive signature or a Backend member changes
# incompatibly; a plugin built for a version outside SUPPORTED_API_VERSIONS is
# reported unavailable instead of being called with arguments it does not expect.
# v2: fused nodes receive a `LayerContext` and the step's metadata instead of
# the runner; `decode_graphs` receives the forward to capture; fast paths are
# declared (`fast_path`); the attention plan is `AttentionMetadata.plan`.
# A v1 backend keeps working: its primitives are called as before (v1's
# `backend_data` is an alias of `plan`); its fused nodes and decode graphs,
# which v1 handed the runner, are not used (the engine runs the primitives eagerly).
PLUGIN_API_VERSION = 2
SUPPORTED_API_VERSIONS = (1, 2)


@dataclass(frozen=True, slots=True)
class FastPath:
    """A faster implementation of one primitive that may decline a call.

    ``fn`` takes the primitive's exact arguments and returns its result, or
    ``NotImplemented`` when it cannot serve this call (a shape, a dtype, a
    layout it has no kernel for); the backend's general implementation then
    runs. ``name`` labels it in `infer run --trace-dispatch`.
    """

    name: str
    fn: Callable[..., Any]


class Backend(ABC):
    """Base class of every backend, in-tree or third-party."""

    # -- declarations -------------------------------------------------------
    name: ClassVar[str] = ""
    api_version: ClassVar[int] = PLUGIN_API_VERSION
    description: ClassVar[str] = ""
    # torch.distributed backend used for all_reduce/all_gather.
    dist_backend: ClassVar[str] = "gloo"
    preferred_block_size: ClassVar[int] = 16
    # `--block-size auto`: the page (the cache's block size) and the larger block
    # sizes requests may use, multiples of it: (page, 2 pages, 4 pages).
    auto_block_sizes: ClassVar[tuple[int, ...]] = (8, 16, 32)
    # Whether `attention` (and `plan_attention`) take `AttentionMetadata.block_sizes`
    # (mixed block sizes in a batch) as is; if not, they get tables of pages.
    native_block_sizes: ClassVar[bool] = False
    # Human-readable layout of one layer's cache (see `kv_cache_shape`).
    kv_cache_layout: ClassVar[str] = "[2, num_blocks, block_size, num_kv_heads, head_dim]"
    dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    weight_kinds: ClassVar[tuple[str, ...]] = ("dense",)
    # Activation quantizations `linear` applies when a weight asks (`Int8GroupWeight.act_quant`,
    # `types.ACT_QUANTS`); a backend that lists none is never handed such a weight.
    act_quants: ClassVar[tuple[str, ...]] = ()
    # Quantized kinds `moe` takes its expert weights w13/w2 in (`types.EXPERT_WEIGHT_KINDS`:
    # 'mxfp4'), besides dense arrays; a backend that lists none is never handed them.
    expert_weight_kinds: ClassVar[tuple[str, ...]] = ()
    # KV cache storage kv_write/attention handle: 'auto' (the model dtype) and
    # 'fp8' (e4m3 codes with per-tensor scales, see spec.kv_write).
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    # Backend that serves what this one does not; None means it must do all.
    fallback: ClassVar[str | None] = "torch"

    def __init__(self, device: str | None = None):
        self.device = device or self.default_device()

    def default_device(self) -> str:
        return "cpu"

    # -- what the core asks about the device (never a device string of its own) --
    @property
    def device_kind(self) -> str:
        """The type of `self.device`: 'cpu', 'cuda', 'npu', ... (the part before ':index')."""
        return str(self.device).partition(":")[0]

    @property
    def host_memory(self) -> bool:
        """Whether this backend's tensors live in host memory (then the KV host tier is a
        memory-mapped file, and the ranks of a node share the host instead of one device each)."""
        return self.device_kind == "cpu"

    def rank_device(self, local_index: int) -> str | None:
        """The device of the rank at `local_index` among this node's ranks when the user named
        none: ``<kind>:<index>`` on an accelerator; None in host memory (every rank on this one)."""
        return None if self.host_memory else f"{self.device_kind}:{local_index}"

    @classmethod
    def is_available(cls) -> Support:
        """Whether this backend can run here; a reason (and the fix) when not."""
        return Support(True)

    def supports(self, primitive: str, **kw: Any) -> Support:
        """Whether `primitive` runs here for the static properties in `kw`.

        Keys the core may pass: ``dtype`` (a name from FLOAT_DTYPES),
        ``weight_kind`` (linear, embedding of a quantized table), ``act_quant`` (linear, only
        when its weight quantizes activations: 'int8_token'),
        ``kv_cache_dtype`` (kv_write, attention; only when not 'auto'), ``head_dim``, ``sliding_window`` (bool),
        ``soft_cap`` (bool), ``shared_expert`` (bool, moe), ``expert_weight_kind`` (moe, only
        for quantized expert weights: 'mxfp4'). Unknown keys must be ignored. The default
        answer: implemented methods support the declared dtypes and weight kinds.
        """
        if primitive not in PRIMITIVES:
            return Support(False, f"'{primitive}' is not a meta-primitive")
        if not callable(getattr(self, primitive, None)):
            return Support(False, f"backend '{self.name}' does not implement {primitive}")
        dtype = kw.get("dtype")
        if dtype is not None and dtype not in self.dtypes:
            return Support(False, f"backend '{self.name}' supports dtypes {self.dtypes}, not {dtype}")
        kind = kw.get("weight_kind")
        if kind is not None and kind not in self.weight_kinds:
            return Support(False, f"backend '{self.name}' supports weights {self.weight_kinds}, not {kind}")
        expert_kind = kw.get("expert_weight_kind")
        if expert_kind is not None and expert_kind not in self.expert_weight_kinds:
            return Support(False, f"backend '{self.name}' takes moe expert weights dense"
                                  f"{' or ' + ', '.join(self.expert_weight_kinds) if self.expert_weight_kinds else ''}, "
                                  f"not {expert_kind}")
        act_quant = kw.get("act_quant")
        if act_quant is not None and act_quant not in self.act_quants:
            return Support(False, f"backend '{self.name}' quantizes activations as {self.act_quants or 'nothing'}, "
                                  f"not {act_quant}")
        cache = kw.get("kv_cache_dtype")
        if cache is not None and primitive in ("kv_write", "attention") and cache not in self.kv_cache_dtypes:
            return Support(False, f"backend '{self.name}' keeps KV caches as {self.kv_cache_dtypes}, not {cache}")
        return Support(True)

    def auto_dtype(self, stored: str | None, loaded: str) -> str:
        """What ``dtype="auto"`` serves: `loaded` (the dtype the loader returns the weights
        in; bfloat16 checkpoints come back as float32, NumPy having no bfloat16) unless the
        backend serves the checkpoint's `stored` dtype faster."""
        return loaded

    def pooling_dtype(self, dtype: str) -> str:
        """What ``dtype="auto"`` serves a pooling model (embeddings, scores) in, `dtype` being what
        `auto_dtype` chose: a backend may go to 16 bits where it computes them natively (vLLM
        serves float32 checkpoints in 16 bits); embeddings keep a cosine of ~0.9995 to float32."""
        return dtype

    def keeps_quantized(self, dtype: str) -> bool:
        """Whether ``quantization="auto"`` keeps a checkpoint's quantized weights for activations in `dtype`.

        16-bit activations: yes, since decode is bound by the bytes read per
        weight. float32 asks for float32 arithmetic, so a backend says yes only
        where its quantized `linear` is exact to float32 rounding and faster
        than the dequantized float32 weights; otherwise the weights are
        dequantized at load.
        """
        return dtype != "float32"

    def fast_path(self, primitive: str, **kw: Any) -> FastPath | None:
        """A `FastPath` tried before this backend's `primitive` for the static
        properties in `kw` (the keys of `supports`), or None (the default).

        Declared here rather than hidden inside the primitive so the resolver
        can record which implementation served each call.
        """
        return None

    def fuses(self, node_op: str, **attrs: Any) -> Support:
        """Whether this backend runs a whole graph node (e.g. 'attention') itself.

        Lowering asks this before expanding a node into primitives; a backend
        says yes by defining a method named ``fused_<node_op>``. The runner
        calls it with the node's inputs and keywords ``params`` (role -> the
        parameter; a linear's weight role -> its prepared `WeightHandle`),
        ``attrs`` (the node's), ``ctx`` (the layer's `LayerContext`) and
        ``meta`` (the step's `AttentionMetadata`, with this backend's plan when
        it serves attention); ``params`` is the same dict on every call, so the
        node may keep what it derives from the weights there. It returns the
        node's output, or ``NotImplemented`` to decline one step, which then
        runs the node's primitives (``Call.expansion``) as if it had not been fused.
        """
        if callable(getattr(self, f"fused_{node_op}", None)):
            return Support(True)
        return Support(False, f"backend '{self.name}' has no fused {node_op}")

    # -- tensor plumbing ------------------------------------------------------
    @abstractmethod
    def asarray(self, x: np.ndarray, dtype: str | None = None) -> Any:
        """A host NumPy array as this backend's tensor on its device.

        ``dtype`` is a contract dtype name; None keeps NumPy's dtype. For
        'bfloat16' the float32 input is rounded to nearest-even.
        """

    @abstractmethod
    def cast(self, x: Any, dtype: str) -> Any:
        """`x` converted to the float dtype named `dtype` (e.g. logits to float32)."""

    @abstractmethod
    def to_numpy(self, x: Any) -> np.ndarray:
        """This backend's tensor as a host NumPy array (bfloat16 widened to float32)."""

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str) -> Any:
        """One layer's zeroed KV cache."""

    @abstractmethod
    def kv_cache_to_numpy(self, kv_cache: Any) -> tuple[np.ndarray, np.ndarray]:
        """(K, V) of one layer as float32 [num_blocks, block_size, Hk, D] each.

        Lets the conformance suite compare caches across layouts.
        """

    def copy_blocks(self, kv_cache: Any, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy whole KV blocks ``src[i] -> dst[i]`` in one layer (copy-on-write).

        The default fits the default layout (block axis 1); a backend with
        another layout overrides it.
        """
        if len(src):
            kv_cache[:, self.asarray(np.asarray(dst))] = kv_cache[:, self.asarray(np.asarray(src))]

    def read_blocks(self, kv_cache: Any, block_ids: np.ndarray) -> np.ndarray:
        """The stored bytes of whole blocks `block_ids` of one layer's cache, as a
        host uint8 array ``[len(block_ids), block_bytes]`` (K and V together, in
        this backend's layout and storage dtype: opaque to the core, which keeps
        them in a host tier for prefix-cache offload and swap preemption).

        A blocking copy: the result is complete, and owns its memory, when it
        returns. The default fits a NumPy cache in the default layout (block axis 1).
        """
        cache = np.asarray(kv_cache)
        ids = np.asarray(block_ids, dtype=np.intp)
        # Fancy indexing copies, so the result never aliases the cache.
        blocks = np.ascontiguousarray(np.moveaxis(cache[:, ids], 1, 0))
        return blocks.view(np.uint8).reshape(len(ids), _block_bytes(cache))

    def write_blocks(self, kv_cache: Any, block_ids: np.ndarray, data: np.ndarray) -> None:
        """Put bytes `read_blocks` returned (this backend, same cache shape) into
        blocks `block_ids` (any ids, ``data[i]`` into ``block_ids[i]``): a read
        then a write reproduces the blocks exactly."""
        cache = np.asarray(kv_cache)
        ids = np.asarray(block_ids, dtype=np.intp)
        check_block_data(data, len(ids), _block_bytes(cache))
        if len(ids):
            block_shape = (cache.shape[0], *cache.shape[2:])
            blocks = np.ascontiguousarray(data).view(cache.dtype).reshape(len(ids), *block_shape)
            cache[:, ids] = np.moveaxis(blocks, 0, 1)

    def set_rows(self, dst: Any, index: int, src: Any) -> None:
        """``dst[index] = src`` in place, `src` an array of this backend (a LoRA
        adapter written into its slot of a stacked weight)."""
        dst[index] = src

    def plan_attention(self, meta: AttentionMetadata) -> AttentionPlan | None:
        """This backend's plan of a step's attention, from the step's host
        metadata (NumPy arrays: no device sync), or None (the default).

        Asked once per step of the backend that serves `attention`; every
        layer's call then finds it as ``meta.plan``.
        """
        return None

    def prepare_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Move a step's host metadata (NumPy arrays) to the device, once per step.

        Called on the backend the engine runs (it owns the device); the plan
        comes from the attention provider's `plan_attention`.
        """
        return AttentionMetadata(
            query_start_loc=self.asarray(meta.query_start_loc),
            seq_lens=self.asarray(meta.seq_lens),
            block_table=self.asarray(meta.block_table),
            slot_mapping=self.asarray(meta.slot_mapping),
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            block_size=meta.block_size,
            block_sizes=None if meta.block_sizes is None else self.asarray(meta.block_sizes),
        )

    def prepare_sampling(self, params: SamplingTensors) -> SamplingTensors:
        """Move a step's host sampling parameters (NumPy arrays) to the device; the
        host arrays come along as `host` (decisions about the batch read them, not the device)."""
        fields = {}
        for name in SamplingTensors.__dataclass_fields__:
            value = getattr(params, name)
            fields[name] = self.asarray(value) if isinstance(value, np.ndarray) else value
        fields["host"] = params if params.host is None else params.host
        return SamplingTensors(**fields)

    def prepare_weight(self, weight: WeightHandle) -> WeightHandle:
        """Re-layout a loaded weight once, at load time (default: as is)."""
        return weight

    def memory_info(self) -> tuple[int, int] | None:
        """(total device bytes, peak bytes this process used since
        `reset_peak_memory`), or None for host memory, where the KV pool is
        sized by bytes instead of by `gpu_memory_utilization`."""
        return None

    def reset_peak_memory(self) -> None:
        """Start a new peak for `memory_info` (no-op without device memory)."""

    def synchronize(self) -> None:
        """Wait for queued device work (for timing); CPU backends need nothing."""

    def decode_graphs(self, forward, *, max_model_len: int, block_size: int, batch_sizes: tuple[int, ...],
                      progress=iter):
        """A captured decode, or None (the default): every step runs eagerly.

        `forward(input_ids, positions, sample_rows, meta) -> ForwardOutput` is
        the model's forward on this backend's tensors (`meta` already prepared),
        reading the KV caches the engine has allocated when it asks. A backend
        whose device can record and replay it (CUDA graphs) returns an object
        with ``can_replay(meta) -> bool`` and ``forward(input_ids, positions,
        meta) -> ForwardOutput`` (host arrays in; the logits of every row and
        the step's expert counts out), having captured a decode step of each
        batch size in `batch_sizes`. The engine sends it the decode-only steps
        that `can_replay` accepts and runs the rest eagerly. `progress` wraps
        the iterable of sizes (a progress bar).
        """
        return None


def check_block_data(data: np.ndarray, num_blocks: int, block_bytes: int) -> None:
    """Raise unless `data` is what `read_blocks` returns for `num_blocks` blocks of `block_bytes`."""
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.shape != (num_blocks, block_bytes):
        got = f"{type(data).__name__} {getattr(data, 'dtype', '')} {tuple(getattr(data, 'shape', ()))}"
        raise ValueError(f"write_blocks takes host uint8 bytes [{num_blocks}, {block_bytes}] as read_blocks "
                         f"returns them (same backend, same cache shape), got {got}")


def _block_bytes(cache: np.ndarray) -> int:
    """Bytes per block of a NumPy cache whose block axis is 1."""
    return math.prod((cache.shape[0], *cache.shape[2:])) * cache.itemsize
