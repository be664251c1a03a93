"""The shape of the code: the import graph of tilekit/ and benchmarks/ has no circle, and no module outside a
family's folder (tilekit/models/<family>/) and the families table names a family's classes, preset tables or
modules."""

import ast
from pathlib import Path

import pytest

from tilekit.models import _EXPORTS
from tilekit.models.families import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tilekit", "benchmarks")


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module of tilekit/ and benchmarks/ (a package by its __init__.py)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, tree: ast.AST, known: dict) -> set[str]:
    """The modules of `known` that module `name` imports, at module level or inside functions: each imported
    module (`from P import X` imports P.X when that is a module, else P) and the packages above it that run
    their __init__ first (those that do not contain `name`)."""
    is_package = known[name].name == "__init__.py"
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    edges = set()
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            module = ".".join(parts[:i])
            if module in known and module != name and not (name + ".").startswith(module + "."):
                edges.add(module)
    return edges


def lazy_imports() -> dict[str, set[str]]:
    """Imports made by name at run time: the families table's modules of each family, and tilekit.models's
    lazily exported names."""
    families = {f"{family.package}.{part}" for family in FAMILIES.values()
                for part in ("config", "weights", "model", "reference", "patch")}
    return {"tilekit.models.families": families, "tilekit.models": {module for module, _ in _EXPORTS.values()}}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {name: imported(name, ast.parse(path.read_text()), known) for name, path in known.items()}
    for name, more in lazy_imports().items():
        assert more <= known.keys(), more - known.keys()
        graph[name] |= more
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as a path that ends where it starts, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_import_graph_has_no_circle():
    graph = import_graph()
    assert len(graph) > 60 and "tilekit.models.gpt2.model" in graph["tilekit.models.families"]
    assert graph["benchmarks.cli"] >= {"benchmarks.suites.overhead", "benchmarks.harness.log"}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_circles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    known = {"p": Path("p/__init__.py"), "p.a": Path("p/a.py"), "p.b": Path("p/b.py"), "q": Path("q.py")}
    tree = ast.parse("from p import b\nimport q\ndef f():\n    from . import b\n    from p.b import x\n")
    assert imported("p.a", tree, known) == {"p.b", "q"}
    assert imported("q", ast.parse("def f():\n    from p.a import x\n"), known) == {"p", "p.a"}


def family_names() -> set[str]:
    """The identifiers that choose a family: its config, model and reference classes, and its preset tables."""
    names = {"LLAMA_PRESETS", "DEEPSEEK_V2_PRESETS"}
    for family in FAMILIES.values():
        names |= {family.config_name, family.model_name, family.reference_name}
    return names


def test_no_module_outside_the_families_names_one():
    """Identifiers only: docstrings, help texts and preset names in benchmark plans may mention a family."""
    names, family_packages = family_names(), tuple(family.package for family in FAMILIES.values())
    offenders = []
    for name, path in modules().items():
        if name.startswith(family_packages) or name == "tilekit.models.families":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            used = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                    else None)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                module = getattr(node, "module", None)
                imports = [a.name for a in node.names] + ([module] + [f"{module}.{a.name}" for a in node.names]
                                                          if module else [])
                offenders += [f"{name}:{node.lineno} imports {i}" for i in imports
                              if i in names or i.startswith(tuple(p + "." for p in family_packages))
                              or i in family_packages]
            elif used in names or (used == "PRESETS" and name != "tilekit.models"):
                offenders.append(f"{name}:{node.lineno} names {used}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("source, found", [
    ("from tilekit.models.llama.config import LlamaConfig", "imports"),
    ("from tilekit.models import GPT", "imports GPT"),
    ("def f(c):\n    return isinstance(c, models.GPTConfig)", "names GPTConfig"),
    ("x = LLAMA_PRESETS", "names LLAMA_PRESETS"),
])
def test_the_family_check_catches_each_kind_of_naming(source, found, tmp_path, monkeypatch):
    (tmp_path / "tilekit").mkdir()
    (tmp_path / "tilekit" / "bad.py").write_text(source)
    (tmp_path / "benchmarks").mkdir()
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    with pytest.raises(AssertionError, match=found):
        test_no_module_outside_the_families_names_one()


# tilekit's layers, lowest first: a module imports only from its own layer or lower ones (the package's __init__,
# which binds the public names, excepted).
LAYERS = (("tilekit.untrusted", "tilekit.env", "tilekit.device"), ("tilekit.autotune",), ("tilekit.kernels",),
          ("tilekit.parallel",), ("tilekit.checkpoints",), ("tilekit.models", "tilekit.patch"), ("tilekit.engine",),
          ("tilekit.serve",), ("tilekit.cli", "tilekit.__main__"))


def layer_of(module: str) -> int | None:
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    return None


def test_imports_point_downwards():
    upward = [f"{name} imports {target}" for name, targets in import_graph().items() for target in sorted(targets)
              if layer_of(name) is not None and layer_of(target) is not None and layer_of(target) > layer_of(name)]
    assert not upward, "\n".join(upward)


def test_models_never_import_the_engine():
    """The engine runs models; a model only defines one (its generate() reaches the engine through
    tilekit.models.running's registered runner)."""
    graph = import_graph()
    assert graph["tilekit.engine.static"] >= {"tilekit.models.base"}
    offenders = [f"{name} imports {target}" for name, targets in graph.items() if name.startswith("tilekit.models")
                 for target in targets if target == "tilekit.engine" or target.startswith("tilekit.engine.")]
    assert not offenders, "\n".join(offenders)


def test_every_tilekit_module_has_a_layer():
    assert [name for name in modules() if name.startswith("tilekit.") and layer_of(name) is None] == []


def test_every_package_is_packaged():
    """pyproject.toml lists the packages by name: a new one left out would be missing from an installed wheel."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "tilekit").rglob("__init__.py")}
    assert found - listed == set()
