"""GGUF checkpoints (llama.cpp's format): metadata -> HF config, tensors -> HF names.

Tensors are dequantized to float32 with the `gguf` package (Q4_1: per block of
32 values, `x = d * q + m` with fp16 `d`, `m` and 4-bit `q`). llama.cpp's
converter permutes the rows of a Llama q/k projection from HF's rotary layout
(per head: first half, second half) into its interleaved one (pairs); `read`
undoes that, so every weight comes out exactly as the HF checkpoint holds it.
Granite's are permuted too; Qwen2/Qwen3, Gemma 2/3 and OLMo 2 files are stored unpermuted.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from . import gguf_arch, quant_gguf
from .errors import CorruptCheckpointError, LoaderError, UnsupportedArchitectureError
from .gguf_arch import (GEMMA, GGUF_ARCHITECTURES, PERMUTED_QK, deepseek2_config, gemma_config, gpt_oss_config,
                        hf_name, joined_tensors, routed_config, unpermute_rows)
from .gguf_header import GGUFHeader, GGUFVersionError

# Tensors that are config, not weights: llama.cpp bakes Llama 3 rope scaling into rope_freqs.
_CONFIG_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
_REFETCH = "re-download the GGUF file"
# Float32 bytes of the row chunks `GGUFCheckpoint.read` dequantizes at a time (bounds its temporaries).
CHUNK_BYTES = 4 << 20


class GGUFCheckpoint:
    """One .gguf file: its metadata, HF config, and tensors under HF names."""

    format = "gguf"

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise CorruptCheckpointError(f"{path}: does not start with the GGUF magic bytes: not a GGUF file "
                                             f"(or a corrupt one); {_REFETCH}")
        try:
            self.reader = GGUFHeader(path)
        except GGUFVersionError as exc:
            raise UnsupportedArchitectureError(
                f"{path}: GGUF format version {exc.version}; infer reads versions 2 and 3 (what llama.cpp has "
                "written since 2023). Convert the model again with a current llama.cpp") from None
        except Exception as exc:  # a short or damaged header: whatever struct or NumPy raise
            raise CorruptCheckpointError(f"{path}: unreadable GGUF ({type(exc).__name__}: {exc}); the file is "
                                         f"probably truncated; {_REFETCH}") from exc
        size = path.stat().st_size
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise CorruptCheckpointError(f"{path}: tensor {t.name} ends at byte {t.data_offset + t.n_bytes} but "
                                             f"the file holds {size}: truncated; {_REFETCH}")
        self.arch = str(self._field("general.architecture"))
        if self.arch not in GGUF_ARCHITECTURES:
            supported = ", ".join(f"{k} ({v[0]})" for k, v in GGUF_ARCHITECTURES.items())
            raise UnsupportedArchitectureError(f"{path}: GGUF architecture {self.arch!r} is not supported; infer reads "
                                               f"GGUF {supported}. Use a GGUF of a supported architecture")
        self._gguf_tensors = {t.name: t for t in self.reader.tensors}
        self._by_hf_name = {}
        self._joined = joined_tensors(self.arch, self._gguf_tensors)
        parts = {p for j in self._joined.values() for p in j.parts}
        if missing := sorted(parts - set(self._gguf_tensors)):
            raise CorruptCheckpointError(f"{path}: tensor {missing[0]} is missing beside the other part of the "
                                         f"tensor it is stored with; {_REFETCH}")
        for name, tensor in self._gguf_tensors.items():
            if name in _CONFIG_TENSORS or name in parts:
                continue
            mapped = hf_name(name, self.arch)
            if mapped is None:
                raise LoaderError(f"{path}: tensor {name!r} has no Hugging Face name in infer's GGUF map for "
                                  f"{self.arch}; this GGUF variant is not supported yet")
            self._by_hf_name[mapped] = tensor
        self.config = self._build_config()

    # -- metadata -----------------------------------------------------------
    def _field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def _arch_field(self, key: str, default: Any = None) -> Any:
        return self._field(f"{self.arch}.{key}", default)

    def _build_config(self) -> dict[str, Any]:
        hidden = self._arch_field("embedding_length")
        heads = self._arch_field("attention.head_count")
        layers = self._arch_field("block_count")
        if None in (hidden, heads, layers):
            raise CorruptCheckpointError(f"{self.path}: GGUF metadata lacks {self.arch}.embedding_length, "
                                         f".attention.head_count or .block_count; {_REFETCH}")
        hf_arch, model_type = GGUF_ARCHITECTURES[self.arch]
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        vocab = self._arch_field("vocab_size") or (tokens.count if tokens else None)
        if vocab is None:
            vocab = int(self._gguf_tensors["token_embd.weight"].shape[-1])
        cfg: dict[str, Any] = {
            "architectures": [hf_arch],
            "model_type": model_type,
            "hidden_size": int(hidden),
            "intermediate_size": int(self._arch_field("feed_forward_length")),
            "num_hidden_layers": int(layers),
            "num_attention_heads": int(heads),
            "num_key_value_heads": int(self._arch_field("attention.head_count_kv", heads)),
            "head_dim": int(self._arch_field("attention.key_length", hidden // heads)),
            "rms_norm_eps": float(self._arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._arch_field("rope.freq_base", 10000.0)),
            "rope_scaling": self._rope_scaling(),
            "max_position_embeddings": int(self._arch_field("context_length", 2048)),
            "vocab_size": int(vocab),
            "tie_word_embeddings": "output.weight" not in self._gguf_tensors,
            "hidden_act": "silu",
            "mlp_bias": False,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self._field("tokenizer.ggml.padding_token_id"),
            "dtype": "float32",
        }
        if self.arch not in ("qwen2", "qwen2moe"):  # Qwen2 always has q/k/v biases; the others say so
            cfg["attention_bias"] = "blk.0.attn_q.bias" in self._gguf_tensors
        if (window := self._arch_field("attention.sliding_window")) is not None:
            cfg["sliding_window"] = int(window)
        if self.arch in GEMMA:
            cfg.update(gemma_config(self.arch, self._arch_field, cfg))
        if self.arch == "phi3":
            cfg.update(self._phi3_config(cfg))
        if self.arch == "smollm3":  # llama.cpp fixes it: every 4th layer has no rope (no key stores it)
            cfg["no_rope_layer_interval"] = 4
        if self.arch == "glm4":  # rope on part of each head, as rope.dimension_count says
            rotated = self._arch_field("rope.dimension_count")
            cfg["partial_rotary_factor"] = int(rotated) / cfg["head_dim"] if rotated else 0.5
        if self.arch in ("llama", "qwen2moe", "qwen3moe"):
            cfg.update(routed_config(self.arch, self._arch_field, self._gguf_tensors, cfg))
        if self.arch == "deepseek2":
            try:
                cfg.update(deepseek2_config(self._arch_field, self._gguf_tensors, cfg))
            except ValueError as exc:
                raise LoaderError(f"{self.path}: {exc}; convert the model again with a current llama.cpp") from None
        if self.arch == "gpt-oss":
            cfg.update(gpt_oss_config(self._arch_field, cfg))
        if self.arch == "granite":  # llama.cpp names the multipliers scales; logit_scale divides the logits
            for key, hf_key in (("attention.scale", "attention_multiplier"), ("embedding_scale", "embedding_multiplier"),
                                ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling")):
                if (value := self._arch_field(key)) is not None:
                    cfg[hf_key] = float(value)
        return cfg

    def _phi3_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """Phi-3 as llama.cpp's converter writes it: the rotated dims as rope.dimension_count,
        LongRoPE's factors as two tensors beside the original context length, and a window
        of 0 for none (Phi-4-mini)."""
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        out: dict[str, Any] = {"head_dim": head_dim,
                               "partial_rotary_factor": int(self._arch_field("rope.dimension_count", head_dim)) / head_dim,
                               "attention_bias": False}
        if not cfg.get("sliding_window"):
            out["sliding_window"] = None
        orig = self._arch_field("rope.scaling.original_context_length")
        if orig is not None:
            out["original_max_position_embeddings"] = int(orig)
        if "rope_factors_long.weight" in self._gguf_tensors:
            from gguf import dequantize

            def factors(name: str) -> list[float]:
                t = self._gguf_tensors[name]
                return [float(f) for f in np.asarray(dequantize(t.data, t.tensor_type), np.float64).reshape(-1)]

            out["rope_scaling"] = {"rope_type": "longrope", "long_factor": factors("rope_factors_long.weight"),
                                   "short_factor": factors("rope_factors_short.weight")}
            if orig is not None:
                out["rope_scaling"]["original_max_position_embeddings"] = int(orig)
        return out

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self._arch_field("rope.scaling.type")
        factor = self._arch_field("rope.scaling.factor")
        if "rope_freqs.weight" in self._gguf_tensors:
            return self._llama3_rope_scaling()
        if kind in (None, "none") or factor in (None, 1.0):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(factor)}
        if kind == "yarn":
            scaling = {"rope_type": "yarn", "factor": float(factor)}
            if (orig := self._arch_field("rope.scaling.original_context_length")) is not None:
                scaling["original_max_position_embeddings"] = int(orig)
            return scaling
        raise LoaderError(f"{self.path}: rope scaling {kind!r} in GGUF metadata is not supported (linear, yarn and "
                          "Llama 3 rope_freqs are)")

    def _llama3_rope_scaling(self) -> dict[str, Any]:
        """llama.cpp stores Llama 3 rope scaling as per-frequency divisors; find the HF parameters that give them."""
        from gguf import dequantize

        t = self._gguf_tensors["rope_freqs.weight"]
        stored = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)
        hidden, heads = self._arch_field("embedding_length"), self._arch_field("attention.head_count")
        dim = int(self._arch_field("rope.dimension_count", hidden // heads))
        theta = float(self._arch_field("rope.freq_base", 10000.0))
        factor = float(stored.max())
        # Every Llama 3.x release uses these three; only `factor` varies (8 or 32).
        low, high, orig = 1.0, 4.0, 8192
        if np.allclose(llama3_freq_factors(theta, dim, factor, low, high, orig), stored, rtol=1e-5):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": orig}
        raise LoaderError(f"{self.path}: rope_freqs tensor does not match Llama 3 rope scaling with low_freq_factor=1, "
                          "high_freq_factor=4, original context 8192; load the HF safetensors checkpoint instead")

    # -- tensors ------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [*self._by_hf_name, *self._joined]

    def nbytes(self, name: str) -> int:
        if name in self._joined:
            return sum(int(self._gguf_tensors[p].n_bytes) for p in self._joined[name].parts)
        return int(self._by_hf_name[name].n_bytes)

    def release(self, name: str) -> None:
        """`name`'s file pages leave the process's resident memory (it has been read)."""
        parts = self._joined[name].parts if name in self._joined else None
        tensors = [self._gguf_tensors[p] for p in parts] if parts else [self._by_hf_name[name]]
        for t in tensors:
            self.reader.release(t.data_offset, t.n_bytes)

    def stored_type(self, name: str) -> str:
        """The ggml type the file stores `name` as (Q4_K, Q8_0, F32 ...)."""
        if name in self._joined:
            return self._gguf_tensors[self._joined[name].parts[0]].tensor_type.name
        return self._by_hf_name[name].tensor_type.name

    def read(self, name: str) -> np.ndarray:
        """One weight dequantized to float32, in HF layout."""
        if name in self._joined:
            joined = self._joined[name]
            return joined.join([self._dequantize(self._gguf_tensors[p]) for p in joined.parts])
        w = self._dequantize(self._by_hf_name[name])
        if self.arch in PERMUTED_QK:
            if ".self_attn.q_proj." in name:
                w = unpermute_rows(w, self.config["num_attention_heads"])
            elif ".self_attn.k_proj." in name:
                w = unpermute_rows(w, self.config["num_key_value_heads"])
        return w

    def _dequantize(self, t) -> np.ndarray:
        """One stored tensor as float32, in HF's dimension order."""
        from gguf import dequantize

        shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists the fastest-moving dimension first
        data = t.data.reshape(-1, t.data.shape[-1]) if t.data.ndim > 1 else t.data.reshape(1, -1)
        w = np.empty((data.shape[0], int(np.prod(shape)) // data.shape[0]), dtype=np.float32)
        # Row chunks into one preallocated array: whole-tensor dequantization
        # makes several float temporaries of the tensor's size (the embedding's
        # are hundreds of MB), which is what set the load's peak RSS.
        step = max(1, CHUNK_BYTES // max(1, w.shape[1] * 4))
        try:
            for lo in range(0, data.shape[0], step):
                w[lo:lo + step] = dequantize(data[lo:lo + step], t.tensor_type)
        except NotImplementedError as exc:
            raise LoaderError(f"{self.path}: tensor {t.name} is stored as {t.tensor_type.name}, which gguf-py cannot "
                              "dequantize; use a file quantized to F16, Q8_0, Q4_0/Q4_1 or a K-quant") from exc
        return w.reshape(shape)

    def _raw_slice(self, name: str, axis: int, start: int, stop: int):
        """(raw ggml rows of [start, stop) along `axis`, their HF shape, the q/k head count
        of those rows) without reading the rest of the tensor, or None where the tensor is
        not a matrix or the cut splits the type's blocks."""
        from gguf.constants import GGML_QUANT_SIZES

        t = self._by_hf_name.get(name)
        shape = tuple(int(d) for d in reversed(t.shape)) if t is not None else ()
        if len(shape) != 2:
            return None
        rows, cols = shape
        data = t.data.reshape(rows, -1)
        block, block_bytes = GGML_QUANT_SIZES[t.tensor_type]
        if axis == 0:
            part, out = data[start:stop], (stop - start, cols)
        else:
            if start % block or stop % block:
                return None
            part, out = data[:, start // block * block_bytes:stop // block * block_bytes], (rows, stop - start)
        heads = None
        if self.arch in PERMUTED_QK and axis == 0:
            for key, module in (("num_attention_heads", ".self_attn.q_proj."), ("num_key_value_heads", ".self_attn.k_proj.")):
                if module in name:
                    head_rows = rows // self.config[key]
                    if start % head_rows or stop % head_rows:
                        return None  # unpermuting works on whole heads
                    heads = (stop - start) // head_rows
        elif self.arch in PERMUTED_QK and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            return None
        return np.ascontiguousarray(part), out, heads

    def read_slice(self, name: str, axis: int, start: int, stop: int) -> np.ndarray:
        """[start, stop) along `axis` of one weight, dequantized to float32; only those rows
        (or those blocks of every row) are read and dequantized."""
        from gguf import dequantize

        raw = self._raw_slice(name, axis, start, stop)
        if raw is None:
            return np.ascontiguousarray(self.read(name)[(slice(None),) * axis + (slice(start, stop),)])
        part, shape, heads = raw
        w = np.asarray(dequantize(part, self._by_hf_name[name].tensor_type), dtype=np.float32).reshape(shape)
        return unpermute_rows(w, heads) if heads else w

    def read_quantized_slice(self, name: str, axis: int, start: int, stop: int):
        """A quantized handle of [start, stop) along `axis` (see `read_quantized`), reading
        only that part; None for a tensor `read_quantized` gives no handle for."""
        from ..quant_params import slice_handle

        if name in self._joined:
            return None
        t = self._by_hf_name[name]
        raw = self._raw_slice(name, axis, start, stop)
        if raw is None:
            handle = self.read_quantized(name)
            return None if handle is None else slice_handle(handle, axis, start, stop)
        part, shape, heads = raw
        handle = quant_gguf.to_handle(part, t.tensor_type.name, *shape)
        if handle is not None and heads:
            handle = quant_gguf.permute_rows(handle, lambda a: unpermute_rows(a, heads))
        return handle

    def read_quantized(self, name: str):
        """One weight as a quantized handle (a type of `quant_gguf.KEPT_TYPES`, repacked
        exactly; q/k rows unpermuted), or None for a tensor of another type: `read` it."""
        t = self._by_hf_name.get(name)
        if t is None:  # stored in parts: MXFP4 gate and up experts join as one stack, others are read
            joined = self._joined.get(name)
            parts = [self._gguf_tensors[p] for p in joined.parts] if joined is not None else []
            if joined is None or joined.join is not gguf_arch.stack_rows or any(
                    p.tensor_type.name != "MXFP4" or len(p.shape) != 3 for p in parts):
                return None
            from ..quant_params import concat_rows

            return concat_rows([quant_gguf.mxfp4_handle(p.data, tuple(int(d) for d in reversed(p.shape)))
                                for p in parts], name)
        shape = tuple(int(d) for d in reversed(t.shape))
        if len(shape) == 3 and t.tensor_type.name == "MXFP4":  # a stack of experts [E, N, K]
            return quant_gguf.mxfp4_handle(t.data, shape)
        if len(shape) != 2:
            return None
        handle = quant_gguf.to_handle(t.data, t.tensor_type.name, *shape)
        if handle is not None and self.arch in PERMUTED_QK:
            if ".self_attn.q_proj." in name:
                handle = quant_gguf.permute_rows(handle, lambda a: unpermute_rows(a, self.config["num_attention_heads"]))
            elif ".self_attn.k_proj." in name:
                handle = quant_gguf.permute_rows(handle, lambda a: unpermute_rows(a, self.config["num_key_value_heads"]))
        return handle

    # -- tokenizer side -------------------------------------------------------
    def chat_template(self, tokenizer: Any = None) -> str | None:
        return self._field("tokenizer.chat_template")

    def generation_config(self) -> dict[str, Any]:
        gen: dict[str, Any] = {}
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if self.config.get(key) is not None:
                gen[key] = self.config[key]
        # Chat models often end a turn with a separate end-of-turn token (Llama 3's <|eot_id|>).
        eot = self._field("tokenizer.ggml.eot_token_id")
        if eot is not None and eot != gen.get("eos_token_id"):
            gen["eos_token_id"] = [x for x in (gen.get("eos_token_id"), eot) if x is not None]
        for gguf_key, hf_key in (("temp", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"), ("min_p", "min_p")):
            if (value := self._field(f"general.sampling.{gguf_key}")) is not None:
                gen[hf_key] = value
        return gen

    def load_tokenizer(self):
        """transformers' tokenizer rebuilt from the GGUF vocabulary, or None when the file has none.

        Rebuilding takes seconds (transformers converts the whole vocabulary),
        so the result is cached on disk per GGUF file (see `tokenizer_cache_dir`).
        """
        if "tokenizer.ggml.model" not in self.reader.fields:
            return None
        from transformers import PreTrainedTokenizerFast

        cached = tokenizer_cache_dir(self.path)
        if cached is not None and (cached / "tokenizer.json").is_file():
            try:
                return PreTrainedTokenizerFast.from_pretrained(str(cached), local_files_only=True)
            except Exception:  # a damaged cache entry: drop it and rebuild below
                shutil.rmtree(cached, ignore_errors=True)
        try:
            tok = PreTrainedTokenizerFast.from_pretrained(str(self.path.parent), gguf_file=self.path.name,
                                                          local_files_only=True)
        except Exception as exc:
            raise LoaderError(f"{self.path}: could not build a tokenizer from the GGUF metadata "
                              f"({type(exc).__name__}: {exc}); pass load_tokenizer=False to load weights only") from exc
        if cached is not None:
            _save_atomically(tok, cached)
        return tok


def tokenizer_cache_dir(gguf: Path) -> Path | None:
    """Where the tokenizer converted from `gguf` is kept: $INFER_CACHE_DIR (or
    $XDG_CACHE_HOME/infer, or ~/.cache/infer)/tokenizers/<key>, the key naming
    the file's path, size and modification time. None when INFER_CACHE_DIR is
    set to an empty string (caching off)."""
    root = os.environ.get("INFER_CACHE_DIR")
    if root == "":
        return None
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "infer")
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    return Path(root) / "tokenizers" / key


def _save_atomically(tok, target: Path) -> None:
    """Best effort: a cache that cannot be written only costs the next load time."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent))
        tok.save_pretrained(str(tmp))
        os.replace(tmp, target)  # another process may have won the race: then keep theirs
    except OSError:
        shutil.rmtree(locals().get("tmp", ""), ignore_errors=True)


def llama3_freq_factors(theta: float, dim: int, factor: float, low: float, high: float, orig: int) -> np.ndarray:
    """The divisor llama.cpp's converter writes to rope_freqs for each rotary frequency."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid))
