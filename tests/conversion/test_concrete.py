"""torch.fx tracing with the values of one call (fxamp/conversion/capture/concrete.py): shapes unpacked and
branched on, each branch guarded (early: nothing ran; late: after an object's method ran), a branch on tensor
data refused, opaque objects as inputs whose methods run at every call, buffers read as graph values."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fxamp.conversion.capture.concrete import LATE_BRANCH, ConcreteFxFrontEnd, GuardFailed, LateGuardFailed, guard
from fxamp.errors import FxampError, TraceError


def trace(model, *values):
    return ConcreteFxFrontEnd(model, list(values)).trace()


def guards(gm):
    return [n.args[1:] for n in gm.graph.nodes if n.op == "call_function" and n.target is guard]


def test_guard_passes_on_the_captured_branch_and_says_early_or_late_otherwise():
    guard(torch.tensor(3) > 2, True, early=True)
    guard(0, False, early=False)
    with pytest.raises(GuardFailed):
        guard(1, False, early=True)
    with pytest.raises(LateGuardFailed, match="convert the model whole with fxamp.convert") as e:
        guard(False, True, early=False)
    assert isinstance(e.value, FxampError) and str(e.value) == LATE_BRANCH
    assert not issubclass(GuardFailed, FxampError)  # an early one is the caller's signal, not the user's error


class Heads(nn.Module):
    def forward(self, x):
        return x.view(*x.shape[:-1], 2, -1).sum(-1)  # plain torch.fx cannot unpack a proxy's shape


def test_an_unpacked_shape_traces_with_its_rank_guarded_and_its_sizes_symbolic():
    with pytest.raises(Exception):
        torch.fx.symbolic_trace(Heads())
    x = torch.randn(3, 4, 6)
    gm = trace(Heads(), x)
    assert torch.equal(gm(x), Heads()(x))
    other = torch.randn(5, 2, 8)  # other sizes, the same rank: the same graph serves
    assert torch.equal(gm(other), Heads()(other))
    assert guards(gm) and all(early for _, early in guards(gm))
    with pytest.raises(GuardFailed):
        gm(torch.randn(4, 6))  # another rank: the caller captures another variant


class Branch(nn.Module):
    def forward(self, x):
        if x.shape[0] > 2:
            return x * 2
        return x - 1


def test_a_branch_on_a_shape_keeps_the_calls_branch_and_guards_it():
    gm = trace(Branch(), torch.randn(3, 2))
    assert guards(gm) == [(True, True)]
    assert "sub" not in gm.code  # the other branch is not in the graph
    x = torch.randn(7, 2)
    assert torch.equal(gm(x), x * 2)
    with pytest.raises(GuardFailed):
        gm(torch.randn(2, 2))
    small = trace(Branch(), torch.randn(1, 2))
    assert guards(small) == [(False, True)] and torch.equal(small(torch.ones(2, 2)), torch.zeros(2, 2))


class PadToBlocks(nn.Module):
    """LongT5's ``_pad_to_multiple``: a list built from the rank, changed, then read."""

    def forward(self, x):
        pad = [(0, 0)] * x.ndim
        pad[1] = (0, -x.shape[1] % 3)
        pad = sum(pad[::-1], ())
        x = nn.functional.pad(x, pad)
        return x.reshape(x.shape[0], x.shape[1] // 3, 3, x.shape[2])


def test_a_list_the_code_changes_is_read_after_the_change():
    """The reads of a list after a write to it stay after the write (the shape arithmetic guards read moves up):
    the read ``pad[::-1]`` moved above ``pad[1] = ...`` padded nothing (LongT5 in place failed at its first
    call).  The write is no side effect: the guards after it stay early."""
    x = torch.randn(2, 8, 4)
    gm = trace(PadToBlocks(), x)
    for n in (8, 7, 9, 3):
        y = torch.randn(2, n, 4)
        assert torch.equal(gm(y), PadToBlocks()(y))
    assert all(early for _, early in guards(gm))
    code = gm.code
    assert code.index("] = (0, ") < code.index("[slice(None, None, -1)]")


class Unsqueezed(nn.Module):
    def forward(self, x):
        y = x * 2
        y.unsqueeze_(1)  # an in-place method that changes the shape: the reads after it see the new one
        return y.reshape(y.shape[0], y.shape[1], -1)


def test_a_shape_read_after_an_in_place_reshape_reads_the_new_shape():
    """A shape read stays after an in-place method that changes the tensor's shape (unsqueeze_, transpose_, t_,
    ...): moved above it, the graph read (3, 4) and returned a (3, 4, 1) tensor for eager's (3, 1, 4), silently."""
    x = torch.randn(3, 4)
    gm = trace(Unsqueezed(), x)
    for y in (x, torch.randn(5, 2)):
        assert gm(y).shape == Unsqueezed()(y).shape and torch.equal(gm(y), Unsqueezed()(y))


class Flagged(nn.Module):
    def forward(self, x):
        y = x * 2
        y.requires_grad_()
        return y + 1 if y.requires_grad else y - 1


def test_a_flag_read_after_an_in_place_method_that_sets_it_reads_the_new_flag():
    x = torch.randn(3, 4)
    gm = trace(Flagged(), x)
    assert guards(gm) == [(True, True)] and torch.equal(gm(x), x * 2 + 1)


class Lengths(nn.Module):
    def forward(self, x):
        n = len(x)  # a tensor's first dim
        return x.reshape(n, -1) * len(x.shape)


def test_len_of_a_tensor_or_a_shape_is_its_value_guarded():
    gm = trace(Lengths(), torch.ones(2, 3, 4))
    assert torch.equal(gm(torch.ones(2, 3, 4)), torch.full((2, 12), 3.0))
    with pytest.raises(GuardFailed):
        gm(torch.ones(5, 3, 4))  # len(x) was 2 at the capture


class DataBranch(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


def test_a_branch_on_tensor_data_is_refused():
    with pytest.raises(TraceError, match=r"a Python branch on tensor data \(.*\) cannot be captured") as e:
        trace(DataBranch(), torch.ones(2))
    assert isinstance(e.value, FxampError)


class Cache:
    """A KV cache as Hugging Face writes them: an object whose update rebinds its tensors."""

    def __init__(self):
        self.keys = torch.zeros(1, 0)
        self.updates = 0

    def update(self, k):
        self.keys = torch.cat([self.keys, k], 1)
        self.updates += 1
        return self.keys


class Attend(nn.Module):
    def forward(self, k, cache):
        kv = cache.update(k)
        if kv.shape[1] > 2:  # read after the update: a late guard
            return kv.sum(1)
        return kv.mean(1)


def test_an_opaque_objects_method_runs_at_every_call_and_not_on_the_users_object_while_tracing():
    cache = Cache()
    gm = trace(Attend(), torch.ones(1, 2), cache)
    assert cache.updates == 0 and cache.keys.shape == (1, 0)  # the trace ran the update on a copy
    assert "cache.update(k)" in gm.code
    assert torch.equal(gm(torch.ones(1, 1), cache), torch.ones(1))  # kv has 1 column: the captured branch
    assert torch.equal(gm(torch.ones(1, 1), cache), torch.ones(1))  # 2 columns: still the mean
    assert cache.updates == 2 and cache.keys.shape == (1, 2)


def test_a_guard_after_an_objects_method_is_late_and_fails_after_the_method_ran():
    cache = Cache()
    gm = trace(Attend(), torch.ones(1, 2), cache)
    assert guards(gm) == [(False, False)]  # after an effect: late
    with pytest.raises(LateGuardFailed, match="use_cache=False"):
        gm(torch.ones(1, 3), cache)  # 3 columns: the other branch, found out after the update
    assert cache.updates == 1  # the update ran: the caller must undo it (calls.undo_point) or fail


class ReadsState(nn.Module):
    def forward(self, k, cache):
        if cache.updates > 0:  # the object's state, before any method: an early guard
            k = k * 2
        return cache.update(k)


def test_a_branch_on_an_objects_state_before_its_methods_is_early():
    cache = Cache()
    gm = trace(ReadsState(), torch.ones(1, 1), cache)
    assert guards(gm) == [(False, True)]
    gm(torch.ones(1, 1), cache)
    with pytest.raises(GuardFailed):
        gm(torch.ones(1, 1), cache)  # now updated once: the other branch, and nothing ran
    assert cache.updates == 1


class Special(Cache):
    pass


class Typed(nn.Module):
    def forward(self, k, cache):
        if isinstance(cache, Special):  # the call's type is part of its key: the branch is the call's
            k = k + 1
        return cache.update(k)


def test_isinstance_of_an_opaque_object_is_its_type():
    assert torch.equal(trace(Typed(), torch.zeros(1, 1), Special())(torch.zeros(1, 1), Special()), torch.ones(1, 1))
    assert torch.equal(trace(Typed(), torch.zeros(1, 1), Cache())(torch.zeros(1, 1), Cache()), torch.zeros(1, 1))


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)))

    def forward(self, x):
        self.count.add_(1)  # a buffer changed in place by forward (a batch norm's counter)
        t = x.shape[0]
        return x @ self.mask[:t, :t] + self.count


