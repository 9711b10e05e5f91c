"""A pytest plugin for ``scripts/gpu_check.sh``: each failing test's id and
report is appended to ``$DSQ_FAILURES_FILE`` the moment it fails, so a
device run cut short by its time limit (or a worker that will not exit)
still brings back why each test failed.

    DSQ_FAILURES_FILE=failures.txt python -m pytest -p scripts.pytest_failures ...
"""
from __future__ import annotations

import os

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("DSQ_FAILURES_FILE")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-8000:]}\n\n")
