import ast
import functools
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch.set_num_threads(1)


def pytest_sessionstart(session):
    """Before any job starts (in the run's first process only, not in each of xdist's workers, which start
    while others' jobs may run): unlink the shared-memory buffers DeepSpeed's earlier jobs left in
    /dev/shm, the machine's memory. A run of the suite used to leave gigabytes there, and the runs after
    it swapped until their launches timed out."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        from tests.helpers.launchers import remove_orphaned_deepspeed_shm
        removed = remove_orphaned_deepspeed_shm()
        if removed:
            print(f"removed {len(removed)} shared-memory buffers earlier DeepSpeed jobs left in /dev/shm")


@pytest.fixture(autouse=True)
def no_failed_compile(request):
    """Fails a test in which a fused kernel's compile failed (in this process), unless it is marked
    ``compile_failure``: such a kernel runs eager for the rest of the process with the same bits, so
    nothing else would say that the compiled path was lost (the test where it first happens names it)."""
    from dsq_plugins.compressors.kernels import failed_compiles
    with failed_compiles() as failures:
        yield
    if failures and request.node.get_closest_marker("compile_failure") is None:
        pytest.fail("a fused kernel's compile failed: " + "; ".join(failures), pytrace=False)


@pytest.fixture
def tmp_file(tmp_path):
    return tmp_path / "state.pt"


def require(module: str):
    """Import an engine for a test. Missing engines skip the test on a
    developer's machine but fail it in CI (CI=true), where the README's set-up
    must have installed them."""
    if os.environ.get("CI"):
        import importlib
        return importlib.import_module(module)
    return pytest.importorskip(module)


# -- markers: launcher (runs real torchrun / horovodrun / deepspeed processes), gpu, slow -------------------
LAUNCHES = ("launch(", "run_hosts(", "run_job(", "subprocess.", "venv_tool(")
SLOW_MODULES = {"test_convergence"}  # trains to an accuracy: minutes on 2 cores


@functools.lru_cache(maxsize=None)
def launching_functions(path: str) -> frozenset:
    """The functions (tests and fixtures) of a test module whose body starts processes."""
    source = open(path).read()
    tree = ast.parse(source)
    return frozenset(node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
                     and any(word in ast.get_source_segment(source, node) for word in LAUNCHES))


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rpartition(".")[2]
        launching = launching_functions(str(item.path))
        if item.originalname in launching or launching & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.launcher)
        if module.startswith("test_cuda"):
            item.add_marker(pytest.mark.gpu)
        if module in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
