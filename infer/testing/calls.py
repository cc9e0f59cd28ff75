"""How each primitive is called on a backend, exactly as the core calls it.

One function per primitive takes a `Harness` and a case's host inputs, moves
them to the backend (`asarray`, `prepare_metadata`, `prepare_sampling`,
`prepare_weight`), calls it through `Harness.call`, which orders the arguments
and derives the dispatch key from the same table the model runner binds with
(`infer.primitives.binding`), so the implementation `Ops.resolve` picks (a
fast path, the backend's own or its fallback's) is the runtime's, and brings
the results home with `to_numpy`.
The oracle runs through the very same functions on `cpu_ref` in float32, so a
difference between the two runs is a difference between the backends.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..primitives.backend import Backend
from ..primitives.binding import arguments, dispatch_key
from ..primitives.types import DenseWeight, SampleOutput, dtype_name
from ..dispatch import Ops
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

    def key(self, primitive: str, kv_cache_dtype: str = "auto", head_dim: int | None = None, **named: Any) -> dict:
        """The dispatch key the model runner would use for such a call (`binding.dispatch_key`)."""
        return dispatch_key(primitive, dtype=self.dtype, named=named, kv_cache_dtype=kv_cache_dtype, head_dim=head_dim)

    def call(self, primitive: str, *, helper: bool = False, kv_cache_dtype: str = "auto", head_dim: int | None = None,
             **named: Any) -> Any:
        """Call `primitive` with arguments by name, as the model runner does: the
        implementation resolved for `dispatch_key`, the arguments ordered by
        `binding.SIGNATURES`. A helper call (a kv_write setting up attention)
        does not count as the case's provider."""
        key = dispatch_key(primitive, dtype=self.dtype, named=named, kv_cache_dtype=kv_cache_dtype, head_dim=head_dim)
        fn, provider = self.ops.resolve(primitive, **key)
        if not helper:
            self.provider = provider
        return fn(*arguments(primitive, named))

    def out(self, name: str, x: Any, like: Any = None, dtype: str | None = None) -> None:
        """Record a result; its dtype must be `like`'s (the input's) or `dtype`."""
        want = dtype_name(like) if like is not None else dtype
        if want is not None and dtype_name(x) != want:
            self.problems.append(f"{name} has dtype {dtype_name(x)}, expected {want}")
        self.outputs[name] = np.asarray(self.backend.to_numpy(x))


def _prepared(h: Harness, weight) -> Any:
    """A weight prepared by the backend that runs `linear` for its kind, as the runner prepares it."""
    return h.ops.provider("linear", **h.key("linear", weight=weight)).prepare_weight(weight)


def call_embedding(h: Harness, x: dict) -> None:
    if x["quant"] is not None:
        # Prepared as the runner prepares a tied lm_head: by linear's provider.
        table = _prepared(h, quantized_handle(x["quant"], h.i, None, h.dtype))
        like = h.f(np.zeros(0, np.float32))  # the backend's storage of the case dtype
        h.out("out", h.call("embedding", ids=h.i(x["ids"]), table=table), like=like)
        return
    table = h.f(x["table"])
    h.out("out", h.call("embedding", ids=h.i(x["ids"]), table=table), like=table)


def call_rms_norm(h: Harness, x: dict) -> None:
    _norm(h, x, "rms_norm")


def _norm(h: Harness, x: dict, primitive: str) -> None:
    """rms_norm or layer_norm: y, and with a residual the sum it returns too."""
    xx, extra = h.f(x["x"]), {"bias": h.f(x["bias"])} if primitive == "layer_norm" else {}
    out = h.call(primitive, x=xx, weight=h.f(x["weight"]), eps=x["eps"], residual=h.f(x["residual"]), **extra)
    if x["residual"] is None:
        h.out("out", out, like=xx)
    else:
        y, residual = out
        h.out("out", y, like=xx)
        h.out("residual", residual, like=xx)


