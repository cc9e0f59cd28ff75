"""Runs a lowered program on a backend: binds weights and KV caches once, then
executes one flattened batch per `forward`."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ..primitives.binding import SIGNATURES, arguments, dispatch_key, value_args
from ..primitives.context import ForwardOutput, LayerContext
from ..primitives.types import AttentionMetadata, DenseWeight, WeightHandle
from . import quant_params
from .kv_groups import KVCacheGroups, plan_kv_groups
from .lowering import VIEW_OPS, Call, Program
from .memory import trim_heap
from .rope import cos_sin_cache


class ModelRunner:
    def __init__(self, program: Program, backend, ops, weights: Mapping[str, np.ndarray], dtype: str,
                 max_positions: int, progress: Callable[[Iterable], Iterable] = iter, quantization: str = "auto",
                 kv_cache_dtype: str = "auto", groups: Mapping[str, Any] | None = None,
                 kv_groups: KVCacheGroups | None = None):
        """`ops` (`infer.dispatch.Ops`) decides what serves each call and
        validates arguments; the first forward runs through it, later ones
        through an unchecked twin, since the program's shapes do not change
        between steps. The program is bound to its KV caches by
        `allocate_kv_caches`, which must come before `forward`.

        Quantized weights arrive as `WeightHandle`s in `weights` and stay
        quantized; ``quantization="fp8"`` quantizes the dense weights of the
        attention and MLP projections (not lm_head, as vLLM) at load.
        ``kv_cache_dtype="fp8"``: KV caches hold e4m3 codes with one scale per
        layer for K and one for V (1.0, vLLM's default without calibrated
        scales), served by a backend that declares fp8 caches.

        `weights` (checkpoint name -> array) is consumed: each entry is dropped
        once the last parameter built from it exists, so loading never holds
        the checkpoint and the device copy of all of it at once. On a
        tensor-parallel rank (`core/parallel.py`) each parameter reads only its
        slices (`weights.read_slice` where the mapping has it).

        `groups`: the torch.distributed process group of each name the
        program's collectives give (``tp``); absent: the default group.

        `kv_groups`: the hybrid KV cache's layout (`kv_groups.plan_kv_groups`);
        None: one group of every layer, the plain cache.
        """
        self.program, self.backend, self.ops, self.dtype = program, backend, ops, dtype
        self.groups = dict(groups or {})
        self.num_kv_heads = program.graph.kv_heads()
        self.quantization, self.kv_cache_dtype = quantization, kv_cache_dtype
        if kv_cache_dtype == "fp8" and any(c.primitive == "mla_kv_write" for c in program.primitive_calls()):
            raise ValueError(f"{program.graph.architecture} caches latents (multi-head latent attention), which have "
                             "no fp8 form yet; serve it with kv_cache_dtype='auto'")
        # (k_scale, v_scale) per layer for an fp8 cache.
        self.kv_scales = [(1.0, 1.0)] * program.graph.num_layers
        if kv_cache_dtype == "fp8":
            self.kv_scales = self._checkpoint_kv_scales(weights)
        self.config = program.graph.config
        self.tensors: dict[str, Any] = {}
        self._handles: dict[tuple, DenseWeight] = {}
        self.max_positions = max_positions
        # One cos/sin table per rotary dim and rope variant the program uses (Gemma 3's
        # local layers have their own base), shared by the layers that use it.
        self._rope = self._rope_tables(program, backend, max_positions)
        # The decoder layers this program runs (a pipeline stage runs a range of them);
        # KV caches exist for these only, in this order.
        self.layers = sorted({n.layer for n in program.graph.nodes if n.op == "attention"})
        self.kv_groups = kv_groups or plan_kv_groups(dict.fromkeys(self.layers), hybrid=False)
        self.encoder = None  # a VLM's `multimodal.VisionEncoder` (set by build_model)
        self.load_report: list[str] = []  # the loader's lines (`LazyWeights.report`), set by build_model
        self.kv_caches: list[Any] = []
        self.kv_tier = None  # the host tier's store (`allocate_kv_tier`), when the engine has one
        self.contexts: dict[int, LayerContext] = {}
        # The program's results: logits, or on a stage before the last what the next stage needs.
        ops_in_graph = {n.op for n in program.graph.nodes}
        self.outputs = ((program.graph.output,) if program.graph.output else ("logits",) if "lm_head" in ops_in_graph
                        else ("pooled",) if "pool" in ops_in_graph else CARRIED)
        # A VLM's language model: its image rows come with the step (`forward`'s `inputs`), or none.
        self.merges_images = any(c.primitive == "merge_rows" for c in program.calls)
        self._node_ops = {n.name: n.op for n in program.graph.nodes}
        self.has_lora = any(c.primitive == "lora" for c in program.calls)  # LoRA stacks (`core/lora.py`)
        self._load_params(weights, progress)
        # Each MoE layer's tokens-per-expert value: forward returns it (ForwardOutput.expert_counts).
        self._count_outputs = tuple((c.layer, c.outputs[1]) for c in program.primitive_calls() if c.primitive == "moe")
        self._dead = program.dead_after((*self.outputs, *(name for _, name in self._count_outputs)))
        self.attention_key: dict[str, Any] = {}  # the dispatch key of the attention calls (set when bound)
        self._steps: list[Callable[[dict], None]] = []
        self._checked_steps: list[Callable[[dict], None]] = []  # the first forward's; `_validated` set with them

    def _rope_tables(self, program: Program, backend, max_positions: int) -> dict[int, dict[int, Any]]:
        """layer -> {rotary_dim: cos/sin table} for the layers with rotary calls."""
        variant = {n.layer: n.attrs.get("rope") for n in program.graph.nodes if n.op == "attention"}
        tables: dict[tuple, Any] = {}
        per_layer: dict[int, dict[int, Any]] = {}
        for c in program.primitive_calls():
            if c.primitive != "rotary":
                continue
            d, name = c.attrs["rotary_dim"], variant.get(c.layer)
            if (d, name) not in tables:
                params = self.config.rope_variants[name] if name else self.config.rope
                tables[d, name] = backend.asarray(cos_sin_cache(self.config.raw, d, max_positions, params))
            per_layer.setdefault(c.layer, {})[d] = tables[d, name]
        return per_layer

    # -- binding --------------------------------------------------------------
    # Names a checkpoint gives a layer's fp8 KV scales, relative to the attention
    # module (vLLM reads the same): k_scale/v_scale (fp8 checkpoints), one kv_scale
    # for both (older AutoFP8), k_proj/v_proj.output_scale (compressed-tensors).
    KV_SCALE_NAMES = (("k_scale", "v_scale"), ("kv_scale", "kv_scale"), ("k_proj.output_scale", "v_proj.output_scale"))

    def _checkpoint_kv_scales(self, weights: Mapping[str, np.ndarray]) -> list[tuple[float, float]]:
        """Per-layer (k_scale, v_scale) from the checkpoint, 1.0 where it has none."""
        scales, found = [], 0
        calls = self.program.primitive_calls()
        for layer in range(self.program.graph.num_layers):
            attn = next((c for c in calls if c.primitive == "linear" and c.layer == layer
                         and c.params.get("weight", "").endswith("qkv_proj")), None)
            source = self.program.graph.params[attn.params["weight"]].sources[0] if attn else ""
            prefix = source.rsplit(".", 2)[0] + "." if source.endswith("_proj.weight") else None
            pair = (1.0, 1.0)
            for k_name, v_name in self.KV_SCALE_NAMES if prefix else ():
                if prefix + k_name in weights and prefix + v_name in weights:
                    pair = tuple(float(np.asarray(weights[prefix + n], dtype=np.float32).reshape(-1)[0])
                                 for n in (k_name, v_name))
                    if not all(np.isfinite(x) and x > 0 for x in pair):
                        raise ValueError(f"layer {layer}: fp8 KV scales must be positive, got {pair}")
                    found += 1
                    break
            scales.append(pair)
        if 0 < found < len(scales):
            raise ValueError(f"the checkpoint gives fp8 KV scales for {found} of {len(scales)} layers")
        if not found:
            logging.getLogger("infer").warning(
                "kv_cache_dtype fp8: the checkpoint has no k_scale/v_scale, so every scale is 1.0 (as in vLLM); "
                "K and V values beyond +-448 saturate")
        return scales

    def _load_param(self, name: str, weights: Mapping[str, np.ndarray]):
        p = self.program.graph.params[name]
        if p.zeros:
            return self.backend.asarray(np.zeros(p.shape, np.float32), self.dtype)
        missing = [s for s in p.sources if s not in weights]
        if missing:
            raise KeyError(f"checkpoint lacks {', '.join(missing)} (needed for {name})")
        if p.slices:
            parts = [_read_pieces(weights, s, spec) for s, spec in zip(p.sources, p.slices)]
        else:
            parts = [weights[s] for s in p.sources]
        if any(isinstance(x, WeightHandle) for x in parts):
            if p.offset:
                raise ValueError(f"{name}: a quantized checkpoint tensor cannot take the offset {p.offset} "
                                 "this architecture adds to it")
            handle = quant_params.concat_rows(parts, name)
            if isinstance(handle, WeightHandle):
                if p.pad_rows:
                    handle = quant_params.pad_rows(handle, p.pad_rows)
                return quant_params.to_backend(handle, self.backend, self.dtype, p.shape, name)
            if hasattr(weights, "note_dequantized"):  # its parts share no quantized form: float (the load report)
                weights.note_dequantized(p.sources)
            parts = [handle]
        arr = np.concatenate([np.asarray(x) for x in parts]) if len(parts) > 1 else parts[0]
        if p.reshape:
            arr = np.asarray(arr).reshape((p.shape[0] - p.pad_rows,) + p.shape[1:])
        if p.offset:
            arr = np.asarray(arr, dtype=np.float32) + np.float32(p.offset)
        if p.pad_rows:
            arr = np.concatenate([np.asarray(arr), np.zeros((p.pad_rows,) + arr.shape[1:], arr.dtype)])
        if self.quantization == "fp8" and name in self._fp8_params:
            return quant_params.to_backend(quant_params.online_fp8(arr), self.backend, self.dtype, p.shape, name)
        if tuple(arr.shape) != p.shape:
            raise ValueError(f"checkpoint tensor for {name} has shape {tuple(arr.shape)}, the config implies {p.shape}")
        return self.backend.asarray(np.asarray(arr, dtype=np.float32), self.dtype)

    def _load_params(self, weights: Mapping[str, np.ndarray], progress: Callable[[Iterable], Iterable]) -> None:
        """Build every parameter, linear weights first, each prepared by the
        backend as soon as it exists, so a re-layout (a K-major copy) replaces
        its checkpoint copy right away: the load never holds two copies of
        the model, and freed memory is reused by the next weight."""
        params = self.program.graph.params
        uses = Counter(src for p in params.values() for src in p.sources)
        built: dict[tuple[str, ...], Any] = {}  # tied parameters share one tensor
        linears = [c for c in self.program.primitive_calls() if c.primitive == "linear"]
        first = [n for c in linears for n in (c.params["weight"], c.params.get("bias")) if n]
        ops_of = {n.name: n.op for n in self.program.graph.nodes}
        self._fp8_params = {c.params["weight"] for c in linears if ops_of.get(c.node) in ("attention", "mlp")}
        waiting = {id(c): {n for n in (c.params["weight"], c.params.get("bias")) if n} for c in linears}
        users: dict[str, list[Call]] = {}
        for c in linears:
            for n in waiting[id(c)]:
                users.setdefault(n, []).append(c)
        for name in progress(list(dict.fromkeys(first + list(params)))):
            p = params[name]
            # Tied parameters (the same slices of one tensor) share one; sourceless ones (LoRA stacks) never do.
            key = (p.sources, p.slices, p.zeros, p.offset) if p.sources else (name,)
            if key not in built:
                built[key] = self._load_param(name, weights)
            self.tensors[name] = built[key]
            for src in p.sources:
                uses[src] -= 1
                if uses[src] == 0 and hasattr(weights, "pop"):
                    weights.pop(src, None)
            for c in users.get(name, ()):
                waiting[id(c)].discard(name)
                if not waiting[id(c)]:
                    self._prepare_linear(c, built)

    def _prepare_linear(self, call: Call, built: dict[tuple[str, ...], Any]) -> None:
        """Prepare a linear weight and let its other users (a tied embedding)
        read the prepared storage instead of keeping the checkpoint copy."""
        original = self.tensors[call.params["weight"]]
        handle = self._linear_weight(call)
        # A quantized table is read whole (embedding dequantizes rows from the handle).
        replacement = handle.weight if isinstance(handle, DenseWeight) else handle
        if replacement is not original:
            for table in (self.tensors, built):
                for key, t in table.items():
                    if t is original:
                        table[key] = replacement
            if isinstance(handle, WeightHandle) and not isinstance(handle, DenseWeight):
                # A backend that re-lays a quantized weight out frees the loaded arrays now: give
                # their pages back one weight at a time, or they add up to the peak before the end.
                del original
                trim_heap(collect=False)

    def _linear_weight(self, call: Call) -> WeightHandle:
        key = (call.params["weight"], call.params.get("bias"))
        if key not in self._handles:
            bias = self.tensors[key[1]] if key[1] else None
            w = self.tensors[key[0]]
            w = dataclasses.replace(w, bias=bias) if isinstance(w, WeightHandle) else DenseWeight(w, bias)
            self._handles[key] = self.ops.prepare_weight(w)
        return self._handles[key]

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> None:
        """Allocate every layer's cache and bind the program to them (see `LayerContext`)."""
        cfg = self.config
        shape = (num_blocks, block_size, self.num_kv_heads, cfg.head_dim)
        # One tensor of pages per position in a KV group (every layer without a hybrid cache).
        # An encoder's layers attend within the step (`encoder_attention`): no cache at all.
        layers = range(self.kv_groups.num_slots) if self.layers else ()
        if self.kv_cache_dtype != "fp8":
            self.kv_caches = [self.backend.allocate_kv_cache(*shape, self.dtype) for _ in layers]
        else:
            # fp8: uint8 codes in the layout of the backend that writes them (maybe a
            # fallback), placed by this backend, which owns the device.
            owner = self.ops.provider("kv_write", dtype=self.dtype, kv_cache_dtype="fp8")
            if owner is self.backend:
                self.kv_caches = [owner.allocate_kv_cache(*shape, "fp8") for _ in layers]
            else:
                self.kv_caches = [self.backend.asarray(np.zeros(owner.kv_cache_shape(*shape), np.uint8)) for _ in layers]
        fp8 = self.kv_cache_dtype == "fp8"
        slot = self.kv_groups.layer_slot
        self.contexts = {i: LayerContext(i, self.kv_caches[slot[i]], self.kv_cache_dtype,
                                         self.kv_scales[i] if fp8 else None, self._rope.get(i, {}))
                         for i in self.layers}
        fast = self.ops.unchecked()
        self._checked_steps = [self._bind(c, self.ops) for c in self.program.calls]
        self._steps = [self._bind(c, fast) for c in self.program.calls]
        self._validated = False

    def assign_slot(self, param: str, slot: int, rows: np.ndarray) -> None:
        """Write one slot (first index) of a stacked parameter (a LoRA stack) from host rows."""
        self.backend.set_rows(self.tensors[param], slot, self.backend.asarray(rows, self.dtype))

    def allocate_kv_tier(self, num_blocks: int, path: str | None = None) -> None:
        """The host tier's store for this rank's layers (`kv_tier.TierStore`), sized by
        what the backend's `read_blocks` gives per block; a memory-mapped file on a
        host-memory backend or when `path` names one."""
        from .kv_tier import TierStore

        block_bytes = int(self.backend.read_blocks(self.kv_caches[0], np.zeros(0, np.int64)).shape[1])
        self.kv_tier = TierStore(len(self.kv_caches), num_blocks, block_bytes, path, mapped=self.backend.host_memory)

    def release_kv_caches(self) -> None:
        self.kv_caches, self.contexts, self._steps, self._checked_steps = [], {}, [], []
        self.kv_tier = None

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        cfg = self.config
        itemsize = 1 if self.kv_cache_dtype == "fp8" else 4 if self.dtype == "float32" else 2
        return 2 * block_size * self.num_kv_heads * cfg.head_dim * itemsize * self.kv_groups.num_slots

    def _bind(self, c: Call, ops) -> Callable[[dict], None]:
        if c.primitive in VIEW_OPS:
            return _bind_view(c, self.dtype)
        if c.primitive.startswith("fused_"):
            return self._bind_fused(c, ops)
        return self._bind_primitive(c, ops)

    def _bind_primitive(self, c: Call, ops) -> Callable[[dict], None]:
        """One primitive call: its arguments gathered by `SIGNATURES` (the table
        the conformance harness calls through too), its implementation bound once."""
        prim, ctx = c.primitive, self.contexts.get(c.layer) if c.layer is not None else None
        values = dict(zip(value_args(prim), c.inputs))
        named: dict[str, Any] = {}
        for arg in SIGNATURES[prim]:
            if arg.source == "weight" and arg.name in c.params:
                named[arg.name] = self._linear_weight(c) if prim == "linear" else self.tensors[c.params[arg.name]]
            elif arg.source == "attr" and arg.name == "group" and "group" in c.attrs:
                named["group"] = self.groups.get(c.attrs["group"])  # a process group, by the name lowering gave
            elif arg.source == "attr" and arg.name in c.attrs:
                named[arg.name] = c.attrs[arg.name]
            elif arg.source == "layer":
                named[arg.name] = ctx.argument(arg.name, c.attrs)
            elif arg.source == "step":  # the forward puts meta and slot_mapping (of each KV group) in env
                values[arg.name] = self._step_value(arg.name, c.layer)
        key = dispatch_key(prim, dtype=self.dtype, named={**named, **values}, kv_cache_dtype=self.kv_cache_dtype,
                           head_dim=self.config.head_dim)
        if prim == "attention":
            self.attention_key = key
        fn = ops.bind(prim, self._node_ops[c.node], **key)
        args = arguments(prim, {**named, **{k: _Slot(v) for k, v in values.items()}})
        slots = tuple((i, a.name) for i, a in enumerate(args) if isinstance(a, _Slot))
        template = [None if isinstance(a, _Slot) else a for a in args]
        outs = c.outputs
        starts_residual = prim == "rms_norm" and len(c.inputs) == 1 and len(outs) == 2

        no_adapter = prim == "lora"  # a step without adapters (lora_indices None) keeps y as it is

        def run(env):
            if no_adapter and env["lora_indices"] is None:
                env[outs[0]] = env[c.inputs[1]]
                return
            args = template.copy()
            for i, name in slots:
                args[i] = env[name]
            result = fn(*args)
            if starts_residual:  # this norm starts the residual stream: its input is the residual
                env[outs[0]], env[outs[1]] = result, args[0]
            elif len(outs) == 1:
                env[outs[0]] = result
            elif outs:
                for o, r in zip(outs, result):
                    env[o] = r

        return run

    def _bind_fused(self, c: Call, ops) -> Callable[[dict], None]:
        op = c.primitive.removeprefix("fused_")
        params = {role: self.tensors[name] for role, name in c.params.items()}
        for e in c.expansion:  # a linear's weight role gets the prepared handle `linear` reads
            if e.primitive == "linear":
                role = next(r for r, name in c.params.items() if name == e.params["weight"])
                params[role] = self._linear_weight(e)
        # What runs when the backend declines this step (NotImplemented); its temporaries go after.
        expansion = [self._bind(e, ops) for e in c.expansion]
        temporaries = tuple({o for e in c.expansion for o in e.outputs} - set(c.outputs))
        ins, outs, attrs, ctx = c.inputs, c.outputs, c.attrs, self.contexts[c.layer]
        fn = ops.fused(op, self._node_ops[c.node])
        meta_key = self._step_value("meta", c.layer)

        def run(env):
            result = fn(*(env[i] for i in ins), params=params, attrs=attrs, ctx=ctx, meta=env[meta_key])
            if result is NotImplemented:
                if not expansion:
                    raise RuntimeError(f"backend '{self.backend.name}' declined {c.primitive} of {c.node}, "
                                       "which has no expansion")
                for step in expansion:
                    step(env)
                for name in temporaries:
                    env.pop(name, None)
                return
            for o, r in zip(outs, result if len(outs) > 1 else (result,)):
                env[o] = r

        return run

    def _step_value(self, name: str, layer: int | None) -> str:
        """The env name of a step value (``meta``, ``slot_mapping``) as a layer's KV group sees it."""
        group = self.kv_groups.layer_group.get(layer, 0) if layer is not None else 0
        return name if group == 0 else f"{name}.{group}"

    # -- execution ------------------------------------------------------------
    def prepare_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        """A step's host metadata on the device, with the plan of the backend that serves this model's attention
        (an encoder, which has no paged attention, gets the arrays alone)."""
        if not self.layers:
            return self.backend.prepare_metadata(meta)
        return self.ops.prepare_metadata(meta, **self.attention_key)

    def forward(self, input_ids, positions, sample_rows, meta: AttentionMetadata,
                carry: dict[str, Any] | None = None, lora_indices=None, token_type_ids=None,
                inputs: dict[str, Any] | None = None) -> ForwardOutput:
        """Logits [S, vocab] (float32) of the rows in `sample_rows`, and each MoE
        layer's tokens per expert; all inputs on the device. A pipeline stage after
        the first starts from `carry` (the previous stage's ``hidden`` and
        ``residual``); one before the last returns its own carry instead of logits.
        `lora_indices` [T]: each token's LoRA adapter slot (0: none), for a program
        with `lora` calls. A pooling program returns ``pooled`` (float32, one row per
        sequence of `meta`) instead of logits; an encoder with token types reads
        `token_type_ids` [T]. `inputs`: further named inputs (a VLM's ``mm_rows`` and
        ``mm_embeds``, a vision tower's patches); an encoder graph returns its `Graph.output`
        (in the model dtype) as `pooled`."""
        if not self._steps:
            raise RuntimeError("ModelRunner.forward before allocate_kv_caches")
        env = {"input_ids": input_ids, "positions": positions, "sample_rows": sample_rows, "meta": meta,
               "slot_mapping": meta.slot_mapping, "query_start_loc": meta.query_start_loc, **(carry or {})}
        if token_type_ids is not None:
            env["token_type_ids"] = token_type_ids
        if self.merges_images:
            env["mm_rows"] = env["mm_embeds"] = None
        env.update(inputs or {})
        if len(meta.kv_groups or ()) != self.kv_groups.num_groups - 1:
            raise ValueError(f"the step's metadata has {1 + len(meta.kv_groups or ())} block tables; this model's "
                             f"hybrid KV cache has {self.kv_groups.num_groups} groups ({self.kv_groups.describe()})")
        for g, group_meta in enumerate(meta.kv_groups or (), 1):
            env[f"meta.{g}"], env[f"slot_mapping.{g}"] = group_meta, group_meta.slot_mapping
        if self.has_lora:
            env["lora_indices"] = lora_indices  # None: no adapter in the step, the lora calls pass y through
        steps = self._steps if self._validated else self._checked_steps
        for step, dead in zip(steps, self._dead):
            step(env)
            for name in dead:
                del env[name]
        self._validated = True
        counts = {layer: env[name] for layer, name in self._count_outputs}
        if self.outputs is CARRIED:
            return ForwardOutput(None, counts, {name: env[name] for name in CARRIED})
        if self.program.graph.output:
            return ForwardOutput(None, counts, pooled=env[self.outputs[0]])
        if self.outputs == ("pooled",):
            return ForwardOutput(None, counts, pooled=self.backend.cast(env["pooled"], "float32"))
        return ForwardOutput(self.backend.cast(env["logits"], "float32"), counts)


