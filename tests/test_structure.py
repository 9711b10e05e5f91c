"""The shape of the code, kept as the reducer split left it: short
functions, one-way imports, a façade that reads like the algorithm."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("dsq_plugins", "horovod_ext", "deepspeed_ext", "robust")
MAX_FUNCTION_LINES = 80
MAX_FACADE_LINES = 350


def modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            yield name.removesuffix(".__init__"), path


def imports_of(name, path):
    """Every module of ours that ``name`` imports, wherever the import sits."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    ours = dict(modules())
    return {m for m in found if m in ours and m != name}


def test_no_function_is_longer_than_80_lines():
    long = []
    for name, path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert not long, long


def test_the_modules_import_each_other_without_a_cycle():
    graph = {name: imports_of(name, path) for name, path in modules()}
    # a package's __init__ re-exports its modules: an edge from a module to its own package is not a cycle
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    state, cycles = {}, []

    def visit(m, trail):
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycles.append(" -> ".join(trail[trail.index(d):] + [d]))
            elif d not in state:
                visit(d, trail + [d])
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


@pytest.mark.parametrize("engine, core", [("horovod_ext", "dsq_plugins"), ("deepspeed_ext", "dsq_plugins"),
                                          ("robust", "dsq_plugins")])
def test_dependencies_point_one_way(engine, core):
    for name, path in modules():
        if name.split(".")[0] == core:
            assert not any(d.split(".")[0] == engine for d in imports_of(name, path)), name
            assert "import horovod" not in path.read_text() and "import deepspeed" not in path.read_text(), name


def test_double_squeeze_is_a_facade():
    lines = len((ROOT / "dsq_plugins" / "reducer.py").read_text().splitlines())
    assert lines <= MAX_FACADE_LINES, lines
