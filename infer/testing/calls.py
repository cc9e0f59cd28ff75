"""How each primitive is called on a backend, exactly as the core calls it.

One function per primitive takes a `Harness` and a case's host inputs, moves
them to the backend (`asarray`, `prepare_metadata`, `prepare_sampling`,
`prepare_weight`), calls the implementation `Ops.resolve` picks (the
backend's own or its fallback's) and brings the results home with `to_numpy`.
The oracle runs through the very same functions on `cpu_ref` in float32, so a
difference between the two runs is a difference between the backends.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..primitives.backend import Backend
from ..primitives.types import DenseWeight, SampleOutput, dtype_name
from ..registry import Ops
from .quant_inputs import handle as quantized_handle


class Harness:
    """One call of one primitive on one backend in one dtype; collects results."""

    def __init__(self, backend: Backend, ops: Ops, dtype: str):
        self.backend, self.ops, self.dtype = backend, ops, dtype
        self.outputs: dict[str, np.ndarray] = {}
        self.problems: list[str] = []
        self.provider: str | None = None

    def f(self, x: np.ndarray | None) -> Any:
        """A float input, in the case dtype."""
        return None if x is None else self.backend.asarray(x, self.dtype)

    def i(self, x: np.ndarray) -> Any:
        """An integer (or fixed float32) input, in its own dtype."""
        return self.backend.asarray(x)

    def fn(self, primitive: str, helper: bool = False, **kw: Any) -> Callable:
        """The implementation the core would use; raises BackendUnavailableError."""
        fn, provider = self.ops.resolve(primitive, dtype=self.dtype, **kw)
        if not helper:
            self.provider = provider
        return fn

    def out(self, name: str, x: Any, like: Any = None, dtype: str | None = None) -> None:
        """Record a result; its dtype must be `like`'s (the input's) or `dtype`."""
        want = dtype_name(like) if like is not None else dtype
        if want is not None and dtype_name(x) != want:
            self.problems.append(f"{name} has dtype {dtype_name(x)}, expected {want}")
        self.outputs[name] = np.asarray(self.backend.to_numpy(x))


def call_embedding(h: Harness, x: dict) -> None:
    if x["quant"] is not None:
        table = quantized_handle(x["quant"], h.i, None, h.dtype)
        # Prepared as the runner prepares a tied lm_head: by linear's provider.
        table = h.ops.provider("linear", dtype=h.dtype, weight_kind=table.kind).prepare_weight(table)
        like = h.f(np.zeros(0, np.float32))  # the backend's storage of the case dtype
        h.out("out", h.fn("embedding", weight_kind=table.kind)(h.i(x["ids"]), table), like=like)
        return
    table = h.f(x["table"])
    h.out("out", h.fn("embedding")(h.i(x["ids"]), table), like=table)


def call_rms_norm(h: Harness, x: dict) -> None:
    fn = h.fn("rms_norm")
    xx, w = h.f(x["x"]), h.f(x["weight"])
    if x["residual"] is None:
        h.out("out", fn(xx, w, x["eps"]), like=xx)
    else:
        y, residual = fn(xx, w, x["eps"], h.f(x["residual"]))
        h.out("out", y, like=xx)
        h.out("residual", residual, like=xx)


def call_linear(h: Harness, x: dict) -> None:
    xx = h.f(x["x"])
    if x["quant"] is not None:
        weight = quantized_handle(x["quant"], h.i, h.f(x["bias"]), h.dtype)
    else:
        weight = DenseWeight(h.f(x["weight"]), h.f(x["bias"]))
    weight = h.ops.provider("linear", dtype=h.dtype, weight_kind=weight.kind).prepare_weight(weight)
    h.out("out", h.fn("linear", weight_kind=weight.kind)(xx, weight), like=xx)


def call_rotary(h: Harness, x: dict) -> None:
    q, k = h.f(x["q"]), h.f(x["k"])
    fn = h.fn("rotary")
    q_out, k_out = fn(q, k, h.i(x["positions"]), h.i(x["cos_sin_cache"]), x["neox_style"])
    h.out("q", q_out, like=q)
    h.out("k", k_out, like=k)


def call_act_and_mul(h: Harness, x: dict) -> None:
    xx = h.f(x["x"])
    h.out("out", h.fn("act_and_mul")(xx, x["kind"]), like=xx)


def _cache_outputs(h: Harness, cache: Any, shape: tuple[int, ...], owner: Backend | None = None) -> None:
    k, v = (owner or h.backend).kv_cache_to_numpy(cache)
    for name, c in (("k_cache", k), ("v_cache", v)):
        if tuple(c.shape) != shape:
            h.problems.append(f"kv_cache_to_numpy gave {name} shape {tuple(c.shape)}, expected {shape}")
        h.outputs[name] = np.asarray(c, dtype=np.float32)


def _kv(h: Harness, x: dict, primitive: str, helper: bool = False, **kw: Any):
    """(implementation, backend that owns the cache) for the case's cache dtype."""
    if x.get("kv_scales") is None:
        return h.fn(primitive, helper=helper, **kw), h.backend
    fn = h.fn(primitive, helper=helper, kv_cache_dtype="fp8", **kw)
    return fn, h.ops.provider("kv_write", dtype=h.dtype, kv_cache_dtype="fp8")


