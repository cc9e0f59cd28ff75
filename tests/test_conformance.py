"""The conformance suite: every available backend on every case, and proof that
the suite catches the bugs it exists to catch (mutants of the reference)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from infer.backends.cpu_ref import CpuRefBackend
from infer.primitives.types import round_to_dtype
from infer.registry import registry
from infer.testing import all_cases, assert_conforms, cases_for, conformance_params, run_conformance, select
from infer.testing.collectives import run_collectives
from infer.testing.conformance import compare

AVAILABLE = sorted(name for name, info in registry().backends.items() if info.available)


@pytest.mark.parametrize("backend, case", [p for name in AVAILABLE for p in conformance_params(name)])
def test_backend_conforms(backend, case):
    assert_conforms(backend, case)


# -- the cases themselves -------------------------------------------------------
def test_case_ids_are_unique_and_cover_every_primitive():
    cases = all_cases()
    assert len({c.id for c in cases}) == len(cases)
    assert {c.primitive for c in cases} >= {"attention", "kv_write", "moe", "sample", "all_reduce", "all_gather"}


def test_inputs_are_deterministic_and_prerounded_to_the_case_dtype():
    case = next(c for c in all_cases() if c.id == "attention-mixed_gqa3_d64-bf16")
    a, b = case.inputs(), case.inputs()
    np.testing.assert_array_equal(a["q"], b["q"])
    np.testing.assert_array_equal(a["q"], round_to_dtype(a["q"], "bfloat16"))


def test_block_boundary_cases_follow_the_preferred_block_size():
    assert "attention-decode_ctx15_16_17_gqa1_d64-fp32" in {c.id for c in all_cases(16)}
    extra = {c.id for c in all_cases(128)} - {c.id for c in all_cases(16)}
    assert "attention-ctx_bs128_boundary_gqa3_d64-fp32" in extra
    reqs = next(c for c in all_cases(128) if c.name.startswith("ctx_bs128")).params["reqs"]
    assert [s for _, s in reqs][:3] == [127, 128, 129]


def test_cases_for_a_registered_name_uses_its_class_declaration():
    assert any("bs128" in c.id for c in cases_for("ascend"))  # no NPU needed to list them


def test_compare_requires_exact_integers():
    problems, _, _ = compare({"ids": np.array([1, 2])}, {"ids": np.array([1, 3])}, "bfloat16")
    assert problems and "ids: 1 of 2 differ" in problems[0]


def test_compare_uses_the_dtype_tolerance():
    want = {"out": np.ones(4, np.float32)}
    got = {"out": np.full(4, 1.005, np.float32)}
    assert compare(got, want, "bfloat16")[0] == []
    assert "outside" in compare(got, want, "float32")[0][0]


def test_compare_reports_nan_and_shape_mismatches():
    want = {"out": np.zeros(3, np.float32)}
    assert "non-finite" in compare({"out": np.array([0, np.nan, 0], np.float32)}, want, "float32")[0][0]
    assert "shape" in compare({"out": np.zeros(4, np.float32)}, want, "float32")[0][0]


# -- mutants: each breaks one rule of the contract; the suite must notice ------
class NoSlidingWindow(CpuRefBackend):
    name = "mutant"

    def attention(self, q, kv_cache, meta, scale, sliding_window=None, soft_cap=None):
        return CpuRefBackend.attention(q, kv_cache, meta, scale, None, soft_cap)


class NoSoftCap(CpuRefBackend):
    name = "mutant"

    def attention(self, q, kv_cache, meta, scale, sliding_window=None, soft_cap=None):
        return CpuRefBackend.attention(q, kv_cache, meta, scale, sliding_window, None)


class IgnoresSinks(CpuRefBackend):
    name = "mutant"

    def attention(self, q, kv_cache, meta, scale, sliding_window=None, soft_cap=None, kv_scales=None, sinks=None):
        return CpuRefBackend.attention(q, kv_cache, meta, scale, sliding_window, soft_cap, kv_scales)


class SinkPerKvHead(CpuRefBackend):
    """Gives every query head of a KV head that KV head's first sink."""
    name = "mutant"

    def attention(self, q, kv_cache, meta, scale, sliding_window=None, soft_cap=None, kv_scales=None, sinks=None):
        if sinks is not None:
            group = q.shape[1] // kv_cache.shape[3]
            sinks = np.repeat(np.asarray(sinks)[::group], group)
        return CpuRefBackend.attention(q, kv_cache, meta, scale, sliding_window, soft_cap, kv_scales, sinks)


