"""int4 packing, which the quantized inputs and the kept-quantized loaders share."""

from __future__ import annotations

import numpy as np

from infer.primitives.dequant import pack_int4, unpack_int4


def test_pack_then_unpack_is_the_identity_on_every_nibble_pair():
    q = np.array([[lo, hi] for lo in range(16) for hi in range(16)], np.uint8).reshape(16, 32)
    packed = pack_int4(q)
    assert packed.shape == (16, 16) and packed.dtype == np.uint8
    np.testing.assert_array_equal(unpack_int4(packed), q)
    assert pack_int4(np.array([[3, 10]], np.uint8)).tolist() == [[0xA3]]  # low nibble first
