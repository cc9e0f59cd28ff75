"""`infer backends` and `infer conformance`."""

from __future__ import annotations

import pytest

from infer import __version__
from infer.backends.cpu_ref import CpuRefBackend
from infer.primitives.torch_tensors import TorchTensors
from infer.cli import declared_coverage, main
from infer.registry import registry
from test_registry import FakeEntryPoint, Plugin, fake_registry


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # no wrapped cells to search across


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


class WrongNorm(CpuRefBackend):
    name = "wrong_norm"

    def rms_norm(self, x, weight, eps, residual=None):
        y = CpuRefBackend.rms_norm(x, weight, eps, residual)
        return (y[0] * 2, y[1]) if residual is not None else y * 2


class HalfTorch(TorchTensors):
    """Declares one primitive itself, inherits nothing, falls back to torch."""

    name = "half_torch"
    fallback = "torch"

    def embedding(self, ids, table):
        return table[ids]


class Vendor(TorchTensors):
    name = "vendor_chip"

    @classmethod
    def is_available(cls):
        from infer.primitives.types import Support

        return Support(False, "vendor SDK not found (install vendor-sdk)")


# -- infer backends -------------------------------------------------------------
def test_backends_lists_every_backend_with_its_declarations(capsys):
    code, out, _ = run(capsys, "backends")
    assert code == 0
    for name in registry().backends:
        assert name in out
    assert "infer.backends.cpu_ref" in out  # the plugin column
    assert "18 native" in out  # cpu_ref implements everything
    assert "[2, num_blocks, block_size, num_kv_heads, head_dim]" in out
    assert "torch CPU kernels" in out and ("built (" in out or "unavailable:" in out or "off (" in out)
    if "built (" in out:  # the torch row names the primitives its native kernels may serve first
        torch_row = next(line for line in out.splitlines() if line.startswith("│ torch "))
        assert "fast path native: rms_norm, rotary, act_and_mul, kv_write, attention" in torch_row


def test_backends_explains_why_a_backend_is_unavailable(capsys):
    info = registry().backends["ascend"]
    if info.available:
        pytest.skip("an Ascend NPU is visible here")
    _, out, _ = run(capsys, "backends")
    assert "torch_npu" in out and "no:" in out
    assert "8 native, 10 via torch (declared)" in out  # coverage read from the class, nothing instantiated


def test_backends_lists_broken_plugins_and_plugin_models(monkeypatch, capsys):
    fake_registry(monkeypatch, FakeEntryPoint("badchip", error=ImportError("No module named 'chip_sdk'")),
                  FakeEntryPoint("vendor", Plugin(Vendor, HalfTorch, models={"VendorForCausalLM": object})))
    code, out, _ = run(capsys, "backends", "--coverage")
    assert code == 0
    assert "plugins that failed to load" in out and "badchip" in out and "chip_sdk" in out
    assert "vendor SDK not found (install vendor-sdk)" in out
    assert "1 native, 17 via torch" in out  # half_torch, resolved through Ops
    assert "VendorForCausalLM" in out
    assert "primitive coverage" in out


def test_declared_coverage_separates_own_methods_from_the_fallback():
    cov = declared_coverage(HalfTorch)
    assert cov["embedding"] == "half_torch"
    assert cov["attention"] == "torch"
    assert set(declared_coverage(CpuRefBackend).values()) == {"cpu_ref"}


def test_declared_coverage_credits_methods_inherited_from_another_backend():
    from infer.backends.torch_native.backend import TorchBackend

    class Subclassed(TorchBackend):
        name = "sub"

        def rms_norm(self, x, weight, eps, residual=None):
            return x

    cov = declared_coverage(Subclassed)
    assert cov["rms_norm"] == "sub" and cov["attention"] == "torch"


# -- infer conformance -----------------------------------------------------------
def test_conformance_prints_a_table_and_a_summary_and_passes(capsys):
    code, out, _ = run(capsys, "conformance", "--backend", "cpu_ref", "--primitive", "rms_norm", "--dtype", "bf16")
    assert code == 0
    assert "residual_h64" in out and "bfloat16" in out
    assert "conformance of 'cpu_ref' (cpu) against cpu_ref: 5 passed, 0 failed, 0 errors, 0 skipped" in out


def test_conformance_fails_with_the_failing_case_named(monkeypatch, capsys):
    fake_registry(monkeypatch, FakeEntryPoint("wrong", Plugin(WrongNorm)))
    code, out, _ = run(capsys, "conformance", "--backend", "wrong_norm", "--primitive", "rms_norm", "--dtype", "float32")
    assert code == 1
    assert "FAIL rms_norm-h64-fp32: out:" in out
    assert "4 failed" in out  # all but the empty batch


def test_conformance_of_an_unavailable_backend_exits_nonzero_with_the_reason(monkeypatch, capsys):
    fake_registry(monkeypatch, FakeEntryPoint("vendor", Plugin(Vendor)))
    code, _, err = run(capsys, "conformance", "--backend", "vendor_chip")
    assert code == 2
    assert "backend 'vendor_chip' unavailable: vendor SDK not found (install vendor-sdk)" in err


def test_conformance_of_an_unknown_backend_exits_nonzero(capsys):
    code, _, err = run(capsys, "conformance", "--backend", "no_such_chip")
    assert code == 2 and "unknown backend 'no_such_chip'" in err


def test_conformance_reports_the_fallback_that_served_a_primitive(monkeypatch, capsys):
    fake_registry(monkeypatch, FakeEntryPoint("half", Plugin(HalfTorch)))
    code, out, _ = run(capsys, "conformance", "--backend", "half_torch", "--dtype", "fp32", "-k", "one_token")
    assert code == 0, out
    table = out.splitlines()
    assert any("embedding" in line and "half_torch" in line for line in table)
    assert any("attention" in line and "torch" in line and "half_torch" not in line for line in table)


def test_conformance_list_shows_case_ids(capsys):
    code, out, _ = run(capsys, "conformance", "--backend", "torch", "--primitive", "attention", "--dtype", "bf16", "--list")
    assert code == 0
    assert "attention-mixed_gqa3_d64-bf16" in out.split()


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