def test_buffers_are_graph_values_and_change_at_the_graphs_calls_not_during_the_trace():
    model = Counter()
    x = torch.ones(3, 3)
    gm = trace(model, x)
    assert model.count.item() == 0  # the trace ran on a copy of the buffer
    assert {n.target for n in gm.graph.nodes if n.op == "get_attr"} >= {"count", "mask"}  # read, not baked in
    expected = Counter()(x)
    assert torch.equal(gm(x), expected) and model.count.item() == 1
    with torch.no_grad():
        model.mask.zero_()  # this instance's mask, read at the call
    assert torch.equal(gm(x), torch.full((3, 3), 2.0))



def test_the_report_names_guards_lengths_and_an_objects_methods_not_unlisted_ops():
    """fxamp's own guards, ``len`` of a shape and an object's method (a cache's ``update``, not ``Tensor.update``) are
    decided like the ops around them, each with its reason: nothing the capture added is 'on no list'."""
    import fxamp

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, cache):
            kv = cache.update(self.fc(x))
            if len(kv.shape) == 2 and kv.shape[1] > 2:
                return kv.sum(1, keepdim=True)
            return kv.mean(1, keepdim=True)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block()])

        def forward(self, x, cache):
            return sum(layer(x, cache) for layer in self.layers)

    model = Net()
    fxamp.convert_(model, "O2", dtype=torch.bfloat16)
    model(torch.ones(1, 4), Cache())
    rows = fxamp.report(model).rows
    assert not [r.op for r in rows if r.category.value == "unlisted"]
    ops = {r.op: r for r in rows}
    assert "Cache.update" in ops and "Tensor.update" not in ops and "a method of the Cache" in ops["Cache.update"].reason
    assert "branch guard fxamp inserted" in next(r.reason for r in rows if r.op.endswith("concrete.guard"))


