"""The conformance runner: a backend against the `cpu_ref` oracle, case by case.

For every case the backend under test gets the case's inputs in the case
dtype and the oracle gets the same (already rounded) values in float32, both
through `calls.invoke`. Float results must agree within the case dtype's
tolerance; integer results (sampled tokens, expert counts, top-logprob ids)
must be equal.
"""

from __future__ import annotations

import functools
import time
import traceback
from dataclasses import dataclass, field


from ..primitives.backend import Backend
from ..dispatch import Ops
from ..registry import BackendUnavailableError, get_backend, registry
from . import calls
from .cases import COLLECTIVES, Case, all_cases, select
from .collectives import run_collectives
from .results import FLOAT32_OUTPUTS, ORACLE, TOLERANCES, CaseResult, Tolerance, compare

__all__ = ["FLOAT32_OUTPUTS", "ORACLE", "TOLERANCES", "CaseResult", "ConformanceReport", "Tolerance", "compare",
           "run_case", "run_conformance", "cases_for"]

@dataclass
class ConformanceReport:
    backend: str
    device: str
    results: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def summary(self) -> str:
        parts = [f"{self.count(s)} {w}" for s, w in (("pass", "passed"), ("fail", "failed"), ("error", "errors"), ("skip", "skipped"))]
        return f"conformance of '{self.backend}' ({self.device}) against {ORACLE}: " + ", ".join(parts) + f" in {self.seconds:.1f}s"


@functools.lru_cache(maxsize=1)
def _oracle() -> tuple[Backend, Ops]:
    ref = get_backend(ORACLE)
    return ref, Ops(ref)


def _error_text(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def run_case(backend: Backend, case: Case, ops: Ops | None = None) -> CaseResult:
    """Check one case on `backend` (collectives go through `run_collectives`)."""
    if case.primitive in COLLECTIVES:
        return run_collectives(backend, [case])[0]
    start = time.perf_counter()
    result = _check(backend, case, ops or Ops(backend))
    result.seconds = time.perf_counter() - start
    return result


def _check(backend: Backend, case: Case, ops: Ops) -> CaseResult:
    result = CaseResult(case, backend.name, "pass")
    try:
        tested = calls.invoke(backend, ops, case.primitive, case.inputs(), case.dtype)
    except BackendUnavailableError as exc:  # declined by the backend and every fallback
        result.status, result.detail = "skip", str(exc)
        return result
    except Exception as exc:
        result.status, result.detail = "error", _error_text(exc)
        return result
    result.provider = tested.provider
    try:
        # Fresh inputs: a backend may legally update its inputs in place (rotary).
        ref, ref_ops = _oracle()
        want = calls.invoke(ref, ref_ops, case.primitive, case.inputs(), "float32").outputs
    except Exception as exc:
        result.status, result.detail = "error", f"oracle {ORACLE} failed: {_error_text(exc)}"
        return result
    problems, result.max_abs_err, result.tol_used = compare(tested.outputs, want, case.dtype)
    problems = tested.problems + problems
    if problems:
        result.status, result.detail = "fail", "; ".join(problems)
    return result


def resolve_backend(backend: Backend | str, device: str | None = None) -> Backend:
    """An instance for a name (raises BackendUnavailableError with the reason)."""
    return get_backend(backend, device=device) if isinstance(backend, str) else backend


def cases_for(backend: Backend | type[Backend] | str) -> list[Case]:
    """Every case for `backend` (a name, class or instance), using its preferred block size."""
    if isinstance(backend, str):
        info = registry().backends.get(backend)
        block_size = info.cls.preferred_block_size if info and info.cls else 16
    else:
        block_size = backend.preferred_block_size
    return all_cases(block_size)


def run_conformance(backend: Backend | str, primitives=None, dtypes=None, match: str | None = None,
                    device: str | None = None, on_result=None) -> ConformanceReport:
    """Run the suite on `backend`; `on_result(result)` is called as results come in."""
    backend = resolve_backend(backend, device)
    start = time.perf_counter()
    report = ConformanceReport(backend.name, backend.device)
    cases = select(cases_for(backend), primitives, dtypes, match)
    ops = Ops(backend)
    local = [c for c in cases if c.primitive not in COLLECTIVES]
    collective = [c for c in cases if c.primitive in COLLECTIVES]
    for case in local:
        report.results.append(run_case(backend, case, ops))
        if on_result:
            on_result(report.results[-1])
    if collective:
        for res in run_collectives(backend, collective):
            report.results.append(res)
            if on_result:
                on_result(res)
    report.seconds = time.perf_counter() - start
    return report
