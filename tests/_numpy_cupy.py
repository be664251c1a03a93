"""NumPy standing in for CuPy, for CPU tests of how models allocate, fill, load and save their weights (no kernel
runs): `import cupy` gives NumPy's arrays and random generator, and the loader's GPU device is the host one."""

import sys
import types

import numpy as np
import pytest

from tilekit import checkpoints


@pytest.fixture
def numpy_cupy(monkeypatch):
    shim = types.ModuleType("cupy")
    shim.asarray, shim.asnumpy, shim.empty, shim.float32, shim.random = (np.asarray, np.asarray, np.empty,
                                                                        np.float32, np.random)
    monkeypatch.setitem(sys.modules, "cupy", shim)
    monkeypatch.setattr(checkpoints.load, "CupyDevice", checkpoints.HostDevice)
    return shim


def step_code_on_numpy(shim, monkeypatch, *replacements) -> None:
    """A model's own step code on the CPU: `shim` (the numpy_cupy fixture) gains the array functions models call,
    and for each (target module, stand-in module, names) the target's kernels of those names become the stand-in
    module's NumPy functions of the same names."""
    for name in ("tile", "arange", "ones", "zeros", "ascontiguousarray", "int32"):
        setattr(shim, name, getattr(np, name))
    for target, stand_ins, names in replacements:
        for name in names:
            monkeypatch.setattr(target, name, getattr(stand_ins, name))
