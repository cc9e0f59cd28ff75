"""HF checkpoints written by compressed-tensors (llm-compressor): ``quant_method: compressed-tensors``.

``quantization_config.config_groups`` maps each group of modules (``targets``:
a class name such as ``Linear``, a module name, or ``re:<regex>``; minus
``ignore``) to a scheme: ``weights`` (num_bits, type int/float, strategy
tensor/channel/group, group_size, symmetric) and ``input_activations``, stored
in a ``format`` (the group's, else the config's). What each format stores per
module ``X`` and the handle it becomes, exactly:

* ``pack-quantized`` (int, 1..8 bits): ``X.weight_packed`` [N, ceil(K * b / 32)]
  int32, a dense little-endian bit stream per row (value k in bits k*b ..
  k*b + b-1) of ``u = q + 2^(b-1)``, q the signed code; ``X.weight_scale``
  [N, K/G] (group), [N, 1] (channel) or [1] (tensor); ``X.weight_shape`` [N, K];
  asymmetric ones ``X.weight_zero_point``, the signed zero points packed the
  same way along N ([ceil(N*b/32), K/G]). ``w = (q - zero) * scale
  = u * scale - (2^(b-1) + zero) * scale``: `Int4GroupWeight` for b <= 4 (for
  b = 4 the stream is already its nibble layout), `Int8GroupWeight` with
  offsets otherwise (q itself, symmetric: no offsets).
* ``int-quantized`` (int8): ``X.weight`` int8 [N, K], scales as above,
  ``X.weight_zero_point`` int8 when asymmetric: `Int8GroupWeight`.
  Activations quantized dynamically per token (symmetric int8, W8A8) ride on
  the handle as ``act_quant="int8_token"`` (`infer.primitives.act_quant`).
* ``float-quantized`` (fp8 e4m3): ``X.weight`` float8_e4m3fn, ``X.weight_scale``
  per tensor or per channel: `Fp8Weight`. fp8 activation quantization, static
  (``X.input_scale``) or dynamic, is not applied: activations stay in the
  model dtype, as for ``quant_method: fp8``.

Anything else (act-order groups, block-wise fp8, nvfp4/mxfp4, 2:4 sparsity,
transforms, static or asymmetric int8 activations, int weights with fp8
activations) is refused with the scheme named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...primitives.types import Fp8Weight, Int4GroupWeight, Int8GroupWeight, WeightHandle
from .errors import LoaderError
from .quant_view import QuantizedView

FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
# Every tensor a quantized module stores besides what the graph asks for (``X.weight``).
_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
          "input_scale", "input_zero_point")


@dataclass(frozen=True, slots=True)
class Scheme:
    """One config group's scheme, checked: what its modules' tensors mean."""

    format: str
    bits: int
    type: str  # "int" | "float"
    strategy: str  # "tensor" | "channel" | "group"
    group_size: int  # 0 unless strategy is "group"
    symmetric: bool
    act_quant: str | None  # "int8_token" (W8A8) or None (weight-only; fp8 activations stay float)

    @property
    def label(self) -> str:
        """The load report's name of the stored type."""
        how = f"group{self.group_size}" if self.strategy == "group" else self.strategy
        acts = "-a8-token" if self.act_quant else ""
        return f"ct:{self.format} {self.type}{self.bits}-{how}-{'sym' if self.symmetric else 'asym'}{acts}"


def _refuse(path: Any, group: str, what: str) -> LoaderError:
    return LoaderError(f"{path}: compressed-tensors scheme {group!r}: {what} is not supported (infer reads int "
                       "pack-quantized / int-quantized weights by tensor, channel or group (W4A16, W8A16, W8A8 with "
                       "dynamic per-token int8 activations) and per-tensor or per-channel fp8)")


