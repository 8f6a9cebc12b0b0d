"""Packed small masters (fxamp.training.packed_step): bitwise the per-parameter step, invisible outside step()."""

import copy
import io

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp import MixedPrecisionOptimizer
from fxamp.training import optimizer as O

from test_optimizer import assert_bitwise, refreshed

BF16, F16 = torch.bfloat16, torch.float16
INF = float("inf")

pytestmark = pytest.mark.usefixtures("one_thread")


class Stack(nn.Module):
    """Small layers (packed), a wide one (its weight is over _CAT_NUMEL: not packed; its bias is), and a
    layer outside the graph (it stays float32 and gets no gradient)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.wide = nn.Linear(8, 200)
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.wide(x)


INNERS = {
    "SGD": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "SGD-nesterov-foreach": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
    "SGD-plain": lambda g: torch.optim.SGD(g, lr=0.1),
    "SGD-fused": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, fused=True),
    "Adam": lambda g: torch.optim.Adam(g, lr=1e-2),
    "AdamW-foreach-amsgrad": lambda g: torch.optim.AdamW(g, lr=1e-2, foreach=True, amsgrad=True),
    "AdamW-fused": lambda g: torch.optim.AdamW(g, lr=1e-2, fused=True),
    "RMSprop": lambda g: torch.optim.RMSprop(g, lr=1e-3, momentum=0.5),
    "Adagrad": lambda g: torch.optim.Adagrad(g, lr=1e-2),
    "NAdam": lambda g: torch.optim.NAdam(g, lr=1e-2),
    "RAdam": lambda g: torch.optim.RAdam(g, lr=1e-2),
    "Rprop": lambda g: torch.optim.Rprop(g, lr=1e-2),
    "ASGD": lambda g: torch.optim.ASGD(g, lr=1e-2),
}


def _groups(model):
    named = dict(model.named_parameters())
    return [{"params": [p for n, p in named.items() if n.startswith(("layers.0", "layers.1"))], "lr": 0.05},
            {"params": [p for n, p in named.items() if not n.startswith(("layers.0", "layers.1"))]}]


def _build(make, dtype, loss_scale="auto"):
    torch.manual_seed(0)
    model = fxamp.convert(Stack(), "O2", dtype=dtype)
    return model, MixedPrecisionOptimizer(make(_groups(model)), model=model, loss_scale=loss_scale)


def _snapshot(model, opt):
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "masters": [m.detach().clone() for m in opt.master_params()],
            "state": copy.deepcopy(opt.optimizer.state_dict()["state"])}


def _train(monkeypatch, make, dtype, packed, steps=5, between=None):
    """Steps of the same model with packing on or off; a snapshot after each; step 2 overflows, and at
    step 3 layers.3 has no gradient (as a branch not taken would leave it)."""
    if not packed:
        monkeypatch.setattr(O._Bucket, "pack", lambda self, pack_groups: [])
    model, opt = _build(make, dtype, loss_scale="dynamic" if dtype == F16 else "auto")
    shots = _steps(model, opt, range(steps), between)
    monkeypatch.undo()
    return model, opt, shots


def _steps(model, opt, steps, between=None):
    shots = []
    for step in steps:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        opt.backward(model(x).float().square().mean())
        if step == 2:
            model.layers[1].weight.grad.view(-1)[3] = INF
        if step == 3:
            model.layers[3].weight.grad = None
        assert bool(opt.step()) == (step != 2)
        assert refreshed(opt)
        if between is not None:
            between(step, model, opt)
        shots.append(_snapshot(model, opt))
    return shots


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("inner", list(INNERS))
def test_packed_step_is_bitwise_the_per_parameter_step(inner, dtype, monkeypatch):
    """Weights, masters and the inner optimizer's state_dict after every step: equal bit for bit, with
    two param groups (the first with its own lr), an unpacked wide weight, a step where one member of
    a pack has no gradient, a skipped step, and float16's dynamic scale."""
    _, packed, got = _train(monkeypatch, INNERS[inner], dtype, packed=True)
    _, _, want = _train(monkeypatch, INNERS[inner], dtype, packed=False)
    assert_bitwise(got, want)
    packs = packed._plan.packs
    # layers.0-1 (group 0): a weight pack and a bias pack; layers.2-3 (group 1) the same, wide.bias with them
    assert sorted((p.group, tuple(p.flat.shape)) for p in packs) == [(0, (16,)), (0, (16, 8)), (1, (16, 8)), (1, (216,))]
    # the last step was packed, but for the pack of layers.3.weight under an optimizer that counts
    # steps per parameter: that member missed step 3, its count differs from the others' for good
    counts = any(torch.is_tensor(v) and v.dim() == 0 for st in packed.optimizer.state.values() for v in st.values())
    assert {(p.group, p.flat.dim()): p.state is not None for p in packs} == {
        (0, 1): True, (0, 2): True, (1, 1): True, (1, 2): not counts}
    inner_state = packed.optimizer.state
    assert all(p.flat not in inner_state for p in packs)  # the packs never show outside step()
    assert set(map(id, inner_state)) <= set(map(id, packed.master_params()))


