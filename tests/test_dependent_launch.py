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


WEIGHT_READERS = {"weight_tile"}    # read a weight, which no kernel writes: allowed before the wait


def _touches_memory(func, module_globals, seen=frozenset()) -> bool:
    """Whether a tilekit tile helper (or one it calls) has a memory op."""
    helper = getattr(module_globals.get(func), "__wrapped__", module_globals.get(func))
    if helper is None or not inspect.isfunction(helper) or func in seen:
        return False
    tree = ast.parse(textwrap.dedent(inspect.getsource(helper)))
    return any(isinstance(n, ast.Call) and (
        (isinstance(n.func, ast.Attribute) and n.func.attr in MEMORY_OPS)
        or (isinstance(n.func, ast.Name) and _touches_memory(n.func.id, helper.__globals__, seen | {func})))
        for n in ast.walk(tree))


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k._pyfunc.__name__)
def test_kernel_waits_before_touching_memory(kernel):
    """Before sync_with_previous_kernel() a kernel may only read weights (through WEIGHT_READERS, on
    an argument named W)."""
    func = kernel._pyfunc
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    sync = _first_line(tree, lambda f: isinstance(f, ast.Name) and f.id == "sync_with_previous_kernel")
    assert sync is not None, f"{func.__name__} never calls sync_with_previous_kernel()"
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and n.lineno <= sync):
        name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
        if name in WEIGHT_READERS:
            assert isinstance(call.args[0], ast.Name) and call.args[0].id == "W", f"{func.__name__}: {name} not on W"
            continue
        direct = isinstance(call.func, ast.Attribute) and name in MEMORY_OPS
        assert not direct and not _touches_memory(name, func.__globals__), \
            f"{func.__name__} touches memory before it waits ({name}, line {call.lineno})"


@pytest.mark.parametrize("value, expected", [("0", False), ("1", True), ("", True)])
def test_environment_turns_dependent_launch_off(value, expected):
    env = dict(os.environ, TILEKIT_DEPENDENT_LAUNCH=value)
    out = subprocess.run([sys.executable, "-c", "from tilekit.autotune import op; print(op.DEPENDENT_LAUNCH)"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(expected)