def _maybe_autocast(device_type, enabled=False):
    """Hugging Face's ``maybe_autocast``, as Nemotron's norm calls it in every block: a region only where autocast
    is on or asked for; it asks ``torch.is_autocast_enabled`` with the device type, a string."""
    import contextlib

    if torch.is_autocast_enabled(device_type) or enabled:
        return torch.autocast(device_type, enabled=enabled)
    return contextlib.nullcontext()


class NormedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        b, n, _ = x.shape  # (plain torch.fx cannot unpack it: the capture with the call's values runs)
        with _maybe_autocast(device_type=x.device.type, enabled=False):
            h = self.norm(x.float())
        return self.lin(h).view(b, n, 2, 4)


def test_a_device_type_read_is_its_value_and_the_signature_holds_it():
    """``x.device.type`` was a proxy, which torch.is_autocast_enabled refused ("unpackString"): every block of
    Nemotron ran as written, in float32. The device type is the call's, and the call's key holds each tensor's."""
    import warnings

    import fxamp
    from fxamp.conversion.calls import flatten_call

    x = torch.randn(2, 4, 8)
    gm = trace(NormedBlock(), x)
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and n.target is getattr and n.args[1] == "type"]
    torch.manual_seed(0)
    model = nn.Sequential(NormedBlock(), nn.Flatten(2), NormedBlock())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no block runs as written
        amp = fxamp.convert_(nn.Sequential(*[m for m in model]), "O1", dtype=torch.bfloat16)
        out = amp[0](x)
    want = model[0](x)
    assert not torch.equal(out, want) and torch.allclose(out, want, atol=0.05)  # (converted: bfloat16 matmuls)
    assert flatten_call((x,), {})[0] == ((("T", torch.float32, 3, "cpu"),), ())
