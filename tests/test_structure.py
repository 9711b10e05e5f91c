"""The shape of the code: rooms a newcomer can find (sub-packages named by
role behind small public faces), short functions, one-way imports, and a
façade that reads like the algorithm."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("dsq_plugins", "horovod_ext", "deepspeed_ext", "robust")
MAX_FUNCTION_LINES = 60
MAX_FACADE_LINES = 350
MAX_SIBLINGS = 8         # modules or sub-packages of its own package that one module imports
MAX_TOP_MODULES = 10     # modules at the top of dsq_plugins besides its sub-packages
MAX_PUBLIC_NAMES = 20    # dsq_plugins.__all__


def modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            yield name.removesuffix(".__init__"), path


def runtime_nodes(tree):
    """Every node, except those under ``if TYPE_CHECKING:`` (imports for annotations only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            test = getattr(child, "test", None)
            if isinstance(child, ast.If) and getattr(test, "id", getattr(test, "attr", "")) == "TYPE_CHECKING":
                continue
            stack.append(child)


def imports_of(name, path):
    """Every module of ours that ``name`` imports when it runs, wherever the import sits."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in runtime_nodes(ast.parse(path.read_text())):
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


def siblings_imported(name, path):
    """The modules and sub-packages of ``name``'s own package that it imports
    (a sub-package's ``__init__`` is a module of its parent: its own
    modules are its children, not its siblings)."""
    package = name.rpartition(".")[0] or name
    depth = len(package.split(".")) + 1
    return {".".join(m.split(".")[:depth]) for m in imports_of(name, path)
            if m.startswith(package + ".") and ".".join(m.split(".")[:depth]) != name}


def test_no_function_is_longer_than_60_lines():
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


def test_no_engine_module_imports_more_than_8_of_its_siblings():
    wide = {name: sorted(siblings) for name, path in modules() if name.startswith("dsq_plugins")
            for siblings in [siblings_imported(name, path)] if len(siblings) > MAX_SIBLINGS}
    assert not wide, wide


def test_the_engine_is_rooms_with_a_few_modules_at_the_top():
    top = sorted(p.name for p in (ROOT / "dsq_plugins").glob("*.py") if p.name != "__init__.py")
    rooms = sorted(p.name for p in (ROOT / "dsq_plugins").iterdir() if (p / "__init__.py").exists())
    assert len(top) <= MAX_TOP_MODULES, top
    assert {"algorithm", "comm", "compressors", "layout", "optim", "state", "step", "testing"} <= set(rooms), rooms


def test_the_public_surface_is_small_and_every_public_module_names_its_own():
    import dsq_plugins
    assert len(dsq_plugins.__all__) <= MAX_PUBLIC_NAMES, dsq_plugins.__all__
    assert all(hasattr(dsq_plugins, n) for n in dsq_plugins.__all__)
    missing = []
    for name, path in modules():
        if name.startswith("dsq_plugins") and not any(part.startswith("_") for part in name.split(".")):
            tree = ast.parse(path.read_text())
            if not any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets)
                       for n in tree.body):
                missing.append(name)
    assert not missing, missing


def test_the_deprecated_manual_staging_is_gone():
    import dsq_plugins
    for old in ("begin", "commit", "abort"):
        assert not hasattr(dsq_plugins.DoubleSqueeze, old), old


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
