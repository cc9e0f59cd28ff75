"""The resolver (`infer.dispatch.Ops`) and its trace: which implementation served each call.

A run's table is asserted for the backends users run (torch with and without
its native kernels, cpu_ref, cuda in Triton's interpreter), and a backend
written against contract v1 still runs through the engine.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace
import sys
from pathlib import Path

import pytest
import torch

import infer.core.executor.rank as rank_mod
import infer.registry as registry_mod
from infer.backends.torch_native import TorchBackend
from infer.backends.torch_native.native.ops import INT4_GEMM_MAX_ROWS
from infer.core.llm import LLM
from infer.core.sampling_params import SamplingParams
from infer.dispatch import DispatchTrace, Ops
from infer.primitives import FLOAT_DTYPES, Support
from infer.primitives.backend import FastPath
from infer.registry import BackendInfo, build_registry

from conftest import require_smollm2

HERE = Path(__file__).resolve().parent
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9]}


def table(trace: DispatchTrace) -> dict[tuple[str, str], dict[str, int]]:
    """(node, call) -> {implementation: calls}."""
    out: dict = {}
    for node, call, impl, n in trace.rows():
        out.setdefault((node, call), {})[impl] = n
    return out


# -- the resolver ----------------------------------------------------------------------
class HalfFast(TorchBackend):
    """rms_norm with a fast path that serves up to two rows and declines more."""

    name = "test_half_fast"
    fallback = None

    def fast_path(self, primitive, **kw):
        if primitive != "rms_norm":
            return None
        return FastPath("two-rows", lambda x, w, eps, residual=None: x * 0 + 7 if x.shape[0] <= 2 else NotImplemented)


def test_a_fast_path_serves_what_it_accepts_and_the_trace_counts_each_side():
    trace = DispatchTrace()
    ops = Ops(HalfFast(), trace=trace)
    norm = ops.bind("rms_norm", "rms_norm", dtype="float32")
    w = torch.ones(4)
    assert torch.equal(norm(torch.ones(2, 4), w, 1e-6), torch.full((2, 4), 7.0))
    assert torch.allclose(norm(torch.full((3, 4), 2.0), w, 1e-6), torch.ones(3, 4))  # declined: the torch op
    norm(torch.ones(1, 4), w, 1e-6)
    assert trace.rows() == [("rms_norm", "rms_norm", "test_half_fast", 1),
                            ("rms_norm", "rms_norm", "test_half_fast:two-rows", 2)]
    assert ops.fast_paths() == {"rms_norm": "test_half_fast:two-rows"}
    # resolve() composes the same way, uncounted.
    assert torch.equal(ops.resolve("rms_norm", dtype="float32")[0](torch.ones(1, 4), w, 1e-6), torch.full((1, 4), 7.0))
    assert len(trace.rows()) == 2


class BeforeSinks(TorchBackend):
    """A plugin written before `sinks` and the expert biases joined the contract: its attention,
    moe and attention fast path take the older signatures (and it claims to support everything)."""

    name = "test_before_sinks"
    fallback = "torch"

    def attention(self, q, kv_cache, meta, scale, sliding_window=None, soft_cap=None, kv_scales=None):
        raise AssertionError("asked to serve a call with sinks")

    def moe(self, x, router_logits, w13, w2, top_k, renormalize, shared=None, shared_gate=None):
        raise AssertionError("asked to serve a call with expert biases")

    def supports(self, primitive, **kw):
        return Support(True)

    def fast_path(self, primitive, **kw):
        if primitive != "attention":
            return None
        return FastPath("old", lambda q, kv_cache, meta, scale, sliding_window=None, soft_cap=None, kv_scales=None: 0)


def test_a_backend_older_than_an_argument_is_not_asked_to_serve_calls_that_pass_it():
    ops = Ops(BeforeSinks())
    assert ops.provider("attention", dtype="float32", head_dim=64).name == "test_before_sinks"
    assert ops.provider("attention", dtype="float32", head_dim=64, sinks=True).name == "torch"
    assert ops.provider("moe", dtype="float32", expert_bias=True).name == "torch"
    assert ops.provider("moe", dtype="float32", moe_activation="swiglu_oai").name == "torch"
    assert ops.provider("moe", dtype="float32").name == "test_before_sinks"
    # Without a fallback the reason names the missing argument.
    no_fallback = type("NoFallback", (BeforeSinks,), {"fallback": None, "name": "test_no_fallback"})
    with pytest.raises(registry_mod.BackendUnavailableError, match="takes no 'sinks' argument"):
        Ops(no_fallback()).implementation("attention", dtype="float32", sinks=True)
    # A general attention that takes sinks keeps the call; its older fast path is left out of it.
    fast_only = type("FastOnly", (TorchBackend,), {"name": "test_fast_only", "fast_path": BeforeSinks.fast_path})
    impl = Ops(fast_only()).implementation("attention", dtype="float32", head_dim=64, sinks=True)
    assert impl.provider.name == "test_fast_only" and impl.fast is None
    assert Ops(fast_only()).implementation("attention", dtype="float32", head_dim=64).fast is not None


def test_the_trace_prints_one_row_per_node_call_and_implementation():
    trace = DispatchTrace()
    trace.count("mlp", "fused_mlp", "torch:fused", 3)
    trace.count("attention", "linear", "torch", 2)
    lines = trace.format().splitlines()
    assert lines[0].split() == ["node", "call", "implementation", "calls"]
    assert [line.split() for line in lines[2:]] == [["attention", "linear", "torch", "2"],
                                                    ["mlp", "fused_mlp", "torch:fused", "3"]]


# -- real runs ---------------------------------------------------------------------------
def test_smollm2_decode_on_torch_runs_the_native_fused_nodes(leak_check):
    require_smollm2()
    llm = LLM("smollm2", backend="torch", trace_dispatch=True, max_num_seqs=1)
    leak_check.append(llm.engine)
    ids = llm.get_tokenizer()("The capital of France is Paris, and the capital of Italy is Rome. " * 4).input_ids
    assert len(ids) > INT4_GEMM_MAX_ROWS  # a prefill too long for the fused kernels
    llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    t, layers = table(llm.engine.dispatch_trace), 30
    # One prefill step (its primitives run) and three decode steps (the fused nodes).
    assert t[("attention", "fused_attention")] == {"torch:fused": 3 * layers, "declined": layers}
    assert t[("mlp", "fused_mlp")] == {"torch:fused": 3 * layers, "declined": layers}
    assert sum(t[("attention", "attention")].values()) == layers  # the prefill's, through the primitives
    assert t[("rms_norm", "rms_norm")] == {"torch:native": 4 * (2 * layers + 1)}
    assert t[("sampler", "sample")] == {"torch": 4}


def test_with_infer_native_0_the_torch_primitives_serve_every_call():
    require_smollm2()
    script = Path(sys.executable).with_name("infer")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "infer.cli"]
    res = subprocess.run([*cmd, "run", "Hi", "--backend", "torch", "--max-tokens", "3", "--temperature", "0",
                          "--trace-dispatch"], env={**os.environ, "INFER_NATIVE": "0"}, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = [line.split() for line in res.stderr.split("(node, call, implementation, calls):")[1].splitlines()[3:]]
    calls = {(r[0], r[1]): (r[2], int(r[3])) for r in rows if len(r) == 4}
    assert {impl for impl, _ in calls.values()} == {"torch"}
    assert not any(call.startswith("fused_") for _, call in calls)
    steps = calls[("sampler", "sample")][1]  # 3, or fewer if the answer ended sooner
    assert calls[("attention", "attention")] == ("torch", steps * 30)  # every step, every layer
    assert calls[("mlp", "act_and_mul")] == ("torch", steps * 30)


def test_cpu_ref_serves_every_call_itself(tiny_llama, leak_check):
    _, path = tiny_llama
    llm = LLM(path, backend="cpu_ref", skip_tokenizer_init=True, trace_dispatch=True)
    leak_check.append(llm.engine)
    llm.generate([PROMPT], GREEDY, use_tqdm=False)
    t = table(llm.engine.dispatch_trace)
    layers = llm.engine.worker.runner.program.graph.num_layers
    assert {impl for impls in t.values() for impl in impls} == {"cpu_ref"}
    assert t[("attention", "attention")] == {"cpu_ref": 4 * layers}
    assert t[("attention", "linear")] == {"cpu_ref": 2 * 4 * layers}  # qkv and o
    assert t[("lm_head", "linear")] == {"cpu_ref": 4}


CUDA_TRACE = """
import json, sys
from infer.core.llm import LLM
from infer.core.sampling_params import SamplingParams
llm = LLM(sys.argv[1], backend="cuda", skip_tokenizer_init=True, trace_dispatch=True, max_num_seqs=2)
llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
             use_tqdm=False)
