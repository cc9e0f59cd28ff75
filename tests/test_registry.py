"""The plugin registry: discovery, availability, fallback resolution, argument checks."""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest

import infer.registry as registry_mod
from infer.primitives import FLOAT_DTYPES, PLUGIN_API_VERSION, AttentionMetadata, Backend, PrimitiveArgumentError, hookimpl
from infer.primitives.types import Support
from infer.dispatch import Ops
from infer.registry import BackendUnavailableError, build_registry, get_backend, registry


# -- tiny NumPy backends, registered through fake entry points ---------------
class NumpyPlumbing(Backend):
    fallback = None

    def asarray(self, x, dtype=None):
        return np.array(x, dtype=np.float32 if dtype else None)

    def cast(self, x, dtype):
        return np.asarray(x, np.float32)

    def to_numpy(self, x):
        return np.asarray(x)

    def allocate_kv_cache(self, num_blocks, block_size, num_kv_heads, head_dim, dtype):
        return np.zeros(self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), np.float32)

    def kv_cache_to_numpy(self, kv_cache):
        return kv_cache[0], kv_cache[1]


class FullBackend(NumpyPlumbing):
    name = "test_full"
    dtypes = FLOAT_DTYPES

    def embedding(self, ids, table):
        return table[ids]

    def rms_norm(self, x, weight, eps, residual=None):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


class PartialBackend(NumpyPlumbing):
    """Implements rms_norm in float32 only; the rest comes from test_full."""

    name = "test_partial"
    dtypes = ("float32",)
    fallback = "test_full"

    def rms_norm(self, x, weight, eps, residual=None):
        return np.zeros_like(x)


class OldApiBackend(FullBackend):
    name = "test_old_api"
    api_version = PLUGIN_API_VERSION + 1


class ProbeRaisesBackend(FullBackend):
    name = "test_probe_raises"

    @classmethod
    def is_available(cls):
        raise OSError("driver library missing")


class ImpostorBackend(FullBackend):
    name = "test_full"  # same name as FullBackend, from another plugin


class Plugin:
    def __init__(self, *backends, models=None):
        self.backends, self.models = backends, models or {}

    @hookimpl
    def infer_register_backends(self):
        return list(self.backends)

    @hookimpl
    def infer_register_models(self):
        return self.models


class FakeEntryPoint:
    def __init__(self, name, plugin=None, error=None):
        self.name, self.value, self.group = name, f"fake_{name}.plugin", "infer"
        self._plugin, self._error = plugin, error

    def load(self):
        if self._error:
            raise self._error
        return self._plugin


def fake_registry(monkeypatch, *eps):
    """A registry with the built-in plugins plus `eps`, installed as the process registry."""
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: list(eps) if group == "infer" else [])
    reg = build_registry()
    monkeypatch.setattr(registry_mod, "registry", lambda: reg)
    return reg


@pytest.fixture
def reg(monkeypatch):
    return fake_registry(
        monkeypatch,
        FakeEntryPoint("goodchip", Plugin(FullBackend, PartialBackend, OldApiBackend, ProbeRaisesBackend,
                                          models={"ToyForCausalLM": object})),
        FakeEntryPoint("copycat", Plugin(ImpostorBackend)),
        FakeEntryPoint("notabackend", Plugin(int)),
        FakeEntryPoint("badchip", error=ImportError("No module named 'chip_sdk'")),
    )


# -- discovery and availability ----------------------------------------------
def test_entry_point_backends_are_registered_next_to_builtins(reg):
    assert {"cpu_ref", "test_full", "test_partial"} <= set(reg.backends)
    assert reg.backends["test_full"].plugin == "goodchip"


def test_api_version_mismatch_is_unavailable_with_reason(reg):
    info = reg.backends["test_old_api"]
    assert not info.available
    assert f"plugin API v{PLUGIN_API_VERSION + 1}" in info.available.reason
    assert f"infer speaks v1, v{PLUGIN_API_VERSION}" in info.available.reason
    with pytest.raises(BackendUnavailableError, match="test_old_api.*unavailable.*plugin API"):
        get_backend("test_old_api")


