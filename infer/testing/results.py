"""What one conformance case produced, and how results are compared with the oracle's."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cases import Case

ORACLE = "cpu_ref"


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


# Results are O(1) by construction of the inputs. fp16/bf16 allow a few
# roundings of the result's dtype (2**-11 and 2**-8 relative) for backends
# that keep intermediates (a GEMM's output, softmax weights) in that dtype.
TOLERANCES = {
    "float32": Tolerance(atol=1e-5, rtol=1e-5),
    "float16": Tolerance(atol=2e-3, rtol=2e-3),
    "bfloat16": Tolerance(atol=1.6e-2, rtol=1.6e-2),
}
# Outputs that are float32 whatever the case dtype (logprobs are taken from
# float32 logits).
FLOAT32_OUTPUTS = {"logprobs", "top_logprobs"}


@dataclass
class CaseResult:
    case: Case
    backend: str
    status: str  # "pass" | "fail" | "error" | "skip"
    provider: str | None = None  # which backend's implementation ran
    detail: str = ""
    max_abs_err: float = 0.0
    # Worst error as a fraction of what the tolerance allows (1.0 = at the limit).
    tol_used: float = 0.0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status in ("pass", "skip")


def compare(got: dict[str, np.ndarray], want: dict[str, np.ndarray], dtype: str) -> tuple[list[str], float, float]:
    """(problems, max abs error, max tolerance used) of `got` against `want`."""
    problems, max_err, used = [], 0.0, 0.0
    for name, w in want.items():
        if name not in got:
            problems.append(f"{name}: missing from the backend's results")
            continue
        g = np.asarray(got[name])
        if g.shape != w.shape:
            problems.append(f"{name}: shape {g.shape}, expected {w.shape}")
            continue
        if g.size == 0:
            continue
        if np.issubdtype(w.dtype, np.integer):
            bad = np.argwhere(g != w)
            if len(bad):
                idx = tuple(bad[0])
                problems.append(f"{name}: {len(bad)} of {w.size} differ, first at {list(idx)}: got {g[idx]}, expected {w[idx]}")
            continue
        tol = TOLERANCES["float32" if name in FLOAT32_OUTPUTS else dtype]
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        finite = np.isfinite(w64)
        if not np.array_equal(np.isfinite(g64), finite) or not np.array_equal(g64[~finite], w64[~finite]):
            idx = tuple(np.argwhere((np.isfinite(g64) != finite) | (~finite & (g64 != w64)))[0])
            problems.append(f"{name}: non-finite mismatch at {list(idx)}: got {g64[idx]}, expected {w64[idx]}")
            continue
        err = np.abs(g64 - w64) * finite
        ratio = np.where(finite, err / (tol.atol + tol.rtol * np.abs(w64)), 0.0)
        max_err, used = max(max_err, float(err.max())), max(used, float(ratio.max()))
        if ratio.max() > 1.0:
            idx = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
            n_bad = int((ratio > 1.0).sum())
            problems.append(
                f"{name}: {n_bad} of {w.size} outside atol={tol.atol:g} rtol={tol.rtol:g}; worst at {list(map(int, idx))}: "
                f"got {g64[idx]:.6g}, expected {w64[idx]:.6g} (abs err {err[idx]:.3g})"
            )
    return problems, max_err, used
