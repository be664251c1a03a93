"""The tuner's benchmark inputs on the GPU: integer codes within their declared bounds, of either sign where the
spec says so (FP8 codes below the NaN codes 0x7F and 0xFF)."""

import numpy as np
import pytest

from tilekit.autotune.arrays import ArraySpec, bench_array

pytestmark = pytest.mark.gpu


def codes(spec: ArraySpec) -> np.ndarray:
    import cupy
    return cupy.asnumpy(bench_array(spec, 0, cupy.random.default_rng())).ravel()


def test_unsigned_codes_stay_below_high():
    got = codes(ArraySpec("uint8", (64, 256), high=0x7F))
    assert got.min() >= 0 and got.max() < 0x7F


def test_signed_fp8_codes_take_both_signs_and_no_nan_code():
    got = codes(ArraySpec("uint8", (64, 256), high=0x7F, signed=True))
    assert not np.isin(got, [0x7F, 0xFF]).any()
    negative = got >= 0x80
    assert 0.4 < negative.mean() < 0.6          # 16384 draws: the sign bit is a fair coin
    assert ((got & 0x7F) < 0x7F).all()


def test_signed_int8_codes_are_negative_as_often_as_not():
    got = codes(ArraySpec("int8", (64, 256), high=0x7F, signed=True))
    assert got.dtype == np.int8 and 0.4 < (got < 0).mean() < 0.6 and got.max() < 0x7F
