"""Loader details the model tests do not reach: byte counts (the load progress
bar's total, and how far a shard read moves it) for every readable dtype and for
fused experts, config defaults, and a chat template kept in its own JSON file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tiny_moe_models import save_moe_model
from tiny_models import make_model

from infer.core.loader import open_checkpoint, resolve_model_path
from infer.core.loader.config import normalize_config
from infer.core.loader.hf_dir import HFCheckpoint
from infer.core.loader.safetensors_file import read_header
from infer.core.models.moe import moe_spec

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn}


def test_every_readable_dtype_counts_its_stored_bytes(tmp_path):
    tensors = {name: torch.zeros(3, 5, dtype=dt) for name, dt in DTYPES.items()}
    save_file(tensors, tmp_path / "t.safetensors")
    entries = read_header(tmp_path / "t.safetensors")
    assert {n: e.dtype for n, e in entries.items()} == {n: n for n in DTYPES}
    assert {n: e.nbytes for n, e in entries.items()} == {n: t.numel() * t.element_size() for n, t in tensors.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_each_tensor_of_a_checkpoint_counts_its_stored_bytes(tmp_path, dtype):
    model, _, _ = make_model("qwen2")
    model.to(dtype).save_pretrained(tmp_path)
    ckpt = open_checkpoint(tmp_path)
    stored = {name: t.numel() * t.element_size() for name, t in model.state_dict().items()}
    assert {name: ckpt.nbytes(name) for name in ckpt.names} == {n: stored[n] for n in ckpt.names}


def test_fused_experts_count_the_bytes_of_every_expert_they_read(tmp_path):
    save_moe_model("mixtral", tmp_path)  # float32, one tensor per expert and projection
    ckpt = open_checkpoint(tmp_path)
    fused = [n for n in ckpt.names if ".experts." in n]
    assert fused
    for name in fused:
        assert ckpt.nbytes(name) == ckpt.read(name).size * 4, name


def test_a_config_without_tie_word_embeddings_does_not_tie():
    """The class default of every supported architecture; a hand-written config may omit it."""
    cfg = normalize_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4})
    assert cfg["tie_word_embeddings"] is False and cfg["num_key_value_heads"] == 4 and cfg["head_dim"] == 16


def test_without_generation_config_json_the_token_ids_set_in_config_json_are_used(tmp_path):
    """Older checkpoints keep bos/eos only in config.json: EOS must still end generation."""
    make_model("qwen2")[0].save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    config = json.loads((tmp_path / "config.json").read_text())
    config |= {"bos_token_id": 1, "eos_token_id": [2, 7], "pad_token_id": None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert HFCheckpoint(tmp_path).generation_config() == {"bos_token_id": 1, "eos_token_id": [2, 7]}


def test_chat_template_is_read_from_chat_template_json(tmp_path):
    make_model("qwen2")[0].save_pretrained(tmp_path)
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert HFCheckpoint(tmp_path).chat_template() == "{{ messages }}"


def test_a_qwen_moe_config_with_no_experts_has_no_sparse_layer():
    """transformers' rule: a layer is sparse only when num_experts > 0."""
    cfg = {"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 0, "num_experts_per_tok": 1,
           "moe_intermediate_size": 8}
    assert moe_spec(cfg, 4).sparse_layers == frozenset()
    assert moe_spec(cfg | {"num_experts": 4}, 4).sparse_layers == frozenset(range(4))
    assert moe_spec(cfg | {"num_experts": 1}, 4).sparse_layers == frozenset(range(4))  # one expert is still MoE


def test_a_file_of_an_hf_directory_stands_for_the_directory(tmp_path):
    make_model("qwen2")[0].save_pretrained(tmp_path)
    whole = resolve_model_path(tmp_path)
    assert resolve_model_path(tmp_path / "model.safetensors") == whole
    assert resolve_model_path(tmp_path / "config.json") == whole


def test_a_shard_read_moves_the_progress_bar_by_its_share_of_the_tensors_bytes(tmp_path, monkeypatch):
    """A tensor-parallel rank reads a part of each tensor: its bar counts the bytes of that part."""
    import tqdm

    from infer.core.loader.load import LazyWeights

    moved = []

    class Bar:
        def __init__(self, total, **kwargs):
            moved.append(total)

        def update(self, n):
            moved.append(n)

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    (tmp_path / "config.json").write_text("{}")
    save_file({"w": torch.zeros(6, 8)}, tmp_path / "model.safetensors")  # 192 bytes
    lazy = LazyWeights(HFCheckpoint(tmp_path), np.dtype(np.float32), progress=True)
    lazy.read_slice("w", 0, 2, 5)  # half the rows
    lazy.read_slice("w", 1, 0, 2)  # a quarter of the columns
    assert moved == [192, 96, 48]


