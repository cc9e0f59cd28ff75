"""Tiny random transformers models run through graph -> lowering -> runner must
give transformers' own logits, on every in-tree CPU backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infer.core.lowering import lower
from infer.core.model_runner import ModelRunner
from infer.core.models.llama import build_llama
from infer.registry import Ops, get_backend

from tiny_models import MODELS, make_model, meta_for

@pytest.mark.parametrize("backend_name", ["torch", "cpu_ref"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_logits_match_transformers_through_prefill_chunks_and_decode(kind, backend_name):
    model, config, weights = make_model(kind)
    backend = get_backend(backend_name)
    runner = ModelRunner(lower(build_llama(config)), backend, Ops(backend), weights, "float32", 256)
    bs = 16
    runner.allocate_kv_caches(num_blocks=12, block_size=bs)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 211, n) for n in (21, 5)]
    tables = [[7, 2], [4]]
    # Step 1: request 0 prefills its first 17 tokens (crossing a block), request 1 all 5.
    # Step 2: request 0 prefills its last 4 tokens while request 1 decodes one token.
    nxt = int(rng.integers(0, 211))
    steps = [([(0, 17), (0, 5)], np.concatenate([prompts[0][:17], prompts[1]])),
             ([(17, 4), (5, 1)], np.concatenate([prompts[0][17:], [nxt]]))]
    got = []
    for chunks, ids in steps:
        meta = meta_for(chunks, bs, tables)
        positions = np.concatenate([np.arange(c, c + q) for c, q in chunks])
        rows = np.arange(len(ids))
        logits = runner.forward(backend.asarray(ids), backend.asarray(positions), backend.asarray(rows),
                                backend.prepare_metadata(meta))
        got.append(backend.to_numpy(logits))
    with torch.no_grad():
        full0 = model(torch.from_numpy(prompts[0])[None]).logits[0].numpy()
        full1 = model(torch.from_numpy(np.append(prompts[1], nxt))[None]).logits[0].numpy()
    np.testing.assert_allclose(got[0][:17], full0[:17], atol=1e-4)
    np.testing.assert_allclose(got[0][17:], full1[:5], atol=1e-4)
    np.testing.assert_allclose(got[1][:4], full0[17:], atol=1e-4)
    np.testing.assert_allclose(got[1][4], full1[5], atol=1e-4)
