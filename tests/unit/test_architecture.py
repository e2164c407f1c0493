"""The package's shape, as docs/architecture.md promises it: every module is named there, and no module imports
another in a circle (checked on the source, so a lazy import inside a function counts too)."""
import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "nvmeof_roce"


def package_modules():
    """Module file paths relative to the package, `__init__.py` files left out."""
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")


def test_every_module_of_the_package_is_named_in_the_architecture_doc():
    doc = (REPO / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([\w/]+\.py)`", doc))
    missing = [m for m in package_modules() if m not in named]
    assert not missing, f"docs/architecture.md's 'Every module' list lacks: {missing}"
    stale = sorted(m for m in named if "/" in m and not (PACKAGE / m).exists() and (PACKAGE / m.split("/")[0]).is_dir())
    assert not stale, f"docs/architecture.md names modules that no longer exist: {stale}"


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node, at any depth (functions too), except under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph():
    """{module: the package's modules it imports}, from the source of every module of the package."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                bases = [(a.name, []) for a in node.names]
            else:
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                bases = [(base, [a.name for a in node.names])]
            for base, names in bases:
                subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in files]
                if subs:
                    targets.update(subs)  # `from pkg import module`
                if len(subs) < len(names) or not names:
                    while base and base not in files:  # `import pkg.module.thing`: the module
                        base = base.rpartition(".")[0]
                    if base:
                        targets.add(base)
        graph[name] = {t for t in targets if t != name and t.split(".")[0] == "nvmeof_roce"}
    return graph


def import_circles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, on_stack, stack, circles = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_module_of_the_package_imports_another_in_a_circle():
    circles = import_circles(import_graph())
    assert not circles, "modules that import each other (directly or around a circle): " + "; ".join(
        " <-> ".join(c) for c in circles)


def test_the_circle_finder_finds_a_circle_and_ignores_type_checking_imports():
    # the checker itself, on a graph with one circle of three and one without
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .x import X\n"
                     "def f():\n    from .y import Y\n")
    assert sorted(n.module for n in _imports(tree)) == ["typing", "y"]


def test_the_engine_imports_nothing_of_the_service_and_the_bench_nothing_of_either():
    graph = import_graph()
    engine_to_service = sorted((m, t) for m, ts in graph.items() if m.startswith("nvmeof_roce.engine")
                               for t in ts if t.startswith("nvmeof_roce.service"))
    assert not engine_to_service, f"the protocol engine imports the daemon: {engine_to_service}"
    # bench.cost measures our own engine and daemon code on the test doubles (run from a checkout, not in the
    # wheel): importing them is its purpose; the `bench` command itself drives the targets through the CLI
    bench_to_daemon = sorted((m, t) for m, ts in graph.items()
                             if m.startswith("nvmeof_roce.bench") and not m.startswith("nvmeof_roce.bench.cost")
                             for t in ts if t.startswith(("nvmeof_roce.service", "nvmeof_roce.engine")))
    assert not bench_to_daemon, f"the bench imports the target's internals (use the CLI): {bench_to_daemon}"


def test_the_cost_benchmarks_are_left_out_of_the_wheel():
    # they import the test doubles of tests/, which the wheel does not carry
    import tomllib
    from setuptools import find_packages
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(REPO), include=find["include"], exclude=find.get("exclude", ()))
    assert "nvmeof_roce.bench" in packages and "nvmeof_roce.bench.cost" not in packages