def test_members_are_views_of_the_pack_and_their_state_too(monkeypatch):
    model, opt, _ = _train(monkeypatch, INNERS["Adam"], BF16, packed=True, steps=3)
    pack = next(p for p in opt._plan.packs if p.group == 1 and p.flat.dim() == 2)
    for m, (start, end) in zip(pack.members, pack.bounds):
        assert m.data_ptr() == pack.flat[start:end].data_ptr()
        state = opt.optimizer.state[m]
        assert state["exp_avg"].data_ptr() == pack.state["exp_avg"][start:end].data_ptr()
        assert state["step"] is not pack.state["step"] and torch.equal(state["step"], pack.state["step"])
    steps = [opt.optimizer.state[m]["step"] for m in pack.members]
    assert len({id(s) for s in steps}) == len(steps)  # stepped alone later, each counts its own


def test_a_member_without_gradient_is_not_stepped_and_its_pack_steps_the_rest_one_by_one(monkeypatch):
    """At step 3 the pack holding layers.3.weight has a member without gradient: its members are
    stepped one by one (layers.3.weight not at all), the other packs as packs; at step 4 it packs again."""
    seen = {}

    def look(step, model, opt):
        if step == 2:
            seen["before"] = model.layers[3].weight.detach().clone()
        if step == 3:
            seen["after"] = model.layers[3].weight.detach().clone()
            seen["packed"] = {(p.group, p.flat.dim()): p.state is not None for p in opt._plan.packs}

    _, opt, _ = _train(monkeypatch, INNERS["SGD"], BF16, packed=True, between=look)
    assert torch.equal(seen["before"], seen["after"])
    assert seen["packed"] == {(0, 1): True, (0, 2): True, (1, 1): True, (1, 2): False}
    assert all(p.state is not None for p in opt._plan.packs)


def test_resume_into_packed_and_unpacked_optimizers_is_bitwise(monkeypatch):
    """A checkpoint of a packed optimizer has per-parameter state; it resumes bit for bit into a packed
    and into an unpacked optimizer (loading gathers the members' state into the packs again)."""
    make = INNERS["AdamW-foreach-amsgrad"]
    saved = {}

    def save_at_2(step, model, opt):
        if step == 1:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
            saved["bytes"] = buf.getvalue()

    _, _, full = _train(monkeypatch, make, BF16, packed=True, between=save_at_2)
    for packed in (True, False):
        if not packed:
            monkeypatch.setattr(O._Bucket, "pack", lambda self, pack_groups: [])
        model, opt = _build(make, BF16)
        ckpt = torch.load(io.BytesIO(saved["bytes"]))
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        assert_bitwise(_steps(model, opt, range(2, 5)), full[2:])
        monkeypatch.undo()


