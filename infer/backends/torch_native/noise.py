"""The contract's seeded Gumbel noise (`infer.primitives.noise`) in torch.

The integer hash must match bit for bit. torch has no usable uint32, so 32-bit
values live in int64 and each 32x32-bit product is split into 16-bit halves:
every partial product stays below 2**49, far from int64 overflow. The float
steps follow the reference op for op in float64, so the noise matches too.

A full [B, V] grid is hashed in cache-sized tiles with in-place ops: the hash
is ~20 elementwise passes, and on a CPU fresh [B, V] int64 temporaries for each
made it many times slower (allocation and memory traffic, not arithmetic;
docs/backends/torch-measurements.md).
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
_TILE = 1 << 17  # elements per tile (1 MiB int64 buffers): measured fastest on a 2-core EPYC


def _mul32_(x: torch.Tensor, c: int, tmp: torch.Tensor) -> None:
    """``x = x * c mod 2**32`` in place, for x in [0, 2**32) and a 32-bit constant c."""
    torch.mul(x, c >> 16, out=tmp)
    tmp.bitwise_and_(0xFFFF).bitwise_left_shift_(16)  # only the low 16 bits survive the shift
    x.mul_(c & 0xFFFF).add_(tmp).bitwise_and_(MASK32)


def _xorshift_(x: torch.Tensor, bits: int, tmp: torch.Tensor) -> None:
    torch.bitwise_right_shift(x, bits, out=tmp)
    x.bitwise_xor_(tmp)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """murmur3 fmix32, in place on int64 values already in [0, 2**32)."""
    tmp = torch.empty_like(x)
    _xorshift_(x, 16, tmp)
    _mul32_(x, 0x85EBCA6B, tmp)
    _xorshift_(x, 13, tmp)
    _mul32_(x, 0xC2B2AE35, tmp)
    _xorshift_(x, 16, tmp)
    return x


def mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3 fmix32 on int64 tensors holding 32-bit values (a new tensor)."""
    return _mix32_(x.long() & MASK32)


def request_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[B] 32-bit keys from int64 seeds and steps (two's-complement bits, as NumPy's uint64 view)."""
    s = seeds.long()
    lo, hi = s & MASK32, (s >> 32) & MASK32  # the mask undoes the arithmetic shift's sign fill
    return mix32(mix32(lo ^ mix32(hi)) ^ (steps.long() & MASK32))


def token_keys(token_ids: torch.Tensor) -> torch.Tensor:
    return mix32(token_ids.long() + GOLDEN)


def _gumbel64(request_key: torch.Tensor, token_key: torch.Tensor) -> torch.Tensor:
    """Float64 Gumbel noise of broadcastable request and token keys (rounded to float32 by the caller)."""
    h = _mix32_(request_key ^ token_key)
    u = h.bitwise_right_shift_(8).double().add_(0.5).div_(float(1 << 24))  # 24 bits, centred in their bin
    return u.log_().neg_().log_().neg_()  # -log(-log(u))


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 standard Gumbel noise of every (request, token)."""
    keys = request_keys(seeds, steps)
    tokens = token_keys(torch.arange(vocab_size, device=seeds.device))
    out = torch.empty(keys.shape[0], vocab_size, dtype=torch.float32, device=seeds.device)
    if out.device.type != "cpu":  # tiling is a CPU cache concern
        return out.copy_(_gumbel64(keys[:, None], tokens[None, :]))
    rows = max(1, _TILE // max(1, vocab_size))
    cols = min(vocab_size, _TILE)
    for r in range(0, keys.shape[0], rows):
        for c in range(0, vocab_size, cols):
            out[r : r + rows, c : c + cols].copy_(_gumbel64(keys[r : r + rows, None], tokens[None, c : c + cols]))
    return out


def gumbel_noise_at(seeds: torch.Tensor, steps: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The noise of `gumbel_noise` at (rows[i], token_ids[i]) only, [N] float32.

    For rows whose filters kept few tokens, hashing just those is far cheaper.
    """
    keys = request_keys(seeds, steps).index_select(0, rows)
    return _gumbel64(keys, token_keys(token_ids)).float()


ACCEPT_ID = 0xFFFFFFFF  # the token key of a draft's acceptance uniform (no vocabulary reaches it)


def acceptance_uniforms(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[B] float64 uniforms of `infer.primitives.noise.acceptance_uniforms`, bit for bit."""
    key = token_keys(torch.full_like(seeds.long(), ACCEPT_ID))
    h = _mix32_(request_keys(seeds, steps) ^ key)
    return h.bitwise_right_shift_(8).double().add_(0.5).div_(float(1 << 24))
