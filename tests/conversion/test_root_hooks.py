"""Hooks on the root module (fxamp/conversion/capture/hooks.py: ``without_hooks``, ``copy_root_hooks``).

No capture runs them: torch.fx traces ``forward``, torch.export runs a copy of the root without them.  ``convert``
registers them on the module it returns, which calls them once per call, around its input checks (a torch.export
capture is held by a ``LazyConverted``, which runs them around its retries on other captures), with the user's
arguments, kwargs, output replacement and ``always_call`` as on the original.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.conversion.lazy import LazyConverted

pytestmark = pytest.mark.usefixtures("one_thread")

BF16 = torch.bfloat16


class Shifted(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, shift=None):
        y = self.b(torch.relu(self.a(x)))
        return y if shift is None else y + shift


class Frozen(Shifted):
    """torch.fx refuses its no_grad region: without example inputs, ``convert`` captures it lazily with torch.export."""

    def forward(self, x, shift=None):
        with torch.no_grad():
            x = x * 0.5
        return super().forward(x, shift)


def _hook(model: nn.Module, counts: collections.Counter) -> None:
    """Every kind of root hook, each counting its calls; the pre-hooks rewrite the call, the forward hook the output."""
    model.register_forward_pre_hook(lambda m, args: counts.update(["pre"]) or (args[0] * 2,))
    model.register_forward_pre_hook(
        lambda m, args, kwargs: counts.update(["pre_kwargs"]) or (args, {**kwargs, "shift": kwargs["shift"] * 3}),
        with_kwargs=True)
    model.register_forward_hook(lambda m, args, out: counts.update(["post"]) or out + 100)
    model.register_forward_hook(lambda m, args, out: counts.update(["always"]), always_call=True)
    model.register_full_backward_hook(lambda m, grad_in, grad_out: counts.update(["backward"]))


#: (model class, convert keywords, whether example inputs are given): each way a root's hooks reach a converted module
WAYS = {
    "fx": (Shifted, dict(frontend="fx"), False),
    "export": (Shifted, dict(frontend="export"), True),
    "export_lazy": (Shifted, dict(frontend="export"), False),
    "auto_lazy": (Frozen, dict(frontend="auto"), False),  # torch.fx fails, no inputs: torch.export at the first call
}


@pytest.mark.parametrize("policy", ["O0", "O1", "O2"])
@pytest.mark.parametrize("way", list(WAYS))
def test_root_hooks_run_once_per_call_with_the_users_arguments_and_output(way, policy):
    # was (torch.export): the hooks were traced into the graph, their side effects ran once, at capture
    cls, keywords, with_inputs = WAYS[way]
    torch.manual_seed(0)
    model, counts = cls(), collections.Counter()
    _hook(model, counts)
    x, shift = torch.randn(4, 8), torch.randn(4, 8)
    ref = model(x, shift=shift)
    with torch.autocast("cpu", dtype=BF16):
        ref_autocast = model(x, shift=shift).float()
    counts.clear()
    inputs = dict(example_inputs=(x,), example_kwargs={"shift": shift}) if with_inputs else {}
    amp = fxamp.convert(model, policy, dtype=BF16, **keywords, **inputs)
    assert counts == {}  # no capture ran them
    for _ in range(3):
        out = amp(x.clone().requires_grad_(), shift=shift)
        out.float().sum().backward()
        if policy == "O0":
            assert torch.equal(out, ref)
        else:
            torch.testing.assert_close(out.float(), ref_autocast, atol=2e-2, rtol=2e-2)
    amp.eval()
    with torch.no_grad():
        for _ in range(2):
            amp(x, shift=shift)
        amp(x[:1], shift=shift[:1])  # a batch of 1: outside the range of a torch.export capture from a batch of 4
    # (Frozen's input reaches the output only through its no_grad region: no input gradient, no backward hook call)
    backward = {"backward": 3} if cls is Shifted else {}
    assert counts == {"pre": 6, "pre_kwargs": 6, "post": 6, "always": 6, **backward}
    assert any(n.startswith("5 hook(s) registered on the root ") and "once per call" in n
               for n in fxamp.conversion_info(amp).notes)
    if way != "fx":  # the retries over captures run inside the module that runs the hooks
        assert isinstance(amp, LazyConverted)


@pytest.mark.parametrize("way", ["fx", "export", "export_lazy"])
def test_a_call_that_raises_runs_an_always_call_hook_once_as_the_original_does(way):
    cls, keywords, with_inputs = WAYS[way]
    model, counts = cls(), collections.Counter()
    model.register_forward_hook(lambda m, args, out: counts.update(["always"]), always_call=True)
    x, shift = torch.randn(4, 8), torch.randn(4, 8)
    amp = fxamp.convert(model, "O1", dtype=BF16, **keywords,
                        **(dict(example_inputs=(x,), example_kwargs={"shift": shift}) if with_inputs else {}))
    amp(x, shift=shift)
    bad = torch.randn(4, 5)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        model(bad, shift=shift)
    with pytest.raises(Exception):  # (each front end words it its own way)
        amp(bad, shift=shift)
    assert counts == {"always": 3}


@pytest.mark.parametrize("way", ["fx", "export"])
def test_a_handle_the_user_holds_removes_the_hook_from_the_original_only(way):
    """The user's handle refers to the original's hook table: the converted module keeps its registration,
    as its note says; a hook registered on the converted module is removed there by its own handle."""
    cls, keywords, with_inputs = WAYS[way]
    model, seen = cls(), []
    handle = model.register_forward_hook(lambda m, args, out: seen.append("original's"))
    x, shift = torch.randn(4, 8), torch.randn(4, 8)
    amp = fxamp.convert(model, "O1", dtype=BF16, **keywords,
                        **(dict(example_inputs=(x,), example_kwargs={"shift": shift}) if with_inputs else {}))
    handle.remove()
    model(x, shift=shift)
    assert seen == []
    amp(x, shift=shift)
    assert seen == ["original's"]
    note = next(n for n in fxamp.conversion_info(amp).notes if "hook(s) registered on the root" in n)
    assert "A handle from the original's register_*_hook removes the hook from the original only: the converted " \
           "module keeps calling it" in note
    own = amp.register_forward_hook(lambda m, args, out: seen.append("converted's"))
    amp(x, shift=shift)
    own.remove()
    amp(x, shift=shift)
    assert seen == ["original's", "original's", "converted's", "original's"]


class Counter:
    """A user's object whose method (or itself) is the hook: a copy of it would count where nobody looks."""

    def __init__(self):
        self.calls = 0

    def __call__(self, module, args, out):
        self.calls += 1

    def count(self, module, args, out):
        self.calls += 1


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_o2_calls_the_users_hook_objects_not_copies(frontend):
    # was: O2's copy of the model deep-copied a hook that is an object or a method of one: its count never moved
    model, by_call, by_method, inner = Shifted(), Counter(), Counter(), Counter()
    model.register_forward_hook(by_call)
    model.register_forward_hook(by_method.count)
    model.a.register_forward_hook(inner)  # a submodule's: torch.fx calls the module
    x = torch.randn(4, 8)
    if frontend == "fx":
        amp = fxamp.convert(model, "O2", dtype=BF16, frontend="fx")
    else:  # (torch.export refuses a hooked submodule: only the root's)
        model.a._forward_hooks.clear()
        amp = fxamp.convert(model, "O2", dtype=BF16, frontend="export", example_inputs=(x,), example_kwargs={"shift": x})
    for _ in range(3):
        amp(x, shift=x)
    assert (by_call.calls, by_method.calls, inner.calls) == (3, 3, 3 if frontend == "fx" else 0)


