"""Hooks registered after ``fxamp.convert_`` on a submodule of a converted block (fxamp/conversion/families.py).

A family's graph runs inline the submodules its capture traced through (a Linear, a module of the user's own),
where a hook never runs.  Each block call checks its submodules' hook tables (``hook_watch``); a hook that came
after conversion (before or after the first call) moves the block to a family of its own, which captures with
the hooked module kept as a call (or runs as written where no front end can), warned once; ``handle.remove()``
takes it back to its family's graphs.  Hooks on the block itself run around its forward, as nn.Module calls
them; global module hooks registered after the first call run around each block, as around a ``convert``ed
module (``tests/conversion/test_hooks.py`` has the hooks present at conversion).
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.conversion.blocks import family_of
from tests.conversion.test_hooks import Blocks, Branchy, Plain, calls  # (Branchy: captured on the call's values;
#   Plain: by torch.fx)

pytestmark = pytest.mark.usefixtures("one_thread")


AFTER = "were registered after conversion"


def _register(module, counts, label=""):
    """A forward pre-hook, a forward hook that halves the output (its effect shows in the numbers) and a full
    backward hook, each counting its calls."""
    return [module.register_forward_pre_hook(lambda m, args: counts.append(f"{label}pre")),
            module.register_forward_hook(lambda m, args, out: counts.append(f"{label}post") or out * 0.5),
            module.register_full_backward_hook(lambda m, gin, gout: counts.append(f"{label}bwd"))]


def _autocast(model, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x).float()


def _captures(model):
    """The captures of the blocks' family and of those its instances moved to (its kin), so far."""
    return sum(f.captures for f in family_of(model.layers[0]).kin.values())


@pytest.mark.parametrize("called", [False, True], ids=["before-first-call", "after-first-call"])
@pytest.mark.parametrize("hooked", [0, 1])
@pytest.mark.parametrize("block", [Plain, Branchy])
def test_a_hook_registered_after_convert_in_place_runs_at_every_call(block, hooked, called):
    # was: the block ran its family's graph, captured from an instance whose Linear had no hook and inlined it:
    # the hooks on layers.<hooked>.lin never ran (nor did the halving forward hook change the numbers)
    torch.manual_seed(0)
    model, counts = Blocks(block), []
    x = torch.randn(2, 3, 8)
    plain_ref = _autocast(model, x)
    handles = _register(model.layers[hooked].lin, counts)
    hooked_ref = _autocast(model, x)
    for h in handles:
        h.remove()
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Branchy runs as written for the first call of a block not hooked)
        if called:
            torch.testing.assert_close(model(x).float(), plain_ref, atol=3e-2, rtol=3e-2)
    handles = _register(model.layers[hooked].lin, counts)
    counts.clear()
    said = calls(model, x, hooked_ref)
    assert counts == ["pre", "post", "bwd"] * 3 + ["pre", "post"] * 3
    moved = [s for s in said if AFTER in s]
    assert len(moved) == 1, said
    assert f"hooks on 'layers.{hooked}.lin' (forward pre-hook, forward hook, backward hook) {AFTER}" in moved[0]
    assert f"block 'layers.{hooked}' ({block.__name__})" in moved[0]
    assert family_of(model.layers[hooked]).hooked == ("lin",)
    # removed: the hooks stop and the block runs its family's graphs again, which need no new capture
    for h in handles:
        h.remove()
    captures = _captures(model)
    counts.clear()
    assert not [s for s in calls(model, x, plain_ref) if AFTER in s]
    assert counts == []
    assert family_of(model.layers[0]) is family_of(model.layers[1])
    assert sorted(family_of(model.layers[0]).paths) == ["layers.0", "layers.1"]
    assert _captures(model) == captures


def test_every_instance_hooked_the_same_way_shares_one_new_family():
    torch.manual_seed(0)
    model = Blocks(Plain)
    model.layers.append(Plain())
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    x = torch.randn(2, 3, 8)
    model(x)
    counts = []
    for i in (1, 2):
        model.layers[i].lin.register_forward_hook(lambda m, args, out, i=i: counts.append(i))
    with pytest.warns(RuntimeWarning, match=r"hooks on 'layers\.1\.lin' \(forward hook\) " + AFTER) as caught:
        model(x)
    assert sum(AFTER in str(w.message) for w in caught) == 1  # one warning: layers.2 joins the family layers.1 made
    moved = family_of(model.layers[1])
    assert moved is family_of(model.layers[2]) and moved is not family_of(model.layers[0])
    assert moved.paths == ["layers.1", "layers.2"] and family_of(model.layers[0]).paths == ["layers.0"]
    assert moved.captures == 1 and counts == [1, 2]


