"""Plain records that cross the core/backend boundary.

Arrays in these records are of the owning backend's tensor type (NumPy arrays
for `cpu_ref`, torch tensors for `torch`, ...). The core builds them on the host
as NumPy arrays and hands them to `Backend.prepare_metadata` /
`Backend.prepare_sampling`, which move them to the device once per step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

# Dtype names used everywhere in the contract. NumPy has no bfloat16, so the
# contract names dtypes by string and each backend maps them to its own types.
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def dtype_name(x: Any) -> str:
    """Backend-neutral name of an array's dtype ('float32', 'int64', ...)."""
    name = str(x.dtype)
    return name.removeprefix("torch.")


@dataclass(slots=True)
class Support:
    """Answer to `Backend.supports(...)`: truthy when supported, else a reason."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


class AttentionPlan:
    """Base of a backend's per-step attention plan (tiles, host-side groupings, device copies).

    The backend that serves `attention` builds one in `Backend.prepare_metadata`,
    from the step's host arrays, once per step; every layer's `attention` call
    then receives it as ``meta.plan``. The core never reads it. A backend
    subclasses this with its own fields; its attention may rely on finding its
    own plan there whenever the metadata went through its `prepare_metadata`
    (the runtime and the conformance harness always do that), and on None when
    a caller built the metadata by hand.
    """

    __slots__ = ()


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention metadata, built once per step and shared by every layer.

    The batch is B requests whose scheduled tokens are flattened into T rows.
    Request b owns rows ``query_start_loc[b] : query_start_loc[b+1]``;
    ``q_len[b]`` is that difference. Its context after this step holds
    ``seq_lens[b]`` tokens (cached ones plus this step's), so its i-th query row
    sits at position ``seq_lens[b] - q_len[b] + i`` and attends to every cached
    position ``<=`` its own (within ``sliding_window`` when one is set).

    Fields (vLLM's names):
      query_start_loc  [B+1] int32, cumulative query lengths, starts at 0.
      seq_lens         [B]   int32, context length including this step's tokens.
      block_table      [B, max_blocks] int32, physical block ids of each request's
                       context in order; entries past a request's last block are
                       ignored (pad with 0).
      slot_mapping     [T]   int64, ``block_id * block_size + offset`` where each
                       new token's K/V is written; -1 marks a padded row to skip.
      max_query_len    int, max of q_len (0 for an empty batch).
      max_seq_len      int, max of seq_lens (0 for an empty batch).
      block_size       int, tokens per KV block: the cache's page.
      plan             the attention provider's `AttentionPlan` for this step,
                       or None (see `AttentionPlan`).
      block_sizes      [B] int32 or None. With ``--block-size auto`` requests use
                       blocks of different sizes, each a multiple of `block_size`:
                       request b's block of ``s = block_sizes[b]`` tokens is
                       ``k = s // block_size`` consecutive pages, and its
                       `block_table` row holds block ids in units of its own
                       size (entry e covers pages ``e*k .. e*k + k-1``); position p
                       lives in page ``block_table[b, p // s] * k + (p % s) // block_size``.
                       `slot_mapping` stays in cache slots. None: every request
                       uses `block_size`. Only a provider that declares
                       `native_block_sizes` sees it; the core hands the others the
                       table in pages (`expand_block_table`).
      kv_groups        None, or with a hybrid KV cache (`core/kv_groups.py`) the
                       metadata of every group after the first: the same step
                       with that group's `block_table`, `slot_mapping` and
                       `block_sizes`. The core hands each layer its group's
                       metadata, so a backend never reads this field; it only
                       sees block tables whose entries behind a layer's sliding
                       window read 0 (a page given back, maybe to another
                       request): loaded or not, keys there stay masked like
                       any key outside the window.
    """

    query_start_loc: Any
    seq_lens: Any
    block_table: Any
    slot_mapping: Any
    max_query_len: int
    max_seq_len: int
    block_size: int
    plan: AttentionPlan | None = None
    block_sizes: Any = None
    kv_groups: tuple | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    # Contract v1 called the plan `backend_data`; v1 plugins still read and set it.
    @property
    def backend_data(self) -> Any:
        return self.plan

    @backend_data.setter
    def backend_data(self, value: Any) -> None:
        self.plan = value