def test_packs_and_segmented_steps_alternate_bitwise(monkeypatch):
    """A segmented step (no unscale_) steps the members one by one; the next plain step gathers their
    state into the packs again: the same as never packing, Adam's step counts included."""
    def segmenting(monkeypatch):
        monkeypatch.setattr(O, "_RELEASE_MIN_BYTES", 0)

    def train(packed):
        segmenting(monkeypatch)
        if not packed:
            monkeypatch.setattr(O._Bucket, "pack", lambda self, pack_groups: [])
        model, opt = _build(INNERS["Adam"], BF16)
        shots = []
        for step in range(7):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            opt.backward(model(x).float().square().mean())
            if step % 3 == 0:
                opt.unscale_()  # the plain (packed) step
            assert opt.step()
            assert (opt._plan.runs is not None) or step == 0
            shots.append(_snapshot(model, opt))
        monkeypatch.undo()
        return opt, shots

    opt, got = train(True)
    _, want = train(False)
    assert_bitwise(got, want)
    assert opt._plan.packs and all(p.state is not None for p in opt._plan.packs)  # the last step (plain) packed again


def test_lr_scheduler_and_a_late_step_hook(monkeypatch):
    """A scheduler's lr reaches the packs (they are stepped inside their group); a step hook added
    later turns packing off (it would see the packs), and the hook runs once per step."""
    calls = []

    def between(step, model, opt):
        sched.step()
        if step == 2:
            opt.optimizer.register_step_post_hook(lambda o, a, k: calls.append(len(o.param_groups[1]["params"])))

    def train(packed):
        global sched
        if not packed:
            monkeypatch.setattr(O._Bucket, "pack", lambda self, pack_groups: [])
        model, opt = _build(INNERS["SGD"], BF16)
        sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)
        shots = []
        for step in range(5):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            opt.backward(model(x).float().square().mean())
            opt.step()
            between(step, model, opt)
            shots.append(_snapshot(model, opt))
        assert bool(opt._plan.packs) == packed
        monkeypatch.undo()
        return shots

    got = train(True)
    n = len(calls)
    want = train(False)
    assert_bitwise(got, want)
    assert calls[:n] == [8, 8]  # every member of group 1 in it: the hook saw no pack


def test_inner_optimizer_stepped_directly_is_noticed(monkeypatch):
    """A step of the inner optimizer behind the wrapper's back moves every member's step count: the
    next packed step gathers the members' state again instead of using the pack's stale count."""
    def train(packed):
        if not packed:
            monkeypatch.setattr(O._Bucket, "pack", lambda self, pack_groups: [])
        model, opt = _build(INNERS["Adam"], BF16)
        for step in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            opt.backward(model(x).float().square().mean())
            if step == 1:
                opt.unscale_()
                opt.optimizer.step()  # the masters' gradients are there: a plain step of theirs
                opt.zero_grad()
                opt.backward(model(x).float().square().mean())
            opt.step()
        monkeypatch.undo()
        return _snapshot(model, opt)

    assert_bitwise(train(True), train(False))


def test_adopted_masters_are_not_packed():
    """fxamp.initialize makes the original model's parameters the masters: the user's tensors, left
    where they are."""
    torch.manual_seed(0)
    original = Stack()
    ptrs = [p.data_ptr() for p in original.parameters()]
    model, opt = fxamp.initialize(original, torch.optim.SGD(original.parameters(), lr=0.1, momentum=0.9),
                                  policy="O2", dtype=BF16)
    opt.zero_grad()
    opt.backward(model(torch.randn(4, 8)).float().square().mean())
    assert opt.step()
    assert opt._plan.packs == []
    assert [p.data_ptr() for p in original.parameters()] == ptrs


def test_a_deep_copy_steps_its_own_members(monkeypatch):
    """copy.deepcopy of the model and optimizer together (a Parameter's deep copy is a clone): the copy's
    members are views of the copy's packs and its packs read the copy's gradients; trained on alone,
    it is the per-parameter step."""
    make = INNERS["AdamW-foreach-amsgrad"]
    model, opt, _ = _train(monkeypatch, make, BF16, packed=True, steps=2)
    model2, opt2 = copy.deepcopy((model, opt))
    for pack in opt2._plan.packs:
        assert all(m.data_ptr() == pack.flat[s:e].data_ptr() for m, (s, e) in zip(pack.members, pack.bounds))
    got = _steps(model2, opt2, range(2, 6))  # the original is not stepped again: its gradients go stale
    _, _, want = _train(monkeypatch, make, BF16, packed=False, steps=6)
    assert_bitwise(got, want[2:])
    assert all(p.state is not None for p in opt2._plan.packs if p.group == 0)
