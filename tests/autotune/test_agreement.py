"""The tuner keeps only candidates whose outputs agree with the default config's (NumPy stand-ins here; the
GPU side is in tests/kernels/test_search_spaces.py)."""

import math

import ml_dtypes
import numpy as np
import pytest

from tilekit.autotune.arrays import agreement_tolerance, as_float64, poison, relative_difference
from tilekit.autotune.tuner import agreeing

BF16 = np.dtype(ml_dtypes.bfloat16)


class FakeCase:
    """A bench case whose configs produce given arrays (a list: one run's arrays after another, the last
    repeating); raises for a config named in `broken`."""

    def __init__(self, results, broken=()):
        self.results, self.broken, self.runs = results, broken, []

    def outputs(self, config):
        c = config["c"]
        if c in self.broken:
            raise RuntimeError("launch failed\nsecond line")
        runs = self.results[c] if isinstance(self.results[c], list) else [self.results[c]]
        self.runs.append(c)
        return {n: a.copy() for n, a in runs[min(self.runs.count(c), len(runs)) - 1].items()}


def test_configs_whose_outputs_differ_from_the_defaults_are_rejected_with_the_array_and_size():
    rng = np.random.default_rng(1)
    y = rng.standard_normal((64, 32)).astype(BF16)
    cache = rng.integers(0, 127, (4, 16)).astype(np.uint8)
    near = (y.astype(np.float32) * (1 + 2 ** -8)).astype(BF16)            # a rounding or so apart: agrees
    far = y.copy()
    far[:, 20:] = 0                                                      # a third of the columns lost
    stray = cache.copy()
    stray[3, 15] ^= 0x40                                                 # one in-place write went elsewhere
    case = FakeCase({0: {"y": y, "k": cache}, 1: {"y": near, "k": cache}, 2: {"y": far, "k": cache},
                     3: {"y": y, "k": stray}, 4: {"y": y, "k": cache}}, broken=(4,))
    configs = [{"c": i} for i in range(5)]
    kept, wrong = agreeing(case, configs, configs[0])
    assert kept == configs[:2]
    assert [(c["c"], reason) for c, reason, _ in wrong] == [(2, "WrongOutput"), (3, "WrongOutput"),
                                                             (4, "RuntimeError")]
    assert wrong[0][2].startswith("y differs from the default config's by 0.")
    assert wrong[1][2].startswith("k differs")
    assert wrong[2][2] == "launch failed"
    assert [case.runs.count(i) for i in range(4)] == [3, 3, 1, 1]        # three runs each, unless one differs


def test_a_config_wrong_in_one_run_of_three_is_rejected_and_a_default_unequal_to_itself_keeps_nothing():
    rng = np.random.default_rng(2)
    y = rng.standard_normal(100).astype(np.float32)
    racy = y.copy()
    racy[:10] = 0
    case = FakeCase({0: {"y": y}, 1: [{"y": y}, {"y": racy}, {"y": y}], 2: {"y": y}})
    configs = [{"c": i} for i in range(3)]
    kept, wrong = agreeing(case, configs, configs[0])
    assert kept == [configs[0], configs[2]] and [c for c, _, _ in wrong] == [configs[1]]
    unsteady = FakeCase({0: [{"y": y}, {"y": racy}], 1: {"y": y}})
    kept, wrong = agreeing(unsteady, configs[:2], configs[0])
    assert kept == [] and {c["c"] for c, _, _ in wrong} == {0, 1}
    assert "does not agree with itself" in wrong[-1][2]


def test_without_the_default_among_the_configs_nothing_is_checked():
    case = FakeCase({})
    configs = [{"c": 1}, {"c": 2}]
    assert agreeing(case, configs, {"c": 0}) == (configs, [])
    assert case.runs == []


def test_relative_difference_matches_nan_with_nan_and_nothing_else():
    a = np.array([1.0, np.nan, 3.0], np.float32)
    assert relative_difference(a, a.copy()) == 0.0
    assert relative_difference(a, np.array([1.0, 2.0, 3.0], np.float32)) == math.inf
    assert relative_difference(np.array([1.0, np.inf]), np.array([1.0, np.inf])) == 0.0
    assert relative_difference(np.array([3.0, 4.0]), np.array([3.0, 0.0])) == pytest.approx(4 / 3)


def test_bfloat16_values_are_read_through_their_bits():
    x = np.array([1.5, -2.25, 3e38, 1e-30], np.float32)
    assert np.array_equal(as_float64(x.astype(BF16)), x.astype(BF16).astype(np.float64))


@pytest.mark.parametrize("dtype", [BF16, np.float16, np.float32, np.int32, np.int64, np.uint8])
def test_poison_fills_every_byte_of_any_dtype_with_a_finite_value(dtype):
    a = np.zeros((3, 5), dtype)[:, ::2]                                  # a strided view
    poison(a)
    assert a.tobytes() == bytes([0x4D]) * a.nbytes and np.all(np.isfinite(as_float64(a)))


def test_tolerance_is_looser_for_16_bit_outputs():
    assert agreement_tolerance(BF16) == agreement_tolerance(np.dtype(np.float16)) > agreement_tolerance(
        np.dtype(np.float32)) == agreement_tolerance(np.dtype(np.int32))
