"""The cross-backend conformance suite, for infer's own tests and plugin authors.

A backend author checks a backend against the `cpu_ref` oracle with pytest::

    import pytest
    from infer.testing import assert_conforms, conformance_params

    @pytest.mark.parametrize("backend, case", conformance_params("mychip"))
    def test_mychip_conforms(backend, case):
        assert_conforms(backend, case)

or from the shell: ``infer conformance --backend mychip``.
"""

from __future__ import annotations

import functools

from ..primitives.backend import Backend
from ..dispatch import Ops
from ..registry import get_backend
from .cases import Case, all_cases, select
from .conformance import (
    TOLERANCES,
    CaseResult,
    ConformanceReport,
    Tolerance,
    cases_for,
    run_case,
    run_conformance,
)

__all__ = [
    "TOLERANCES",
    "Case",
    "CaseResult",
    "ConformanceReport",
    "Tolerance",
    "all_cases",
    "assert_conforms",
    "cases_for",
    "conformance_params",
    "run_case",
    "run_conformance",
    "select",
]


@functools.lru_cache(maxsize=None)
def _backend(name: str) -> Backend:
    return get_backend(name)


@functools.lru_cache(maxsize=None)
def _ops(backend: Backend) -> Ops:
    return Ops(backend)


def conformance_params(backend: str, primitives=None, dtypes=None) -> list:
    """``pytest.param(backend, case, id="backend-primitive-case-dtype")`` for every case."""
    import pytest

    return [pytest.param(backend, c, id=f"{backend}-{c.id}") for c in select(cases_for(backend), primitives, dtypes)]


def assert_conforms(backend: Backend | str, case: Case) -> CaseResult:
    """Check one case; skips (pytest.skip) what the backend declares unsupported."""
    b = _backend(backend) if isinstance(backend, str) else backend
    result = run_case(b, case, _ops(b))
    if result.status == "skip":
        import pytest

        pytest.skip(result.detail)
    assert result.status == "pass", (
        f"{case.id} on backend '{b.name}' (implementation from '{result.provider}') {result.status}: {result.detail}"
    )
    return result