class Mxfp4HighNibbleFirst(CpuRefBackend):
    """Reads an MXFP4 weight's bytes high nibble first (ggml's block layout is not the contract's)."""

    name = "mutant"

    def linear(self, x, weight):
        if weight.kind == "mxfp4":
            q = np.asarray(weight.qweight)
            weight = replace(weight, qweight=((q >> 4) | (q << 4)).astype(np.uint8))
        return CpuRefBackend.linear(x, weight)


class UnclampedSwigluOai(CpuRefBackend):
    name = "mutant"

    def moe(self, x, router_logits, w13, w2, top_k, renormalize, shared=None, shared_gate=None, w13_bias=None,
            w2_bias=None, activation=None, swiglu_alpha=None, swiglu_limit=None):
        return CpuRefBackend.moe(x, router_logits, w13, w2, top_k, renormalize, shared, shared_gate, w13_bias,
                                 w2_bias, activation, swiglu_alpha, 1e9 if swiglu_limit else None)


class IgnoresRoutingBias(CpuRefBackend):
    name = "mutant"

    def moe(self, x, router_logits, w13, w2, top_k, renormalize, shared=None, shared_gate=None, w13_bias=None,
            w2_bias=None, activation=None, swiglu_alpha=None, swiglu_limit=None, routed_scaling_factor=None,
            scoring_func=None, routing_bias=None, expert_groups=None):
        return CpuRefBackend.moe(x, router_logits, w13, w2, top_k, renormalize, shared, shared_gate, w13_bias, w2_bias,
                                 activation, swiglu_alpha, swiglu_limit, routed_scaling_factor, scoring_func, None,
                                 expert_groups)


class ScalesSharedExpertToo(CpuRefBackend):
    """Applies the routed scale to the shared experts' output as well."""
    name = "mutant"

    def moe(self, x, router_logits, w13, w2, top_k, renormalize, shared=None, shared_gate=None, w13_bias=None,
            w2_bias=None, activation=None, swiglu_alpha=None, swiglu_limit=None, routed_scaling_factor=None,
            scoring_func=None, routing_bias=None, expert_groups=None):
        if shared_gate is not None:  # Qwen2-MoE's gated shared expert: no routed scale to misapply
            return CpuRefBackend.moe(x, router_logits, w13, w2, top_k, renormalize, shared, shared_gate, w13_bias,
                                     w2_bias, activation, swiglu_alpha, swiglu_limit, routed_scaling_factor,
                                     scoring_func, routing_bias, expert_groups)
        out, counts = CpuRefBackend.moe(x, router_logits, w13, w2, top_k, renormalize, None, None, w13_bias, w2_bias,
                                        activation, swiglu_alpha, swiglu_limit, routed_scaling_factor, scoring_func,
                                        routing_bias, expert_groups)
        if shared is not None:
            out = out + (routed_scaling_factor or 1.0) * np.asarray(shared, np.float32)
        return out, counts


class IgnoresLatentRopeKey(CpuRefBackend):
    """Scores latent attention without the rope part of its keys."""
    name = "mutant"

    def mla_attention(self, q_nope, q_pe, kv_cache, meta, kv_b_proj, scale, v_head_dim):
        return CpuRefBackend.mla_attention(q_nope, np.zeros_like(np.asarray(q_pe)), kv_cache, meta, kv_b_proj, scale,
                                           v_head_dim)


class LatentInOnePlane(CpuRefBackend):
    """Stores a latent's second half over its first (both in the K plane)."""
    name = "mutant"

    def mla_kv_write(self, c_kv, k_pe, kv_cache, slot_mapping):
        latent = np.concatenate([np.asarray(c_kv), np.asarray(k_pe)], axis=1)
        half = latent.shape[1] // 2
        CpuRefBackend.kv_write(latent[:, None, half:], latent[:, None, half:], kv_cache, slot_mapping)


class NoDownBias(CpuRefBackend):
    name = "mutant"

    def moe(self, x, router_logits, w13, w2, top_k, renormalize, shared=None, shared_gate=None, w13_bias=None,
            w2_bias=None, activation=None, swiglu_alpha=None, swiglu_limit=None):
        return CpuRefBackend.moe(x, router_logits, w13, w2, top_k, renormalize, shared, shared_gate, w13_bias,
                                 None, activation, swiglu_alpha, swiglu_limit)


