"""Kernel and launch digests: comments and docstrings do not count, code does, and they never raise."""

import importlib
import sys
import textwrap

import pytest

from tilekit.autotune.digest import UNAVAILABLE, code_digest

BASE = '''
SCALE = 2.0


def helper(x):
    """Doubles."""
    return x * SCALE


helper._cutile_tile_function = True     # what @ct.function marks a tile helper with


def kernel(x):
    """A kernel."""
    sync_with_previous_kernel()
    if x:
        x = x + 1
    return helper(x) + 1  # a comment


def sync_with_previous_kernel():
    pass
'''


def load(tmp_path, name, source):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))


@pytest.mark.parametrize("edit, same", [
    (lambda s: s.replace("# a comment", "# another comment"), True),
    (lambda s: s.replace('"""A kernel."""', '"""A kernel, better described."""'), True),
    (lambda s: s.replace('"""Doubles."""\n', ''), True),
    (lambda s: s.replace("return helper(x) + 1", "return helper(x) + 2"), False),
    (lambda s: s.replace("return x * SCALE", "return x * SCALE * 1"), False),     # a helper it calls
    (lambda s: s.replace("SCALE = 2.0", "SCALE = 3.0"), False),                   # a constant it reads
    # where a kernel waits for the kernel before it or lets the next one launch (programmatic dependent launch,
    # which the tuner does not use) does not count; what it computes around them does
    (lambda s: s.replace("    sync_with_previous_kernel()\n", ""), True),
    (lambda s: s.replace("x = x + 1\n", "x = x + 1\n        ct.grid_dependency_control_wait()\n"), True),
    (lambda s: s.replace("    sync_with_previous_kernel()\n", "    print()\n"), False),
])
def test_what_changes_the_digest(tmp_path, edit, same, request):
    name = request.node.name.replace("[", "_").replace("]", "").replace("-", "_")
    base = load(tmp_path, f"{name}_base", BASE)
    other = load(tmp_path, f"{name}_other", edit(BASE))
    assert (code_digest(base.kernel) == code_digest(other.kernel)) is same


def test_no_source_is_a_marker_not_an_exception():
    namespace = {}
    exec("def kernel(x):\n    return x\n", namespace)   # no file to read the source from
    digest = code_digest(namespace["kernel"])
    assert digest.startswith(UNAVAILABLE)


def test_lambdas_cannot_be_digested():
    assert code_digest(lambda x: x + 1).startswith(UNAVAILABLE)


def test_real_ops_have_stable_digests():
    import tilekit.kernels  # noqa: F401
    from tilekit.autotune.registry import registered_ops
    for op in registered_ops().values():
        assert len(op.kernel_hash()) == 16 and not op.kernel_hash().startswith(UNAVAILABLE), op.name
        parts = [f for launch in op.launches for f in (launch.kernel, launch.grid, launch.constants)]
        assert code_digest(*parts, op.arrays, *([op.scratch] if op.scratch else [])) == op.kernel_hash()


def test_the_written_tree_has_no_empty_fields():
    """Python versions add optional syntax-tree fields (3.12's type_params) and change ast.dump's
    defaults (3.13); the digest writes neither None nor empty lists, so every version digests alike."""
    import ast

    from tilekit.autotune.digest import _canonical
    text = _canonical(ast.parse("def f(x):\n    return x + 1\n"))
    assert "type_params" not in text and "=None" not in text and "=[]" not in text
    assert text.startswith("Module(body=[FunctionDef(name='f'")
