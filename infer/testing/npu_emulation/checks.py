"""The error an emulated torch_npu op raises where the real one would reject its arguments."""

from __future__ import annotations


class NpuOpError(RuntimeError):
    """Arguments the documented op does not accept (the device would raise or misbehave)."""


def require(condition: bool, op: str, problem: str) -> None:
    if not condition:
        raise NpuOpError(f"{op}: {problem}")
