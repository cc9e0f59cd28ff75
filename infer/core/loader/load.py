"""`load_model`: a path or alias in, a `LoadedModel` (config, NumPy weights, tokenizer) out."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ...primitives.types import WeightHandle
from .architectures import check_architecture
from .config import normalize_config, resolve_dtype
from .errors import CorruptCheckpointError
from .gguf_file import GGUFCheckpoint
from .hf_dir import HFCheckpoint
from .moe_layout import fuse_experts
from .quant_hf import with_quantization
from .paths import DEFAULT_MODEL, resolve_model_path


class Checkpoint(Protocol):
    """What `HFCheckpoint` and `GGUFCheckpoint` share."""

    format: str
    path: Path
    config: dict[str, Any]
    names: list[str]

    def nbytes(self, name: str) -> int: ...
    def read(self, name: str) -> np.ndarray: ...
    def chat_template(self, tokenizer: Any = None) -> str | None: ...
    def generation_config(self) -> dict[str, Any]: ...
    def load_tokenizer(self) -> Any: ...


@dataclass
class LoadedModel:
    """A model ready for the engine.

    ``weights`` maps HF parameter names (``model.layers.0.self_attn.q_proj.weight``)
    to arrays of ``dtype`` in HF layout (``[out, in]`` for projections). It holds
    what the checkpoint holds: with ``tie_word_embeddings`` there is no
    ``lm_head.weight``. Empty when loaded with ``load_weights=False``; then
    stream them with `iter_weights`.
    """

    config: dict[str, Any]
    weights: dict[str, np.ndarray]
    tokenizer: Any  # transformers PreTrainedTokenizerFast, or None when the checkpoint has no tokenizer
    chat_template: str | None
    generation_config: dict[str, Any]
    source: Path  # the HF directory or the .gguf file
    format: str  # "safetensors" or "gguf"
    dtype: np.dtype
    architecture: str
    checkpoint: Checkpoint = field(repr=False)

    @property
    def weight_names(self) -> list[str]:
        return self.checkpoint.names

    def iter_weights(self, progress: bool | None = None) -> Iterator[tuple[str, np.ndarray]]:
        """(name, array) one weight at a time, so only one is in memory beyond what the caller keeps."""
        return stream_weights(self.checkpoint, self.dtype, progress)

    def lazy_weights(self, progress: bool | None = None, quantized: bool = False) -> LazyWeights:
        """The checkpoint's weights as a mapping that reads each one when asked.

        ``quantized``: a tensor the checkpoint stores quantized (GGUF block
        types with a kept form, `quant_gguf.KEPT_TYPES`; AWQ, GPTQ, fp8) comes as a
        quantized `WeightHandle` of NumPy arrays instead of a dequantized array.
        """
        return LazyWeights(self.checkpoint, self.dtype, progress, quantized)


def open_checkpoint(path_or_alias: str | Path = DEFAULT_MODEL) -> Checkpoint:
    path, fmt = resolve_model_path(path_or_alias)
    return GGUFCheckpoint(path) if fmt == "gguf" else with_quantization(fuse_experts(HFCheckpoint(path)))


def load_model(
    path_or_alias: str | Path = DEFAULT_MODEL,
    dtype: Any = "auto",
    *,
    load_weights: bool = True,
    load_tokenizer: bool = True,
    progress: bool | None = None,
    supported_architectures: Iterable[str] | None = None,
) -> LoadedModel:
    """Load an HF directory, a .gguf file, or an alias (default ``smollm2``).

    ``dtype``: ``"auto"``, ``"float32"`` or ``"float16"`` (also NumPy or torch
    dtypes). ``progress``: a tqdm bar on stderr; None shows it only on a TTY.
    ``supported_architectures``: the names a plugin registry knows, replacing
    the built-in Llama family.
    """
    ckpt = open_checkpoint(path_or_alias)
    config = normalize_config(ckpt.config)
    architecture = check_architecture(config, ckpt.path, supported_architectures)
    np_dtype = resolve_dtype(dtype, config, ckpt.format)
    tokenizer = ckpt.load_tokenizer() if load_tokenizer else None
    weights = dict(stream_weights(ckpt, np_dtype, progress)) if load_weights else {}
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        chat_template=ckpt.chat_template(tokenizer),
        generation_config=ckpt.generation_config(),
        source=ckpt.path,
        format=ckpt.format,
        dtype=np_dtype,
        architecture=architecture,
        checkpoint=ckpt,
    )


def iter_weights(
    path_or_alias: str | Path = DEFAULT_MODEL, dtype: Any = "auto", progress: bool | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """Stream (HF name, array) pairs straight from a checkpoint, without the tokenizer."""
    ckpt = open_checkpoint(path_or_alias)
    return stream_weights(ckpt, resolve_dtype(dtype, normalize_config(ckpt.config), ckpt.format), progress)


def _progress_bar(ckpt: Checkpoint, names: list[str], progress: bool | None):
    from tqdm import tqdm

    show = sys.stderr.isatty() if progress is None else progress
    total = sum(ckpt.nbytes(n) for n in names)
    return tqdm(total=total, unit="B", unit_scale=True, desc=f"Loading {ckpt.path.name}", file=sys.stderr,
                disable=not show, leave=False)


def _read(ckpt: Checkpoint, name: str, dtype: np.dtype) -> np.ndarray:
    array = ckpt.read(name)
    if np.issubdtype(array.dtype, np.floating) and array.dtype != dtype:
        array = array.astype(dtype)
    return array


def require_finite(path: Path, name: str, value: Any) -> Any:
    """`value` (an array, or a quantized handle's arrays) unless it holds nan or inf: a
    corrupt file would otherwise load and generate garbage (token 0, nan logprobs)."""
    arrays = [("", value)] if isinstance(value, np.ndarray) else [
        (f" ({f})", getattr(value, f)) for f in ("qweight", "scales", "offsets", "bias")
        if isinstance(getattr(value, f, None), np.ndarray)]
    for part, a in arrays:
        if np.issubdtype(a.dtype, np.floating):
            bad = ~np.isfinite(a)
        elif part == " (qweight)" and getattr(value, "kind", None) == "fp8":
            bad = (a & 0x7F) == 0x7F  # e4m3fn's nan patterns
        else:
            continue
        if bad.any():
            first = np.unravel_index(int(np.argmax(bad)), a.shape)
            raise CorruptCheckpointError(f"{path}: tensor {name}{part} holds {int(bad.sum())} non-finite values (nan "
                                         f"or inf; the first at index {tuple(int(i) for i in first)}): the file is "
                                         "corrupt or was written wrongly; download or convert it again")
    return value


class LazyWeights(Mapping):
    """Checkpoint weights read on first access; `pop` forgets one.

    The model runner converts one parameter at a time and pops its sources,
    so a load holds at most one checkpoint tensor besides the backend's copy:
    peak memory stays near the model's size instead of twice it.
    """

    def __init__(self, ckpt: Checkpoint, dtype: np.dtype, progress: bool | None = None, quantized: bool = False):
        self._ckpt, self._dtype = ckpt, dtype
        self._quantized = quantized and hasattr(ckpt, "read_quantized")
        self._names = dict.fromkeys(ckpt.names)
        self._bar = _progress_bar(ckpt, list(self._names), progress)
        # name -> [stored type, file bytes, bytes as loaded, kept quantized, values]
        self._loaded: dict[str, list] = {}

    def _release(self, name: str) -> None:
        """The checkpoint's pages of `name` out of resident memory, where it can (GGUF's mapping)."""
        release = getattr(self._ckpt, "release", None)
        if release is not None:
            try:
                release(name)
            except KeyError:  # a name a wrapper made up (fused experts): its parts stay mapped
                pass

    def _note(self, name: str, value: Any) -> None:
        try:
            stored = self._ckpt.stored_type(name)
        except (AttributeError, KeyError):
            stored = "stored"
        entry = self._loaded.setdefault(name, [stored, self._ckpt.nbytes(name), 0, False, 0])
        entry[2] += _nbytes(value)
        entry[3] = isinstance(value, WeightHandle)
        entry[4] += value.out_features * value.in_features if entry[3] else int(np.asarray(value).size)

    def note_dequantized(self, names: Iterable[str]) -> None:
        """The model runner dequantized these after reading them kept (their fused parts share
        no form): float32 from then on."""
        for name in names:
            entry = self._loaded.get(name)
            if entry is not None and entry[3]:
                entry[2], entry[3] = 4 * entry[4], False

    def report(self) -> list[str]:
        """What the load did with each stored type: tensors and bytes (in the file -> as loaded),
        kept quantized or as float; a quantized type that could not be kept is named in a
        warning line (returned first, prefixed "warning: ")."""
        groups: dict[tuple[str, bool], list[int]] = {}
        for stored, file_bytes, loaded, kept, _ in self._loaded.values():
            g = groups.setdefault((stored, kept), [0, 0, 0])
            g[0], g[1], g[2] = g[0] + 1, g[1] + file_bytes, g[2] + loaded
        mb = lambda b: f"{b / 2**20:.1f} MB"  # noqa: E731
        kept = [f"{t} {n} ({mb(f)} -> {mb(b)})" for (t, k), (n, f, b) in sorted(groups.items()) if k]
        floats = [f"{t} {n} ({mb(f)} -> {mb(b)})" for (t, k), (n, f, b) in sorted(groups.items()) if not k]
        lines = []
        lost = sorted(t for (t, k) in groups if not k and t not in _FLOAT_TYPES and t != "stored")
        if lost and self._quantized:
            lines.append(f"warning: dequantized at load (no kept form here for these types): {', '.join(lost)}")
        lines.append(f"weights kept quantized: {'; '.join(kept) or 'none'}")
        lines.append(f"weights as float: {'; '.join(floats) or 'none'}")
        return lines

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)
        handle = self._ckpt.read_quantized(name) if self._quantized else None
        array = handle if handle is not None else _read(self._ckpt, name, self._dtype)
        self._bar.update(self._ckpt.nbytes(name))
        self._note(name, array)
        array = require_finite(self._ckpt.path, name, array)
        self._release(name)
        return array

    def read_slice(self, name: str, axis: int, start: int, stop: int) -> np.ndarray:
        """[start, stop) along `axis` of one weight, as `dtype` (a tensor-parallel shard); where
        the checkpoint can, only that part is read. A tensor kept quantized is read as stored
        and its handle sliced (input columns on the format's group boundaries)."""
        if name not in self._names:
            raise KeyError(name)
        from ..quant_params import slice_handle
        from .moe_layout import slice_of

        if self._quantized and hasattr(self._ckpt, "read_quantized_slice"):  # GGUF: only the shard's blocks
            handle = self._ckpt.read_quantized_slice(name, axis, start, stop)
        else:
            handle = self._ckpt.read_quantized(name) if self._quantized else None  # read as stored, then cut
            handle = None if handle is None else slice_handle(handle, axis, start, stop)
        if handle is not None:
            self._bar.update(self._ckpt.nbytes(name))
            self._note(name, handle)
            handle = require_finite(self._ckpt.path, name, handle)
            self._release(name)
            return handle
        array = slice_of(self._ckpt, name, axis, start, stop)
        if np.issubdtype(array.dtype, np.floating) and array.dtype != self._dtype:
            array = array.astype(self._dtype)
        try:  # the bar moves by the share of the tensor read, where the checkpoint knows its shape
            full = self._ckpt.shape(name)[axis]
        except (AttributeError, KeyError):
            full = None
        if full:
            self._bar.update(self._ckpt.nbytes(name) * (stop - start) // full)
        self._note(name, array)
        array = require_finite(self._ckpt.path, name, array)
        self._release(name)
        return array

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def pop(self, name: str, default: Any = None) -> None:
        self._names.pop(name, default)
        if not self._names:
            self._bar.close()

    def close(self) -> None:
        self._bar.close()


# Stored types that are float already (GGUF's and safetensors' names).
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64", "U8", "BOOL", "float"})


def _nbytes(value: Any) -> int:
    if isinstance(value, WeightHandle):
        return sum(int(np.asarray(v).nbytes) for v in (getattr(value, f, None) for f in ("qweight", "scales", "offsets"))
                   if v is not None)
    return int(getattr(value, "nbytes", 0))


def stream_weights(ckpt: Checkpoint, dtype: np.dtype, progress: bool | None = None) -> Iterator[tuple[str, np.ndarray]]:
    names = ckpt.names
    with _progress_bar(ckpt, names, progress) as bar:
        for name in names:
            array = _read(ckpt, name, dtype)
            bar.update(ckpt.nbytes(name))
            yield name, require_finite(ckpt.path, name, array)
