import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch.set_num_threads(1)


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
