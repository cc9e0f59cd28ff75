"""Runs a lowered program on a backend: binds weights and KV caches once, then
executes one flattened batch per `forward`."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ..primitives.spec import PRIMITIVES
from ..primitives.types import AttentionMetadata, DenseWeight
from .lowering import Call, Program
from .rope import cos_sin_cache


_PRIMITIVE_SET = frozenset(PRIMITIVES)


class ModelRunner:
    def __init__(self, program: Program, backend, ops, weights: Mapping[str, np.ndarray], dtype: str,
                 max_positions: int, progress: Callable[[Iterable], Iterable] = iter):
        """`ops` validates arguments (Ops(backend)); the first forward runs
        through it, later ones through an unchecked twin, since the program's
        shapes do not change between steps.

        `weights` (checkpoint name -> array) is consumed: each entry is dropped
        once the last parameter built from it exists, so loading never holds
        the checkpoint and the device copy of all of it at once.
        """
        self.program, self.backend, self.ops, self.dtype = program, backend, ops, dtype
        self.config = program.graph.config
        self.tensors: dict[str, Any] = {}
        params = program.graph.params
        uses = Counter(src for p in params.values() for src in p.sources)
        built: dict[tuple[str, ...], Any] = {}  # tied parameters share one tensor
        for name in progress(list(params)):
            p = params[name]
            if p.sources not in built:
                built[p.sources] = self._load_param(name, weights)
            self.tensors[name] = built[p.sources]
            for src in p.sources:
                uses[src] -= 1
                if uses[src] == 0 and isinstance(weights, dict):
                    weights.pop(src, None)
        self._handles: dict[tuple, DenseWeight] = {}
        self._rope: dict[int, Any] = {}
        self.max_positions = max_positions
        self.kv_caches: list[Any] = []
        self._prepare_linear_weights()
        fast = type(ops)(backend, validate=False)
        self._checked_steps = [self._bind(c, ops) for c in program.calls]
        self._steps = [self._bind(c, fast) for c in program.calls]
        self._dead = program.dead_after()
        self._validated = False

    # -- binding --------------------------------------------------------------
    def _load_param(self, name: str, weights: Mapping[str, np.ndarray]):
        p = self.program.graph.params[name]
        missing = [s for s in p.sources if s not in weights]
        if missing:
            raise KeyError(f"checkpoint lacks {', '.join(missing)} (needed for {name})")
        arr = np.concatenate([np.asarray(weights[s]) for s in p.sources]) if len(p.sources) > 1 else weights[p.sources[0]]
        if tuple(arr.shape) != p.shape:
            raise ValueError(f"checkpoint tensor for {name} has shape {tuple(arr.shape)}, the config implies {p.shape}")
        return self.backend.asarray(np.asarray(arr, dtype=np.float32), self.dtype)

    def _linear_weight(self, call: Call) -> DenseWeight:
        key = (call.params["weight"], call.params.get("bias"))
        if key not in self._handles:
            bias = self.tensors[key[1]] if key[1] else None
            self._handles[key] = self.ops.prepare_weight(DenseWeight(self.tensors[key[0]], bias))
        return self._handles[key]

    def _prepare_linear_weights(self) -> None:
        """Prepare every linear weight before anything binds a tensor, and let
        the other users of a weight (a tied embedding) read the prepared
        storage, so a backend's re-layout replaces the checkpoint copy
        instead of doubling it."""
        for c in self.program.calls:
            if c.primitive != "linear":
                continue
            original = self.tensors[c.params["weight"]]
            handle = self._linear_weight(c)
            if handle.weight is not original:
                for name, t in self.tensors.items():
                    if t is original:
                        self.tensors[name] = handle.weight

    def _rope_cache(self, rotary_dim: int):
        if rotary_dim not in self._rope:
            table = cos_sin_cache(self.config.raw, rotary_dim, self.max_positions)
            self._rope[rotary_dim] = self.backend.asarray(table)
        return self._rope[rotary_dim]

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> None:
        cfg = self.config
        self.kv_caches = [self.backend.allocate_kv_cache(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype)
                          for _ in range(self.program.graph.num_layers)]

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        cfg = self.config
        itemsize = 4 if self.dtype == "float32" else 2
        return 2 * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize * self.program.graph.num_layers

    def _bind(self, c: Call, ops) -> Callable[[dict], None]:
        ins, outs, a = c.inputs, c.outputs, c.attrs
        kind = c.primitive
        static = {"dtype": self.dtype}
        if kind == "linear":
            handle = self._linear_weight(c)
            static["weight_kind"] = handle.kind
        elif kind == "attention":
            static.update(head_dim=self.config.head_dim, sliding_window=a["sliding_window"] is not None,
                          soft_cap=a["soft_cap"] is not None)
        fn = ops.resolve(kind, **static)[0] if kind in _PRIMITIVE_SET else None
        if kind == "embedding":
            table = self.tensors[c.params["table"]]
            def run(env):
                env[outs[0]] = fn(env[ins[0]], table)
        elif kind == "rms_norm":
            w, eps = self.tensors[c.params["weight"]], a["eps"]
            if len(ins) == 2:
                def run(env):
                    env[outs[0]], env[outs[1]] = fn(env[ins[0]], w, eps, residual=env[ins[1]])
            else:
                def run(env):
                    x = env[ins[0]]
                    env[outs[0]] = fn(x, w, eps)
                    if len(outs) == 2:  # this norm starts the residual stream
                        env[outs[1]] = x
        elif kind == "linear":
            def run(env):
                env[outs[0]] = fn(env[ins[0]], handle)
        elif kind == "split":
            bounds = np.cumsum((0,) + tuple(a["sizes"]))
            def run(env):
                x = env[ins[0]]
                for o, lo, hi in zip(outs, bounds[:-1], bounds[1:]):
                    env[o] = x[:, int(lo):int(hi)]
        elif kind == "reshape":
            shape = a["shape"]
            def run(env):
                env[outs[0]] = env[ins[0]].reshape(shape)
        elif kind == "rows":
            def run(env):
                env[outs[0]] = env[ins[0]][env[ins[1]]]
        elif kind == "rotary":
            cache, neox = self._rope_cache(a["rotary_dim"]), a["neox_style"]
            def run(env):
                env[outs[0]], env[outs[1]] = fn(env[ins[0]], env[ins[1]], env[ins[2]], cache, neox)
        elif kind == "act_and_mul":
            act = a["kind"]
            def run(env):
                env[outs[0]] = fn(env[ins[0]], act)
        elif kind == "kv_write":
            layer = c.layer
            def run(env):
                meta = env["meta"]
                fn(env[ins[0]], env[ins[1]], self.kv_caches[layer], meta.slot_mapping)
        elif kind == "attention":
            layer, scale, window, cap = c.layer, a["scale"], a["sliding_window"], a["soft_cap"]
            def run(env):
                env[outs[0]] = fn(env[ins[0]], self.kv_caches[layer], env["meta"], scale, window, cap)
        elif kind.startswith("fused_"):
            fn = getattr(self.backend, kind)
            params = {role: self.tensors[name] for role, name in c.params.items()}
            def run(env):
                result = fn(*(env[i] for i in ins), params=params, attrs=a, env=env, runner=self)
                for o, r in zip(outs, result if len(outs) > 1 else (result,)):
                    env[o] = r
        else:
            raise ValueError(f"cannot execute {kind!r} (call of {c.node})")
        return run

    # -- execution ------------------------------------------------------------
    def forward(self, input_ids, positions, sample_rows, meta: AttentionMetadata):
        """Logits [S, vocab] (float32) of the rows in `sample_rows`; all inputs on the device."""
        env = {"input_ids": input_ids, "positions": positions, "sample_rows": sample_rows, "meta": meta}
        steps = self._steps if self._validated else self._checked_steps
        for step, dead in zip(steps, self._dead):
            step(env)
            for name in dead:
                del env[name]
        self._validated = True
        return self.backend.cast(env["logits"], "float32")