class HighestExpertOnTies(CpuRefBackend):
    name = "mutant"

    def moe(self, x, router_logits, w13, w2, top_k, renormalize, shared=None, shared_gate=None):
        # Reversing the expert order turns "lowest id first" into "highest id first".
        out, counts = CpuRefBackend.moe(x, router_logits[:, ::-1], w13[::-1], w2[::-1], top_k, renormalize,
                                        shared, shared_gate)
        return out, counts[::-1].copy()


class UngatedSharedExpert(CpuRefBackend):
    name = "mutant"

    def moe(self, x, router_logits, w13, w2, top_k, renormalize, shared=None, shared_gate=None):
        return CpuRefBackend.moe(x, router_logits, w13, w2, top_k, renormalize, shared, None)


class WritesPaddedSlots(CpuRefBackend):
    name = "mutant"
    kv_cache_dtypes = ("auto",)  # writes floats only: declines the fp8 cases, so they skip

    def kv_write(self, k, v, kv_cache, slot_mapping, scales=None):
        flat = kv_cache.reshape(2, -1, *kv_cache.shape[3:])
        flat[0, slot_mapping], flat[1, slot_mapping] = k, v  # -1 lands in the last slot


class IgnoresSeed(CpuRefBackend):
    name = "mutant"

    def sample(self, logits, params):
        return CpuRefBackend.sample(logits, replace(params, seeds=np.zeros_like(params.seeds)))


class IgnoresPenalties(CpuRefBackend):
    name = "mutant"

    def sample(self, logits, params):
        return CpuRefBackend.sample(logits, replace(params, repetition_penalty=np.ones_like(params.repetition_penalty),
                                                    frequency_penalty=np.zeros_like(params.frequency_penalty),
                                                    presence_penalty=np.zeros_like(params.presence_penalty)))


class IgnoresLogitBias(CpuRefBackend):
    name = "mutant"

    def sample(self, logits, params):
        return CpuRefBackend.sample(logits, replace(params, logit_bias_ids=None, logit_bias_values=None))


class IgnoresTokenBitmask(CpuRefBackend):
    name = "mutant"

    def sample(self, logits, params):
        return CpuRefBackend.sample(logits, replace(params, token_bitmask=None))


class AcceptsEveryDraft(CpuRefBackend):
    name = "mutant"

    def sample(self, logits, params):
        out = CpuRefBackend.sample(logits, params)
        if params.draft_token_ids is not None:
            has = params.draft_token_ids >= 0
            out.token_ids = np.where(has, params.draft_token_ids, out.token_ids)
            out.logprobs = CpuRefBackend.sample(logits, replace(params, draft_token_ids=None, draft_probs=None,
                                                                temperature=np.zeros_like(params.temperature))).logprobs
            out.accepted = has
        return out


class TakesDraftsAsOneHot(CpuRefBackend):
    name = "mutant"

    def sample(self, logits, params):
        return CpuRefBackend.sample(logits, replace(params, draft_probs=None))


class ForgetsResidualSum(CpuRefBackend):
    name = "mutant"

    def rms_norm(self, x, weight, eps, residual=None):
        if residual is None:
            return CpuRefBackend.rms_norm(x, weight, eps)
        return CpuRefBackend.rms_norm(x + residual, weight, eps), x


class SlightlyOffLinear(CpuRefBackend):
    name = "mutant"

    def linear(self, x, weight):
        return CpuRefBackend.linear(x, weight) * np.float32(1.003)


class CopiesNoBlocks(CpuRefBackend):
    name = "mutant"

    def copy_blocks(self, kv_cache, src, dst):
        pass


class WritesBlocksReversed(CpuRefBackend):
    name = "mutant"

    def write_blocks(self, kv_cache, block_ids, data):
        CpuRefBackend.write_blocks(self, kv_cache, np.asarray(block_ids)[::-1], data)


class ReadsKeysOnly(CpuRefBackend):
    """Round-trips exactly but keeps only K: its rows are half a block's bytes."""
    name = "mutant"

    def read_blocks(self, kv_cache, block_ids):
        return CpuRefBackend.read_blocks(self, kv_cache[:1], block_ids)

    def write_blocks(self, kv_cache, block_ids, data):
        CpuRefBackend.write_blocks(self, kv_cache[:1], block_ids, data)


class ReadsBlocksAsPages(CpuRefBackend):
    """Takes mixed block sizes itself, then reads a block's first page for each of its pages."""
    name = "mutant"
    native_block_sizes = True

    def attention(self, q, kv_cache, meta, *args, **kw):
        k = int(meta.block_sizes.max()) // meta.block_size
        pages = np.repeat(np.asarray(meta.block_table), k, axis=1)
        return CpuRefBackend.attention(q, kv_cache, replace(meta, block_table=pages, block_sizes=None), *args, **kw)


