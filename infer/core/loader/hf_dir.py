"""Hugging Face model directories: config.json, safetensors weights, tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .errors import LoaderError
from .safetensors_file import find_safetensors, read_tensor, read_tensor_slice

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoaderError(f"{path}: not valid JSON ({exc}); re-download or re-save the model") from exc
    if not isinstance(data, dict):
        raise LoaderError(f"{path}: expected a JSON object; re-download or re-save the model")
    return data


class HFCheckpoint:
    """An HF model directory; weights are only read when asked for."""

    format = "safetensors"

    def __init__(self, directory: Path):
        self.path = directory
        config = directory / "config.json"
        if not config.is_file():
            raise LoaderError(f"{directory}: no config.json, so this is not a Hugging Face model directory; pass "
                              "the directory that holds config.json and the *.safetensors files, or a .gguf file")
        self.config = read_json(config)
        self._entries = find_safetensors(directory)

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def nbytes(self, name: str) -> int:
        return self._entries[name].nbytes

    def stored_type(self, name: str) -> str:
        return self._entries[name].dtype

    def read(self, name: str) -> np.ndarray:
        return read_tensor(self._entries[name])

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def read_slice(self, name: str, axis: int, start: int, stop: int) -> np.ndarray:
        """[start, stop) along `axis` of one tensor, reading only that part (a tensor-parallel shard)."""
        return read_tensor_slice(self._entries[name], axis, start, stop)

    def chat_template(self, tokenizer: Any = None) -> str | None:
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            return tokenizer.chat_template
        # transformers >= 4.43 may keep it in its own file; older ones in tokenizer_config.json.
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        for name in ("chat_template.json", "tokenizer_config.json"):
            if (self.path / name).is_file():
                template = read_json(self.path / name).get("chat_template")
                if template:
                    return template if isinstance(template, str) else _default_template(template)
        return None

    def generation_config(self) -> dict[str, Any]:
        path = self.path / "generation_config.json"
        if path.is_file():
            return read_json(path)
        return {k: self.config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if self.config.get(k) is not None}

    def load_tokenizer(self):
        """transformers' tokenizer for the directory, or None when it ships none."""
        if not any((self.path / name).is_file() for name in _TOKENIZER_FILES):
            return None
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.path), local_files_only=True, trust_remote_code=False)
        except Exception as exc:
            raise LoaderError(f"{self.path}: could not load its tokenizer ({type(exc).__name__}: {exc}); fix or "
                              "remove the tokenizer files, or pass load_tokenizer=False") from exc


def _default_template(templates: list[dict[str, str]]) -> str | None:
    # Some tokenizer configs hold a list of named templates; 'default' is the chat one.
    named = {t.get("name"): t.get("template") for t in templates if isinstance(t, dict)}
    return named.get("default") or next(iter(named.values()), None)
