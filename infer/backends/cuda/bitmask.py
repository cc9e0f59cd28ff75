"""The structured-output step of `sample`: -inf on every token a row's
`token_bitmask` does not allow (bit ``t % 32`` of word ``t // 32``, least
significant first), one read of the logits and of the mask words."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens per program: 32 words of the mask.
BLOCK = 1024


@triton.jit
def _token_bitmask_kernel(out_ptr, x_ptr, mask_ptr, vocab, num_words, stride_x, stride_m, stride_o,
                          WORDS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    # A [WORDS, 32] tile: each mask word is loaded once and spread over its 32 tokens.
    words = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
    bits = tl.arange(0, 32)
    mask = tl.load(mask_ptr + row * stride_m + words, mask=words < num_words, other=0)
    cols = words[:, None] * 32 + bits[None, :]
    inside = cols < vocab  # bits past V are ignored, as the contract says
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
    keep = ((mask[:, None] >> bits[None, :]) & 1) != 0
    tl.store(out_ptr + row * stride_o + cols, tl.where(keep, x, float("-inf")), mask=inside)


def apply_token_bitmask(x: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """x [B, V] with -inf where `bitmask` [B, ceil(V / 32)] int32 clears the token's bit.

    Returns a new tensor: x may be the caller's logits (`sample` masks them
    directly when no penalty or bias made a copy first)."""
    num_seqs, vocab = x.shape
    out = torch.empty(num_seqs, vocab, dtype=x.dtype, device=x.device)
    if num_seqs and vocab:
        if x.stride(-1) != 1:
            x = x.contiguous()
        if bitmask.stride(-1) != 1:
            bitmask = bitmask.contiguous()
        _token_bitmask_kernel[(num_seqs, triton.cdiv(vocab, BLOCK))](
            out, x, bitmask, vocab, bitmask.shape[1], x.stride(0), bitmask.stride(0), out.stride(0),
            WORDS=BLOCK // 32, num_warps=4)
    return out