print(json.dumps(llm.engine.dispatch_trace.rows()))
"""


def test_cuda_in_the_interpreter_runs_its_kernels_and_torch_for_the_rest(tiny_llama):
    import json

    _, path = tiny_llama
    res = subprocess.run([sys.executable, "-c", CUDA_TRACE, path], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = {(node, call): impl for node, call, impl, _ in json.loads(res.stdout.splitlines()[-1])}
    for call in ("rms_norm", "rotary", "kv_write", "attention", "act_and_mul", "sample"):
        node = next(n for n, c in got if c == call)
        assert got[(node, call)] == "cuda", (call, got)
    # Dense GEMMs (cuBLAS) and the embedding gather are torch's, by declaration.
    assert got[("attention", "linear")] == got[("lm_head", "linear")] == "torch (fallback)"
    assert got[("embedding", "embedding")] == "torch (fallback)"


# -- contract v1 -----------------------------------------------------------------------------
def _v1_backend():
    # Written as a v1 plugin was: TorchPlumbing from its v1 home, `backend_data`, no kv_scales,
    # a fused node that took the runner, decode graphs that took the runner.
    from infer.backends.torch_native import attention as torch_attention
    from infer.backends.torch_native.plumbing import TorchPlumbing

    class V1Chip(TorchPlumbing):
        name = "test_v1chip"
        api_version = 1
        dtypes = FLOAT_DTYPES
        fallback = "torch"
        attention_calls = 0

        def prepare_metadata(self, meta):
            out = super().prepare_metadata(meta)
            out.backend_data = ("v1 plan", torch_attention.lazy_plan(meta.query_start_loc, meta.seq_lens))
            return out

        def attention(self, q, kv_cache, meta, scale, sliding_window=None, soft_cap=None):
            tag, plan = meta.backend_data
            assert tag == "v1 plan"
            type(self).attention_calls += 1
            return torch_attention.attention(q, kv_cache, replace(meta, plan=plan), scale, sliding_window, soft_cap)

        def fuses(self, node_op, **attrs):
            return Support(True)

        def fused_mlp(self, x, *, params, attrs, env, runner, layer):
            raise AssertionError("a v1 fused node was called")

        def decode_graphs(self, runner, **kw):
            raise AssertionError("v1 decode graphs were asked for")

    return V1Chip


def test_a_contract_v1_backend_still_serves_the_engine(tiny_llama, monkeypatch, leak_check):
    _, path = tiny_llama
    reference = LLM(path, backend="torch", skip_tokenizer_init=True)
    leak_check.append(reference.engine)
    want = reference.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    cls = _v1_backend()
    reg = build_registry(entry_points=False)
    reg.backends[cls.name] = BackendInfo(cls.name, cls, "test", Support(True))
    monkeypatch.setattr(registry_mod, "registry", lambda: reg)
    monkeypatch.setattr(rank_mod, "registry", lambda: reg)
    llm = LLM(path, backend=cls.name, skip_tokenizer_init=True, trace_dispatch=True)
    leak_check.append(llm.engine)
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
    layers = llm.engine.worker.runner.program.graph.num_layers
    assert cls.attention_calls == 4 * layers
    t = table(llm.engine.dispatch_trace)
    assert t[("attention", "attention")] == {cls.name: 4 * layers}
    assert not any(call.startswith("fused_") for _, call in t)  # v1 fused nodes are not used
    assert llm.engine.worker.decode_graphs is None
    assert "contract v1" in llm.engine.worker.ops.fuses("mlp").reason


def test_a_kv_scales_argument_is_never_given_to_a_cache_in_the_model_dtype():
    from infer.primitives.binding import arguments

    args = arguments("attention", dict(q=1, kv_cache=2, meta=3, scale=0.5, sliding_window=None, soft_cap=None,
                                       kv_scales=None))
    assert args == [1, 2, 3, 0.5]  # trailing defaults left off: a v1 attention without kv_scales accepts it
    assert arguments("attention", dict(q=1, kv_cache=2, meta=3, scale=0.5, kv_scales=(1.0, 2.0))) == \
        [1, 2, 3, 0.5, None, None, (1.0, 2.0)]
    with pytest.raises(TypeError, match="needs argument 'scale'"):
        arguments("attention", dict(q=1, kv_cache=2, meta=3))
    with pytest.raises(TypeError, match="no argument"):
        arguments("linear", dict(x=1, weight=2, bias=3))


def test_v1_fused_nodes_are_recognised_by_their_signature_even_without_api_version():
    class Unpinned(TorchBackend):  # a v1-era plugin that never set api_version inherits the current one
        name = "test_unpinned"

        def fused_mlp(self, x, *, params, attrs, env, runner, layer):
            raise AssertionError("called with v2 arguments")

        def decode_graphs(self, runner, **kw):
            raise AssertionError("called with v2 arguments")

    ops = Ops(Unpinned())
    assert not ops.fuses("mlp") and "contract v1" in ops.fuses("mlp").reason
    assert ops.decode_graphs(lambda *a: None, max_model_len=8, block_size=16, batch_sizes=(1,)) is None


@pytest.mark.parametrize("name", ["torch", "cpu_ref", "cuda", "ascend"])
def test_every_in_tree_backend_implements_the_contract_signatures(name):
    import inspect

    from infer.primitives.binding import SIGNATURES

    cls = registry_mod.registry().backends[name].cls
    for prim, sig in SIGNATURES.items():
        fn = getattr(cls, prim, None)
        if fn is None:
            continue
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        assert params == [a.name for a in sig], (name, prim, params)
