"""The output records' own logic."""

from __future__ import annotations

import pytest

from infer.core.outputs import CompletionOutput


@pytest.mark.parametrize("reason, finished", [(None, False), ("stop", True), ("length", True), ("abort", True)])
def test_a_completion_is_finished_once_it_has_a_finish_reason(reason, finished):
    assert CompletionOutput(0, "", [], finish_reason=reason).finished() is finished