def test_reading_casts_float_tensors_to_the_load_dtype_and_leaves_integer_ones(tmp_path):
    from infer.core.loader.load import _read

    class Checkpoint:
        def read(self, name):
            return {"w": np.ones(3, np.float32), "ids": np.arange(3, dtype=np.int32)}[name]

    assert _read(Checkpoint(), "w", np.dtype(np.float16)).dtype == np.float16
    assert _read(Checkpoint(), "ids", np.dtype(np.float16)).dtype == np.int32


def test_old_style_rope_scaling_gets_a_rope_type_and_a_new_style_one_is_kept():
    """transformers < 4.45 wrote `rope_scaling: {"type": ...}`; the core reads `rope_type`."""
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4}
    old = normalize_config(base | {"rope_scaling": {"type": "linear", "factor": 2.0}})
    assert old["rope_scaling"] == {"rope_type": "linear", "type": "linear", "factor": 2.0}
    new = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert normalize_config(base | {"rope_scaling": dict(new)})["rope_scaling"] == new


def test_chat_template_the_tokenizer_carries_comes_first(tmp_path):
    """A tokenizer with a template (set on it, or loaded with it) gives that template even when the
    directory holds no template file; without one the files are read."""
    from server_harness import CHATML, make_tokenizer

    make_model("qwen2")[0].save_pretrained(tmp_path)
    ckpt = HFCheckpoint(tmp_path)
    tok = make_tokenizer()
    assert tok.chat_template == CHATML
    assert ckpt.chat_template(tok) == CHATML
    assert ckpt.chat_template() is None
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    tok.chat_template = None
    assert ckpt.chat_template(tok) == "{{ messages }}"


@pytest.mark.parametrize("factor, rotary_dim", [(1.0, 64), (0.5, 32), (0.25, 16)])
def test_partial_rotary_factor_rotates_that_fraction_of_each_head(factor, rotary_dim):
    """HF's rule (transformers' rope init): dim = int(head_dim * partial_rotary_factor)."""
    from infer.core.models.config import normalize_config as model_config

    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_attention_heads": 4,
           "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100, "partial_rotary_factor": factor}
    got = model_config(cfg)
    assert (got.head_dim, got.rotary_dim) == (64, rotary_dim)


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("step, dense", [(1, []), (2, []), (3, []), (2, [1, 3]), (1, [0, 4])])
def test_sparse_layers_are_those_transformers_builds_with_experts(arch, step, dense):
    """decoder_sparse_step and mlp_only_layers as transformers reads them: the oracle is which
    layers of the transformers model get an MoE block."""
    import transformers
    from tiny_moe_models import COMMON, MOE_MODELS

    cfg_cls, model_cls, extra = MOE_MODELS[arch]
    config = getattr(transformers, cfg_cls)(**(COMMON | extra | dict(num_hidden_layers=6, decoder_sparse_step=step,
                                                                      mlp_only_layers=dense)))
    model = getattr(transformers, model_cls)(config)
    want = {i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")}
    assert want != set(range(6)) or (step, dense) == (1, [])  # the oracle does tell the layers apart
    assert moe_spec(config.to_dict() | {"architectures": [model_cls]}, 6).sparse_layers == want


def test_unsigned_integer_tensors_count_and_read_their_bytes(tmp_path):
    """U16/U32/U64, which torch cannot save: written with safetensors' NumPy API."""
    from safetensors.numpy import save_file as save_numpy

    from infer.core.loader.safetensors_file import read_tensor

    tensors = {"U8": np.arange(15, dtype=np.uint8), "U16": np.arange(15, dtype=np.uint16) * 4001,
               "U32": np.arange(15, dtype=np.uint32) * 270_000_001, "U64": np.arange(15, dtype=np.uint64) * 2**60}
    tensors = {k: v.reshape(3, 5) for k, v in tensors.items()}
    save_numpy(tensors, str(tmp_path / "u.safetensors"))
    entries = read_header(tmp_path / "u.safetensors")
    assert {n: (e.dtype, e.nbytes) for n, e in entries.items()} == {n: (n, t.nbytes) for n, t in tensors.items()}
    for name, t in tensors.items():
        np.testing.assert_array_equal(read_tensor(entries[name]), t, err_msg=name)


def test_safetensors_files_without_an_index_are_read_together_and_a_tensor_in_two_is_refused(tmp_path):
    from infer.core.loader.errors import CorruptCheckpointError
    from infer.core.loader.safetensors_file import find_safetensors

    save_file({"a": torch.zeros(2), "b": torch.ones(3)}, tmp_path / "part-1.safetensors")
    save_file({"c": torch.full((4,), 2.0)}, tmp_path / "part-2.safetensors")
    entries = find_safetensors(tmp_path)
    assert {n: e.file.name for n, e in entries.items()} == {"a": "part-1.safetensors", "b": "part-1.safetensors",
                                                           "c": "part-2.safetensors"}
    save_file({"b": torch.ones(3)}, tmp_path / "part-3.safetensors")
    with pytest.raises(CorruptCheckpointError, match="'b' is in both part-1.safetensors and part-3.safetensors"):
        find_safetensors(tmp_path)
