"""The Prometheus families, fed in-process the way the engine thread feeds them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from prometheus_client.parser import text_string_to_metric_families

from infer.core.async_engine import FinishedRequestStats, IterationStats
from infer.core.block_manager import PrefixCacheStats
from infer.core.scheduler import SchedulerStats
from infer.server.metrics import Metrics


def samples(m: Metrics) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def stats(preemptions=0, queries=0, hits=0, running=0, usage=0.0):
    return SchedulerStats(running, 0, preemptions, int(usage * 10), 10, usage, PrefixCacheStats(queries, hits))


def test_gauges_follow_the_latest_snapshot_and_totals_count_increases():
    m = Metrics()
    log = m.logger("a")
    log(stats(preemptions=2, queries=40, hits=16, running=3, usage=0.5), None)
    log(stats(preemptions=5, queries=90, hits=48, running=0, usage=0.0), None)
    s = samples(m)
    a = (("model_name", "a"),)
    assert s[("infer:num_preemptions_total", a)] == 5
    assert s[("infer:prefix_cache_queries_total", a)] == 90
    assert s[("infer:prefix_cache_hits_total", a + (("tier", "device"),))] == 48
    assert s[("infer:prefix_cache_hits_total", a + (("tier", "host"),))] == 0
    assert s[("infer:num_requests_running", a)] == 0 and s[("infer:kv_cache_usage_perc", a)] == 0


def test_step_stats_feed_counters_histograms_and_finish_reasons():
    m = Metrics()
    log_a, log_b = m.logger("a"), m.logger("b")
    it = IterationStats(num_prompt_tokens=7, num_generation_tokens=3, time_to_first_tokens=[0.2],
                        inter_token_latencies=[0.01, 0.03], queue_times=[0.0],
                        finished=[FinishedRequestStats("stop", 1.5, 7, 3)])
    log_a(stats(), it)
    log_a(stats(), dataclasses.replace(it, num_prompt_tokens=0, time_to_first_tokens=[], queue_times=[]))
    s = samples(m)
    a, b = (("model_name", "a"),), (("model_name", "b"),)
    assert s[("infer:prompt_tokens_total", a)] == 7 and s[("infer:generation_tokens_total", a)] == 6
    assert s[("infer:generation_tokens_total", b)] == 0  # the other model's series exists, untouched
    assert s[("infer:time_to_first_token_seconds_count", a)] == 1
    assert s[("infer:inter_token_latency_seconds_count", a)] == 4
    assert s[("infer:inter_token_latency_seconds_sum", a)] == pytest.approx(0.08)
    assert s[("infer:e2e_request_latency_seconds_count", a)] == 2
    assert s[("infer:request_success_total", (("finished_reason", "stop"), ("model_name", "a")))] == 2
    del log_b


def test_expert_load_is_exported_per_layer_and_expert():
    """Counters follow the engine's ExpertLoad by their increase; a reset starts them over."""
    from infer.core.expert_load import ExpertLoad

    load = ExpertLoad({1: 4, 3: 4}, np.asarray)
    m = Metrics()
    log = m.logger("moe", load)
    it = IterationStats(num_generation_tokens=1)
    load.record({1: np.array([2, 0, 0, 0]), 3: np.array([1, 1, 0, 0])})
    log(stats(), it)
    load.record({1: np.array([1, 0, 1, 0]), 3: np.array([0, 0, 1, 1])})
    log(stats(), it)
    log(stats(), None)  # a loop pass that ran no step records nothing
    s = samples(m)

    def tokens(layer, expert):
        return s.get(("infer:moe_expert_tokens_total", (("expert", str(expert)), ("layer", str(layer)),
                                                        ("model_name", "moe"))), 0)

    assert [tokens(1, e) for e in range(4)] == [3, 0, 1, 0]
    assert [tokens(3, e) for e in range(4)] == [1, 1, 1, 1]
    assert s[("infer:moe_expert_imbalance", (("layer", "1"), ("model_name", "moe")))] == pytest.approx(3.0)
    assert s[("infer:moe_expert_imbalance", (("layer", "3"), ("model_name", "moe")))] == pytest.approx(1.0)
    load.reset()
    load.record({1: np.array([0, 2, 0, 0]), 3: np.array([0, 0, 0, 2])})
    log(stats(), it)
    s = samples(m)
    assert [tokens(1, e) for e in range(4)] == [3, 2, 1, 0]
    assert [tokens(3, e) for e in range(4)] == [1, 1, 1, 3]


def test_dense_models_export_no_expert_series():
    m = Metrics()
    m.logger("dense")(stats(), IterationStats(num_generation_tokens=1))
    assert not [k for k in samples(m) if k[0].startswith("infer:moe_")]
