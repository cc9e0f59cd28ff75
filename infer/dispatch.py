"""The one place that decides which implementation serves each call, and can say so.

For a backend, `Ops` resolves every primitive through the declarations alone:
the first backend of its fallback chain whose `supports(...)` says yes
provides it; that provider's declared `FastPath`, if any, is tried first and
may decline a call. Lowering asks `Ops.fuses` whether a node runs whole; a
fused node may decline a step, and then the node's primitives run. Decode
graphs are asked for through `Ops.decode_graphs`.

With a `DispatchTrace`, every bound call counts which of these served it:
``infer run --trace-dispatch`` prints the table (node × call × implementation
× calls) for the run.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from .primitives.backend import Backend
from .primitives.binding import weight_key
from .primitives.spec import CHECKS, PRIMITIVES
from .primitives.types import Support, expand_block_table
from .registry import BackendUnavailableError, get_backend


@dataclass
class DispatchTrace:
    """Calls counted by (node, call, implementation) over a run.

    node            the graph node kind a call belongs to ('attention', 'mlp', ...;
                    'sampler' for `sample`).
    call            a primitive, or ``fused_<node>`` for a fused node.
    implementation  ``backend`` (its general implementation), ``backend:fast path``
                    (e.g. ``torch:native``), ``backend (fallback)`` when served by a
                    backend of the fallback chain, ``backend:fused`` for a fused
                    node, and ``declined`` when a fused node handed a step to its
                    primitives.
    """

    counts: Counter = field(default_factory=Counter)
    # With `timed`, also the wall seconds each (node, call, implementation) took (no
    # device sync: on an accelerator that is launch time, on the CPU compute time).
    timed: bool = False
    seconds: Counter = field(default_factory=Counter)

    def count(self, node: str, call: str, implementation: str, n: int = 1) -> None:
        self.counts[(node, call, implementation)] += n

    def clear(self) -> None:
        self.counts.clear()
        self.seconds.clear()

    def rows(self) -> list[tuple[str, str, str, int]]:
        return [(*k, n) for k, n in sorted(self.counts.items())]

    def format(self) -> str:
        head = ("node", "call", "implementation", "calls")
        rows = [head] + [(a, b, c, str(n)) for a, b, c, n in self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Implementation:
    """How one primitive is served for one dispatch key."""

    general: Callable
    provider: Backend
    label: str  # the general implementation's trace label
    fast: Callable | None = None
    fast_label: str = ""


class Ops:
    """The primitives of one backend, each resolved to an implementation.

    ``ops.attention(...)`` calls the backend's own attention if it supports it,
    else its fallback's. `resolve` answers for specific static properties
    (dtype, weight kind, ...), which is how the runner binds a call site once
    instead of deciding per call.
    """

    def __init__(self, backend: Backend, validate: bool = True, trace: DispatchTrace | None = None):
        self.backend = backend
        self.validate = validate
        self.trace = trace
        self._chain = [backend]
        seen = {backend.name}
        while (next_name := self._chain[-1].fallback) is not None and next_name not in seen:
            seen.add(next_name)
            self._chain.append(get_backend(next_name, device=backend.device))
        self._impls: dict[tuple, Implementation] = {}
        self._cache: dict[tuple, tuple[Callable, str]] = {}
        for prim in PRIMITIVES:
            try:
                fn, _ = self.resolve(prim)
            except BackendUnavailableError:
                continue  # reported by `coverage`; calling it raises AttributeError
            setattr(self, prim, fn)
        self._check_cache_layout()

    def unchecked(self) -> Ops:
        """The same resolution without argument checks (for steps after the first)."""
        return Ops(self.backend, validate=False, trace=self.trace)

    # -- resolution --------------------------------------------------------------
    def implementation(self, primitive: str, **kw: Any) -> Implementation:
        key = (primitive, tuple(sorted(kw.items())))
        impl = self._impls.get(key)
        if impl is None:
            reasons = []
            needs = [arg for k, arg in _NEWER_ARGS.get(primitive, ()) if kw.get(k)]
            for b in self._chain:
                missing = [arg for arg in needs if not _takes(getattr(b, primitive, None), arg)]
                ok = b.supports(primitive, **kw) if not missing else Support(
                    False, f"backend '{b.name}' {primitive} takes no {missing[0]!r} argument (added to the contract later)")
                if ok:
                    break
                reasons.append(ok.reason)
            else:
                raise BackendUnavailableError(f"{primitive} unsupported: " + "; ".join(reasons))
            label = b.name if b is self.backend else f"{b.name} (fallback)"
            fast = b.fast_path(primitive, **kw) if b.api_version >= 2 else None
            if fast is not None and not all(_takes(fast.fn, arg) for arg in needs):
                fast = None  # a fast path written before the argument existed cannot serve the call
            impl = Implementation(getattr(b, primitive), b, label, fast and fast.fn, fast and f"{b.name}:{fast.name}")
            self._impls[key] = impl
        return impl

    def resolve(self, primitive: str, **kw: Any) -> tuple[Callable, str]:
        """(implementation, name of the backend providing it) for `primitive`: its
        fast path composed with its general implementation, argument-checked
        when this `Ops` validates. Not counted by a trace (see `bind`)."""
        key = (primitive, tuple(sorted(kw.items())))
        if key not in self._cache:
            impl = self.implementation(primitive, **kw)
            fn = _composed(impl.fast, impl.general)
            self._cache[key] = (_checked(primitive, fn) if self.validate else fn, impl.provider.name)
        return self._cache[key]

    def bind(self, primitive: str, node: str, **kw: Any) -> Callable:
        """The callable for one call site of `node`; counted when tracing."""
        if self.trace is None:
            return self.resolve(primitive, **kw)[0]
        impl, trace = self.implementation(primitive, **kw), self.trace
        count, seconds = trace.count, trace.seconds
        fast, general = impl.fast, impl.general

        def call(*args):
            start = time.perf_counter() if trace.timed else 0.0
            label, out = impl.label, NotImplemented
            if fast is not None:
                out = fast(*args)
                label = impl.fast_label
            if out is NotImplemented:
                label, out = impl.label, general(*args)
            count(node, primitive, label)
            if start:
                seconds[(node, primitive, label)] += time.perf_counter() - start
            return out

        return _checked(primitive, call) if self.validate else call

    def provider(self, primitive: str, **kw: Any) -> Backend:
        """The backend instance that runs `primitive`."""
        return self.implementation(primitive, **kw).provider

    # -- whole nodes and steps ---------------------------------------------------
    def fuses(self, node_op: str, **attrs: Any) -> Support:
        """Whether the backend runs graph node `node_op` whole (`Backend.fuses`)."""
        fn = getattr(self.backend, f"fused_{node_op}", None)
        if self.backend.api_version < 2 or (fn is not None and _takes(fn, "runner")):
            return Support(False, f"backend '{self.backend.name}' is built for contract v1, whose fused nodes "
                                  "took the runner; its primitives run instead")
        return self.backend.fuses(node_op, **attrs)

    def fused(self, node_op: str, node: str) -> Callable:
        """The backend's ``fused_<node_op>``, counted when tracing (a declined step,
        whose primitives then run, counts as 'declined')."""
        fn = getattr(self.backend, f"fused_{node_op}")
        if self.trace is None:
            return fn
        count, served = self.trace.count, f"{self.backend.name}:fused"

        def call(*args, **kw):
            out = fn(*args, **kw)
            count(node, f"fused_{node_op}", "declined" if out is NotImplemented else served)
            return out

        return call

    def decode_graphs(self, forward, **kw: Any):
        """The backend's captured decode (`Backend.decode_graphs`), or None."""
        if self.backend.api_version < 2 or _takes(self.backend.decode_graphs, "runner"):
            return None  # v1 handed it the runner
        return self.backend.decode_graphs(forward, **kw)

    def prepare_metadata(self, meta, **kw: Any):
        """A step's host metadata on the backend's device, with the plan of the
        backend that serves attention for the dispatch key `kw` (maybe a
        fallback, whose kernel then finds its own plan)."""
        if meta.kv_groups:  # a hybrid cache: each group's metadata on its own (`AttentionMetadata.kv_groups`)
            out = self.prepare_metadata(dataclasses.replace(meta, kv_groups=None), **kw)
            out.kv_groups = tuple(self.prepare_metadata(m, **kw) for m in meta.kv_groups)
            return out
        provider = self.provider("attention", **kw)
        if meta.block_sizes is not None and not provider.native_block_sizes:
            meta = expand_block_table(meta)
        if provider.api_version < 2:  # v1: the provider moved the arrays and attached `backend_data` itself
            return provider.prepare_metadata(meta)
        out = self.backend.prepare_metadata(meta)
        out.plan = provider.plan_attention(meta)
        return out

    def prepare_weight(self, weight):
        return self.provider("linear", **weight_key(weight)).prepare_weight(weight)

    def _check_cache_layout(self) -> None:
        # kv_write, attention and the cache itself must agree on the layout; a
        # fallback with another layout would read garbage silently.
        probe = (3, 16, 2, 8)
        own = self.backend.kv_cache_shape(*probe)
        for prim in ("kv_write", "attention"):
            try:
                other = self.provider(prim)
            except BackendUnavailableError:
                continue
            if other is not self.backend and other.kv_cache_shape(*probe) != own:
                raise BackendUnavailableError(
                    f"backend '{self.backend.name}' lays out its KV cache as {self.backend.kv_cache_layout} but takes "
                    f"{prim} from '{other.name}', which expects {other.kv_cache_layout}; implement {prim} or keep the layout")

    def coverage(self, **kw: Any) -> dict[str, str]:
        """primitive -> provider name, or 'missing: reason'."""
        out = {}
        for prim in PRIMITIVES:
            try:
                out[prim] = self.provider(prim, **kw).name
            except BackendUnavailableError as exc:
                out[prim] = f"missing: {exc}"
        return out

    def fast_paths(self, **kw: Any) -> dict[str, str]:
        """primitive -> the trace label of its declared fast path (e.g. 'torch:native'), where it has one."""
        out = {}
        for prim in PRIMITIVES:
            try:
                impl = self.implementation(prim, **kw)
            except BackendUnavailableError:
                continue
            if impl.fast is not None:
                out[prim] = impl.fast_label
        return out


# Optional arguments added to a primitive after v2 shipped: (dispatch key, argument).
# A backend (or fast path) whose method lacks the argument is not asked to serve a
# call that passes it, so a plugin written before it keeps working through its fallback.
_NEWER_ARGS = {
    "attention": (("sinks", "sinks"),),
    "moe": (("expert_bias", "w13_bias"), ("moe_activation", "activation"), ("routing", "expert_groups")),
}


def _takes(fn: Callable, name: str) -> bool:
    """Whether `fn` has a parameter `name` (a v1 class that inherits the current
    api_version still shows its v1 signatures)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _composed(fast: Callable | None, general: Callable) -> Callable:
    if fast is None:
        return general

    def call(*args, **kwargs):
        out = fast(*args, **kwargs)
        return general(*args, **kwargs) if out is NotImplemented else out

    return call


def _checked(primitive: str, fn: Callable) -> Callable:
    check = CHECKS[primitive]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        check(*args, **kwargs)
        return fn(*args, **kwargs)

    return call