# What a pipeline stage hands the next: the residual stream after its last layer.
CARRIED = ("hidden", "residual")


class _Slot:
    """A value argument's place in a bound call: filled from the step's env by name."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


def _bind_view(c: Call, dtype: str = "float32") -> Callable[[dict], None]:
    """split / reshape / rows and the elementwise ops: what every tensor type has (see `lowering.VIEW_OPS`)."""
    ins, outs, a = c.inputs, c.outputs, c.attrs
    if c.primitive == "add":
        def run(env):
            env[outs[0]] = env[ins[0]] + env[ins[1]]
        return run
    if c.primitive == "scale":
        factor = _round_to(a["factor"], dtype) if a.get("rounded") else float(a["factor"])

        def run(env):
            env[outs[0]] = env[ins[0]] * factor
        return run
    if c.primitive == "soft_cap":
        cap = float(a["cap"])

        def run(env):
            x = env[ins[0]] / cap
            env[outs[0]] = (x.tanh() if hasattr(x, "tanh") else np.tanh(x)) * cap
        return run
    if c.primitive == "split":
        bounds = [int(b) for b in np.cumsum((0,) + tuple(a["sizes"]))]
        pieces = tuple((o, slice(lo, hi)) for o, lo, hi in zip(outs, bounds[:-1], bounds[1:]))

        def run(env):
            x = env[ins[0]]
            for o, cols in pieces:
                env[o] = x[:, cols]
    elif c.primitive == "reshape":
        shape = a["shape"]

        def run(env):
            env[outs[0]] = env[ins[0]].reshape(shape)
    elif c.primitive == "vocab_ids":
        start, size = a["start"], a["size"]

        def run(env):
            local = env[ins[0]] - start
            valid = (local >= 0) & (local < size)
            env[outs[0]], env[outs[1]] = local * valid, valid  # out-of-shard ids read row 0, masked next
    elif c.primitive == "merge_rows":
        def run(env):
            x, rows = env[ins[0]], env[ins[1]]
            if rows is not None:  # the embedding's output is this step's own: written in place
                x[rows] = env[ins[2]]
            env[outs[0]] = x
    elif c.primitive == "mask_rows":
        def run(env):
            env[outs[0]] = env[ins[0]] * env[ins[1]][:, None]
    else:
        def run(env):
            env[outs[0]] = env[ins[0]][env[ins[1]]]
    return run


def _round_to(value: float, dtype: str) -> float:
    """`value` rounded to `dtype` (what a model computing in that dtype multiplies by)."""
    if dtype == "bfloat16":
        bits = int(np.float32(value).view(np.uint32))
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # round to nearest even
        return float(np.uint32(bits).view(np.float32))
    return float(np.dtype(dtype).type(value)) if dtype in ("float16", "float32") else float(value)


def _read_pieces(weights: Mapping[str, Any], source: str, spec):
    """This rank's pieces of one checkpoint tensor (see `Param.slices`), concatenated."""
    if spec is None:
        return weights[source]
    axis, ranges = spec
    read = getattr(weights, "read_slice", None)
    pieces = []
    for lo, hi in ranges:
        if read is not None:
            piece = read(source, axis, lo, hi)
        else:
            whole = weights[source]
            if isinstance(whole, WeightHandle):
                piece = quant_params.slice_handle(whole, axis, lo, hi)
            else:
                piece = np.asarray(whole)[(slice(None),) * axis + (slice(lo, hi),)]
        pieces.append(piece)
    if len(pieces) == 1:
        return pieces[0]
    if isinstance(pieces[0], WeightHandle):
        if axis != 0:
            raise ValueError(f"{source}: a quantized tensor is sharded by rows or by one column range, "
                             f"not by {len(pieces)} column ranges")
        return quant_params.concat_rows(pieces, source)
    return np.concatenate(pieces, axis=axis)
