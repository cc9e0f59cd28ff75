"""What a backend reports of its device's memory: nothing on a CPU, so the
engine sizes the KV pool from kv_cache_memory instead of a device's free memory."""

from __future__ import annotations

from infer.registry import get_backend


def test_the_torch_backend_on_cpu_reports_no_device_memory():
    assert get_backend("torch").memory_info() is None
