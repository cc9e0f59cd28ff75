"""Launch parameters measured on a GPU, one JSON file per device model.

As vLLM ships its fused-MoE tile configs per device, the kernels here look up
their tiles in ``configs/<device name>.json`` (spaces as underscores, e.g.
``NVIDIA_H200.json``), written by ``benchmarks/gpu_check.py --tune
--write-config DIR`` on that device. A device without a file gets the
built-in guesses (`attention.launch_config`, `quant_linear.tiles`). The
variable ``INFER_CUDA_CONFIG`` names a file to use instead, whatever the device
(one tuned elsewhere, or a test under the interpreter).

The file::

    {"attention": {"head_dim": 128,
                   "decode": {"rows": 16, "tile_n": 64, "num_warps": 4, "num_stages": 3},
                   "decode_split": {...}, "prefill": {...}},
     "quant_linear": {"decode": [16, 32, 128, 4], "prefill": [64, 64, 64, 4]},
     "measured": {...free-form: versions, shapes, timings}}

Every entry is optional. They apply to fp16/bf16 inputs (what the sweep
measures); float32 keeps the built-in tiles. Attention tiles apply at the
``head_dim`` they were measured at only: a program's shared memory grows with
it, so tiles that fit head size 128 may not build at 256. The quantized
linear's tiles do not depend on the model's shapes.
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


def _int_in(v: Any, lo: int, hi: int, pow2: bool = True) -> bool:
    ok = isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
    return ok and (not pow2 or v & (v - 1) == 0)


def validate(data: Any, source: str) -> dict:
    """`data` itself, or TunedConfigError naming `source` and the first thing wrong."""
    def fail(what: str):
        raise TunedConfigError(f"tuned cuda config {source}: {what}")

    if not isinstance(data, dict):
        fail("must be a JSON object")
    unknown = set(data) - {"attention", "quant_linear", "measured"}
    if unknown:
        fail(f"unknown section(s) {sorted(unknown)}; expected attention, quant_linear, measured")
    for section in ("attention", "quant_linear"):
        if not isinstance(data.get(section, {}), dict):
            fail(f"{section} must be an object, got {data[section]!r}")
    att = data.get("attention", {})
    if att and not _int_in(att.get("head_dim"), 16, 512, pow2=False):
        fail(f"attention.head_dim (the head size the tiles were measured at) must be given, 16..512: "
             f"{att.get('head_dim')!r}")
    for kind, cfg in att.items():
        if kind == "head_dim":
            continue
        if kind not in ATTENTION_KINDS:
            fail(f"attention.{kind}: unknown; expected head_dim or one of {ATTENTION_KINDS}")
        if not isinstance(cfg, dict) or set(cfg) != set(_ATTENTION_FIELDS):
            fail(f"attention.{kind} must have exactly {_ATTENTION_FIELDS}, got {cfg!r}")
        if not (_int_in(cfg["rows"], 16, 256) and _int_in(cfg["tile_n"], 16, 256)
                and _int_in(cfg["num_warps"], 1, 32) and _int_in(cfg["num_stages"], 1, 8, pow2=False)):
            fail(f"attention.{kind}: rows and tile_n must be powers of two in 16..256 (tl.dot's smallest tile "
                 f"is 16), num_warps a power of two up to 32, num_stages 1..8: {cfg}")
    for kind, tile in data.get("quant_linear", {}).items():
        if kind not in LINEAR_KINDS:
            fail(f"quant_linear.{kind}: unknown; expected one of {LINEAR_KINDS}")
        if not (isinstance(tile, list) and len(tile) == 4 and all(_int_in(v, 16, 512) for v in tile[:3])
                and _int_in(tile[3], 1, 32)):
            fail(f"quant_linear.{kind} must be [BLOCK_T, BLOCK_N, BLOCK_K, num_warps]: tiles powers of two in "
                 f"16..512, num_warps a power of two up to 32: {tile!r}")
    return data


def load(name: str) -> dict:
    """The tuned config for device `name` ({} when there is none). INFER_CUDA_CONFIG is
    read on every call (cheap); each file is parsed once."""
    return _load(name, os.environ.get(ENV) or None)


@functools.lru_cache(maxsize=None)
def _load(name: str, override: str | None) -> dict:
    path = override or str(CONFIG_DIR / file_name(name))
    if not os.path.isfile(path):
        if override:
            raise TunedConfigError(f"{ENV}={path}: no such file")
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TunedConfigError(f"tuned cuda config {path}: not JSON ({exc})") from None
    return validate(data, path)


def attention(kind: str, device: torch.device | str, head_dim: int) -> dict | None:
    """Tiles for `kind` at `head_dim`: only the head size they were measured at (shared
    memory grows with it, so tiles that fit one head size may not build for a larger one)."""
    att = load(device_name(device)).get("attention", {})
    cfg = att.get(kind) if att.get("head_dim") == head_dim else None
    return dict(cfg) if cfg else None


def quant_linear(kind: str, device: torch.device | str) -> tuple[int, int, int, int] | None:
    tile = load(device_name(device)).get("quant_linear", {}).get(kind)
    return tuple(tile) if tile else None
