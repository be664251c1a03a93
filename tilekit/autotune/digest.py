"""Hashes of code by what it does: a tuned result stays valid while its kernel and launch stay the same.

A digest covers each function's syntax tree without docstrings (comments never reach the tree; the
tree is written out so that every Python version writes it alike), and,
recursively, every tilekit function, cuTile function or kernel and plain constant it names. So editing
a comment or a docstring keeps a tuning database valid, while changing a kernel, a tile helper it
calls, a constant it reads, or the grid and arguments it is launched with makes its entries stale.
Statements that only order a kernel against its neighbours under programmatic dependent launch
(PDL_CONTROL: waiting for the previous kernel, letting the next one launch) are left out too: the
tuner launches kernels without it, where they do nothing, so where a kernel places them changes no
tuned measurement (their placement is checked by the GPU tests and measured in whole decode steps).
"""

from __future__ import annotations

import ast
import enum
import hashlib
import inspect
import textwrap

UNAVAILABLE = "unavailable"   # prefix of the digest of code whose source cannot be read
PDL_CONTROL = frozenset({"grid_dependency_control_wait", "grid_dependency_control_launch_dependents",
                         "sync_with_previous_kernel"})


def code_digest(*objects) -> str:
    """16 hex digits; "unavailable:<what>" when a source cannot be read, lambdas included (never raises)."""
    try:
        parts: list[str] = []
        seen: set[int] = set()
        for obj in objects:
            _visit(obj, parts, seen)
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    except _NoSource as e:
        return f"{UNAVAILABLE}:{e}"
    except Exception as e:  # noqa: BLE001 - a digest must never break dispatch
        return f"{UNAVAILABLE}:{type(e).__name__}"


class _NoSource(Exception):
    pass


def _function_of(obj):
    """The Python function behind a cuTile kernel, a cuTile function wrapper, or a plain function."""
    obj = getattr(obj, "_pyfunc", obj)                  # @ct.kernel
    while hasattr(obj, "__wrapped__"):                  # @ct.function (functools.wraps)
        obj = obj.__wrapped__
    return obj if inspect.isfunction(obj) else None


def _ours(value) -> bool:
    module = getattr(value, "__module__", "") or ""
    return module.split(".")[0] == "tilekit" or getattr(value, "_cutile_tile_function", False)


def _canonical(node) -> str:
    """A syntax tree as text that no Python version adds to: fields that are None or empty lists
    (new optional fields such as 3.12's type_params, or 3.13's dump defaults) are left out."""
    if isinstance(node, ast.AST):
        fields = ((name, _canonical(getattr(node, name, None))) for name in node._fields)
        return f"{type(node).__name__}(" + ",".join(f"{k}={v}" for k, v in fields if v not in ("None", "[]")) + ")"
    if isinstance(node, list):
        return "[" + ",".join(_canonical(item) for item in node) + "]"
    return repr(node)


def _visit(obj, parts: list[str], seen: set[int]) -> None:
    func = _function_of(obj)
    if func is None or id(func) in seen:
        return
    seen.add(id(func))
    if func.__name__ == "<lambda>":            # its source is a fragment of a larger statement
        raise _NoSource(f"a lambda in {func.__module__}")
    try:
        source = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError):
        raise _NoSource(func.__qualname__) from None
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and body
                and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list) and any(_pdl_control(s) for s in block):
                setattr(node, field, [s for s in block if not _pdl_control(s)] or [ast.Pass()])
    parts.append(f"{func.__qualname__}:{_canonical(tree)}")
    names = sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)})
    for name in names:
        if name not in func.__globals__:
            continue
        value = func.__globals__[name]
        if isinstance(value, (bool, int, float, str, enum.Enum)):
            parts.append(f"{name}={value!r}")
        elif _function_of(value) is not None and _ours(value):
            _visit(value, parts, seen)


def _pdl_control(statement) -> bool:
    """A statement that is only a call of a PDL_CONTROL function (ct.f() or f())."""
    call = statement.value if isinstance(statement, ast.Expr) else None
    func = call.func if isinstance(call, ast.Call) else None
    return (isinstance(func, ast.Attribute) and func.attr in PDL_CONTROL) or \
        (isinstance(func, ast.Name) and func.id in PDL_CONTROL)
