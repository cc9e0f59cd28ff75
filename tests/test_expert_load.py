"""Expert load: which layers and experts a model's load is counted over, and the
imbalance figure, on loads whose mean is not 1 (where max * mean would pass for max / mean)."""

from __future__ import annotations

import numpy as np
from tiny_moe_models import make_moe_model
from tiny_models import make_model

from infer.core.expert_load import ExpertLoad
from infer.core.lowering import lower
from infer.core.models.llama import build_llama
from infer.core.models.moe import build_moe


def test_imbalance_is_the_busiest_expert_over_the_mean():
    load = ExpertLoad({0: 4, 1: 4}, np.asarray)
    load.record({0: np.array([6, 2, 0, 0]), 1: np.array([3, 3, 3, 3])})
    snap = load.snapshot()
    np.testing.assert_allclose(snap.imbalance, [3.0, 1.0])  # 6 / 2, 3 / 3
    assert snap.max_imbalance == 3.0


def test_a_moe_program_counts_each_sparse_layer_over_its_experts():
    qwen2_moe = make_moe_model("qwen2_moe")[1]  # 8 experts; layer 1 is a dense MLP
    load = ExpertLoad.for_program(lower(build_moe(qwen2_moe)), np.asarray)
    assert (load.layers, load.num_experts) == ((0, 2), 8)
    assert ExpertLoad.for_program(lower(build_llama(make_model("qwen2")[1])), np.asarray) is None
