"""The real ascend backend code over the torch_npu emulation: conformance against
cpu_ref (with the fused attention path at the backend's block size 128), a tiny
Llama end to end, availability reasons, declared declines and SmoothGEMM."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from infer.backends.ascend import AscendBackend
from infer.backends.ascend import linear as smooth
from infer.backends.ascend.availability import probe
from infer.primitives.types import DenseWeight
from infer.dispatch import Ops
from infer.registry import get_backend
from infer.testing import assert_conforms, cases_for, conformance_params
from infer.testing.cases import COLLECTIVES, Case
from infer.testing.npu_emulation import installed

from tiny_models import LLAMA3_ROPE, make_model, meta_for, random_model

LOCAL = [p for p in conformance_params("ascend") if p.values[1].primitive not in COLLECTIVES]
# Every attention case again with the cache paged by 128, as the engine runs
# this backend: the fused kernel's path (the suite's default block is 16).
AT_128 = [Case(c.primitive, c.name + "_bs128", c.dtype, {**c.params, "block_size": 128})
          for c in cases_for("ascend") if c.primitive == "attention" and "block_size" not in c.params]


@pytest.fixture
def emulated():
    with installed() as mod:
        yield mod


@pytest.fixture
def backend(emulated):
    return AscendBackend()


@pytest.fixture
def fused_calls(emulated, monkeypatch):
    """Counts calls of the emulated fused attention (proof the fused path ran)."""
    calls = []
    real = emulated.npu_fused_infer_attention_score

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(emulated, "npu_fused_infer_attention_score", counting)
    return calls


@pytest.mark.parametrize("_, case", LOCAL)
def test_ascend_conforms_over_the_emulation(_, case, backend):
    assert_conforms(backend, case)


@pytest.mark.parametrize("case", AT_128, ids=[c.id for c in AT_128])
def test_fused_attention_at_block_size_128_conforms(case, backend, fused_calls):
    result = assert_conforms(backend, case)
    declined = (case.dtype == "float32" or {"sliding_window", "soft_cap", "kv_scales"} & set(case.params)  # fp8 KV: torch
                or case.params["d"] not in (128, 192))  # TND takes head_dim 128 or 192
    assert result.provider == ("torch" if declined else "ascend")
    # The fused kernel ran exactly when the backend kept the case (and it has tokens).
    assert bool(fused_calls) == bool(not declined and case.params["reqs"])


def test_fused_attention_gets_one_entry_per_planner_tile(backend, fused_calls):
    case = next(c for c in AT_128 if c.name == "mixed_gqa8_d128_bs128" and c.dtype == "float16")
    assert_conforms(backend, case)
    meta = case.inputs()["meta"]
    from infer.core.xy_plan import attention_table

    table = attention_table(meta.query_start_loc, meta.seq_lens)
    (call,) = fused_calls
    assert call["actual_seq_lengths"] == np.cumsum(table.token_num).tolist()
    assert call["actual_seq_lengths_kv"] == table.kv_len.tolist()
    assert call["input_layout"] == "TND" and call["sparse_mode"] == 3 and call["block_size"] == 128


def test_tiny_llama_matches_cpu_ref_through_prefill_chunks_and_decode():
    from infer.core.lowering import lower
    from infer.core.model_runner import ModelRunner
    from infer.core.models.llama import build_llama

    # Built before the emulation is installed: transformers probes for torch_npu. head_dim 128: the fused kernel's.
    _, config, weights = random_model("LlamaConfig", "LlamaForCausalLM", hidden_size=192, num_attention_heads=3,
                                      num_key_value_heads=1, head_dim=128, rope_parameters=LLAMA3_ROPE,
                                      intermediate_size=160, num_hidden_layers=2, vocab_size=211,
                                      max_position_embeddings=256)
    with installed() as mod:
        calls = []
        fused = mod.npu_fused_infer_attention_score
        mod.npu_fused_infer_attention_score = lambda *a, **kw: calls.append(1) or fused(*a, **kw)
        _run_llama_steps(config, weights, AscendBackend(), lower, ModelRunner, build_llama)
    assert len(calls) == 2 * 2  # two steps, two layers: every attention ran the fused kernel


def _run_llama_steps(config, weights, backend, lower, ModelRunner, build_llama):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 211, n) for n in (150, 5)]
    tables = [[3, 0], [2]]
    nxt = int(rng.integers(0, 211))
    steps = [([(0, 140), (0, 5)], np.concatenate([prompts[0][:140], prompts[1]])),
             ([(140, 10), (5, 1)], np.concatenate([prompts[0][140:], [nxt]]))]
    logits = {}
    for be in (backend, get_backend("cpu_ref")):
        runner = ModelRunner(lower(build_llama(config)), be, Ops(be), dict(weights), "float16", 256)
        runner.allocate_kv_caches(num_blocks=4, block_size=128)
        out = []
        for chunks, ids in steps:
            positions = np.concatenate([np.arange(c, c + q) for c, q in chunks])
            meta = runner.prepare_metadata(meta_for(chunks, 128, tables))
            got = runner.forward(be.asarray(ids), be.asarray(positions), be.asarray(np.arange(len(ids))), meta).logits
            out.append(be.to_numpy(got))
        logits[be.name] = np.concatenate(out)
    np.testing.assert_allclose(logits["ascend"], logits["cpu_ref"], atol=5e-3, rtol=0)
    # fp16 near-ties may flip a greedy token or two; the logits above agree to 5e-3.
    assert (logits["ascend"].argmax(-1) == logits["cpu_ref"].argmax(-1)).mean() > 0.97


def test_declines_what_the_fused_kernels_cannot_do(backend):
    assert "float16/bfloat16" in backend.supports("attention", dtype="float32").reason
    assert "soft-cap" in backend.supports("attention", dtype="float16", soft_cap=True).reason
    for d in (64, 72, 80, 96, 256):  # 16-aligned, but not a TND head size
        assert "128 or 192" in backend.supports("attention", dtype="float16", head_dim=d).reason
    assert backend.supports("attention", dtype="bfloat16", head_dim=128)
    assert backend.supports("attention", dtype="float16", head_dim=192)
    assert Ops(backend).resolve("attention", dtype="float32")[1] == "torch"
    assert "float32" in backend.supports("kv_write", dtype="float32").reason
    assert backend.supports("kv_write", dtype="bfloat16")


def test_smoothgemm_linear_tiles_rows_and_matches_f_linear(emulated):
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((300, 64)).astype(np.float32))
    w = DenseWeight(torch.from_numpy(rng.standard_normal((48, 64)).astype(np.float32)),
                    torch.from_numpy(rng.standard_normal(48).astype(np.float32)))
    assert smooth.row_tiles(300, 128) == [(0, 128), (128, 128), (256, 44)]
    torch.testing.assert_close(smooth.tiled_linear(x, w, m_tile=128), F.linear(x, w.weight, w.bias))


def test_device_is_npu_and_tensors_follow_the_emulated_namespace(backend):
    assert backend.device == "npu:0" and backend.placement == "cpu" and backend.dist_backend == "hccl"
    assert backend.kv_cache_shape(5, 128, 2, 64) == (2, 5, 128, 2, 64)


# -- availability reasons (no emulation) ---------------------------------------
def test_unavailable_here_because_torch_npu_is_not_installed():
    reason = AscendBackend.is_available().reason
    assert "torch_npu not installed" in reason and "CANN" in reason


def _raise(exc):
    def importer(name):
        raise exc
    return importer


def test_missing_cann_libraries_point_at_set_env():
    found = lambda name: object()  # noqa: E731
    r = probe(found, _raise(ImportError("libhccl.so: cannot open shared object file")), {})
    assert "CANN" in r.reason and "set_env.sh" in r.reason and "libhccl.so" in r.reason


def test_missing_torch_npu_namespace_mentions_disabled_autoload(monkeypatch):
    mod = type("M", (), {"__version__": torch.__version__})
    r = probe(lambda n: object(), lambda n: mod, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert "torch.npu is missing" in r.reason and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in r.reason


def test_no_visible_npu_and_mismatched_versions_are_reported(monkeypatch):
    monkeypatch.setattr(torch, "npu", type("N", (), {"is_available": staticmethod(lambda: False)}), raising=False)
    ok_mod = type("M", (), {"__version__": torch.__version__})
    assert "no NPU is visible" in probe(lambda n: object(), lambda n: ok_mod, {}).reason
    old = type("M", (), {"__version__": "2.1.0.post6"})
    assert "does not match torch" in probe(lambda n: object(), lambda n: old, {}).reason


def test_infer_backends_lists_ascend_unavailable_with_the_reason(capsys, monkeypatch):
    from infer.cli import main

    monkeypatch.setenv("COLUMNS", "1000")  # one line per backend
    assert main(["backends"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.strip("│ ").startswith("ascend"))
    assert "torch_npu not installed" in row


# -- the engine on the emulated NPU ---------------------------------------------
def test_engine_pages_by_128_and_generates_what_cpu_ref_generates(tmp_path, monkeypatch, leak_check):
    import infer.core.executor.rank as rank_mod
    from infer.core.llm import LLM
    from infer.core.sampling_params import SamplingParams

    model, _, _ = make_model("llama3")
    model.save_pretrained(tmp_path)  # before the emulation: transformers probes for torch_npu
    real_get_backend = rank_mod.get_backend
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (150, 5, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for name in ("ascend", "cpu_ref"):
        with installed():
            # The registry was built without the emulation (ascend unavailable there): hand the engine an instance.
            monkeypatch.setattr(rank_mod, "get_backend",
                                lambda n, device=None: AscendBackend() if n == "ascend" else real_get_backend(n, device))
            llm = LLM(str(tmp_path), backend=name, dtype="float16", skip_tokenizer_init=True, max_num_seqs=4,
                      max_num_batched_tokens=64, num_gpu_blocks_override=12, block_size=None if name == "ascend" else 128)
            leak_check.append(llm.engine)
            assert llm.engine.cache_config.block_size == 128
            outs = llm.generate(prompts, params, use_tqdm=False)
            outputs[name] = [o.outputs[0].token_ids for o in outs]
    assert outputs["ascend"] == outputs["cpu_ref"]


def test_quantized_linear_is_the_npu_weight_quant_matmul_in_half_precision_only(backend):
    ops = Ops(backend)
    for kind in ("int4_group", "int8_group"):
        assert ops.provider("linear", weight_kind=kind, dtype="bfloat16").name == "ascend"
        assert ops.provider("linear", weight_kind=kind, dtype="float32").name == "torch"
    assert ops.provider("linear", weight_kind="fp8", dtype="bfloat16").name == "torch"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_int4_groups_with_zero_scale_stay_exact(backend, emulated, dtype):
    """A Q4_1 group whose weights are all equal has scale 0: it must dequantize to its offset."""
    from infer.primitives.types import Int4GroupWeight

    g = torch.Generator().manual_seed(0)
    n, k = 16, 64
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales, offsets = torch.rand(n, 2, generator=g) / 8, torch.randn(n, 2, generator=g)
    scales[3, 1] = scales[7, 0] = 0.0
    w = Int4GroupWeight(packed, scales, offsets, 32, dtype=dtype)
    calls = []
    real = emulated.npu_weight_quant_batchmatmul
    emulated.npu_weight_quant_batchmatmul = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    x = torch.eye(k, dtype=getattr(torch, dtype))
    got = backend.linear(x, backend.prepare_weight(w)).float().t()  # identity rows: the dequantized weight
    q = torch.stack((packed & 15, packed >> 4), -1).view(n, k).float()
    want = q * scales.repeat_interleave(32, 1) + offsets.repeat_interleave(32, 1)
    assert calls
    for row, cols in ((3, slice(32, 64)), (7, slice(0, 32))):  # the flat groups: their offset, rounded once
        assert torch.equal(got[row, cols], want[row, cols].to(getattr(torch, dtype)).float())
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7)


# -- the documented limits the backend's calls keep --------------------------------
def _spy(emulated, name):
    calls, real = [], getattr(emulated, name)

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    setattr(emulated, name, spy)
    return calls


def test_kv_write_passes_norm_mode_and_leaves_minus_one_slots_to_the_op(backend, emulated):
    calls = _spy(emulated, "npu_scatter_pa_kv_cache")
    k = torch.randn(4, 2, 128).half()
    cache = torch.zeros(2, 2, 128, 2, 128, dtype=torch.float16)
    backend.kv_write(k, k + 1, cache, torch.tensor([3, -1, 130, -1]))
    (call,) = calls
    assert call["cache_mode"] == "Norm"
    assert torch.equal(cache[0, 0, 3], k[0]) and torch.equal(cache[1, 1, 2], k[2] + 1)
    assert int((cache != 0).flatten(2).any(-1).sum()) == 4  # two slots in each cache, nothing for the -1 rows


def test_float32_kv_write_runs_torch_not_the_scatter(backend, emulated):
    calls = _spy(emulated, "npu_scatter_pa_kv_cache")
    k = torch.randn(3, 1, 128)
    cache = torch.zeros(2, 1, 128, 1, 128)
    backend.kv_write(k, -k, cache, torch.tensor([5, -1, 0]))
    assert not calls
    assert torch.equal(cache[0, 0, 5, 0], k[0, 0]) and torch.equal(cache[1, 0, 0, 0], -k[2, 0])


def _blocks_read(call, bs=128):
    return sum(-(-n // bs) for n in call.kv_lens)


def test_pack_splits_tiles_into_calls_within_the_cache_and_entry_limits():
    from infer.backends.ascend.attention import pack
    from infer.core.xy_plan import attention_table

    # A 2048-row chunk after 30,720 cached tokens, one tile of 128 per entry, reads 3,976 blocks; the request owns 256.
    t = attention_table([0, 2048], [30720 + 2048])
    assert int((-(-t.kv_len // 128)).sum()) == 3976
    one = pack(t.token_num, t.kv_len, t.request, 5000, 128)
    assert len(one.calls) == 1 and len(one.calls[0].kv_lens) == 16  # it fits: the tiles as they are
    merged = pack(t.token_num, t.kv_len, t.request, 3000, 128)  # it does not: one entry, its 256 blocks once
    assert [(c.q_ends, c.kv_lens) for c in merged.calls] == [([2048], [32768])]
    # Two 512-row prefills (1+2+3+4 = 10 blocks each) on a cache of 10 blocks: two calls of four tiles.
    t = attention_table([0, 512, 1024], [512, 512])
    two = pack(t.token_num, t.kv_len, t.request, 10, 128)
    assert [c.rows for c in two.calls] == [(0, 512), (512, 1024)] and [c.entries for c in two.calls] == [(0, 4), (4, 8)]
    assert all(_blocks_read(c) == 10 and c.q_ends == [128, 256, 384, 512] for c in two.calls)
    # 5000 decodes: the TND entry limit cuts them, whatever the cache.
    t = attention_table(np.arange(5001), np.full(5000, 300))
    calls = pack(t.token_num, t.kv_len, t.request, 10**6, 128).calls
    assert [len(c.kv_lens) for c in calls] == [4096, 904] and calls[1].rows == (4096, 5000)


def _paged_step(reqs, num_blocks, hq, hk, d, dtype=torch.float16, seed=0):
    """A cache of `num_blocks` blocks of 128 holding each request's context, its query and metadata."""
    from infer.primitives.types import AttentionMetadata

    rng = np.random.default_rng(seed)
    qlen, seq = np.array([q for q, _ in reqs], np.int32), np.array([s for _, s in reqs], np.int32)
    nblocks = [-(-int(s) // 128) for s in seq]
    physical = rng.permutation(num_blocks)[: sum(nblocks)]
    table = np.zeros((len(reqs), max(nblocks)), np.int32)
    table[np.arange(len(reqs)).repeat(nblocks), np.concatenate([np.arange(n) for n in nblocks])] = physical
    kv = torch.from_numpy(rng.standard_normal((2, num_blocks, 128, hk, d)).astype(np.float32)).to(dtype)
    q = torch.from_numpy(rng.standard_normal((int(qlen.sum()), hq, d)).astype(np.float32)).to(dtype)
    qsl = np.concatenate([[0], np.cumsum(qlen)]).astype(np.int32)
    meta = AttentionMetadata(qsl, seq, table, np.zeros(int(qlen.sum()), np.int64), int(qlen.max()), int(seq.max()), 128)
    return q, kv, meta


@pytest.mark.parametrize("reqs, num_blocks, entries_per_call", [
    ([(512, 512), (512, 512)], 10, [4, 4]),  # each request's tiles read 10 blocks: one call each
    ([(768, 768), (1, 100)], 8, [2]),  # 6 tiles would read 21 blocks: the prefill merged into one entry
])
def test_long_prefills_on_a_small_cache_run_several_calls_and_match_cpu_ref(backend, emulated, reqs, num_blocks,
                                                                             entries_per_call):
    from infer.backends.cpu_ref import attention as ref_attention

    calls = _spy(emulated, "npu_fused_infer_attention_score")
    q, kv, meta = _paged_step(reqs, num_blocks, hq=2, hk=1, d=128)
    got = backend.attention(q, kv, replace(backend.prepare_metadata(meta), plan=backend.plan_attention(meta)), 0.09)
    assert [len(c["actual_seq_lengths"]) for c in calls] == entries_per_call
    want = ref_attention.attention(q.float().numpy(), kv.float().numpy(), meta, 0.09)
    np.testing.assert_allclose(got.float().numpy(), want, atol=3e-3, rtol=3e-3)


def test_quantized_lm_head_wider_than_65535_is_cut_into_products_the_op_takes(backend, emulated):
    from infer.primitives.types import Int8GroupWeight

    calls = _spy(emulated, "npu_weight_quant_batchmatmul")
    g = torch.Generator().manual_seed(0)
    n, k = 70000, 64
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, 1, generator=g) / 64
    w = backend.prepare_weight(Int8GroupWeight(q, scales, k, dtype="float16"))  # one group per row: per channel
    x = torch.randn(3, k, generator=g).half()
    got = backend.linear(x, w)
    assert len(calls) == 2  # columns [0, 65472) and [65472, 70000)
    want = x.float() @ (q.float() * scales).t()
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-3)


def test_quantized_weight_with_k_over_65535_runs_torch(backend, emulated):
    from infer.primitives.types import Int8GroupWeight

    calls = _spy(emulated, "npu_weight_quant_batchmatmul")
    k = 65536 + 32
    q = torch.ones(2, k, dtype=torch.int8)
    w = backend.prepare_weight(Int8GroupWeight(q, torch.full((2, k // 32), 0.5), 32, dtype="float16"))
    got = backend.linear(torch.full((1, k), 2**-10, dtype=torch.float16), w)
    assert not calls and torch.allclose(got.float(), torch.full((1, 2), k * 2**-11), rtol=1e-2)
