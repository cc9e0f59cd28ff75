"""The conformance cases: which edge cases each primitive is checked on, and
their host inputs.

A `Case` is a name and a few shape parameters; `Case.inputs()` turns it into
NumPy arrays from a seed fixed by the case name, so every run, every backend
and every dtype of a case sees the same values (float inputs pre-rounded to the
case dtype, so the backend under test and the float32 oracle start from the
exact same numbers). Shapes are tiny on purpose: the suite must stay quick
under the Triton interpreter.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from ..primitives.spec import PRIMITIVES
from ..primitives.types import FLOAT_DTYPES
from . import inputs as make

SHORT_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
COLLECTIVES = ("all_reduce", "all_gather")
# The primitives plus the cache plumbing the core relies on whose correctness
# depends on the backend's KV layout: block copies on the device, and whole
# blocks read to host bytes and written back (read_blocks / write_blocks).
CHECKED = (*PRIMITIVES, "copy_blocks", "read_write_blocks")


@dataclass(frozen=True)
class Case:
    primitive: str
    name: str
    dtype: str
    params: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def id(self) -> str:
        return f"{self.primitive}-{self.name}-{SHORT_DTYPE[self.dtype]}"

    @property
    def seed(self) -> int:
        # Independent of dtype (same values, rounded differently) and of the
        # case list (adding a case never changes another's inputs).
        return zlib.crc32(f"{self.primitive}-{self.name}".encode())

    def inputs(self) -> dict[str, Any]:
        rng = np.random.default_rng(self.seed)
        return make.BUILDERS[self.primitive](rng, self.dtype, **self.params)

    def __str__(self) -> str:
        return self.id


def _each_dtype(primitive: str, specs: Iterable[tuple[str, dict]], dtypes=FLOAT_DTYPES) -> list[Case]:
    return [Case(primitive, name, dt, params) for name, params in specs for dt in dtypes]


def _attention_specs(block_size: int) -> list[tuple[str, dict]]:
    # (q_len, seq_len) per request: seq_len counts cached tokens plus this step's.
    mixed = [(5, 21), (1, 16), (7, 7), (1, 33)]
    specs = [
        ("decode_ctx15_16_17_gqa1_d64", dict(reqs=[(1, 15), (1, 16), (1, 17)], hq=2, d=64)),
        ("prefill_ctx15_16_17_gqa1_d64", dict(reqs=[(15, 15), (16, 16), (17, 17)], hq=2, d=64)),
        ("prefill_only_gqa3_d64", dict(reqs=[(9, 9), (4, 4)], hq=6, d=64)),
        ("decode_only_gqa8_d128", dict(reqs=[(1, 9), (1, 40), (1, 3)], hq=16, d=128)),
        ("mixed_gqa1_d80", dict(reqs=mixed, hq=2, d=80)),
        ("mixed_gqa3_d64", dict(reqs=mixed, hq=6, d=64)),
        ("mixed_gqa8_d128", dict(reqs=mixed, hq=16, d=128)),
        ("mixed_mqa_d64", dict(reqs=mixed, hq=4, hk=1, d=64)),
        ("one_token", dict(reqs=[(1, 1)], hq=2, d=64)),
        # Padding rows of a captured decode step: seq_len 0, nothing to read, zero output.
        ("decode_padding_rows_gqa3_d64", dict(reqs=[(1, 20), (1, 0), (1, 5), (1, 0), (1, 0)], hq=6, d=64)),
        ("empty_batch", dict(reqs=[], hq=2, d=64)),
        ("many_blocks_gqa3_d64", dict(reqs=[(1, 150), (16, 130)], hq=6, d=64)),
        ("sliding_window8_gqa3_d64", dict(reqs=mixed, hq=6, d=64, sliding_window=8)),
        ("soft_cap_gqa3_d64", dict(reqs=mixed, hq=6, d=64, soft_cap=5.0, q_scale=4.0)),
        ("window_soft_cap_gqa8_d128", dict(reqs=mixed, hq=16, d=128, sliding_window=5, soft_cap=3.0, q_scale=3.0)),
        # gpt-oss's attention sinks: a per-head logit in every softmax denominator.
        ("sinks_mixed_gqa3_d64", dict(reqs=mixed, hq=6, d=64, sinks=2.0)),
        ("sinks_window4_gqa8_d64", dict(reqs=mixed, hq=16, d=64, sliding_window=4, sinks=3.0, q_scale=2.0)),
        ("sinks_decode_many_blocks_gqa8_d64", dict(reqs=[(1, 150), (1, 3), (1, 0)], hq=16, d=64, sinks=2.0)),
        ("sinks_one_token_d64", dict(reqs=[(1, 1)], hq=2, d=64, sinks=1.0)),
        # fp8 (e4m3) caches: K and V stored as codes of value / scale.
        ("fp8_kv_mixed_gqa3_d64", dict(reqs=mixed, hq=6, d=64, kv_scales=(0.5, 2.0))),
        ("fp8_kv_decode_gqa8_d128", dict(reqs=[(1, 9), (1, 40), (1, 3)], hq=16, d=128, kv_scales=(0.25, 1.0))),
    ]
    # Mixed block sizes in one batch (--block-size auto): blocks of 1, 2 and 4 pages.
    long_mixed = [(5, 70), (1, 33), (9, 9), (1, 130), (17, 64)]
    specs += [
        ("mixed_block_sizes_gqa3_d64", dict(reqs=long_mixed, hq=6, d=64, pages=[4, 1, 2, 4, 2])),
        ("mixed_block_sizes_decode_gqa8_d128", dict(reqs=[(1, 65), (1, 16), (1, 100)], hq=16, d=128,
                                                    pages=[2, 1, 4])),
        ("mixed_block_sizes_window_gqa3_d64", dict(reqs=long_mixed, hq=6, d=64, pages=[2, 4, 1, 4, 1],
                                                   sliding_window=20)),
        ("mixed_block_sizes_fp8_gqa3_d64", dict(reqs=long_mixed, hq=6, d=64, pages=[4, 2, 1, 2, 4],
                                                kv_scales=(0.5, 2.0))),
    ]
    if block_size != 16:
        b = block_size
        reqs = [(1, b - 1), (1, b), (1, b + 1), (3, b + 2)]
        specs.append((f"ctx_bs{b}_boundary_gqa3_d64", dict(reqs=reqs, hq=6, d=64, block_size=b)))
    return specs


def _kv_write_specs(block_size: int) -> list[tuple[str, dict]]:
    specs = [
        ("contiguous_across_block", dict(t=20, slots="contiguous")),
        ("scattered_d64", dict(t=12, slots="scattered")),
        ("scattered_d80", dict(t=12, slots="scattered", d=80)),
        ("scattered_d128_hk8", dict(t=12, slots="scattered", d=128, hk=8)),
        ("padded_minus1_slots", dict(t=12, slots="padded")),
        ("one_token", dict(t=1, slots="scattered")),
        ("empty_batch", dict(t=0, slots="scattered")),
        ("fp8_scattered", dict(t=12, slots="scattered", kv_scales=(0.5, 2.0))),
        ("fp8_padded_minus1_slots", dict(t=12, slots="padded", kv_scales=(1.0, 0.25))),
    ]
    if block_size != 16:
        specs.append((f"contiguous_bs{block_size}", dict(t=20, slots="contiguous", block_size=block_size)))
    return specs


_SAMPLE_SPECS = [
    ("greedy", dict(temperature=0.0)),
    ("greedy_ties_lowest_id", dict(temperature=0.0, ties=2)),
    ("temperature", dict(temperature=[0.5, 1.0, 1.5, 0.8])),
    ("mixed_greedy_and_random", dict(temperature=[0.0, 1.0, 0.0, 0.7])),
    ("top_k", dict(temperature=1.0, top_k=[1, 3, 10, 0])),
    # Three ids tie for the top and k=2: all three stay candidates (8 rows so a
    # filter that drops one is very likely to be caught by some row's noise).
    ("top_k_ties_all_kept", dict(b=8, temperature=1.0, top_k=2, ties=3)),
    ("top_k_ties_all_kept_temperature", dict(b=8, temperature=[0.6, 1.7] * 4, top_k=3, ties=4)),
    ("top_p", dict(temperature=1.0, top_p=[0.1, 0.5, 0.9, 1.0])),
    # Exact boundaries: top_k 4 leaves the 4 ties, renormalised to exactly 1/4
    # each, so top_p 0.5 sits on a cumulative sum (keeps 2: preceding mass < top_p).
    ("top_p_ties_exact_boundary", dict(b=8, temperature=0.7, top_k=4, top_p=0.5, ties=4)),
    ("top_p_ties_each_boundary", dict(b=8, temperature=1.3, top_k=4, ties=4,
                                      top_p=[0.25, 0.5, 0.75, 0.25, 0.5, 0.75, 1.0, 0.5])),
    ("min_p", dict(temperature=1.0, min_p=[0.05, 0.2, 0.5, 0.0])),
    # min_p 1 keeps exactly the tokens tied with the maximum (prob >= max prob).
    ("min_p_one_keeps_ties", dict(b=8, temperature=0.6, min_p=1.0, ties=3)),
    # The top logit is 2 above the runner-up: after temperature 2 (or 1.5) the
    # runner-up's ratio is e^-1 (e^-1.33), kept by min_p 0.25; before, e^-2 is not.
    ("min_p_after_temperature", dict(b=8, temperature=[2.0, 1.5] * 4, min_p=0.25, ties=1)),
    ("top_k_top_p_min_p", dict(temperature=0.9, top_k=[5, 20, 0, 8], top_p=[0.8, 0.6, 0.95, 1.0], min_p=[0.1, 0.0, 0.05, 0.2])),
    ("penalties", dict(temperature=[0.0, 0.0, 0.0, 0.8], penalties=True)),
    ("logit_bias", dict(temperature=[0.0, 1.0, 0.0, 0.8], logit_bias=True)),
    ("seeded_same_seed_rows", dict(temperature=1.0, same_seed=True)),
    ("logprobs", dict(temperature=[0.0, 1.0, 0.7, 0.0], logprobs=5, penalties=True)),
    ("one_request", dict(b=1, temperature=1.0, logprobs=2)),
    ("empty_batch", dict(b=0, temperature=1.0)),
    # Structured outputs: a bitmask under every other setting; row 0 unconstrained.
    ("bitmask_greedy", dict(temperature=0.0, bitmask=True)),
    ("bitmask_one_allowed", dict(b=8, temperature=[0.0, 1.0, 0.5, 2.0] * 2, top_k=[0, 3] * 4, bitmask="one")),
    ("bitmask_filters", dict(b=8, temperature=[0.7, 1.0, 1.3, 0.9] * 2, top_k=[0, 5, 0, 3] * 2,
                             top_p=[1.0, 0.9, 0.5, 1.0] * 2, min_p=[0.1, 0.0, 0.0, 0.05] * 2, bitmask=True)),
    ("bitmask_bias_penalties_logprobs", dict(temperature=[0.0, 0.8, 0.0, 1.0], bitmask=True, logit_bias=True,
                                             penalties=True, logprobs=3)),
    ("bitmask_vocab100", dict(v=100, temperature=[0.0, 1.0, 0.0, 0.6], bitmask=True)),
    # Speculative decoding (step 6): n-gram drafts (q one-hot) and a draft model's q.
    ("draft_onehot_greedy", dict(b=6, temperature=0.0, drafts="onehot")),
    ("draft_onehot_sampled", dict(b=9, temperature=[0.7, 1.0, 1.5], drafts="onehot")),
    ("draft_probs_sampled", dict(b=9, temperature=[0.0, 1.0, 0.8], drafts="probs", logprobs=2)),
    ("draft_filters_bitmask", dict(b=12, temperature=[0.9, 1.2, 0.0, 1.0] * 3, top_k=[0, 5] * 6,
                                   top_p=[1.0, 0.8, 1.0, 0.9] * 3, bitmask=True, penalties=True, drafts="probs")),
    ("vocab1000", dict(v=1000, temperature=[0.0, 1.0, 0.6, 1.2], top_k=[0, 50, 0, 10], top_p=[1.0, 0.9, 0.7, 1.0])),
]


# Quantized weights (GGUF's block types, AWQ, GPTQ, fp8): 1, a few and many
# rows, since backends switch kernels with the row count; N=40 is not a
# multiple of 16, which packed int4 kernels need.
_QUANT_LINEAR_SPECS = [
    *[(f"{q}_{name}", dict(spec, quant=q)) for q in ("int4", "int8", "int8_offset", "fp8") for name, spec in (
        ("one_token", dict(t=1, k=64, n=48)), ("t5_bias", dict(t=5, k=64, n=48, bias=True)),
        ("t40", dict(t=40, k=96, n=32)), ("empty_batch", dict(t=0, k=64, n=48)))],
    ("int4_g128_k256_n48", dict(t=3, k=256, n=48, quant="int4", group=128)),
    ("int4_g64_n40", dict(t=2, k=128, n=40, quant="int4", group=64)),
    ("int8_g64_t3", dict(t=3, k=128, n=48, quant="int8", group=64)),
    # Groups of 16 (GGUF Q6_K, Q3_K): under some kernels' minimum group.
    ("int8_g16_t1", dict(t=1, k=64, n=48, quant="int8", group=16)),
    ("int8_g16_t40_bias", dict(t=40, k=96, n=32, quant="int8", group=16, bias=True)),
    ("int8_offset_g16_t3", dict(t=3, k=64, n=40, quant="int8_offset", group=16)),
    ("fp8_per_tensor", dict(t=5, k=64, n=48, quant="fp8_tensor", bias=True)),
    # MXFP4 (gpt-oss, GGUF MXFP4): E2M1 codes, a power of two per 32 (subnormal 2^-127 included).
    *[(f"mxfp4_{name}", dict(spec, quant="mxfp4")) for name, spec in (
        ("one_token", dict(t=1, k=64, n=48)), ("t5_bias", dict(t=5, k=128, n=40, bias=True)),
        ("t40", dict(t=40, k=96, n=32)), ("empty_batch", dict(t=0, k=64, n=48)))],
    # W8A8: int8 per-channel weights, x quantized per token (act_quant); an all-zero row's scale is 1.
    *[(f"int8_token_{name}", dict(spec, quant="int8_token")) for name, spec in (
        ("one_token", dict(t=1, k=64, n=48)), ("t5_bias", dict(t=5, k=64, n=48, bias=True)),
        ("t40", dict(t=40, k=96, n=32)), ("empty_batch", dict(t=0, k=64, n=48)),
        ("zero_row_t7_n40", dict(t=7, k=128, n=40, zero_row=True)))],
]


def all_cases(block_size: int = 16) -> list[Case]:
    """Every case, for a backend whose preferred KV block size is `block_size`."""
    cases: list[Case] = []
    cases += _each_dtype("embedding", [
        ("tokens7", dict(t=7)), ("ids_int32", dict(t=7, id_dtype="int32")),
        ("one_token", dict(t=1)), ("empty_batch", dict(t=0)),
        ("int8_table", dict(t=7, quant="int8")), ("int4_table", dict(t=7, quant="int4")),
        ("int8_offset_table", dict(t=7, quant="int8_offset")),
        ("fp8_table", dict(t=7, quant="fp8")),
    ])
    cases += _each_dtype("rms_norm", [
        ("h64", dict(t=5, h=64)), ("residual_h64", dict(t=5, h=64, residual=True)),
        ("large_values_h80", dict(t=3, h=80, scale=40.0)), ("one_token", dict(t=1, h=64, residual=True)),
        ("empty_batch", dict(t=0, h=64, residual=True)),
    ])
    cases += _each_dtype("layer_norm", [
        ("bias_h64", dict(t=5, h=64)), ("residual_h64", dict(t=5, h=64, residual=True)),
        ("no_bias_h48", dict(t=4, h=48, bias=False)),
        # A large common offset: a one-pass E[x^2] - E[x]^2 variance loses it.
        ("offset_h80", dict(t=3, h=80, shift=20.0)), ("one_token", dict(t=1, h=64, residual=True)),
        ("empty_batch", dict(t=0, h=64, residual=True)),
    ])
    cases += _each_dtype("activation", [
        ("gelu", dict(kind="gelu")), ("gelu_tanh", dict(kind="gelu_tanh")), ("silu", dict(kind="silu")),
        ("relu", dict(kind="relu")), ("tanh", dict(kind="tanh")), ("quick_gelu", dict(kind="quick_gelu")),
        ("one_token", dict(t=1, kind="gelu")),
        ("empty_batch", dict(t=0, kind="gelu")),
    ])
    cases += _each_dtype("encoder_attention", [
        ("three_seqs_gqa", dict(lens=[5, 1, 9])), ("mha_d64", dict(lens=[7, 3], hq=2, hk=2, d=64)),
        ("mqa_one_seq", dict(lens=[12], hq=4, hk=1)), ("one_token", dict(lens=[1])),
        # Sharp scores: a query that leaks into another sequence's keys shows.
        ("sharp_many_seqs", dict(lens=[2, 17, 4, 1, 6], q_scale=3.0)), ("empty_batch", dict(lens=[])),
    ])
    cases += _each_dtype("pool", [
        (f"{m}_three_seqs", dict(lens=[4, 1, 6], method=m)) for m in ("cls", "last", "mean", "max", "all")
    ] + [("mean_one_seq", dict(lens=[9], method="mean")), ("last_one_token", dict(lens=[1], method="last")),
         ("mean_empty_batch", dict(lens=[], method="mean"))])
    cases += _each_dtype("linear", [
        ("k64_n48", dict(t=5, k=64, n=48)), ("bias_k80_n40", dict(t=5, k=80, n=40, bias=True)),
        ("one_token", dict(t=1, k=64, n=48, bias=True)), ("empty_batch", dict(t=0, k=64, n=48)),
    ])
    cases += _each_dtype("linear", _QUANT_LINEAR_SPECS)
    cases += _each_dtype("rotary", [
        ("neox_d64", dict(d=64, neox=True)), ("gptj_d64", dict(d=64, neox=False)),
        ("neox_d80", dict(d=80, neox=True)), ("neox_partial_d128_r64", dict(d=128, rot=64, neox=True)),
        ("gptj_partial_d64_r32", dict(d=64, rot=32, neox=False)),
        ("one_token", dict(t=1, d=64, neox=True)), ("empty_batch", dict(t=0, d=64, neox=True)),
    ])
    cases += _each_dtype("act_and_mul", [
        ("silu", dict(kind="silu")), ("gelu", dict(kind="gelu")), ("gelu_tanh", dict(kind="gelu_tanh")),
        ("one_token", dict(t=1, kind="silu")), ("empty_batch", dict(t=0, kind="silu")),
    ])
    cases += _each_dtype("kv_write", _kv_write_specs(block_size))
    cases += _each_dtype("attention", _attention_specs(block_size))
    cases += _each_dtype("copy_blocks", [("two_blocks", dict(src=[1, 3], dst=[4, 0])), ("no_blocks", dict(src=[], dst=[]))])
    cases += _each_dtype("read_write_blocks", [
        ("two_blocks", dict(src=[1, 3], dst=[4, 0])),
        # Read completes before the write: a swap through the host needs no scratch block.
        ("swapped_blocks", dict(src=[1, 3], dst=[3, 1])),
        ("fp8_two_blocks", dict(src=[2, 0], dst=[1, 4], kv_scales=(0.5, 2.0))),
        ("no_blocks", dict(src=[], dst=[])),
    ])
    cases += _each_dtype("moe", [
        ("top1_renorm", dict(top_k=1, renormalize=True)), ("top1", dict(top_k=1, renormalize=False)),
        ("top2_renorm", dict(top_k=2, renormalize=True)), ("top2", dict(top_k=2, renormalize=False)),
        ("top1_ties_lowest_id", dict(top_k=1, renormalize=False, ties=2)),
        ("top2_ties_lowest_id", dict(top_k=2, renormalize=True, ties=3)),
        ("one_token", dict(t=1, top_k=2, renormalize=True)), ("empty_batch", dict(t=0, top_k=2, renormalize=True)),
        ("top4_e16", dict(top_k=4, e=16, renormalize=True)), ("top2_e4", dict(top_k=2, e=4, renormalize=False)),
        ("top1_e16_empty_experts", dict(t=3, top_k=1, e=16, renormalize=False)),
        ("top1_all_to_one_expert", dict(top_k=1, renormalize=True, hot_expert=5)),
        # MXFP4 expert stacks (gpt-oss): plain, gpt-oss's biased clamped form, decode, all tokens to one expert.
        ("mxfp4_top2_renorm", dict(top_k=2, renormalize=True, h=64, i=32, quant="mxfp4")),
        ("mxfp4_bias_swiglu_oai_top4_e16", dict(top_k=4, e=16, renormalize=True, h=32, i=64, quant="mxfp4",
                                                bias=True, activation="swiglu_oai", limit=0.75)),
        ("mxfp4_one_token", dict(t=1, top_k=2, renormalize=True, h=32, i=32, quant="mxfp4")),
        ("mxfp4_all_to_one_expert", dict(top_k=1, renormalize=True, h=32, i=32, quant="mxfp4", hot_expert=3)),
        ("mxfp4_empty_batch", dict(t=0, top_k=2, renormalize=True, h=32, i=32, quant="mxfp4")),
        ("top2_all_to_one_expert_e4", dict(top_k=2, e=4, renormalize=True, hot_expert=0)),
        ("top4_one_token_e8", dict(t=1, top_k=4, renormalize=False)),
        ("shared_gated_top4", dict(top_k=4, renormalize=False, shared="gated")),
        ("shared_plain_top2", dict(top_k=2, renormalize=True, shared="plain")),
        ("shared_gated_one_token", dict(t=1, top_k=2, renormalize=False, shared="gated")),
        # gpt-oss: biased experts, clamped SwiGLU (a limit low enough that the clamp bites: `UnclampedSwigluOai`).
        ("bias_swiglu_oai_top2_renorm", dict(top_k=2, renormalize=True, bias=True, activation="swiglu_oai",
                                             w_scale=1.5, limit=0.75)),
        ("bias_silu_top4_e16", dict(top_k=4, e=16, renormalize=True, bias=True)),
        ("swiglu_oai_one_token", dict(t=1, top_k=4, renormalize=True, activation="swiglu_oai", w_scale=1.5, limit=1.0)),
        # DeepSeek's routing: V3's sigmoid scores, selection bias and groups led by their two best experts;
        # V2's groups led by their best; a routed-sum scale (shared experts unscaled).
        ("v3_sigmoid_bias_groups_top4_e16", dict(top_k=4, e=16, renormalize=True, shared="plain", routing=dict(
            scoring_func="sigmoid", bias=0.3, expert_groups=(4, 2, "top2"), routed_scaling_factor=2.5))),
        ("v3_one_token_groups_top2", dict(t=1, top_k=2, renormalize=True, routing=dict(
            scoring_func="sigmoid", bias=0.3, expert_groups=(4, 1, "top2")))),
        ("v2_group_max_top2_scaled", dict(top_k=2, renormalize=False, routing=dict(
            expert_groups=(4, 2, "max"), routed_scaling_factor=1.5))),
        ("v2_greedy_scaled_shared", dict(top_k=2, renormalize=False, shared="plain",
                                         routing=dict(routed_scaling_factor=2.0))),
    ])
    # DeepSeek's latent attention: prefill chunks, decodes over many blocks, a padding row,
    # mixed block sizes.
    cases += _each_dtype("mla_kv_write", [("scattered_r32_p8", dict(t=12)), ("padded_minus1", dict(t=12, padded=True)),
                                          ("r64_p16", dict(t=7, r=64, p=16)), ("empty_batch", dict(t=0))])
    cases += _each_dtype("mla_attention", [
        ("mixed_h4", dict(reqs=[(5, 5), (3, 20), (1, 40)], h=4)),
        ("decode_many_blocks_h8", dict(reqs=[(1, 70), (1, 3)], h=8, r=64, p=16, nope=32, v=24)),
        ("padding_row", dict(reqs=[(1, 9), (1, 0)], h=2)),
        ("mixed_block_sizes", dict(reqs=[(4, 30), (1, 50)], h=4, pages=[2, 1])),
        ("one_token", dict(reqs=[(1, 1)], h=2)),
    ])
    cases += _each_dtype("lora", [
        ("decode_4_slots", dict(t=7)), ("one_slice_rank16", dict(t=9, rank=16, k=64, slices=(24,))),
        ("qkv_slices", dict(t=11, slices=(32, 16, 16))), ("gate_up_slices", dict(t=6, slices=(40, 40))),
        ("no_adapter_rows", dict(t=5, indices="none")), ("one_adapter_every_row", dict(t=8, indices="same")),
        ("one_token", dict(t=1, indices="same")), ("empty_batch", dict(t=0)),
        # Enough tokens for a backend's prefill form (grouped by slot) rather than its decode form.
        ("prefill_600_tokens", dict(t=600, slices=(24, 8, 8), k=32)),
        ("prefill_runs_of_one_adapter", dict(t=300, slices=(24, 8, 8), k=32, indices="runs")),
    ])
    # Logits are float32 by contract, so sampling has float32 cases only.
    cases += _each_dtype("sample", _SAMPLE_SPECS, dtypes=("float32",))
    cases += _each_dtype("all_reduce", [("sum_2ranks", dict())])
    cases += _each_dtype("all_gather", [("dim0_2ranks", dict(dim=0))])
    cases += _each_dtype("all_gather", [("dim_last_2ranks", dict(dim=-1))], dtypes=("float32",))
    assert {c.primitive for c in cases} == set(CHECKED), "every primitive needs cases"
    return cases


def select(cases: Iterable[Case], primitives: Iterable[str] | None = None, dtypes: Iterable[str] | None = None,
           match: str | None = None) -> list[Case]:
    """The cases of the given primitives and dtypes whose id contains `match`."""
    prims = set(primitives) if primitives else None
    dts = set(dtypes) if dtypes else None
    return [
        c for c in cases
        if (prims is None or c.primitive in prims) and (dts is None or c.dtype in dts)
        and (not match or match in c.id)
    ]
