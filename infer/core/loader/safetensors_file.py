"""safetensors checkpoints, read with the `safetensors` package: a single file
or an index + shards.

`safe_open` validates each header against its file (a truncated download
fails here, before any weight is read); tensors come back through torch so
BF16 can be widened to float32 exactly (NumPy has no bfloat16).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

from .errors import CorruptCheckpointError, LoaderError, PickledCheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# Bytes per element of the safetensors dtypes infer reads.
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1}
_REFETCH = "re-download or re-save the checkpoint"


@dataclass(frozen=True, slots=True)
class TensorEntry:
    file: Path
    name: str
    dtype: str  # safetensors name: F32, F16, BF16, ...
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * _ITEMSIZE[self.dtype]


def _open(path: Path):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as exc:
        raise CorruptCheckpointError(f"{path}: not a readable safetensors file ({exc}): truncated or corrupt; "
                                     f"{_REFETCH}") from exc


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Every tensor of one .safetensors file (the header checked against the file)."""
    entries = {}
    with _open(path) as f:
        for name in f.keys():
            piece = f.get_slice(name)
            dtype = piece.get_dtype()
            if dtype not in _ITEMSIZE:
                raise LoaderError(f"{path}: tensor {name!r} has dtype {dtype}, which infer cannot read "
                                  f"(readable: {', '.join(_ITEMSIZE)}); re-save it as float16 or float32")
            entries[name] = TensorEntry(path, name, dtype, tuple(piece.get_shape()))
    return entries


def read_tensor(entry: TensorEntry) -> np.ndarray:
    """One tensor as a writable array (BF16 widened to float32, exactly)."""
    with _open(entry.file) as f:
        t = f.get_tensor(entry.name)
    if entry.dtype == "BF16":
        t = t.float()
    elif entry.dtype == "F8_E4M3":  # NumPy has no fp8: its bit patterns (see infer.primitives.fp8)
        import torch

        t = t.view(torch.uint8)
    return t.numpy()


def read_tensor_slice(entry: TensorEntry, axis: int, start: int, stop: int) -> np.ndarray:
    """Rows (or columns, ...) [start, stop) of one tensor along `axis`; only those bytes are read."""
    if not (0 <= axis < len(entry.shape) and 0 <= start <= stop <= entry.shape[axis]):
        raise ValueError(f"{entry.name}: slice [{start}, {stop}) on axis {axis} is outside its shape {entry.shape}")
    with _open(entry.file) as f:
        t = f.get_slice(entry.name)[(slice(None),) * axis + (slice(start, stop),)]
    if entry.dtype == "BF16":
        t = t.float()
    elif entry.dtype == "F8_E4M3":
        import torch

        t = t.view(torch.uint8)
    return t.contiguous().numpy()


def find_safetensors(directory: Path) -> dict[str, TensorEntry]:
    """The tensors of an HF model directory, in checkpoint order.

    With an index, it is the source of truth: every name it lists must be in
    the shard it names. Without one, `model.safetensors`, else every
    `*.safetensors` file in the directory.
    """
    index = directory / INDEX_FILE
    if index.is_file():
        return _from_index(index)
    if (directory / SINGLE_FILE).is_file():
        return read_header(directory / SINGLE_FILE)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        _refuse_pickles(directory)
        raise LoaderError(f"{directory}: no *.safetensors weights (looked for {INDEX_FILE}, {SINGLE_FILE}, "
                          "*.safetensors); put the model's safetensors files next to its config.json")
    entries: dict[str, TensorEntry] = {}
    for file in files:
        for name, entry in read_header(file).items():
            if name in entries:
                raise CorruptCheckpointError(f"{directory}: tensor {name!r} is in both {entries[name].file.name} and "
                                             f"{file.name}; remove the stray file or add a {INDEX_FILE}")
            entries[name] = entry
    return entries


def _from_index(index: Path) -> dict[str, TensorEntry]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"{index}: not a valid safetensors index ({exc}); {_REFETCH}") from exc
    shards: dict[str, dict[str, TensorEntry]] = {}
    for shard in sorted(set(weight_map.values())):
        path = index.parent / shard
        if not path.is_file():
            raise CorruptCheckpointError(f"{index} lists shard {shard}, which is missing from {index.parent}; "
                                         "download every shard the index names")
        shards[shard] = read_header(path)
    entries = {}
    missing = []
    for name, shard in weight_map.items():
        if name in shards[shard]:
            entries[name] = shards[shard][name]
        else:
            missing.append(f"{name} (in {shard})")
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CorruptCheckpointError(f"{index} names weights its shards do not hold: {shown}; the index and shards "
                                     f"disagree (a partial or mixed download?); {_REFETCH}")
    return entries


def _refuse_pickles(directory: Path) -> None:
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise PickledCheckpointError(pickled_message(directory, pickles))


def pickled_message(where: Path, names: list[str]) -> str:
    return (
        f"{where}: pickled PyTorch checkpoint ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); infer never "
        "unpickles weights, because unpickling runs arbitrary code. Convert it to safetensors once, e.g. "
        "`python -c \"import transformers as t; t.AutoModelForCausalLM.from_pretrained('IN').save_pretrained('OUT')\"` "
        "(transformers writes safetensors), then load OUT"
    )