def test_a_hook_removed_before_the_first_call_leaves_the_other_instances_hooks_running():
    # was: both instances were one family (both hooked at conversion); layers.0, its hook removed, captured the
    # family's graph with its Linear inlined, and layers.1 ran that graph: its hook never ran
    model, counts = Blocks(Plain), []
    handle = model.layers[0].lin.register_forward_hook(lambda m, args, out: counts.append(0))
    model.layers[1].lin.register_forward_hook(lambda m, args, out: counts.append(1))
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    handle.remove()
    x = torch.randn(2, 3, 8)
    for _ in range(3):
        model(x)
    assert counts == [1, 1, 1]
    assert family_of(model.layers[0]).hooked == () and family_of(model.layers[1]).hooked == ("lin",)


def test_hooks_on_the_block_itself_run_around_its_graph_with_no_new_capture():
    torch.manual_seed(0)
    model, counts = Blocks(Plain), []
    x = torch.randn(2, 3, 8)
    handles = _register(model.layers[1], counts)
    ref = _autocast(model, x)
    for h in handles:
        h.remove()
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    model(x)
    captures = _captures(model)
    _register(model.layers[1], counts)
    counts.clear()
    assert calls(model, x, ref) == []  # no warning: nn.Module calls the block's own hooks around its forward
    assert counts == ["pre", "post", "bwd"] * 3 + ["pre", "post"] * 3
    assert _captures(model) == captures and family_of(model.layers[0]) is family_of(model.layers[1])


def test_a_global_module_hook_after_the_first_call_runs_around_each_block_as_around_a_converted_model():
    # as fxamp.convert's module: a global hook registered after conversion runs around the modules called, once
    # each per call, the blocks and the root here (a whole-model graph: the root), never inside a graph
    model = Blocks(Plain)
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    x = torch.randn(2, 3, 8)
    ref = model(x)
    captures, seen = _captures(model), []
    handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: seen.append(type(m).__name__))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(2):
                torch.testing.assert_close(model(x), ref)
    finally:
        handle.remove()
    assert seen == ["Plain", "Plain", "Blocks"] * 2 and _captures(model) == captures


def test_a_global_module_hook_before_the_first_call_runs_everywhere_then_the_blocks_capture_once_removed():
    # no front end captures while a global hook is registered (it would run once, at capture): the blocks run as
    # written, the hook around every module; was: they ran as written for good, float32, after handle.remove()
    torch.manual_seed(0)
    model = Blocks(Plain)
    x = torch.randn(2, 3, 8)
    ref, fp32 = _autocast(model, x), model(x)
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    seen = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: seen.append(type(m).__name__))
    try:
        with pytest.warns(RuntimeWarning, match=r"block 'layers\.0' \(Plain\) and the 1 other\(s\) of its family "
                                                r"run\(s\) as written .*a global module hook is registered"):
            out = model(x)
        model(x)
    finally:
        handle.remove()
    assert seen == (["Linear", "Linear", "Plain"] * 2 + ["Blocks"]) * 2
    torch.testing.assert_close(out, fp32)  # (as written: float32)
    family = family_of(model.layers[0])
    assert family.captures == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(model(x).float(), ref, atol=3e-2, rtol=3e-2)
    assert family.captures == 1 and not family.as_written


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_model_whose_block_moved_keeps_its_own_families(how):
    model, counts = Blocks(Plain), []
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    x = torch.randn(2, 3, 8)
    model(x)
    handle = model.layers[1].lin.register_forward_hook(Counter(counts))
    with pytest.warns(RuntimeWarning, match=AFTER):
        model(x)
    copied = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    handle.remove()  # the original's hook only: the copy keeps its copy of it
    model(x)
    assert family_of(model.layers[1]) is family_of(model.layers[0])
    assert family_of(copied.layers[1]).hooked == ("lin",) and family_of(copied.layers[1]).paths == ["layers.1"]
    assert family_of(copied.layers[0]).paths == ["layers.0"]  # (the original's move back did not reach it)
    hook = next(iter(copied.layers[1].lin._forward_hooks.values()))
    before = len(hook.counts)
    copied(x)
    assert len(hook.counts) == before + 1 and len(counts) == 1


class Counter:
    """A forward hook that pickles (a lambda does not)."""

    def __init__(self, counts):
        self.counts = counts

    def __call__(self, module, args, out):
        self.counts.append(out.dtype)
