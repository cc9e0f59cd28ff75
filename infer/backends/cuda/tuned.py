"""Launch parameters measured on a GPU, one JSON file per device model.

As vLLM ships its fused-MoE tile configs per device, the kernels here look up
their tiles in ``configs/<device name>.json`` (spaces as underscores, e.g.
``NVIDIA_H200.json``), written by ``benchmarks/gpu_check.py --tune
--write-config DIR`` on that device. A device without a file gets the
built-in guesses (`attention.launch_config`, `quant_linear.tiles`). The
variable ``INFER_CUDA_CONFIG`` names a file to use instead, whatever the device
(one tuned elsewhere, or a test under the interpreter).

The file::

    {"attention": {"decode": {"rows": 16, "tile_n": 64, "num_warps": 4, "num_stages": 3},
                   "decode_split": {...}, "prefill": {...}},
     "quant_linear": {"decode": [16, 32, 128, 4], "prefill": [64, 64, 64, 4]},
     "measured": {...free-form: versions, shapes, timings}}

Every entry is optional. They apply to fp16/bf16 inputs (what the sweep
measures); float32 keeps the built-in tiles.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import torch

ENV = "INFER_CUDA_CONFIG"
CONFIG_DIR = Path(__file__).parent / "configs"
ATTENTION_KINDS = ("decode", "decode_split", "prefill")
LINEAR_KINDS = ("decode", "prefill")
_ATTENTION_FIELDS = ("rows", "tile_n", "num_warps", "num_stages")


class TunedConfigError(ValueError):
    """A tuned-config file that is not what `tuned.py` describes."""


def file_name(device_name: str) -> str:
    return device_name.strip().replace(" ", "_").replace("/", "_") + ".json"


def device_name(device: torch.device | str) -> str:
    return _device_name(torch.device(device))


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _pow2(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


def validate(data: Any, source: str) -> dict:
    """`data` itself, or TunedConfigError naming `source` and the first thing wrong."""
    def fail(what: str):
        raise TunedConfigError(f"tuned cuda config {source}: {what}")

    if not isinstance(data, dict):
        fail("must be a JSON object")
    unknown = set(data) - {"attention", "quant_linear", "measured"}
    if unknown:
        fail(f"unknown section(s) {sorted(unknown)}; expected attention, quant_linear, measured")
    for kind, cfg in data.get("attention", {}).items():
        if kind not in ATTENTION_KINDS:
            fail(f"attention.{kind}: unknown; expected one of {ATTENTION_KINDS}")
        if not isinstance(cfg, dict) or set(cfg) != set(_ATTENTION_FIELDS):
            fail(f"attention.{kind} must have exactly {_ATTENTION_FIELDS}, got {cfg!r}")
        stages = cfg["num_stages"]
        if not all(_pow2(cfg[f]) for f in ("rows", "tile_n", "num_warps")) or not (
                isinstance(stages, int) and not isinstance(stages, bool) and stages >= 1):
            fail(f"attention.{kind}: rows, tile_n and num_warps must be powers of two, num_stages >= 1: {cfg}")
        if cfg["rows"] < 16 or cfg["tile_n"] < 16:
            fail(f"attention.{kind}: rows and tile_n must be >= 16 (tl.dot's smallest tile): {cfg}")
    for kind, tile in data.get("quant_linear", {}).items():
        if kind not in LINEAR_KINDS:
            fail(f"quant_linear.{kind}: unknown; expected one of {LINEAR_KINDS}")
        if not isinstance(tile, list) or len(tile) != 4 or not all(_pow2(v) for v in tile) or min(tile[:3]) < 16:
            fail(f"quant_linear.{kind} must be [BLOCK_T, BLOCK_N, BLOCK_K, num_warps], powers of two, "
                 f"tiles >= 16: {tile!r}")
    return data


@functools.lru_cache(maxsize=None)
def load(name: str) -> dict:
    """The tuned config for device `name` ({} when there is none)."""
    path = os.environ.get(ENV) or CONFIG_DIR / file_name(name)
    if not os.path.exists(path):
        if os.environ.get(ENV):
            raise TunedConfigError(f"{ENV}={path}: no such file")
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise TunedConfigError(f"tuned cuda config {path}: not JSON ({exc})") from None
    return validate(data, str(path))


def attention(kind: str, device: torch.device | str) -> dict | None:
    cfg = load(device_name(device)).get("attention", {}).get(kind)
    return dict(cfg) if cfg else None


def quant_linear(kind: str, device: torch.device | str) -> tuple[int, int, int, int] | None:
    tile = load(device_name(device)).get("quant_linear", {}).get(kind)
    return tuple(tile) if tile else None