def call_linear(h: Harness, x: dict) -> None:
    xx = h.f(x["x"])
    if x["quant"] is not None:
        weight = quantized_handle(x["quant"], h.i, h.f(x["bias"]), h.dtype)
    else:
        weight = DenseWeight(h.f(x["weight"]), h.f(x["bias"]))
    h.out("out", h.call("linear", x=xx, weight=_prepared(h, weight)), like=xx)


def call_rotary(h: Harness, x: dict) -> None:
    q, k = h.f(x["q"]), h.f(x["k"])
    q_out, k_out = h.call("rotary", q=q, k=k, positions=h.i(x["positions"]), cos_sin_cache=h.i(x["cos_sin_cache"]),
                          neox_style=x["neox_style"])
    h.out("q", q_out, like=q)
    h.out("k", k_out, like=k)


def call_act_and_mul(h: Harness, x: dict) -> None:
    xx = h.f(x["x"])
    h.out("out", h.call("act_and_mul", x=xx, kind=x["kind"]), like=xx)


def call_layer_norm(h: Harness, x: dict) -> None:
    _norm(h, x, "layer_norm")


def call_activation(h: Harness, x: dict) -> None:
    xx = h.f(x["x"])
    h.out("out", h.call("activation", x=xx, kind=x["kind"]), like=xx)


def call_encoder_attention(h: Harness, x: dict) -> None:
    q = h.f(x["q"])
    out = h.call("encoder_attention", q=q, k=h.f(x["k"]), v=h.f(x["v"]), query_start_loc=h.i(x["query_start_loc"]),
                 scale=x["scale"])
    h.out("out", out, like=q)


def call_pool(h: Harness, x: dict) -> None:
    xx = h.f(x["x"])
    h.out("out", h.call("pool", x=xx, query_start_loc=h.i(x["query_start_loc"]), method=x["method"]), like=xx)


def _cache_outputs(h: Harness, cache: Any, shape: tuple[int, ...], owner: Backend | None = None) -> None:
    k, v = (owner or h.backend).kv_cache_to_numpy(cache)
    for name, c in (("k_cache", k), ("v_cache", v)):
        if tuple(c.shape) != shape:
            h.problems.append(f"kv_cache_to_numpy gave {name} shape {tuple(c.shape)}, expected {shape}")
        h.outputs[name] = np.asarray(c, dtype=np.float32)


def _cache_dtype(x: dict) -> str:
    return "fp8" if x.get("kv_scales") else "auto"


def _allocate(h: Harness, x: dict) -> tuple[Any, Backend]:
    """The case's cache and the backend whose layout it has. An fp8 cache is
    uint8 codes in the layout of the backend that writes it, placed by the
    backend under test (a fallback instance may not know the device, as under
    the Ascend emulation): `ModelRunner.allocate_kv_caches` does the same."""
    if _cache_dtype(x) == "auto":
        return h.backend.allocate_kv_cache(*x["cache_shape"], h.dtype), h.backend
    owner = h.ops.provider("kv_write", **h.key("kv_write", kv_cache_dtype="fp8"))
    if owner is h.backend:
        return owner.allocate_kv_cache(*x["cache_shape"], "fp8"), owner
    return h.backend.asarray(np.zeros(owner.kv_cache_shape(*x["cache_shape"]), np.uint8)), owner


def call_kv_write(h: Harness, x: dict) -> None:
    cache, owner = _allocate(h, x)
    h.call("kv_write", kv_cache_dtype=_cache_dtype(x), k=h.f(x["k"]), v=h.f(x["v"]), kv_cache=cache,
           slot_mapping=h.i(x["slot_mapping"]), scales=x["kv_scales"])
    # An fp8 cache comes back as its codes' values: backends must store the same codes.
    _cache_outputs(h, cache, x["cache_shape"], owner)


def call_copy_blocks(h: Harness, x: dict) -> None:
    cache = h.backend.allocate_kv_cache(*x["cache_shape"], h.dtype)
    h.call("kv_write", helper=True, k=h.f(x["k"]), v=h.f(x["v"]), kv_cache=cache, slot_mapping=h.i(x["slot_mapping"]))
    # Plumbing, not a primitive: always the backend's own (it owns the layout).
    h.provider = h.backend.name
    h.backend.copy_blocks(cache, x["src"], x["dst"])
    _cache_outputs(h, cache, x["cache_shape"])


