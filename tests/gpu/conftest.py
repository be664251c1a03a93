"""GPU tests: skipped with the reason where no usable CUDA GPU is present."""

import pytest

from tilekit.device import gpu_unavailable_reason
from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand, rel_err, rounded  # noqa: F401

REASON = gpu_unavailable_reason()


def pytest_collection_modifyitems(config, items):
    if REASON:
        skip = pytest.mark.skip(reason=f"GPU test: {REASON}")
        for item in items:
            if "tests/gpu" in str(item.fspath):
                item.add_marker(skip)