def expand_block_table(meta: AttentionMetadata) -> AttentionMetadata:
    """Host metadata with mixed block sizes (`AttentionMetadata.block_sizes`) as one
    table of cache pages: row b's entry e of ``k`` pages becomes entries
    ``e*k .. e*k + k-1``. Metadata without `block_sizes` comes back as is."""
    import numpy as np

    if meta.block_sizes is None:
        return meta
    table = np.asarray(meta.block_table, dtype=np.int64)
    k = np.maximum(np.asarray(meta.block_sizes, dtype=np.int64) // meta.block_size, 1)[:, None]
    # As wide as the longest context's pages (not widest row x most pages): a captured step's table fits.
    col = np.arange(max(1, -(-int(meta.max_seq_len) // meta.block_size)))[None, :]
    entry = np.minimum(col // k, max(table.shape[1] - 1, 0))  # past a row's entries: padding, ignored
    pages = np.take_along_axis(table, entry, axis=1) * k + col % k if table.size else table
    return dataclasses.replace(meta, block_table=pages.astype(np.int32), block_sizes=None)


@dataclass(slots=True)
class SamplingTensors:
    """Per-request sampling parameters of one step, one row per request.

    Order of processing (every backend must follow it):
      1. logprobs are taken from the raw logits (log_softmax in float32), before
         anything below, as vLLM does by default.
      2. penalties on the raw logits: repetition (tokens seen in prompt or output:
         positive logits divided by r, negative multiplied by r), then
         frequency (minus f * count in output) and presence (minus p if seen in
         output); then ``logit_bias`` is added (a repeated id adds up); then
         ``token_bitmask`` (structured outputs) sets every token it does not
         allow to -inf, so no later step and no bias can bring one back.
      3. greedy rows (temperature == 0) take the argmax (lowest id on ties).
      4. other rows: divide by temperature; min_p keeps tokens with
         prob >= min_p * max prob; top_k keeps the k largest logits (ties at the
         k-th value are all kept); top_p keeps, in descending prob order, each
         token whose preceding cumulative prob is < top_p (so at least one).
         Each filter sees the renormalised result of the one before.
      5. the token is argmax(filtered_logits + gumbel) where the Gumbel noise is
         the counter-based function of (seed, step, token id) defined by
         `infer.primitives.noise.gumbel_noise`; the same seed and step
         give the same token on every backend, whatever else is in the batch.
      6. speculative decoding: a row with a drafted token d (``draft_token_ids``
         >= 0) verifies it against the row's distribution p, which is
         softmax(filtered_logits) of step 4 (one-hot at the argmax of step 3 for
         a greedy row), and the drafter's q (``draft_probs``; one-hot at d when
         None, as n-gram drafts are). d is accepted when u * q(d) < p(d), with u
         = `infer.primitives.noise.acceptance_uniforms` of (seed, step): with
         probability min(1, p(d) / q(d)). An accepted row returns d; a rejected
         one returns argmax(log(max(p - q, 0)) + gumbel) with step 5's noise
         (max(p - q, 0) normalised is the residual distribution; log p when it
         is all zero). Whatever q is, the token follows p. A greedy row accepts d
         exactly when d is its argmax and otherwise returns the argmax. Rows
         without a draft are sampled by steps 3-5 as usual.

    Fields:
      temperature        [B] float32, 0 means greedy.
      top_k              [B] int32, <= 0 disables.
      top_p              [B] float32, 1.0 disables.
      min_p              [B] float32, 0.0 disables.
      seeds              [B] int64, per-request seed (the core draws one when the
                         user gives none).
      steps              [B] int64, output tokens the request generated so far.
      presence_penalty   [B] float32, 0 disables.
      frequency_penalty  [B] float32, 0 disables.
      repetition_penalty [B] float32, 1.0 disables.
      prompt_token_ids   [B, Lp] int64 padded with -1, or None when no row uses
                         a repetition penalty.
      output_token_ids   [B, Lo] int64 padded with -1, or None when no row uses
                         a penalty.
      logit_bias_ids     [B, Lb] int64 padded with -1, or None.
      logit_bias_values  [B, Lb] float32 (-inf bans a token), or None.
      token_bitmask      [B, ceil(V / 32)] int32, or None when no row is
                         constrained: bit ``t % 32`` (least significant first)
                         of word ``t // 32`` set allows token ``t`` (xgrammar's
                         and llguidance's layout). An unconstrained row is all
                         ones; bits past V are ignored. The core guarantees a
                         row allows at least one token.
      max_num_logprobs   int, how many top logprobs to return per row (0: none).
      draft_token_ids    [B] int64, the drafted token each row verifies (-1: none),
                         or None when no row has one (step 6).
      draft_probs        [B, V] float32, the drafter's distribution per row, or
                         None: one-hot at the drafted token (n-gram drafts).
      host               the same parameters as host NumPy arrays, or None. Set
                         by `prepare_sampling` when it moves them to a device, so
                         a backend can take its per-batch decisions (any greedy
                         row? the largest top_k?) on the host instead of reading
                         device memory back (each read a blocking sync).
    """

    temperature: Any
    top_k: Any
    top_p: Any
    min_p: Any
    seeds: Any
    steps: Any
    presence_penalty: Any
    frequency_penalty: Any
    repetition_penalty: Any
    prompt_token_ids: Any = None
    output_token_ids: Any = None
    logit_bias_ids: Any = None
    logit_bias_values: Any = None
    token_bitmask: Any = None
    max_num_logprobs: int = 0
    draft_token_ids: Any = None
    draft_probs: Any = None
    host: SamplingTensors | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.temperature.shape[0])


@dataclass(slots=True)
class SampleOutput:
    """Result of `sample`: arrays of the backend's type.

      token_ids      [B] int64, the sampled tokens.
      logprobs       [B] float32, raw logprob of each sampled token.
      top_token_ids  [B, K] int64 with K = max_num_logprobs (descending logprob,
                     lowest id first on ties), or None when K == 0.
      top_logprobs   [B, K] float32, or None.
      ranks          [B] int64 when K > 0, else None: 1-based rank of each
                     sampled token among the raw logprobs (1 + how many
                     tokens have a strictly higher one), as vLLM reports it.
      accepted       [B] bool when `draft_token_ids` was given, else None:
                     the row's drafted token was accepted (False for rows
                     without one).
    """

    token_ids: Any
    logprobs: Any
    top_token_ids: Any = None
    top_logprobs: Any = None
    ranks: Any = None
    accepted: Any = None


class WeightHandle(ABC):
    """A typed handle to a linear layer's weight.

    `kind` names the storage format; `linear` dispatches on it and a backend
    declares which kinds it supports through ``supports("linear", weight_kind=...)``.
    v1 defines ``dense``; quantized kinds (int4 group-quantized as in AWQ/GPTQ/
    GGUF Q4, fp8 with per-channel scales) are further subclasses with their own
    fields and the same two properties.
    """

    kind: ClassVar[str] = ""

    @property
    @abstractmethod
    def out_features(self) -> int: ...

    @property
    @abstractmethod
    def in_features(self) -> int: ...


@dataclass(slots=True)
class DenseWeight(WeightHandle):
    """A dense weight ``[N, K]`` (out_features, in_features) and optional bias ``[N]``.

    ``prepared`` is a backend's private re-layout of ``weight`` (made once by
    `Backend.prepare_weight`, e.g. a transposed copy); the core never reads it.
    """

    kind: ClassVar[str] = "dense"
    weight: Any
    bias: Any = None
    prepared: Any = field(default=None, repr=False)

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])


# Quantized handles. Their arrays are the owning backend's tensors (NumPy on
# the host and in `cpu_ref`); `infer.backends.cpu_ref.quant` is their spec in
# code. ``dtype`` names the float dtype the model computes in: the dtype of
# `linear`'s result and of rows an `embedding` gathers from a quantized table.
# Scales stay float32 whatever ``dtype`` is, so the stored weight is exact.


class _QuantizedWeight(WeightHandle):
    """A quantized handle whose ``qweight`` holds one row per output feature, one value per input."""

    __slots__ = ()

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1])