def test_report_of_a_model_with_root_hooks_under_torch_export_reports_the_graph_without_running_them():
    # was (after the root's hooks moved to a LazyConverted): report ran the LazyConverted as a graph module and failed
    model, calls = Shifted(), []
    model.register_forward_hook(lambda m, args, out: calls.append(1))
    x = torch.randn(4, 8)
    rep = fxamp.report(model, "O1", example_inputs=(x,), frontend="export")
    assert [(r.op, r.compute) for r in rep.rows if "linear" in r.op] == [("aten.linear", "bfloat16")] * 2
    assert calls == []


class ModeBranch(Shifted):
    """Its modes capture different graphs: ``convert`` holds a graph per mode in a LazyConverted, with either front end."""

    def forward(self, x):
        y = self.b(torch.relu(self.a(x)))
        return y * 2 if self.training else y


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_root_hooks_of_a_model_with_a_graph_per_mode_run_once_per_call(frontend):
    # the graph captured at convert is adopted by the LazyConverted, which holds the hooks: not registered twice
    model, calls = ModeBranch(), []
    model.register_forward_pre_hook(lambda m, args: calls.append("pre") or (args[0] * 2,))
    x = torch.randn(4, 8)
    amp = fxamp.convert(model, "O0", frontend=frontend, **({"example_inputs": (x,)} if frontend == "export" else {}))
    assert isinstance(amp, LazyConverted)
    for mode in (True, False):  # each mode's first call captures its graph
        amp.train(mode), model.train(mode)
        assert torch.equal(amp(x), model(x)) and torch.equal(amp(x[:1]), model(x[:1]))
    assert calls == ["pre"] * 8  # 4 calls of each


def test_copied_pre_hooks_run_first_in_their_order_ahead_of_the_modules_own():
    """``copy_root_hooks`` on a module with pre-hooks of its own (torch.export's input binding and checks): the
    user's see and rewrite the call's arguments first, in the order registered; forward hooks come after its own."""
    from fxamp.conversion.capture import copy_root_hooks

    original, target, order = Shifted(), Shifted(), []
    target.register_forward_pre_hook(lambda m, args: order.append(("own", float(args[0][0, 0]))))
    target.register_forward_hook(lambda m, args, out: order.append(("own post", None)))
    original.register_forward_pre_hook(lambda m, args: order.append(("a", None)) or (args[0] + 1,))
    original.register_forward_pre_hook(lambda m, args: order.append(("b", None)) or (args[0] * 10,))
    original.register_forward_hook(lambda m, args, out: order.append(("post", None)))
    copy_root_hooks(original, target)
    target(torch.zeros(1, 8))
    assert order == [("a", None), ("b", None), ("own", 10.0), ("own post", None), ("post", None)]