def test_is_available_that_raises_is_reported_as_unavailable(reg):
    info = reg.backends["test_probe_raises"]
    assert not info.available
    assert "OSError: driver library missing" in info.available.reason


def test_broken_entry_point_is_listed_not_fatal(reg):
    assert "failed to load" in reg.broken["badchip"]
    assert "chip_sdk" in reg.broken["badchip"]
    assert reg.backends["cpu_ref"].available  # everything else still loads


def test_duplicate_backend_name_keeps_the_first_and_reports_the_second(reg):
    assert reg.backends["test_full"].cls is FullBackend
    assert "already registered by goodchip" in reg.broken["copycat"]


def test_registering_a_non_backend_is_reported(reg):
    assert "not a named Backend subclass" in reg.broken["notabackend"]


def test_model_architectures_from_plugins_are_registered(reg):
    assert "ToyForCausalLM" in reg.models
    assert "LlamaForCausalLM" in reg.models  # built-in architectures too


def test_unknown_backend_error_lists_known_names():
    with pytest.raises(BackendUnavailableError, match=r"unknown backend 'nope' \(known: .*cpu_ref"):
        get_backend("nope")


def test_builtin_cpu_backends_are_available():
    backends = registry().backends
    assert backends["cpu_ref"].available
    assert backends["torch"].available, backends["torch"].available.reason


def test_auto_picks_an_available_backend():
    assert registry().backends[get_backend("auto").name].available


# -- fallback resolution -------------------------------------------------------
def test_own_primitive_resolves_to_the_backend_itself(reg):
    assert Ops(PartialBackend()).resolve("rms_norm", dtype="float32")[1] == "test_partial"


def test_missing_primitive_resolves_to_the_fallback(reg):
    ops = Ops(PartialBackend())
    assert ops.resolve("embedding")[1] == "test_full"
    table = np.arange(6, dtype=np.float32).reshape(3, 2)
    np.testing.assert_array_equal(ops.embedding(np.array([2, 0]), table), table[[2, 0]])


def test_declined_dtype_resolves_to_the_fallback(reg):
    assert Ops(PartialBackend()).resolve("rms_norm", dtype="bfloat16")[1] == "test_full"


def test_primitive_nobody_implements_is_missing_with_every_reason(reg):
    ops = Ops(PartialBackend())
    with pytest.raises(BackendUnavailableError, match="attention unsupported: .*test_partial.*test_full"):
        ops.resolve("attention")
    assert ops.coverage()["attention"].startswith("missing:")
    assert not hasattr(ops, "attention")


def test_fallback_cycle_terminates(monkeypatch):
    class A(FullBackend):
        name, fallback = "test_a", "test_b"

    class B(NumpyPlumbing):
        name, fallback = "test_b", "test_a"

    fake_registry(monkeypatch, FakeEntryPoint("cycle", Plugin(A, B)))
    ops = Ops(B())
    assert ops.resolve("embedding")[1] == "test_a"
    assert [b.name for b in ops._chain] == ["test_b", "test_a"]


def test_unavailable_fallback_is_an_error_naming_it(monkeypatch):
    class NeedsOld(NumpyPlumbing):
        name, fallback = "test_needs_old", "test_old_api"

    fake_registry(monkeypatch, FakeEntryPoint("p", Plugin(NeedsOld, OldApiBackend)))
    with pytest.raises(BackendUnavailableError, match="test_old_api"):
        Ops(NeedsOld())


def test_supports_answers_with_reasons():
    b = PartialBackend()
    assert b.supports("rms_norm", dtype="float32")
    assert "does not implement attention" in b.supports("attention").reason
    assert "not bfloat16" in b.supports("rms_norm", dtype="bfloat16").reason
    assert "not a meta-primitive" in b.supports("matmul").reason
    assert isinstance(b.supports("rms_norm"), Support)