def parse_scheme(path: Any, name: str, group: dict[str, Any], default_format: str | None) -> Scheme | None:
    """The scheme of config group `name`, or None when it quantizes no weights."""
    w = group.get("weights")
    if not w:
        if group.get("input_activations"):
            raise _refuse(path, name, "activation quantization without weight quantization")
        return None
    fmt = group.get("format") or default_format
    bits, kind = int(w.get("num_bits", 8)), w.get("type", "int")
    strategy, symmetric = w.get("strategy") or "tensor", bool(w.get("symmetric", True))
    desc = f"{fmt} {kind}{bits} {strategy}"
    if fmt not in FORMATS:
        raise _refuse(path, name, f"format {fmt!r} ({desc})")
    if strategy not in ("tensor", "channel", "group"):
        raise _refuse(path, name, f"weight strategy {strategy!r} ({desc}; block-wise scales)")
    if w.get("actorder") == "group":
        raise _refuse(path, name, f"actorder 'group' ({desc}: act-order groups, weight_g_idx)")
    if w.get("dynamic"):
        raise _refuse(path, name, f"dynamic weight quantization ({desc})")
    group_size = int(w.get("group_size") or 0) if strategy == "group" else 0
    if strategy == "group" and group_size <= 0:
        raise _refuse(path, name, f"group strategy without a group_size ({desc})")
    if kind == "float":
        if bits != 8 or fmt not in ("float-quantized", "naive-quantized") or strategy == "group":
            raise _refuse(path, name, f"{desc} (fp8 e4m3 weights per tensor or per channel only)")
        if not symmetric:
            raise _refuse(path, name, f"asymmetric fp8 ({desc})")
    elif kind == "int":
        if not 1 <= bits <= 8 or (fmt != "pack-quantized" and bits != 8):
            raise _refuse(path, name, f"{desc} ({bits}-bit int weights must be pack-quantized)")
    else:
        raise _refuse(path, name, f"weight type {kind!r} ({desc})")
    act_quant = None
    a = group.get("input_activations")
    if a:
        adesc = f"{a.get('type', 'int')}{a.get('num_bits', 8)} {a.get('strategy')} " \
                f"{'dynamic' if a.get('dynamic') else 'static'} activations with {desc} weights"
        if a.get("type", "int") == "float" and kind == "float":
            pass  # fp8 activations: the model dtype serves (documented), as quant_method fp8 does
        elif (a.get("type", "int") == "int" and int(a.get("num_bits", 8)) == 8 and a.get("strategy") == "token"
              and a.get("dynamic") is True and a.get("symmetric", True) and kind == "int" and bits == 8):
            act_quant = "int8_token"
        else:
            raise _refuse(path, name, adesc)
    if group.get("output_activations"):
        raise _refuse(path, name, f"output activation quantization ({desc})")
    return Scheme(fmt, bits, kind, strategy, group_size, symmetric, act_quant)


def _matches(target: str, module: str) -> int:
    """How specifically `target` names `module`: 3 by name, 2 by regex, 1 by class (a quantized
    module is a Linear; its checkpoint names no other class), 0 not at all."""
    if target == module:
        return 3
    if target.startswith("re:"):
        return 2 if re.match(target[3:], module) else 0
    return 1 if target == "Linear" else 0