@dataclass(slots=True)
class Int4GroupWeight(_QuantizedWeight):
    """4-bit weight ``[N, K]`` in groups of ``group_size`` along K:
    ``w[n, k] = q[n, k] * scales[n, k // G] + offsets[n, k // G]`` with q in 0..15.

    One affine form covers every published int4 format: AWQ/GPTQ's
    ``(q - zero) * scale`` (offset = -zero * scale) and GGUF's Q4_0
    ``d * (q - 8)`` and Q4_1 ``d * q + m``.

      qweight  [N, K/2] uint8: q[n, 2j] in the low nibble of byte j, q[n, 2j+1] in the high.
      scales   [N, K/G] float32.   offsets [N, K/G] float32.
    """

    kind: ClassVar[str] = "int4_group"
    qweight: Any
    scales: Any
    offsets: Any
    group_size: int
    bias: Any = None
    dtype: str = "float32"
    prepared: Any = field(default=None, repr=False)

    @property
    def in_features(self) -> int:  # two values per byte
        return 2 * int(self.qweight.shape[1])


@dataclass(slots=True)
class Int8GroupWeight(_QuantizedWeight):
    """8-bit weight ``[N, K]``: ``w[n, k] = q[n, k] * scales[n, k // G] (+ offsets[n, k // G])``.

    Symmetric without offsets (GGUF Q8_0, Q5_0, Q6_K, Q3_K, IQ4_NL, IQ4_XS,
    MXFP4's doubled E2M1 codes, compressed-tensors' int8 and 5..8-bit weights),
    affine with them (Q5_1's ``d * q + m``, Q5_K's sub-block mins).

      qweight  [N, K] int8.   scales [N, K/G] float32.   offsets None or [N, K/G] float32.

    ``act_quant`` (None: weight-only) quantizes `linear`'s input as well, as
    W8A8 checkpoints were calibrated: ``"int8_token"`` is dynamic symmetric
    int8 per token row, `infer.primitives.act_quant` (``y = fq(x) @ w.T``,
    with ``fq(x) = round_half_even(x / s) * s``, ``s = max|x| / 127`` per row).
    It is part of the dispatch key (``supports("linear", act_quant=...)``):
    a backend that does not declare it in `Backend.act_quants` is not asked.
    """

    kind: ClassVar[str] = "int8_group"
    qweight: Any
    scales: Any
    group_size: int
    bias: Any = None
    dtype: str = "float32"
    prepared: Any = field(default=None, repr=False)
    offsets: Any = None  # last, so positional construction (q, scales, G, bias, dtype) keeps its meaning
    act_quant: str | None = None  # after offsets, for the same reason


