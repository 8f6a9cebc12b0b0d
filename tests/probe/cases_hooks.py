"""The new-user probe, hooks: the root's under torch.export, and a ``convert_`` block's added after its first call
(hooks that change inputs or outputs, hooks removed mid-training, a Lightning-style temporary hook).

The oracle: the original float32 model with the same hooks (``like_autocast``), and the converted model's own
calls before a hook was added and after it was removed (bit for bit).
"""
from __future__ import annotations

import contextlib
import copy
from typing import Iterator, List

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp

from .runner import Cases, bitwise, like_autocast, sqnr

cases = Cases("hooks")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(F.gelu(self.lin(x)) + x)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _export(m: nn.Module, x: torch.Tensor) -> nn.Module:
    return fxamp.convert(m, "O1", frontend="export", example_inputs=(x,))


@cases.add("works")
def export_root_pre_hook_changing_the_input_registered_after_conversion():
    m, x = mlp(), torch.randn(3, 8)
    amp = _export(m, x)
    amp(x)
    amp.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    m.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    like_autocast(m, amp, x)


def _train_removing_the_hook(opt, model, x, handle, seen):
    """4 training steps, the hook removed before the third: it ran at the first two calls only."""
    for i in range(4):
        if i == 2:
            handle.remove()
        opt.zero_grad()
        out = model(x)
        assert len(seen) == min(i + 1, 2), f"call {i}: the hook ran {len(seen)} times"
        opt.backward(out.float().square().mean())
        assert opt.step()


@cases.add("works")
def export_root_forward_hook_removed_mid_training():
    m, x = mlp(), torch.randn(3, 8)
    amp = _export(m, x)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(amp.parameters(), lr=0.1), model=amp)
    seen = []
    handle = amp.register_forward_hook(lambda mod, args, out: seen.append(1) or out * 0.5)
    _train_removing_the_hook(opt, amp, x, handle, seen)
    ref = copy.deepcopy(m)
    ref.load_state_dict(opt.fp32_state_dict())
    like_autocast(ref, amp, x)


@cases.add("works")
def export_root_hooks_with_kwargs_change_a_keyword_input():
    class KW(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x, scale=None):
            return self.lin(x) * (1.0 if scale is None else scale)

    def pre(mod, args, kwargs):
        return args, {**kwargs, "scale": kwargs["scale"] * 3}

    m, x, s = KW(), torch.randn(3, 8), torch.tensor(2.0)
    amp = fxamp.convert(m, "O1", frontend="export", example_inputs=(x,), example_kwargs={"scale": s})
    amp.register_forward_pre_hook(pre, with_kwargs=True)
    m.register_forward_pre_hook(pre, with_kwargs=True)
    like_autocast(m, amp, x, scale=s)


@cases.add("works")
def export_root_full_backward_hook_scales_the_gradient():
    m, x = mlp(), torch.randn(3, 8, requires_grad=True)
    amp = _export(m, x.detach())
    for mod in (m, amp):
        mod.register_full_backward_hook(lambda mod, gin, gout: (gin[0] * 0.0,))
    for mod in (m, amp):
        x.grad = None
        mod(x).float().sum().backward()
        assert x.grad is not None and not x.grad.any(), f"{type(mod).__name__}: the hook's zero gradient was lost"


def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return Stack()


@cases.add("works")
def convert_inplace_block_hook_changing_the_output_after_the_first_call():
    m = _blocks()
    ref = copy.deepcopy(m)
    fxamp.convert_(m, "O1")
    x = torch.randn(2, 5, 8)
    m(x)
    m.blocks[1].register_forward_hook(lambda mod, args, out: out * 0.5)
    ref.blocks[1].register_forward_hook(lambda mod, args, out: out * 0.5)
    like_autocast(ref, m, x)


@cases.add("works")
def convert_inplace_pre_hook_with_kwargs_on_a_submodule_after_the_first_call():
    m = _blocks()
    ref = copy.deepcopy(m)
    fxamp.convert_(m, "O1")
    x = torch.randn(2, 5, 8)
    m(x)

    def pre(mod, args, kwargs):
        return (args[0] + 1.0,), kwargs

    m.blocks[2].lin.register_forward_pre_hook(pre, with_kwargs=True)
    ref.blocks[2].lin.register_forward_pre_hook(pre, with_kwargs=True)
    like_autocast(ref, m, x)


