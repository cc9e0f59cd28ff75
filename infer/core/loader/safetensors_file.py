"""safetensors checkpoints, read with NumPy: single file or index + shards.

The format is 8 bytes of little-endian header length, a JSON header mapping each
tensor to its dtype, shape and byte range, then the raw data. Reading it here
(instead of through the safetensors package) lets every header be checked
against the file size up front, so a truncated download fails with a clear
message before any weight is read, and lets BF16 be widened to float32, which
NumPy cannot represent.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

from .errors import CorruptCheckpointError, LoaderError, PickledCheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

# safetensors dtype -> NumPy dtype; BF16 is read as raw uint16 and widened.
_NUMPY_DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
    "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
}
_REFETCH = "re-download or re-save the checkpoint"


@dataclass(frozen=True, slots=True)
class TensorEntry:
    file: Path
    dtype: str  # safetensors name: F32, F16, BF16, ...
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Every tensor of one .safetensors file, checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptCheckpointError(f"{path}: only {size} bytes, too short to be safetensors (truncated?); {_REFETCH}")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise CorruptCheckpointError(
                f"{path}: header says it is {header_len} bytes but the file holds only {size - 8} after the "
                f"length field: the file is truncated or not safetensors; {_REFETCH}"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptCheckpointError(f"{path}: header is not valid JSON ({exc}): the file is corrupt; {_REFETCH}") from exc
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: header is not a JSON object: the file is corrupt; {_REFETCH}")
    data_start, data_size = 8 + header_len, size - 8 - header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(f"{path}: malformed header entry for {name!r}; {_REFETCH}") from exc
        if dtype not in _NUMPY_DTYPES:
            raise LoaderError(f"{path}: tensor {name!r} has dtype {dtype}, which infer cannot read "
                              f"(readable: {', '.join(_NUMPY_DTYPES)}); re-save it as float16 or float32")
        nbytes = prod(shape) * np.dtype(_NUMPY_DTYPES[dtype]).itemsize
        if end - begin != nbytes or begin < 0:
            raise CorruptCheckpointError(f"{path}: tensor {name!r} spans {end - begin} bytes, but {dtype}{list(shape)} "
                                         f"needs {nbytes}: the header is corrupt; {_REFETCH}")
        if end > data_size:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} ends at byte {end} of the data section, which holds only {data_size} "
                f"bytes: the file is truncated; {_REFETCH}"
            )
        entries[name] = TensorEntry(path, dtype, shape, data_start + begin, nbytes)
    return entries


def read_tensor(entry: TensorEntry) -> np.ndarray:
    """One tensor as a writable array (BF16 widened to float32, exactly)."""
    buf = bytearray(entry.nbytes)
    with open(entry.file, "rb") as f:
        f.seek(entry.start)
        got = f.readinto(buf)
    if got != entry.nbytes:
        raise CorruptCheckpointError(f"{entry.file}: short read ({got} of {entry.nbytes} bytes); the file changed "
                                     f"while loading or is truncated; {_REFETCH}")
    raw = np.frombuffer(buf, dtype=_NUMPY_DTYPES[entry.dtype])
    if entry.dtype == "BF16":
        # bfloat16 is the top half of a float32: shifting it up is exact.
        raw = (raw.astype("<u4") << 16).view("<f4")
    return raw.reshape(entry.shape)


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
