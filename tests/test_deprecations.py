"""The spellings this release deprecates still work, with a DeprecationWarning naming the new one."""

from __future__ import annotations

import importlib
import re

import pytest

import fxamp


@pytest.mark.parametrize("name", sorted(fxamp._MOVED))
def test_a_name_that_left_the_top_level_still_resolves_with_a_warning(name):
    module = fxamp._MOVED[name]
    with pytest.warns(DeprecationWarning, match=re.escape(f"fxamp.{name} is deprecated and kept for one release: "
                                                          f"write 'from {module} import {name}'")):
        old = getattr(fxamp, name)
    assert old is getattr(importlib.import_module(module), name)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'fxamp' has no attribute 'LossScalar'"):
        fxamp.LossScalar
    assert not hasattr(fxamp, "no_such_name")
