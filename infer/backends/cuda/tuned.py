"""Launch parameters measured on a GPU, one JSON file per device model.

As vLLM ships its fused-MoE tile configs per device, the kernels here look up
their tiles in ``configs/<device name>.json`` (spaces as underscores, e.g.
``NVIDIA_H200.json``), written by ``benchmarks/gpu_check.py --tune
--write-config DIR`` on that device. A device without a file gets the
built-in guesses (`attention.launch_config`, `quant_linear.tiles`). The
variable ``INFER_CUDA_CONFIG`` names a file to use instead, whatever the device
(one tuned elsewhere, or a test under the interpreter).

The file::

    {"attention": {"head_dim": 128, "group_pad": 4,
                   "decode": {"rows": 16, "tile_n": 64, "num_warps": 4, "num_stages": 3},
                   "decode_split": {...}, "prefill": {...}},
     "quant_linear": {"decode": [16, 32, 128, 4], "prefill": [64, 64, 64, 4]},
     "measured": {...free-form: versions, shapes, timings}}

Every entry is optional. They apply to fp16/bf16 inputs (what the sweep
measures); float32 keeps the built-in tiles. The quantized linear's tiles do
not depend on the model's shapes; attention tiles apply only at the shape
they were measured at:

- ``head_dim``: a program's shared memory grows with it, so tiles that fit
  head size 128 may not build at 256.
- ``group_pad``: query heads per KV head, rounded up to a power of two. A
  program holds a whole group, ``max(rows, group_pad)`` score rows, so tiles
  measured at 4 query heads per KV head can run out of registers (and spill)
  at 128. Optional: a file without it (gpu_check wrote none before) was
  measured at Llama-3-8B's 32 query / 8 KV heads, `DEFAULT_GROUP_PAD`.

``attention`` may also be a list of such objects, one per (head_dim,
group_pad), for a device tuned at several model shapes.

`registers` and `spills` read a compiled kernel's register use, so a sweep
can refuse tiles that spill to local memory.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ENV = "INFER_CUDA_CONFIG"
CONFIG_DIR = Path(__file__).parent / "configs"
ATTENTION_KINDS = ("decode", "decode_split", "prefill")
LINEAR_KINDS = ("decode", "prefill")
_ATTENTION_FIELDS = ("rows", "tile_n", "num_warps", "num_stages")
# The group_pad of an attention entry that names none: what gpu_check --tune measured at (32 / 8 heads).
DEFAULT_GROUP_PAD = 4


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
    if not isinstance(data.get("quant_linear", {}), dict):
        fail(f"quant_linear must be an object, got {data['quant_linear']!r}")
    att = data.get("attention", {})
    if not (isinstance(att, dict) or (isinstance(att, list) and att and all(isinstance(a, dict) and a for a in att))):
        fail(f"attention must be an object or a list of non-empty objects, got {att!r}")
    entries = _attention_entries(data)
    shapes = set()
    for i, entry in enumerate(entries):
        where = "attention" if isinstance(att, dict) else f"attention[{i}]"
        if entry and not _int_in(entry.get("head_dim"), 16, 512, pow2=False):
            fail(f"{where}.head_dim (the head size the tiles were measured at) must be given, 16..512: "
                 f"{entry.get('head_dim')!r}")
        if not _int_in(entry.get("group_pad", DEFAULT_GROUP_PAD), 1, 256):
            fail(f"{where}.group_pad (query heads per KV head, padded) must be a power of two in 1..256: "
                 f"{entry['group_pad']!r}")
        shape = (entry.get("head_dim"), entry.get("group_pad", DEFAULT_GROUP_PAD))
        if entry and shape in shapes:
            fail(f"{where}: a second entry for head_dim {shape[0]}, group_pad {shape[1]}")
        shapes.add(shape)
        for kind, cfg in entry.items():
            if kind in ("head_dim", "group_pad"):
                continue
            if kind not in ATTENTION_KINDS:
                fail(f"{where}.{kind}: unknown; expected head_dim, group_pad or one of {ATTENTION_KINDS}")
            if not isinstance(cfg, dict) or set(cfg) != set(_ATTENTION_FIELDS):
                fail(f"{where}.{kind} must have exactly {_ATTENTION_FIELDS}, got {cfg!r}")
            if not (_int_in(cfg["rows"], 16, 256) and _int_in(cfg["tile_n"], 16, 256)
                    and _int_in(cfg["num_warps"], 1, 32) and _int_in(cfg["num_stages"], 1, 8, pow2=False)):
                fail(f"{where}.{kind}: rows and tile_n must be powers of two in 16..256 (tl.dot's smallest "
                     f"tile is 16), num_warps a power of two up to 32, num_stages 1..8: {cfg}")
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


def _attention_entries(data: dict) -> list[dict]:
    att = data.get("attention", {})
    return att if isinstance(att, list) else [att]


def attention(kind: str, device: torch.device | str, head_dim: int, group_pad: int) -> dict | None:
    """Tiles for `kind` measured at this `head_dim` and `group_pad` (query heads per KV
    head, padded): tiles that fit one shape may overflow shared memory or registers at another."""
    for att in _attention_entries(load(device_name(device))):
        if att.get("head_dim") == head_dim and att.get("group_pad", DEFAULT_GROUP_PAD) == group_pad:
            return dict(att[kind]) if kind in att else None
    return None


def quant_linear(kind: str, device: torch.device | str) -> tuple[int, int, int, int] | None:
    tile = load(device_name(device)).get("quant_linear", {}).get(kind)
    return tuple(tile) if tile else None


@dataclass(frozen=True)
class Registers:
    """A compiled kernel's registers per thread and local memory in 4-byte words (Triton's
    `CompiledKernel.n_regs` / `n_spills`: what the driver reports, local bytes / 4)."""

    n_regs: int
    n_spills: int


def registers(kernel) -> Registers:
    """`Registers` of a Triton `CompiledKernel` for an NVIDIA target: the driver's figures once
    the kernel is loaded on a GPU, else read from its cubin by the cuobjdump Triton ships
    (ahead of time, no GPU needed)."""
    if getattr(kernel, "module", None) is not None:
        return Registers(kernel.n_regs, kernel.n_spills)
    from triton import knobs

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", path], capture_output=True, text=True,
                               check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) .*?LOCAL:(\d+)", usage)
    if not found:
        raise RuntimeError(f"cuobjdump -res-usage gave no REG/STACK/LOCAL figures for {kernel.name}: {usage!r}")
    # ptxas spills to the stack frame; the driver counts it as the thread's local memory.
    return Registers(int(found[1]), (int(found[2]) + int(found[3])) // 4)


def spills(kernel) -> bool:
    """Whether a compiled kernel keeps values in local memory (registers spilled): tiles
    that do are slower than smaller tiles that fit, so a tuning sweep should refuse them."""
    return registers(kernel).n_spills > 0
