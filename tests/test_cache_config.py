"""Engine configuration settled before anything loads: CacheConfig.resolve (the
KV pool's block size and count), decode-graph batch sizes, model-config defaults."""

from __future__ import annotations

import pytest

from infer.core.config import CacheConfig, graph_batch_sizes
from infer.core.models.config import normalize_config


def test_block_size_defaults_to_16_when_the_backend_states_none():
    assert CacheConfig(num_blocks=4).resolve().block_size == 16


def test_the_backends_preferred_block_size_is_taken_unless_one_is_set():
    assert CacheConfig(num_blocks=4).resolve(preferred_block_size=128).block_size == 128
    assert CacheConfig(num_blocks=4, block_size=32).resolve(preferred_block_size=128).block_size == 32


def test_bytes_become_whole_blocks():
    cfg = CacheConfig(kv_cache_memory_bytes=10_000).resolve(preferred_block_size=16, kv_bytes_per_token=100)
    assert (cfg.block_size, cfg.num_blocks, cfg.kv_cache_memory_bytes) == (16, 6, None)  # 10000 // 1600


@pytest.mark.parametrize("per_token", [0, -8])
def test_a_non_positive_kv_footprint_is_rejected(per_token):
    with pytest.raises(ValueError, match="kv_bytes_per_token must be a positive integer"):
        CacheConfig(kv_cache_memory_bytes=1 << 20).resolve(kv_bytes_per_token=per_token)


def test_a_pool_too_small_for_one_block_names_the_fix():
    with pytest.raises(ValueError, match="holds no block.*raise kv_cache_memory_bytes"):
        CacheConfig(kv_cache_memory_bytes=1599).resolve(preferred_block_size=16, kv_bytes_per_token=100)


def test_decode_graph_sizes_default_to_vllms_pattern_up_to_max_num_seqs():
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert graph_batch_sizes(8) == (1, 2, 4, 8)
    assert graph_batch_sizes(8, [4, 1, 4]) == (1, 4)


@pytest.mark.parametrize("sizes", [[0, 4], [], [2, -1], [True]])
def test_decode_graph_sizes_must_be_positive_integers(sizes):
    with pytest.raises(ValueError, match="cuda_graph_sizes must be positive integers"):
        graph_batch_sizes(8, sizes)


def test_a_model_config_without_max_position_embeddings_allows_2048():
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
           "intermediate_size": 128, "vocab_size": 100}
    assert normalize_config(cfg).max_position_embeddings == 2048


@pytest.mark.parametrize("preferred", [None, 0, -16])
def test_without_a_set_block_size_the_backends_must_be_positive(preferred):
    with pytest.raises(ValueError, match="preferred_block_size must be a positive integer"):
        CacheConfig(num_blocks=8).resolve(preferred_block_size=preferred)
    assert CacheConfig(block_size=4, num_blocks=8).resolve(preferred_block_size=preferred).block_size == 4


@pytest.mark.parametrize("field", ["block_size", "num_blocks", "kv_cache_memory_bytes"])
@pytest.mark.parametrize("value", [0, -16])
def test_each_size_must_be_positive(field, value):
    with pytest.raises(ValueError, match=f"CacheConfig.{field}"):
        CacheConfig(**{field: value})