def unpack_bits(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """[R, W] int32 words of a dense little-endian stream -> [R, count] unsigned b-bit values."""
    words = np.ascontiguousarray(packed, dtype="<i4").view(np.uint8)  # little-endian bytes, stream order
    if bits == 4:
        return np.stack([words & 0xF, words >> 4], axis=-1).reshape(words.shape[0], -1)[:, :count]
    stream = np.unpackbits(words, axis=1, bitorder="little")[:, :count * bits]
    weights = (1 << np.arange(bits)).astype(np.uint16)
    return (stream.reshape(stream.shape[0], count, bits) * weights).sum(-1).astype(np.uint8)


def _per_row(scales: np.ndarray, n: int) -> np.ndarray:
    """Scales as [N, groups] float32 (a per-tensor scale repeated on every row)."""
    s = np.asarray(scales, dtype=np.float32)
    return np.ascontiguousarray(np.broadcast_to(s.reshape(1, 1), (n, 1)) if s.size == 1 else s.reshape(n, -1))


def int_handle(q_unsigned: np.ndarray | None, q_signed: np.ndarray | None, scales: np.ndarray,
               zero: np.ndarray | None, scheme: Scheme) -> WeightHandle:
    """The handle of ``w = (q - zero) * scale``, given the codes unsigned (``q + 2^(b-1)``,
    pack-quantized) or signed (int-quantized) and the signed zero points (None: 0)."""
    q = q_unsigned if q_unsigned is not None else q_signed
    n, k = q.shape
    s = _per_row(scales, n)
    group = k // s.shape[1]
    if group * s.shape[1] != k:
        raise LoaderError(f"compressed-tensors weight [{n}, {k}] has {s.shape[1]} scale groups per row, which do "
                          "not divide its input features; infer reads groups that divide K")
    z = np.zeros_like(s, dtype=np.float64) if zero is None else np.asarray(zero, np.float64).reshape(s.shape)
    half = 1 << (scheme.bits - 1)
    if q_unsigned is not None and scheme.bits <= 4:  # u * s - (half + z) * s, u in 0..15
        offsets = (-(half + z) * s).astype(np.float32)
        packed = (q_unsigned[:, 0::2] | (q_unsigned[:, 1::2] << 4)).astype(np.uint8)
        return Int4GroupWeight(packed, s, offsets, group)
    codes = q_signed if q_signed is not None else (q_unsigned.astype(np.int16) - half).astype(np.int8)
    offsets = None if zero is None else (-z * s).astype(np.float32)
    return Int8GroupWeight(np.ascontiguousarray(codes, dtype=np.int8), s, group, offsets=offsets,
                           act_quant=scheme.act_quant)


class CompressedTensorsHF(QuantizedView):
    """A view of a compressed-tensors checkpoint whose quantized modules read as one ``.weight`` each."""

    def __init__(self, ckpt: Any, qconfig: dict[str, Any]):
        self._ckpt, self.qconfig = ckpt, qconfig
        path = ckpt.path
        groups = {name: parse_scheme(path, name, g, qconfig.get("format"))
                  for name, g in (qconfig.get("config_groups") or {}).items()}
        targets = [(t, groups[name]) for name, g in (qconfig.get("config_groups") or {}).items()
                   for t in g.get("targets") or ()]
        ignore = list(qconfig.get("ignore") or ())
        stored = set(ckpt.names)
        modules = sorted({n.rsplit(".", 1)[0] for n in stored
                          if n.endswith((".weight_packed", ".weight_scale"))})
        self.schemes: dict[str, Scheme] = {}
        for module in modules:
            if any(_matches(t, module) for t in ignore):
                raise LoaderError(f"{path}: {module} stores quantized tensors but the config's ignore list names it")
            best = max(targets, key=lambda ts: _matches(ts[0], module), default=None)
            if best is None or not _matches(best[0], module) or best[1] is None:
                raise LoaderError(f"{path}: {module} stores quantized tensors that no config group's targets "
                                  "name with a weight scheme")
            if f"{module}.weight_g_idx" in stored:
                raise _refuse(path, module, "act-order groups (weight_g_idx)")
            self.schemes[module] = best[1]
        self._quantized = self.schemes
        parts = {f"{m}.{p}" for m in self.schemes for p in _PARTS}
        self.names = [n for n in ckpt.names if n not in parts and n.removesuffix(".weight") not in self.schemes]
        self.names += [f"{m}.weight" for m in self.schemes]

    def _parts(self, base: str) -> tuple[str, ...]:
        return ("weight", *_PARTS)

    def stored_type(self, name: str) -> str:
        module = self._base(name)
        return self.schemes[module].label if module is not None else self._ckpt.stored_type(name)

    def read_quantized(self, name: str) -> WeightHandle | None:
        module = self._base(name)
        if module is None:
            return None
        scheme = self.schemes[module]
        get = lambda part: self._ckpt.read(f"{module}.{part}")  # noqa: E731
        has = lambda part: f"{module}.{part}" in self._ckpt.names  # noqa: E731
        if not scheme.symmetric and not has("weight_zero_point"):
            raise LoaderError(f"{self._ckpt.path}: {module} is asymmetric ({scheme.label}) but stores no "
                              "weight_zero_point")
        scales = get("weight_scale")
        if scheme.type == "float":
            if self._ckpt.stored_type(f"{module}.weight") != "F8_E4M3":
                raise LoaderError(f"{self._ckpt.path}: {module}.weight is {self._ckpt.stored_type(module + '.weight')}, "
                                  f"expected F8_E4M3 for {scheme.label}")
            return Fp8Weight(np.asarray(get("weight")).view(np.uint8), np.asarray(scales, np.float32).reshape(-1))
        if scheme.format == "pack-quantized":
            n, k = (int(v) for v in np.asarray(get("weight_shape")).reshape(-1))
            q = unpack_bits(get("weight_packed"), scheme.bits, k)
            zero = None
            if not scheme.symmetric:
                groups = _per_row(scales, n).shape[1]
                zp = unpack_bits(np.ascontiguousarray(np.asarray(get("weight_zero_point")).T), scheme.bits, n)
                zero = (zp.T.astype(np.int16) - (1 << (scheme.bits - 1)))[:, :groups]
            return int_handle(q, None, scales, zero, scheme)
        zero = get("weight_zero_point") if not scheme.symmetric else None
        return int_handle(None, np.asarray(get("weight"), np.int8), scales, zero, scheme)


def open_compressed_tensors(ckpt: Any, qconfig: dict[str, Any]) -> CompressedTensorsHF:
    """A `CompressedTensorsHF` view of `ckpt`, after refusing what no handle stands for."""
    status = qconfig.get("quantization_status", "compressed")
    if status != "compressed":
        raise LoaderError(f"{ckpt.path}: compressed-tensors quantization_status {status!r}; infer reads "
                          "'compressed' checkpoints (save with llm-compressor's save_compressed=True)")
    sparsity = qconfig.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise LoaderError(f"{ckpt.path}: compressed-tensors sparsity format {sparsity.get('format')!r} "
                          f"({sparsity.get('sparsity_structure', '?')}) is not supported; infer reads dense "
                          "quantized checkpoints")
    if qconfig.get("transform_config"):
        raise LoaderError(f"{ckpt.path}: compressed-tensors transforms (transform_config: Hadamard/SpinQuant "
                          "rotations) are not supported")
    return CompressedTensorsHF(ckpt, qconfig)
