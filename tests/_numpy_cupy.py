"""NumPy standing in for CuPy, for CPU tests of how models allocate, fill, load and save their weights (no kernel
runs): `import cupy` gives NumPy's arrays and random generator, and the loader's GPU device is the host one."""

import sys
import types

import numpy as np
import pytest

from tilekit.models import hf


@pytest.fixture
def numpy_cupy(monkeypatch):
    shim = types.ModuleType("cupy")
    shim.asarray, shim.asnumpy, shim.empty, shim.float32, shim.random = (np.asarray, np.asarray, np.empty,
                                                                        np.float32, np.random)
    monkeypatch.setitem(sys.modules, "cupy", shim)
    monkeypatch.setattr(hf, "CupyDevice", hf.HostDevice)
    return shim