class LoraOneSlice(CpuRefBackend):
    """Applies a fused projection's first slice's rank to all its columns."""
    name = "mutant"

    def lora(self, x, y, lora_a, lora_b, lora_indices, output_slices=None):
        r = lora_b.shape[2]
        return CpuRefBackend.lora(x, y, lora_a[:, :r], lora_b, lora_indices)


class LoraReadsSlotZero(CpuRefBackend):
    """Adds slot 0's weights to the tokens without an adapter."""
    name = "mutant"

    def lora(self, x, y, lora_a, lora_b, lora_indices, output_slices=None):
        out = CpuRefBackend.lora(x, y, lora_a, lora_b, lora_indices, output_slices)
        swapped = np.where(lora_indices == 0, 1, 0)  # slot 0's rows as if they were slot 1's
        a, b = lora_a.copy(), lora_b.copy()
        a[1], b[1] = lora_a[0], lora_b[0]
        return np.where((lora_indices == 0)[:, None], CpuRefBackend.lora(x, y, a, b, swapped, output_slices), out)


class LayerNormWithoutBias(CpuRefBackend):
    name = "mutant"

    def layer_norm(self, x, weight, bias, eps, residual=None):
        return CpuRefBackend.layer_norm(x, weight, None, eps, residual)


class EncoderAttentionAcrossSequences(CpuRefBackend):
    """Treats the flattened batch as one sequence: queries see other sequences' keys."""
    name = "mutant"

    def encoder_attention(self, q, k, v, query_start_loc, scale):
        return CpuRefBackend.encoder_attention(q, k, v, np.array([0, q.shape[0]]), scale)


class MeanPoolsTheBatch(CpuRefBackend):
    """'mean' averages every row of the batch for each sequence."""
    name = "mutant"

    def pool(self, x, query_start_loc, method):
        out = CpuRefBackend.pool(x, query_start_loc, method)
        if method == "mean" and len(x):
            out[:] = x.astype(np.float64).mean(axis=0)
        return out


MUTANTS = [
    (LayerNormWithoutBias, "layer_norm", {"bias_h64", "residual_h64", "offset_h80", "one_token"}),
    (EncoderAttentionAcrossSequences, "encoder_attention", {"three_seqs_gqa", "mha_d64", "sharp_many_seqs"}),
    (MeanPoolsTheBatch, "pool", {"mean_three_seqs"}),
    (NoSlidingWindow, "attention", {"sliding_window8_gqa3_d64", "window_soft_cap_gqa8_d128",
                                    "mixed_block_sizes_window_gqa3_d64"}),
    (ReadsBlocksAsPages, "attention", {"mixed_block_sizes_gqa3_d64", "mixed_block_sizes_decode_gqa8_d128",
                                       "mixed_block_sizes_window_gqa3_d64", "mixed_block_sizes_fp8_gqa3_d64"}),
    (LoraOneSlice, "lora", {"qkv_slices", "gate_up_slices", "prefill_600_tokens", "prefill_runs_of_one_adapter"}),
    (LoraReadsSlotZero, "lora", {"decode_4_slots", "one_slice_rank16", "qkv_slices", "gate_up_slices",
                                 "no_adapter_rows", "prefill_600_tokens", "prefill_runs_of_one_adapter"}),
    (NoSoftCap, "attention", {"soft_cap_gqa3_d64", "window_soft_cap_gqa8_d128"}),
    (IgnoresSinks, "attention", {"sinks_mixed_gqa3_d64", "sinks_window4_gqa8_d64", "sinks_decode_many_blocks_gqa8_d64",
                                 "sinks_one_token_d64"}),
    # sinks_one_token has one query head per KV head: nothing to confuse.
    (SinkPerKvHead, "attention", {"sinks_mixed_gqa3_d64", "sinks_window4_gqa8_d64", "sinks_decode_many_blocks_gqa8_d64"}),
    (UnclampedSwigluOai, "moe", {"bias_swiglu_oai_top2_renorm", "swiglu_oai_one_token",
                                 "mxfp4_bias_swiglu_oai_top4_e16"}),
    (Mxfp4HighNibbleFirst, "linear", {"mxfp4_one_token", "mxfp4_t5_bias", "mxfp4_t40"}),
    (NoDownBias, "moe", {"bias_swiglu_oai_top2_renorm", "bias_silu_top4_e16", "mxfp4_bias_swiglu_oai_top4_e16"}),
    (IgnoresRoutingBias, "moe", {"v3_sigmoid_bias_groups_top4_e16", "v3_one_token_groups_top2"}),
    (ScalesSharedExpertToo, "moe", {"v3_sigmoid_bias_groups_top4_e16", "v2_greedy_scaled_shared"}),
    (IgnoresLatentRopeKey, "mla_attention", {"mixed_h4", "decode_many_blocks_h8", "padding_row", "mixed_block_sizes"}),
    (LatentInOnePlane, "mla_kv_write", {"scattered_r32_p8", "padded_minus1", "r64_p16"}),
    (HighestExpertOnTies, "moe", {"top1_ties_lowest_id", "top2_ties_lowest_id"}),
    (UngatedSharedExpert, "moe", {"shared_gated_top4", "shared_gated_one_token"}),
    (WritesPaddedSlots, "kv_write", {"padded_minus1_slots"}),
    (IgnoresPenalties, "sample", {"penalties", "logprobs", "draft_filters_bitmask"}),
    # Row 0 of the bitmask case is unconstrained and banned its best token by bias.
    (IgnoresLogitBias, "sample", {"logit_bias", "bitmask_bias_penalties_logprobs"}),
    (IgnoresTokenBitmask, "sample", {"bitmask_greedy", "bitmask_one_allowed", "bitmask_filters",
                                     "bitmask_bias_penalties_logprobs", "bitmask_vocab100", "draft_filters_bitmask"}),
    (AcceptsEveryDraft, "sample", {"draft_onehot_greedy", "draft_onehot_sampled", "draft_probs_sampled",
                                   "draft_filters_bitmask"}),
    (TakesDraftsAsOneHot, "sample", {"draft_probs_sampled", "draft_filters_bitmask"}),
    (ForgetsResidualSum, "rms_norm", {"residual_h64", "one_token"}),
    (CopiesNoBlocks, "copy_blocks", {"two_blocks"}),
    (WritesBlocksReversed, "read_write_blocks", {"two_blocks", "swapped_blocks", "fp8_two_blocks"}),
    (ReadsKeysOnly, "read_write_blocks", {"two_blocks", "swapped_blocks", "fp8_two_blocks", "no_blocks"}),
]


