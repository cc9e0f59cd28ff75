"""Expert-load statistics: accumulation, the imbalance figure, and the bench report."""

from __future__ import annotations

import math

import numpy as np
import pytest

from infer.core.expert_load import ExpertLoad

from tiny_moe_models import MOE_MODELS, save_moe_model


def test_counts_accumulate_per_layer_and_the_last_step_is_kept():
    load = ExpertLoad({1: 4, 3: 4}, np.asarray)
    load.record({1: np.array([2, 0, 0, 0]), 3: np.array([1, 1, 0, 0])})
    load.record({1: np.array([0, 1, 1, 0]), 3: np.array([0, 0, 1, 1])})
    snap = load.snapshot()
    assert snap.steps == 2 and snap.layers == (1, 3)
    np.testing.assert_array_equal(snap.tokens_per_expert, [[2, 1, 1, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(snap.last_step, [[0, 1, 1, 0], [0, 0, 1, 1]])


def test_imbalance_is_max_over_mean_per_layer():
    """Non-uniform loads whose means are not 1 (2, 3 and 1/4), so max * mean or max - mean cannot pass."""
    load = ExpertLoad({0: 4, 1: 4, 2: 4}, np.asarray)
    load.record({0: np.array([5, 1, 2, 0]), 1: np.array([3, 2, 3, 4]), 2: np.array([0, 1, 0, 0])})
    snap = load.snapshot()
    np.testing.assert_allclose(snap.imbalance, [2.5, 4 / 3, 4.0])
    assert snap.max_imbalance == 4.0
    assert snap.as_dict()["imbalance"] == pytest.approx([2.5, 4 / 3, 4.0])
    load.record({0: np.array([1, 1, 2, 4]), 1: np.array([1, 2, 1, 0]), 2: np.array([2, 0, 1, 1])})
    np.testing.assert_allclose(load.snapshot().imbalance, [6 / 4, 4 / 4, 2 / 1.25])  # over the accumulated counts


def test_no_tokens_yet_has_no_imbalance_and_reset_clears():
    load = ExpertLoad({0: 2}, np.asarray)
    assert math.isnan(load.snapshot().max_imbalance) and load.snapshot().as_dict()["max_imbalance"] is None
    load.record({0: np.array([3, 1])})
    load.reset()
    snap = load.snapshot()
    assert snap.steps == 0 and snap.tokens_per_expert.sum() == 0


def test_snapshot_is_not_changed_by_later_steps():
    load = ExpertLoad({0: 2}, np.asarray)
    load.record({0: np.array([1, 0])})
    before = load.snapshot()
    load.record({0: np.array([0, 5])})
    np.testing.assert_array_equal(before.tokens_per_expert, [[1, 0]])


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mixtral")
    save_moe_model("mixtral", directory)
    return directory


def test_bench_reports_the_workloads_expert_load(tiny_mixtral):
    from infer.bench import BenchConfig, QUICK, make_workload
    from infer.bench.report import _expert_load_lines
    from infer.bench.runners import run_infer
    from infer.bench.workload import engine_kwargs

    cfg = BenchConfig(model=str(tiny_mixtral), skip_transformers=True, **QUICK)
    work = make_workload(cfg, 211, [])
    result = run_infer(cfg, work, engine_kwargs(cfg, work, 16, 1 << 12))
    load = result["expert_load"]
    # Counted from the workload alone (warm-up excluded): every prompt token and
    # every output token but the last ran once, each routed to top_k = 2 experts.
    ran = sum(map(len, work.prompts)) + len(work.prompts) * (work.output_len - 1)
    assert load["layers"] == [0, 1]
    assert [sum(c) for c in load["tokens_per_expert"]] == [2 * ran] * 2
    text = "\n".join(_expert_load_lines(load))
    assert "layer   0: imbalance" in text and "worst layer imbalance" in text


def test_every_moe_model_kind_is_a_registered_architecture():
    from infer.registry import registry

    assert {MOE_MODELS[k][1] for k in MOE_MODELS} <= set(registry().models)