def call_read_write_blocks(h: Harness, x: dict) -> None:
    """Blocks `src` read to host bytes and written to blocks `dst`: the cache must
    end as if copied src -> dst, with bytes of the width the cache stores per block."""
    cache, owner = _allocate(h, x)
    dtype = _cache_dtype(x)
    h.call("kv_write", helper=True, kv_cache_dtype=dtype, k=h.f(x["k"]), v=h.f(x["v"]), kv_cache=cache,
           slot_mapping=h.i(x["slot_mapping"]), scales=x["kv_scales"])
    # Copies: a CPU cache's kv_cache_to_numpy may be a view, which the write would change.
    before = [np.array(c, dtype=np.float32) for c in owner.kv_cache_to_numpy(cache)]
    # Plumbing, not a primitive: the backend that owns the device and the cache (as the engine calls it).
    h.provider = h.backend.name
    stored = int(cache.nbytes) // x["cache_shape"][0]
    data = h.backend.read_blocks(cache, x["src"])
    want = (len(x["src"]), stored)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.shape != want:
        h.problems.append(f"read_blocks gave {type(data).__name__} {getattr(data, 'dtype', '')} "
                          f"{tuple(getattr(data, 'shape', ()))}, expected host uint8 {want}")
        return
    h.backend.write_blocks(cache, x["dst"], data)
    _cache_outputs(h, cache, x["cache_shape"], owner)
    # Exact, not within tolerance: the bytes came back unchanged, and nothing else moved.
    if not np.array_equal(h.backend.read_blocks(cache, x["dst"]), data):
        h.problems.append("read_blocks of the written blocks differs from the bytes written")
    for name, b in zip(("k_cache", "v_cache"), before):
        b[x["dst"]] = b[x["src"]]
        if not np.array_equal(h.outputs[name], b):
            h.problems.append(f"{name} after the round trip is not the cache with blocks {list(x['src'])} "
                              f"copied to {list(x['dst'])}")


def call_attention(h: Harness, x: dict) -> None:
    cache, _ = _allocate(h, x)
    scales, dtype = x.get("kv_scales"), _cache_dtype(x)
    # The cached context arrives in an earlier step, this step's K/V just
    # before attention: the order the model runner uses.
    if len(x["cached_slots"]):
        h.call("kv_write", helper=True, kv_cache_dtype=dtype, k=h.f(x["cached_k"]), v=h.f(x["cached_v"]),
               kv_cache=cache, slot_mapping=h.i(x["cached_slots"]), scales=scales)
    named = dict(scale=x["scale"], sliding_window=x["sliding_window"], soft_cap=x["soft_cap"], kv_scales=scales,
                 sinks=h.f(x.get("sinks")))
    head_dim = int(x["q"].shape[-1])
    meta = h.ops.prepare_metadata(x["meta"], **h.key("attention", kv_cache_dtype=dtype, head_dim=head_dim, **named))
    if len(x["new_k"]):
        h.call("kv_write", helper=True, kv_cache_dtype=dtype, k=h.f(x["new_k"]), v=h.f(x["new_v"]), kv_cache=cache,
               slot_mapping=meta.slot_mapping, scales=scales)
    q = h.f(x["q"])
    out = h.call("attention", kv_cache_dtype=dtype, head_dim=head_dim, q=q, kv_cache=cache, meta=meta, **named)
    h.out("out", out, like=q)


def call_mla_kv_write(h: Harness, x: dict) -> None:
    cache = h.backend.allocate_kv_cache(*x["cache_shape"], h.dtype)
    h.call("mla_kv_write", c_kv=h.f(x["c_kv"]), k_pe=h.f(x["k_pe"]), kv_cache=cache, slot_mapping=h.i(x["slot_mapping"]))
    _cache_outputs(h, cache, x["cache_shape"])