@cases.add("works")
def convert_inplace_hook_removed_mid_training():
    # a hook that doubles a block's Linear's output, added after the first call, runs for two steps and is removed;
    # the model then computes as the float32 original with the masters' weights
    m = _blocks()
    fxamp.convert_(m, "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), model=m)
    x = torch.randn(2, 5, 8)
    m(x)
    seen = []
    handle = m.blocks[0].lin.register_forward_hook(lambda mod, args, out: seen.append(1) or out * 2.0)
    _train_removing_the_hook(opt, m, x, handle, seen)
    ref = _blocks()
    ref.load_state_dict(opt.fp32_state_dict())
    like_autocast(ref, m, x)


@contextlib.contextmanager
def _capture_activations(model: nn.Module, names: List[str], into: dict) -> Iterator[None]:
    """What Lightning-style callbacks do: forward hooks for one call, then removed."""
    handles = [model.get_submodule(n).register_forward_hook(
        lambda mod, args, out, n=n: into.__setitem__(n, out.detach())) for n in names]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@cases.add("works")
def lightning_style_temporary_hook_collects_activations_and_leaves_no_trace():
    m = _blocks()
    ref = copy.deepcopy(m)
    fxamp.convert_(m, "O1")
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        before = m(x)
        got, want = {}, {}
        names = ["blocks.0", "blocks.1.lin", "head"]
        with _capture_activations(m, names, got):
            m(x)
        with _capture_activations(ref, names, want):
            ref(x)
        assert got.keys() == want.keys() == set(names), f"hooks ran for {sorted(got)}"
        for n in names:
            assert sqnr(want[n], got[n].float()) > 20, f"{n}: the activation seen is not the model's"
        bitwise(m(x), before, "a call after the hooks were removed")
        with _capture_activations(m, names, got):  # again, on the same blocks
            m(x)
    assert len(got) == 3


@cases.add("works")
def convert_inplace_full_backward_hook_on_a_block_after_the_first_call():
    m = _blocks()
    ref = copy.deepcopy(m)
    fxamp.convert_(m, "O1")
    x = torch.randn(2, 5, 8)
    m(x)
    seen = []
    for mod in (m, ref):
        mod.blocks[1].register_full_backward_hook(lambda mod, gin, gout: seen.append(gout[0].shape))
    for mod in (m, ref):
        mod(x).float().sum().backward()
    assert seen == [(2, 5, 8), (2, 5, 8)], seen
    for (n, p), q in zip(ref.named_parameters(), m.parameters()):
        assert sqnr(p.grad, q.grad) > 15, f"{n}: gradient {sqnr(p.grad, q.grad):.1f} dB against float32"


@cases.add("works")
def fx_root_forward_hook_added_and_removed_between_calls():
    m, x = mlp(), torch.randn(3, 8)
    amp = fxamp.convert(m, "O2")
    with torch.no_grad():
        before = amp(x)
        handle = amp.register_forward_hook(lambda mod, args, out: out - 1.0)
        bitwise(amp(x), before - 1.0, "the hooked call")
        handle.remove()
        bitwise(amp(x), before, "after handle.remove()")


@cases.add("works")
def global_module_hook_after_the_first_call_runs_around_each_block_as_documented():
    # docs/conversion.md: a global module hook registered after conversion runs around the modules called (each
    # convert_ block, the glue, the root), never inside a graph (a block's Linear is inlined there); the numbers
    # are the converted model's own, bit for bit
    m = _blocks()
    fxamp.convert_(m, "O1")
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        before = m(x)
        seen = []
        handle = nn.modules.module.register_module_forward_hook(lambda mod, a, out: seen.append(type(mod).__name__))
        try:
            out = m(x)
        finally:
            handle.remove()
        bitwise(out, before, "a call with a global hook")
        bitwise(m(x), before, "after handle.remove()")
    assert seen.count("Block") == 3 and seen[-2:] == ["Linear", "Stack"], seen