# -- argument validation ---------------------------------------------------------
def _meta(num_tokens: int) -> AttentionMetadata:
    return AttentionMetadata(
        query_start_loc=np.array([0, num_tokens], np.int32), seq_lens=np.array([num_tokens], np.int32),
        block_table=np.zeros((1, 1), np.int32), slot_mapping=np.arange(num_tokens, dtype=np.int64),
        max_query_len=num_tokens, max_seq_len=num_tokens, block_size=16,
    )


F = np.float32
BAD_CALLS = [
    ("embedding", "ids", lambda: (np.zeros(3, F), np.zeros((4, 8), F))),
    ("rms_norm", "weight", lambda: (np.zeros((2, 8), F), np.zeros(7, F), 1e-6)),
    ("rms_norm", "eps", lambda: (np.zeros((2, 8), F), np.zeros(8, F), 0.0)),
    ("act_and_mul", "kind", lambda: (np.zeros((2, 8), F), "relu")),
    ("kv_write", "v", lambda: (np.zeros((2, 1, 4), F), np.zeros((3, 1, 4), F), np.zeros((2, 1, 16, 1, 4), F), np.zeros(2, np.int64))),
    ("attention", "meta", lambda: (np.zeros((3, 2, 4), F), np.zeros((2, 1, 16, 1, 4), F), _meta(2), 0.5)),
    ("attention", "sliding_window", lambda: (np.zeros((2, 2, 4), F), np.zeros((2, 1, 16, 1, 4), F), _meta(2), 0.5, 0)),
    ("moe", "top_k", lambda: (np.zeros((2, 4), F), np.zeros((2, 3), F), np.zeros((3, 6, 4), F), np.zeros((3, 4, 3), F), 4, True)),
    ("sample", "logits", lambda: (np.zeros((2, 5), np.float16), None)),
    ("all_gather", "dim", lambda: (np.zeros((2, 3), F), 2)),
]


@pytest.mark.parametrize("primitive, argument, args", BAD_CALLS, ids=[f"{p}-{a}" for p, a, _ in BAD_CALLS])
def test_bad_argument_error_names_primitive_and_argument(primitive, argument, args):
    ops = Ops(get_backend("cpu_ref"))
    with pytest.raises(PrimitiveArgumentError) as err:
        getattr(ops, primitive)(*args())
    assert (err.value.primitive, err.value.argument) == (primitive, argument)
    assert str(err.value).startswith(f"{primitive}: argument '{argument}'")


def test_validation_can_be_turned_off_for_the_hot_path():
    ops = Ops(get_backend("cpu_ref"), validate=False)
    with pytest.raises(Exception) as err:  # the implementation's own error, not the contract's
        ops.rms_norm(np.zeros((2, 8), F), np.zeros(7, F), 1e-6)
    assert not isinstance(err.value, PrimitiveArgumentError)


class RaisingPlugin:
    @hookimpl
    def infer_register_backends(self):
        raise RuntimeError("vendor SDK crashed while listing devices")


def test_plugin_whose_hook_raises_is_listed_not_fatal(monkeypatch):
    reg = fake_registry(monkeypatch, FakeEntryPoint("crashy", RaisingPlugin()))
    assert "vendor SDK crashed" in reg.broken["crashy"]
    assert reg.backends["cpu_ref"].available


def test_arguments_leave_off_every_trailing_optional_argument_not_given():
    """A backend sees exactly the required arguments (in signature order) when no optional one is given,
    and Nones only for optional arguments before one that is."""
    from infer.primitives.binding import SIGNATURES, arguments

    for primitive, sig in SIGNATURES.items():
        required = {a.name: f"{primitive}.{a.name}" for a in sig if not a.optional}
        last = max((i for i, a in enumerate(sig) if not a.optional), default=-1)
        assert arguments(primitive, required) == [required.get(a.name) for a in sig[:last + 1]], primitive
        if sig and sig[-1].optional:
            given = required | {sig[-1].name: "last"}
            assert arguments(primitive, given) == [given.get(a.name) for a in sig], primitive


def test_a_dense_weight_is_out_features_by_in_features():
    from infer.primitives.types import DenseWeight

    w = DenseWeight(np.zeros((3, 5), np.float32))
    assert (w.out_features, w.in_features) == (3, 5)