def _allocate(h: Harness, x: dict, owner: Backend) -> Any:
    """The case's cache. An fp8 cache is uint8 codes in the layout of the
    backend that writes it, placed by the backend under test (a fallback
    instance may not know the device, as under the Ascend emulation)."""
    if not x.get("kv_scales"):
        return h.backend.allocate_kv_cache(*x["cache_shape"], h.dtype)
    if owner is h.backend:
        return owner.allocate_kv_cache(*x["cache_shape"], "fp8")
    return h.backend.asarray(np.zeros(owner.kv_cache_shape(*x["cache_shape"]), np.uint8))


def call_kv_write(h: Harness, x: dict) -> None:
    fn, owner = _kv(h, x, "kv_write")
    cache = _allocate(h, x, owner)
    fn(h.f(x["k"]), h.f(x["v"]), cache, h.i(x["slot_mapping"]), x["kv_scales"])
    # An fp8 cache comes back as its codes' values: backends must store the same codes.
    _cache_outputs(h, cache, x["cache_shape"], owner)


def call_copy_blocks(h: Harness, x: dict) -> None:
    write = h.fn("kv_write", helper=True)
    cache = h.backend.allocate_kv_cache(*x["cache_shape"], h.dtype)
    write(h.f(x["k"]), h.f(x["v"]), cache, h.i(x["slot_mapping"]), None)
    # Plumbing, not a primitive: always the backend's own (it owns the layout).
    h.provider = h.backend.name
    h.backend.copy_blocks(cache, x["src"], x["dst"])
    _cache_outputs(h, cache, x["cache_shape"])


def call_attention(h: Harness, x: dict) -> None:
    d = x["q"].shape[-1]
    fn, owner = _kv(h, x, "attention", head_dim=d, sliding_window=x["sliding_window"] is not None,
                    soft_cap=x["soft_cap"] is not None)
    write, _ = _kv(h, x, "kv_write", helper=True)
    scales = x.get("kv_scales")
    cache = _allocate(h, x, owner)
    # The cached context arrives in an earlier step, this step's K/V just
    # before attention: the order the model runner uses.
    if len(x["cached_slots"]):
        write(h.f(x["cached_k"]), h.f(x["cached_v"]), cache, h.i(x["cached_slots"]), scales)
    meta = h.backend.prepare_metadata(x["meta"])
    if len(x["new_k"]):
        write(h.f(x["new_k"]), h.f(x["new_v"]), cache, meta.slot_mapping, scales)
    q = h.f(x["q"])
    extra = {"kv_scales": scales} if scales else {}
    h.out("out", fn(q, cache, meta, x["scale"], x["sliding_window"], x["soft_cap"], **extra), like=q)


def call_moe(h: Harness, x: dict) -> None:
    xx = h.f(x["x"])
    shared = () if x["shared"] is None else (h.f(x["shared"]), h.f(x["shared_gate"]))
    fn = h.fn("moe", shared_expert=True) if shared else h.fn("moe")
    out, counts = fn(xx, h.f(x["router_logits"]), h.f(x["w13"]), h.f(x["w2"]), x["top_k"], x["renormalize"], *shared)
    h.out("out", out, like=xx)
    h.out("tokens_per_expert", counts, dtype="int64")


def call_sample(h: Harness, x: dict) -> None:
    params = h.backend.prepare_sampling(x["params"])
    res: SampleOutput = h.fn("sample")(h.i(x["logits"]), params)
    h.out("token_ids", res.token_ids, dtype="int64")
    h.out("logprobs", res.logprobs, dtype="float32")
    if x["params"].max_num_logprobs:
        if res.top_token_ids is None or res.top_logprobs is None:
            h.problems.append("max_num_logprobs > 0 but top_token_ids/top_logprobs is None")
            return
        h.out("top_token_ids", res.top_token_ids, dtype="int64")
        h.out("top_logprobs", res.top_logprobs, dtype="float32")
        if res.ranks is None:
            h.problems.append("max_num_logprobs > 0 but ranks is None")
            return
        h.out("ranks", res.ranks, dtype="int64")


# Collectives: `x["x"]` is this rank's input (set by the worker process).
def call_all_reduce(h: Harness, x: dict) -> None:
    xx = h.f(x["x"])
    h.out("out", h.fn("all_reduce")(xx), like=xx)


def call_all_gather(h: Harness, x: dict) -> None:
    xx = h.f(x["x"])
    h.out("out", h.fn("all_gather")(xx, x["dim"]), like=xx)


CALLS: dict[str, Callable[[Harness, dict], None]] = {
    name.removeprefix("call_"): fn for name, fn in globals().items() if name.startswith("call_")
}


def invoke(backend: Backend, ops: Ops, primitive: str, inputs: dict, dtype: str) -> Harness:
    """Run one primitive on `backend` in `dtype`; the harness holds the results."""
    h = Harness(backend, ops, dtype)
    CALLS[primitive](h, inputs)
    return h
