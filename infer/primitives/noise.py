"""The seeded Gumbel noise of `sample`: part of the contract, not an RNG choice.

Every backend must produce the same uniforms bit for bit (they are integer
hashes), so a request's seed yields the same token on every backend and in
any batch. The hash is murmur3's 32-bit finalizer applied to a key made of the
request's seed, its step (output tokens so far) and the token id; all
arithmetic is modulo 2**32. A backend without unsigned 32-bit multiply can
split each product into 16-bit halves.
"""

from __future__ import annotations

import numpy as np

MASK32 = np.uint64(0xFFFFFFFF)
GOLDEN = np.uint64(0x9E3779B9)


def mix32(x: np.ndarray) -> np.ndarray:
    """murmur3 fmix32 on uint64 arrays holding 32-bit values."""
    x = x & MASK32
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x85EBCA6B)) & MASK32
    x = x ^ (x >> np.uint64(13))
    x = (x * np.uint64(0xC2B2AE35)) & MASK32
    return x ^ (x >> np.uint64(16))


def request_keys(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """[B] 32-bit keys from int64 seeds and steps."""
    s = seeds.astype(np.int64).view(np.uint64)
    lo, hi = s & MASK32, s >> np.uint64(32)
    step = steps.astype(np.int64).view(np.uint64) & MASK32
    return mix32(mix32(lo ^ mix32(hi)) ^ step)


def uniforms(seeds: np.ndarray, steps: np.ndarray, vocab_size: int) -> np.ndarray:
    """[B, V] float64 uniforms in (0, 1): 24 hash bits, centred in their bin."""
    token_keys = mix32(np.arange(vocab_size, dtype=np.uint64) + GOLDEN)
    h = mix32(request_keys(seeds, steps)[:, None] ^ token_keys[None, :])
    return ((h >> np.uint64(8)).astype(np.float64) + 0.5) / float(1 << 24)


def gumbel_noise(seeds: np.ndarray, steps: np.ndarray, vocab_size: int) -> np.ndarray:
    """[B, V] float32 standard Gumbel noise, ``-log(-log(u))``."""
    return (-np.log(-np.log(uniforms(seeds, steps, vocab_size)))).astype(np.float32)


# The token key of a draft's acceptance uniform: an id no vocabulary reaches.
ACCEPT_ID = np.uint64(0xFFFFFFFF)


def acceptance_uniforms(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """[B] float64 uniforms in (0, 1) deciding speculative drafts (`sample` step 6):
    the hash of `uniforms` at token id 2**32 - 1, independent of the Gumbel noise."""
    h = mix32(request_keys(seeds, steps) ^ mix32(np.full(len(seeds), ACCEPT_ID) + GOLDEN))
    return ((h >> np.uint64(8)).astype(np.float64) + 0.5) / float(1 << 24)
