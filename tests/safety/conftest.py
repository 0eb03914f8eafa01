"""The safety tests' ``slow`` marker: randomised variants that take several runs more. They run when
``LUWU_SLOW_TESTS=1``, so that the default suite stays within its time budget."""

import os

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: longer randomised variants of a safety test (LUWU_SLOW_TESTS=1)")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("LUWU_SLOW_TESTS") == "1":
        return
    for item in items:
        if "slow" in item.keywords and "tests/safety" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason="slow variant: run with LUWU_SLOW_TESTS=1"))
