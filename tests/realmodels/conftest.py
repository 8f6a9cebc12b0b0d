"""tests/realmodels: the default run (CI's ``python -m pytest tests -q``) skips cases marked ``slow``.

Everything: ``FXAMP_REALMODELS=all python -m pytest tests/realmodels -q``, or select with a marker
expression of your own (``-m "slow or not slow"``, ``-m slow``): any ``-m`` turns the skip off.
"""

import os

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("FXAMP_REALMODELS", "").lower() == "all" or config.getoption("markexpr", ""):
        return
    skip = pytest.mark.skip(reason="slow real-model case: run with FXAMP_REALMODELS=all "
                                   "(or -m 'slow or not slow')")
    for item in items:
        if "slow" in item.keywords and str(item.fspath).startswith(_HERE + os.sep):
            item.add_marker(skip)
