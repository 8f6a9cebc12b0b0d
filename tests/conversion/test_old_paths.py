"""Modules converted before the conversion stages became folders load and run as they are (issue 38).

``data/old_paths.pt`` holds two converted modules pickled by the fxamp of that time (``data/make_old_paths.py``
made it): their generated code and pickles name ``fxamp.conversion.runtime``, ``.recompute``, ``.float8`` and
``.debug`` as the modules they were.  Each loads without a warning and gives the outputs and gradients it gave then.
"""

from __future__ import annotations

import pathlib
import warnings

import pytest
import torch

import fxamp
from fxamp.conversion.runtime import ConvertedGraphModule, attention, cast
from fxamp.conversion.runtime.float8 import float8_linear
from fxamp.conversion.runtime.recompute import island_output
from fxamp.conversion.rewrite.debug import overflow_info

OLD = pathlib.Path(__file__).with_name("data") / "old_paths.pt"


def _load():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # a saved model has nothing to change: no warning
        return torch.load(OLD, weights_only=False)


def _run(model, inputs):
    torch.manual_seed(1)  # the dropout's stream, as when it was saved
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warnings.filterwarnings("ignore", "fxamp: the converted module's .* got gradients", RuntimeWarning)
        out = model(*inputs)
        loss = out[0] if isinstance(out, tuple) else out.float().square().mean()
        loss.backward()
    return out, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("name", ["attend", "dense"])
def test_a_module_pickled_with_the_old_paths_loads_silently_and_gives_the_same_numbers(name):
    saved = _load()[name]
    out, grads = _run(saved["model"], saved["inputs"])
    want = saved["outputs"] if isinstance(saved["outputs"], tuple) else (saved["outputs"],)
    got = out if isinstance(out, tuple) else (out,)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(grads) == len(saved["grads"]) and all(torch.equal(a, b) for a, b in zip(grads, saved["grads"]))


def test_the_old_paths_resolve_to_todays_functions():
    saved = _load()
    attend, dense = saved["attend"]["model"], saved["dense"]["model"]
    assert isinstance(attend, ConvertedGraphModule)
    targets = {n.target for m in (attend, dense) for n in m.graph.nodes if n.op == "call_function"}
    assert {cast, attention, island_output, float8_linear} <= targets
    _run(dense, saved["dense"]["inputs"])
    assert overflow_info(dense).forward is None  # the overflow monitor pickled under fxamp.conversion.debug works
    with pytest.raises(TypeError, match="casts assume the storage its policy chose"):
        dense.half()  # O2's storage check, pickled as fxamp.conversion.runtime.StorageCheck
    assert fxamp.conversion_info(dense).policy.float8 is not None