@pytest.mark.parametrize("mutant, primitive, broken", MUTANTS, ids=[m.__name__ for m, _, _ in MUTANTS])
def test_suite_fails_exactly_the_cases_a_mutant_breaks(mutant, primitive, broken):
    report = run_conformance(mutant(), primitives=[primitive])
    failed = {r.case.name for r in report.results if r.status == "fail"}
    assert failed == broken, [r.detail for r in report.results if r.status == "fail"]
    assert not report.ok


def test_seeded_sampling_must_match_the_reference_token_for_token():
    report = run_conformance(IgnoresSeed(), primitives=["sample"])
    failed = {r.case.name for r in report.results if r.status == "fail"}
    assert {"temperature", "top_p", "seeded_same_seed_rows"} <= failed
    assert not failed & {"greedy", "greedy_ties_lowest_id", "empty_batch"}
    assert "token_ids" in next(r.detail for r in report.results if r.status == "fail")


def test_tolerance_is_per_dtype():
    report = run_conformance(SlightlyOffLinear(), primitives=["linear"], match="k64_n48")
    status = {r.case.dtype: r.status for r in report.results}
    assert status == {"float32": "fail", "float16": "fail", "bfloat16": "pass"}


def test_results_record_which_backend_provided_the_primitive():
    report = run_conformance("cpu_ref", primitives=["embedding"], dtypes=["float32"])
    assert {r.provider for r in report.results} == {"cpu_ref"}


def test_collectives_are_skipped_with_a_reason_off_the_cpu():
    case = select(all_cases(), ["all_reduce"])[0]
    (res,) = run_collectives(CpuRefBackend(device="cuda:0"), [case])
    assert res.status == "skip" and "gloo processes on the CPU" in res.detail


class SkipsCommunication(CpuRefBackend):
    name = "mutant"

    def all_reduce(self, x, group=None):
        return np.array(x)  # each rank keeps its own part


def test_collectives_run_in_two_processes_and_catch_a_missing_reduction():
    cases = select(all_cases(), ["all_reduce"], ["float32"])
    (res,) = run_collectives(SkipsCommunication(), cases)
    assert res.status == "fail" and "rank 0" in res.detail, res.detail