def call_mla_attention(h: Harness, x: dict) -> None:
    """The latents arrive as `kv_write` stores them (their halves as K and V of one
    head: `mla_kv_write`'s layout), the cached ones before this step's."""
    cache = h.backend.allocate_kv_cache(*x["cache_shape"], h.dtype)
    if len(x["cached_slots"]):
        h.call("kv_write", helper=True, k=h.f(x["cached_k"]), v=h.f(x["cached_v"]), kv_cache=cache,
               slot_mapping=h.i(x["cached_slots"]))
    meta = h.ops.prepare_metadata(x["meta"], **h.key("attention", head_dim=int(x["cache_shape"][-1])))
    if len(x["new_k"]):
        h.call("kv_write", helper=True, k=h.f(x["new_k"]), v=h.f(x["new_v"]), kv_cache=cache,
               slot_mapping=meta.slot_mapping)
    q_nope = h.f(x["q_nope"])
    out = h.call("mla_attention", q_nope=q_nope, q_pe=h.f(x["q_pe"]), kv_cache=cache, meta=meta,
                 kv_b_proj=h.f(x["kv_b_proj"]), scale=x["scale"], v_head_dim=x["v_head_dim"])
    h.out("out", out, like=q_nope)


def call_moe(h: Harness, x: dict) -> None:
    xx = h.f(x["x"])
    if x.get("w13_quant") is not None:  # quantized expert stacks (MXFP4)
        w13 = quantized_handle(x["w13_quant"], h.i, None, h.dtype)
        w2 = quantized_handle(x["w2_quant"], h.i, None, h.dtype)
    else:
        w13, w2 = h.f(x["w13"]), h.f(x["w2"])
    out, counts = h.call("moe", x=xx, router_logits=h.f(x["router_logits"]), w13=w13, w2=w2,
                         top_k=x["top_k"], renormalize=x["renormalize"], shared=h.f(x["shared"]),
                         shared_gate=h.f(x["shared_gate"]), w13_bias=h.f(x.get("w13_bias")),
                         w2_bias=h.f(x.get("w2_bias")), activation=x.get("activation"),
                         swiglu_alpha=x.get("swiglu_alpha"), swiglu_limit=x.get("swiglu_limit"),
                         routed_scaling_factor=x.get("routed_scaling_factor"), scoring_func=x.get("scoring_func"),
                         routing_bias=h.f(x.get("routing_bias")), expert_groups=x.get("expert_groups"))
    h.out("out", out, like=xx)
    h.out("tokens_per_expert", counts, dtype="int64")


def call_lora(h: Harness, x: dict) -> None:
    y = h.f(x["y"])
    out = h.call("lora", x=h.f(x["x"]), y=y, lora_a=h.f(x["lora_a"]), lora_b=h.f(x["lora_b"]),
                 lora_indices=h.i(x["lora_indices"]), output_slices=x["output_slices"])
    h.out("out", out, like=y)


def call_sample(h: Harness, x: dict) -> None:
    res: SampleOutput = h.call("sample", logits=h.i(x["logits"]), params=h.backend.prepare_sampling(x["params"]))
    h.out("token_ids", res.token_ids, dtype="int64")
    h.out("logprobs", res.logprobs, dtype="float32")
    if x["params"].draft_token_ids is not None:
        if res.accepted is None:
            h.problems.append("draft_token_ids given but accepted is None")
        else:
            h.out("accepted", res.accepted, dtype="bool")
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
    h.out("out", h.call("all_reduce", x=xx), like=xx)


def call_all_gather(h: Harness, x: dict) -> None:
    xx = h.f(x["x"])
    h.out("out", h.call("all_gather", x=xx, dim=x["dim"]), like=xx)


CALLS: dict[str, Callable[[Harness, dict], None]] = {
    name.removeprefix("call_"): fn for name, fn in globals().items() if name.startswith("call_")
}


def invoke(backend: Backend, ops: Ops, primitive: str, inputs: dict, dtype: str) -> Harness:
    """Run one primitive on `backend` in `dtype`; the harness holds the results."""
    h = Harness(backend, ops, dtype)
    CALLS[primitive](h, inputs)
    return h
