"""Elementwise and GEMM primitives, in float64 NumPy: the spec in code."""

from __future__ import annotations

import math

import numpy as np

from ...primitives.types import DenseWeight

_erf = np.vectorize(math.erf, otypes=[np.float64])


def embedding(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    return table[ids].astype(np.float32)


def rms_norm(x, weight, eps, residual=None):
    if residual is not None:
        x = (x.astype(np.float64) + residual).astype(np.float32)
    x64 = x.astype(np.float64)
    rms = np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    y = (x64 / rms * weight).astype(np.float32)
    return y if residual is None else (y, x)


def layer_norm(x, weight, bias, eps, residual=None):
    if residual is not None:
        x = (x.astype(np.float64) + residual).astype(np.float32)
    x64 = x.astype(np.float64)
    centred = x64 - x64.mean(axis=-1, keepdims=True)
    y = centred / np.sqrt(np.mean(centred * centred, axis=-1, keepdims=True) + eps) * weight
    if bias is not None:
        y = y + bias
    y = y.astype(np.float32)
    return y if residual is None else (y, x)


def linear(x: np.ndarray, weight: DenseWeight) -> np.ndarray:
    y = x.astype(np.float64) @ weight.weight.astype(np.float64).T
    if weight.bias is not None:
        y = y + weight.bias
    return y.astype(np.float32)


def rotary(q, k, positions, cos_sin_cache, neox_style):
    rot = cos_sin_cache.shape[1]
    half = rot // 2
    cos = cos_sin_cache[positions, :half].astype(np.float64)[:, None, :]  # [T, 1, R/2]
    sin = cos_sin_cache[positions, half:].astype(np.float64)[:, None, :]

    def rotate(x):
        x = x.astype(np.float64)
        out = x.copy()
        # neox rotates the two halves of the rotated span; gptj rotates adjacent pairs.
        first, second = (slice(0, half), slice(half, rot)) if neox_style else (slice(0, rot, 2), slice(1, rot, 2))
        x1, x2 = x[..., first], x[..., second]
        out[..., first] = x1 * cos - x2 * sin
        out[..., second] = x2 * cos + x1 * sin
        return out.astype(np.float32)

    return rotate(q), rotate(k)


def act(x: np.ndarray, kind: str) -> np.ndarray:
    if kind == "relu":
        return np.maximum(x, 0.0)
    if kind == "tanh":
        return np.tanh(x)
    if kind == "silu":
        return x / (1.0 + np.exp(-x))
    if kind == "quick_gelu":
        return x / (1.0 + np.exp(-1.702 * x))
    if kind == "gelu":
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    if kind == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    raise ValueError(f"act_and_mul: unknown activation {kind!r}")


def act_and_mul(x: np.ndarray, kind: str) -> np.ndarray:
    x = x.astype(np.float64)
    i = x.shape[1] // 2
    return (act(x[:, :i], kind) * x[:, i:]).astype(np.float32)


def activation(x: np.ndarray, kind: str) -> np.ndarray:
    return act(x.astype(np.float64), kind).astype(np.float32)


def pool(x: np.ndarray, query_start_loc, method: str) -> np.ndarray:
    """One row per sequence (see spec.pool), reduced in float64."""
    if method == "all":
        return np.array(x, dtype=np.float32)
    bounds = np.asarray(query_start_loc).tolist()
    rows = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        seq = x[lo:hi].astype(np.float64)
        rows.append({"cls": lambda: seq[0], "last": lambda: seq[-1], "mean": lambda: seq.mean(axis=0),
                     "max": lambda: seq.max(axis=0)}[method]())
    return np.array(rows, dtype=np.float32).reshape(len(rows), x.shape[1])


def lora(x, y, lora_a, lora_b, lora_indices, output_slices=None):
    """Each token's adapter, one token and one slice at a time (float64)."""
    out = np.array(y, dtype=np.float32)
    slices = tuple(output_slices) if output_slices is not None else (y.shape[1],)
    rank = lora_a.shape[1] // len(slices)
    bounds = np.cumsum((0,) + slices)
    for t, s in enumerate(np.asarray(lora_indices).tolist()):
        if s <= 0:
            continue
        row = out[t].astype(np.float64)
        for p, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            mid = lora_a[s, p * rank : (p + 1) * rank].astype(np.float64) @ x[t].astype(np.float64)
            row[lo:hi] += lora_b[s, lo:hi].astype(np.float64) @ mid
        out[t] = row
    return out
