"""How the engine sizes the KV pool: bytes on host memory, a profiled share of
device memory on accelerators (gpu_memory_utilization)."""

from __future__ import annotations

import pytest

from infer.backends.torch_native.backend import TorchBackend
from infer.core.engine import LLMEngine

from tiny_models import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model, _, _ = make_model("llama3")
    path = tmp_path_factory.mktemp("llama3")
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(path)
    return str(path)


def test_kv_cache_memory_bytes_become_blocks(model_dir):
    e = LLMEngine(model=model_dir, backend="torch", skip_tokenizer_init=True, kv_cache_memory=4 << 20)
    per_block = e.worker.runner.kv_cache_bytes_per_block(e.cache_config.block_size)
    assert e.cache_config.num_blocks == (4 << 20) // per_block


def test_gpu_memory_utilization_leaves_the_profiled_peak_out(model_dir, monkeypatch):
    resets = []
    monkeypatch.setattr(TorchBackend, "memory_info", lambda self: (100 << 20, 30 << 20))
    monkeypatch.setattr(TorchBackend, "reset_peak_memory", lambda self: resets.append(True))
    e = LLMEngine(model=model_dir, backend="torch", skip_tokenizer_init=True, gpu_memory_utilization=0.5)
    per_block = e.worker.runner.kv_cache_bytes_per_block(e.cache_config.block_size)
    assert resets, "the engine must profile a forward before sizing the pool"
    assert e.cache_config.num_blocks == ((50 - 30) << 20) // per_block


def test_too_low_gpu_memory_utilization_is_a_clear_error(model_dir, monkeypatch):
    monkeypatch.setattr(TorchBackend, "memory_info", lambda self: (100 << 20, 60 << 20))
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.5 .* raise it"):
        LLMEngine(model=model_dir, backend="torch", skip_tokenizer_init=True, gpu_memory_utilization=0.5)
