"""Expert-load statistics of an MoE model: tokens routed to each expert, per layer.

The `moe` primitive reports tokens_per_expert [E] on every call; the model
runner keeps the last forward's per layer, and the engine hands them to
`ExpertLoad.record` once per step. Counts stay on the device and are summed
there, so recording costs no host sync; `snapshot()` brings them home when
someone asks (the bench report, the server's metrics), from any thread.

The imbalance figure of a layer is ``max / mean`` of its accumulated expert
counts: 1.0 when every expert got the same number of tokens, E when one
expert got them all. It bounds how much slower a layer runs than perfect
balance would allow when experts run in parallel (expert parallelism), and
shows routers that collapse onto a few experts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np


@dataclass(frozen=True)
class ExpertLoadSnapshot:
    """Counts since the engine started (or the last `reset`)."""

    steps: int  # engine steps that ran the model
    layers: tuple[int, ...]  # the MoE layers' indices; rows of the arrays below
    tokens_per_expert: np.ndarray  # [L, E] int64, accumulated
    last_step: np.ndarray  # [L, E] int64, the most recent step only

    @property
    def imbalance(self) -> np.ndarray:
        """[L] max/mean of each layer's accumulated counts (nan before any token)."""
        counts = self.tokens_per_expert.astype(np.float64)
        mean = counts.mean(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(mean > 0, counts.max(axis=1) / mean, np.nan)

    @property
    def max_imbalance(self) -> float:
        """The worst layer's imbalance (nan before any token)."""
        imb = self.imbalance
        return float(np.nanmax(imb)) if np.isfinite(imb).any() else float("nan")

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (nan becomes None)."""
        imb = [None if np.isnan(v) else float(v) for v in self.imbalance]
        worst = self.max_imbalance
        return dict(steps=self.steps, layers=list(self.layers), tokens_per_expert=self.tokens_per_expert.tolist(),
                    last_step=self.last_step.tolist(), imbalance=imb,
                    max_imbalance=None if np.isnan(worst) else worst)


class ExpertLoad:
    """Accumulates the per-layer expert counts of each step."""

    def __init__(self, num_experts: Mapping[int, int], to_numpy: Callable[[Any], np.ndarray]):
        if not num_experts:
            raise ValueError("ExpertLoad needs at least one MoE layer")
        self.layers = tuple(sorted(num_experts))
        self.num_experts = max(num_experts.values())
        self._to_numpy = to_numpy
        self._lock = threading.Lock()
        self.reset()

    @classmethod
    def for_program(cls, program, to_numpy: Callable[[Any], np.ndarray]) -> ExpertLoad | None:
        """An ExpertLoad for the `moe` calls of a lowered program; None for a dense model."""
        experts = {c.layer: program.graph.params[c.params["w13"]].shape[0]
                   for c in program.calls if c.primitive == "moe"}
        return cls(experts, to_numpy) if experts else None

    def reset(self) -> None:
        with self._lock:
            self._steps = 0
            self._totals: dict[int, Any] = {}
            self._last: dict[int, Any] = {}

    def record(self, counts: Mapping[int, Any]) -> None:
        """One step's counts: MoE layer -> tokens_per_expert [E] (a backend tensor)."""
        # `+ 0` copies on the device: a backend may reuse its counts buffer on the next call.
        counts = {layer: c + 0 for layer, c in counts.items()}
        with self._lock:
            self._steps += 1
            for layer, c in counts.items():
                self._totals[layer] = c if layer not in self._totals else self._totals[layer] + c
            self._last = counts

    def snapshot(self) -> ExpertLoadSnapshot:
        with self._lock:
            steps, totals, last = self._steps, dict(self._totals), dict(self._last)
        return ExpertLoadSnapshot(steps, self.layers, self._stack(totals), self._stack(last))

    def _stack(self, per_layer: dict[int, Any]) -> np.ndarray:
        out = np.zeros((len(self.layers), self.num_experts), dtype=np.int64)
        for row, layer in enumerate(self.layers):
            if layer in per_layer:
                c = np.asarray(self._to_numpy(per_layer[layer]), dtype=np.int64)
                out[row, : c.shape[0]] = c
        return out
