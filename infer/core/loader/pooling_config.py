"""A checkpoint's pooling settings, read from its sentence-transformers files.

``modules.json`` lists the pipeline (Transformer, Pooling, Normalize, ...);
``1_Pooling/config.json`` names the method, as ``pooling_mode`` (sentence-
transformers >= 5) or the older ``pooling_mode_*`` flags;
``sentence_bert_config.json`` may cap the sequence length. A module this
runtime has no form of (a Dense projection, weighted-mean pooling) is refused,
never skipped: skipping it would return other embeddings than the model's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# sentence-transformers' pooling modes -> the `pool` primitive's methods.
METHODS = {"cls": "cls", "mean": "mean", "max": "max", "lasttoken": "last"}
_LEGACY = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
           "pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
           "pooling_mode_weightedmean_tokens": "weightedmean"}


@dataclass(frozen=True)
class PoolingConfig:
    method: str | None = None  # a `pool` method; None: the architecture's default
    normalize: bool = True  # L2-normalise embeddings (vLLM's default without sentence-transformers files)
    max_seq_length: int | None = None
    sentence_transformers: bool = False  # read from modules.json


def read_pooling_config(model_dir: Path | str) -> PoolingConfig:
    root = Path(model_dir)
    if root.is_file() or not (root / "modules.json").is_file():
        return PoolingConfig()
    modules = json.loads((root / "modules.json").read_text())
    method, normalize = None, False
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            method = _method(root / m.get("path", "1_Pooling") / "config.json")
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(f"{root}: sentence-transformers module {kind!r} ({m.get('path')}) is not supported "
                             "(supported: Transformer, Pooling, Normalize)")
    st = root / "sentence_bert_config.json"
    cap = json.loads(st.read_text()).get("max_seq_length") if st.is_file() else None
    return PoolingConfig(method, normalize, int(cap) if cap else None, True)


def _method(path: Path) -> str:
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    mode = cfg.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in _LEGACY.items() if cfg.get(key)]
        mode = modes[0] if len(modes) == 1 else tuple(modes) if modes else "mean"
    if isinstance(mode, (list, tuple)):
        mode = mode[0] if len(mode) == 1 else tuple(mode)
    if mode not in METHODS:
        raise ValueError(f"{path}: pooling mode {mode!r} is not supported (supported: {', '.join(METHODS)})")
    return METHODS[mode]
