"""Every kernel is launched with programmatic dependent launch, so each must wait for the previous
kernel before it touches memory: checked on every declared kernel's source."""

import ast
import inspect
import os
import subprocess
import sys
import textwrap

import pytest

import tilekit.kernels  # noqa: F401  (declares the ops)
from tilekit.autotune.registry import registered_ops

MEMORY_OPS = {"load", "store", "gather", "scatter"} | {n for n in dir(__import__("cuda.tile").tile)
                                                       if n.startswith("atomic_")}
KERNELS = sorted({launch.kernel for op in registered_ops().values() for launch in op.launches
                  if launch.kernel._pyfunc.__module__.startswith("tilekit.kernels")},
                 key=lambda k: k._pyfunc.__name__)


def _first_line(tree, wanted) -> int | None:
    lines = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and wanted(n.func)]
    return min(lines, default=None)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k._pyfunc.__name__)
def test_kernel_waits_before_touching_memory(kernel):
    tree = ast.parse(textwrap.dedent(inspect.getsource(kernel._pyfunc)))
    sync = _first_line(tree, lambda f: isinstance(f, ast.Name) and f.id == "sync_with_previous_kernel")
    memory = _first_line(tree, lambda f: isinstance(f, ast.Attribute) and f.attr in MEMORY_OPS)
    assert sync is not None, f"{kernel._pyfunc.__name__} never calls sync_with_previous_kernel()"
    assert memory is None or sync < memory, f"{kernel._pyfunc.__name__} touches memory before it waits"


@pytest.mark.parametrize("value, expected", [("0", False), ("1", True), ("", True)])
def test_environment_turns_dependent_launch_off(value, expected):
    env = dict(os.environ, TILEKIT_DEPENDENT_LAUNCH=value)
    out = subprocess.run([sys.executable, "-c", "from tilekit.autotune import op; print(op.DEPENDENT_LAUNCH)"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(expected)
