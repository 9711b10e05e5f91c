"""The docs site builds with no warning (a reference to a name that does not
exist is one), and its API reference lists every public name of the core and
of each engine's module: what ``make docs`` builds and ``.ci/run`` runs."""
import importlib
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: the API reference's pages, and the module each documents
PAGES = {"core": "dsq_plugins", "ddp": "dsq_plugins.ddp", "fsdp": "dsq_plugins.fsdp", "horovod": "horovod_ext",
         "deepspeed": "deepspeed_ext", "robust": "robust"}

pytest.importorskip("sphinx")
pytest.importorskip("furo")
pytest.importorskip("myst_parser")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "sphinx", "-W", "-n", "--keep-going", "-q", "-b", "html",
                          str(ROOT / "docs"), str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return out


@pytest.mark.parametrize("page,module", sorted(PAGES.items()))
def test_the_api_reference_lists_every_public_name(site, page, module):
    try:
        names = importlib.import_module(module).__all__
    except ImportError as exc:  # an engine not installed here
        pytest.skip(str(exc))
    html = (site / "api" / f"{page}.html").read_text()
    missing = [name for name in names if f'id="{module}.{name}"' not in html]
    assert not missing, f"{module}: not in the API reference: {missing}"