@dataclass(slots=True)
class Fp8Weight(_QuantizedWeight):
    """fp8 e4m3 (the ``fn`` variant: max 448, no infinities) weight ``[N, K]``:
    ``w[n, k] = e4m3(qweight[n, k]) * scales[n]`` (per channel) or ``* scales[0]`` (per tensor).

      qweight  [N, K] uint8 holding e4m3fn bit patterns (NumPy has no fp8;
               a torch backend may view them as torch.float8_e4m3fn).
      scales   [N] or [1] float32.
    """

    kind: ClassVar[str] = "fp8"
    qweight: Any
    scales: Any
    bias: Any = None
    dtype: str = "float32"
    prepared: Any = field(default=None, repr=False)


@dataclass(slots=True)
class Mxfp4Weight(_QuantizedWeight):
    """OCP microscaling FP4 weight ``[..., N, K]`` (gpt-oss's experts, GGUF MXFP4):
    ``w[n, k] = e2m1(q[n, k]) * 2 ** (scales[n, k // 32] - 127)``, blocks of 32 along K.

      qweight  [..., N, K/2] uint8: E2M1 codes (sign bit 3, then 2 exponent bits and 1
               mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives,
               `MXFP4_VALUES`), q[n, 2j] in the low nibble of byte j, q[n, 2j+1] in the high.
      scales   [..., N, K/32] uint8: E8M0 biased exponents (255 is NaN).

    Leading axes stack matrices: `moe` takes ``w13`` [E, 2I, H] and ``w2`` [E, H, I] in
    this form (``supports("moe", expert_weight_kind="mxfp4")``), 4.25 bits per value as
    the checkpoints store them.
    """

    kind: ClassVar[str] = "mxfp4"
    qweight: Any
    scales: Any
    bias: Any = None
    dtype: str = "float32"
    prepared: Any = field(default=None, repr=False)
    group_size: ClassVar[int] = 32

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[-2])

    @property
    def in_features(self) -> int:  # two values per byte
        return 2 * int(self.qweight.shape[-1])


# The E2M1 value of each 4-bit code (OCP MX spec, table of FP4 E2M1).
MXFP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

QUANTIZED_KINDS = (Int4GroupWeight.kind, Int8GroupWeight.kind, Fp8Weight.kind, Mxfp4Weight.kind)
# Kinds `moe` may take its expert weights in (besides dense arrays), `Backend.expert_weight_kinds`.
EXPERT_WEIGHT_KINDS = (Mxfp4Weight.kind,)
# Activation quantizations a weight may ask of `linear` (`Int8GroupWeight.act_quant`).
ACT_QUANTS = ("int8_token",)


def round_to_dtype(x, dtype: str):
    """Float32 NumPy copy of `x` with values rounded to `dtype` (nearest-even).

    NumPy has no bfloat16; this is how host code and `cpu_ref` represent
    fp16/bf16 values exactly in float32 storage.
    """
    import numpy as np

    x = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        return x.copy()
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        bits = x.view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.astype(np.uint32).view(np.float32)
    raise ValueError(f"unknown float dtype {dtype!r}; expected one of {FLOAT_DTYPES}")
