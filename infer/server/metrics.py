"""Prometheus metrics: vLLM's set under the ``infer:`` prefix, labelled by model_name.

Every family is one row of a table below, fed from what the engine thread
reports after each loop iteration (`SchedulerStats`, `IterationStats`). A new
family is one more row: a gauge or counter reading a field of the stats, or a
histogram of a list of them. MoE expert load has two more labels (layer,
expert), so it has its own two families, fed from the engine's `ExpertLoad`
(`moe_expert_tokens`, `moe_expert_imbalance`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..core.async_engine import IterationStats
from ..core.scheduler import SchedulerStats

PREFIX = "infer:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


@dataclass(frozen=True)
class Family:
    name: str  # without the prefix (and without _total for counters)
    doc: str
    read: Callable  # SchedulerStats or IterationStats -> number or list of numbers


# Set from the scheduler's snapshot.
GAUGES = (
    Family("num_requests_running", "Requests in the model's running batch.", lambda s: s.num_running),
    Family("num_requests_waiting", "Requests waiting to be scheduled (preempted ones included).",
           lambda s: s.num_waiting),
    Family("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", lambda s: s.kv_cache_usage),
    Family("kv_cache_fragmentation_perc", "Allocated but unused token slots over allocated slots in the blocks "
           "running requests hold, percent.", lambda s: s.kv_cache_fragmentation_perc),
    Family("num_requests_swapped", "Preempted requests whose KV waits in the host tier.", lambda s: s.num_swapped),
    Family("kv_offload_usage_perc", "Fraction of the host KV tier's blocks in use (0 without a tier).",
           lambda s: s.tier_used_blocks / s.tier_blocks if s.tier_blocks else 0.0),
)
# Prefix-cache hits by the tier they were found in: device (the KV pool) or host (copied back).
TIERS = (("device", lambda s: s.prefix_cache.hits - s.prefix_cache.tier_hits),
         ("host", lambda s: s.prefix_cache.tier_hits))
# Cumulative totals of the scheduler, exported as counters by their increase.
TOTALS = (
    Family("num_preemptions", "Requests preempted (their KV dropped) since start.", lambda s: s.num_preemptions),
    Family("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", lambda s: s.prefix_cache.queries),
    Family("num_preemptions_swapped", "Of the preemptions, those whose KV went to the host tier.",
           lambda s: s.num_swapped_out),
    Family("spec_decode_num_drafts", "Request-steps that verified speculative drafts.",
           lambda s: s.spec_decode.num_drafts),
    Family("spec_decode_num_draft_tokens", "Speculative tokens drafted and verified.",
           lambda s: s.spec_decode.num_draft_tokens),
    Family("spec_decode_num_accepted_tokens", "Speculative tokens accepted.",
           lambda s: s.spec_decode.num_accepted_tokens),
)
# Per-step increments.
COUNTERS = (
    Family("prompt_tokens", "Prompt tokens prefilled.", lambda it: it.num_prompt_tokens),
    Family("generation_tokens", "Tokens generated.", lambda it: it.num_generation_tokens),
    Family("pooling_requests", "Pooling requests served (embeddings, scores, classifications).",
           lambda it: it.num_pooled),
)
# Observations of one step, seconds.
HISTOGRAMS = (
    (Family("time_to_first_token_seconds", "Time from arrival to the first token.",
            lambda it: it.time_to_first_tokens), LATENCY_BUCKETS),
    (Family("inter_token_latency_seconds", "Time between successive token outputs of a request.",
            lambda it: it.inter_token_latencies), ITL_BUCKETS),
    (Family("e2e_request_latency_seconds", "Time from arrival to the last output.",
            lambda it: [f.e2e_latency for f in it.finished]), LATENCY_BUCKETS),
    (Family("request_queue_time_seconds", "Time from arrival to the first scheduled step.",
            lambda it: it.queue_times), LATENCY_BUCKETS),
)


class Metrics:
    """The families of one server process; `logger(model)` feeds one model's series."""

    def __init__(self, engine_label: bool = False):
        """`engine_label`: every series also carries ``engine`` (the data-parallel
        replica, as vLLM labels them), for a server that runs replicas."""
        self.registry = CollectorRegistry()
        reg = self.registry
        self.engine_label = engine_label
        key = ["model_name"] + (["engine"] if engine_label else [])
        self._gauges = [(f, Gauge(PREFIX + f.name, f.doc, key, registry=reg)) for f in GAUGES]
        self._totals = [(f, Counter(PREFIX + f.name, f.doc, key, registry=reg)) for f in TOTALS]
        self._counters = [(f, Counter(PREFIX + f.name, f.doc, key, registry=reg)) for f in COUNTERS]
        self._histograms = [(f, Histogram(PREFIX + f.name, f.doc, key, buckets=b, registry=reg))
                            for f, b in HISTOGRAMS]
        self._hits = Counter(PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache, by tier.",
                             key + ["tier"], registry=reg)
        self._accepted_per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                         "Speculative tokens accepted at each draft position (0 first).",
                                         key + ["position"], registry=reg)
        self._success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                key + ["finished_reason"], registry=self.registry)
        # MoE models only: two labels (layer, expert), so outside the one-label tables above.
        self._expert_tokens = Counter(PREFIX + "moe_expert_tokens", "Tokens routed to each expert of each MoE layer.",
                                      key + ["layer", "expert"], registry=reg)
        # vLLM's LoRA gauge: the adapters in use as labels, the time of the reading as the value.
        self._lora_info = Gauge(PREFIX + "lora_requests_info", "LoRA adapters of running and waiting requests.",
                                key + ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=reg)
        self._expert_imbalance = Gauge(PREFIX + "moe_expert_imbalance",
                                       "Max/mean of a MoE layer's accumulated tokens per expert (1 = balanced).",
                                       key + ["layer"], registry=reg)

    def logger(self, model_name: str, expert_load=None,
               engine: int = 0) -> Callable[[SchedulerStats, IterationStats | None], None]:
        """A stat logger for AsyncLLM: runs on that model's engine thread.
        `expert_load`: the engine's `ExpertLoad` (MoE models), read after each step."""
        key = (model_name, str(engine)) if self.engine_label else (model_name,)
        last: dict[str, float] = {}
        seen_experts: list = [None]  # the previous snapshot's counts
        for _, m in self._gauges + self._totals + self._counters + self._histograms:
            m.labels(*key)  # so every series exists (at 0) before the first request
        for tier, _ in TIERS:
            self._hits.labels(*key, tier)

        lora_labels: list = [None]  # the series last set: replaced, not accumulated

        def record(stats: SchedulerStats, it: IterationStats | None) -> None:
            for f, g in self._gauges:
                g.labels(*key).set(f.read(stats))
            if stats.max_loras:
                labels = (str(stats.max_loras), ",".join(stats.running_loras), ",".join(stats.waiting_loras))
                if lora_labels[0] not in (None, labels):
                    self._lora_info.remove(*key, *lora_labels[0])
                self._lora_info.labels(*key, *labels).set(time.time())
                lora_labels[0] = labels
            for f, c in self._totals:
                v, prev = f.read(stats), last.get(f.name, 0)
                if v > prev:
                    c.labels(*key).inc(v - prev)
                last[f.name] = v
            for tier, read in TIERS:
                v, prev = read(stats), last.get(f"hits_{tier}", 0)
                if v > prev:
                    self._hits.labels(*key, tier).inc(v - prev)
                last[f"hits_{tier}"] = v
            for pos, v in enumerate(stats.spec_decode.accepted_per_position):
                prev = last.get(f"accepted_pos{pos}", 0)
                if v > prev:
                    self._accepted_per_pos.labels(*key, str(pos)).inc(v - prev)
                last[f"accepted_pos{pos}"] = v
            if it is None:
                return
            for f, c in self._counters:
                c.labels(*key).inc(f.read(it))
            for f, h in self._histograms:
                series = h.labels(*key)
                for v in f.read(it):
                    series.observe(v)
            for fin in it.finished:
                self._success.labels(*key, fin.finish_reason).inc()
            if expert_load is not None:
                record_experts(expert_load.snapshot())

        def record_experts(snap) -> None:
            counts, prev = snap.tokens_per_expert, seen_experts[0]
            if prev is None or prev.shape != counts.shape or (counts < prev).any():  # first step, or a reset
                prev = counts * 0
            for row, layer in enumerate(snap.layers):
                for expert in (counts[row] - prev[row]).nonzero()[0]:
                    self._expert_tokens.labels(*key, str(layer), str(expert)).inc(int(counts[row, expert] - prev[row, expert]))
            for layer, imb in zip(snap.layers, snap.imbalance):
                if imb == imb:  # nan before the layer saw a token
                    self._expert_imbalance.labels(*key, str(layer)).set(float(imb))
            seen_experts[0] = counts.copy()

        return record

    def render(self) -> bytes:
        return generate_latest(self.registry)
