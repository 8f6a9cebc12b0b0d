"""A block's call as a graph sees it (fxamp/conversion/calls.py): the key a call is cached under, its leaves
(graph inputs), the tree a call is rebuilt from, placeholder names, the module torch.fx traces for one call,
and the way back when a late guard fails."""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from fxamp.conversion.calls import bound_root, describe_call, flatten_call, leaf_names, rebuild_call, undo_point


class Cache:
    """An opaque object, as a KV cache is: neither a tensor nor a constant."""

    def __init__(self, keys=None):
        self.keys = torch.zeros(1, 0) if keys is None else keys
        self.seen = []

    def update(self, k):
        self.keys = torch.cat([self.keys, k], 1)  # rebinds: undoable
        self.seen.append(k.shape[1])
        return self.keys


def test_tensors_and_opaque_objects_are_leaves_and_everything_else_is_a_constant_of_the_key():
    h, m, c = torch.randn(2, 3), torch.ones(3, dtype=torch.bool), Cache()
    key, leaves, tree = flatten_call((h, None, torch.Size([2, 3])), dict(use_cache=True, cache=c, masks=[m, 0.5]))
    assert leaves[0] is h and leaves[1] is c and leaves[2] is m  # arguments, then keywords in sorted order
    assert len(leaves) == 3 and key == tree
    assert key[0] == (("T", torch.float32, 2, "cpu"), ("C", type(None), None), ("C", torch.Size, torch.Size([2, 3])))
    assert key[1] == (("cache", ("O", Cache)),
                      ("masks", (list, (("T", torch.bool, 1, "cpu"), ("C", float, 0.5)))),
                      ("use_cache", ("C", bool, True)))
    hash(key)  # a dict key: the graphs of a family are found by it


def test_the_key_holds_dtypes_ranks_and_constants_not_sizes_or_values():
    def key(*args, **kwargs):
        return flatten_call(args, kwargs)[0]

    same = key(torch.randn(2, 3), flag=True)
    assert key(torch.zeros(7, 9), flag=True) == same  # sizes and values are not part of it
    assert key(torch.zeros(2, 3, dtype=torch.bfloat16), flag=True) != same  # a dtype is
    assert key(torch.zeros(2, 3, 1), flag=True) != same  # a rank is
    assert key(torch.zeros(2, 3), flag=False) != same  # a constant is
    assert key(torch.zeros(2, 3), flag=1) != same  # and its type (True == 1 in Python)
    assert key([torch.zeros(2, 3)]) != key((torch.zeros(2, 3),))  # a list is not a tuple
    assert key(torch.zeros(2), Cache()) == key(torch.zeros(2), Cache())  # objects by their type


def test_rebuild_puts_new_leaves_where_the_old_ones_were_and_keeps_the_containers():
    a, b, c = torch.randn(2), torch.randn(3), Cache()
    args = (a, [b, 2, (None, c)], "mode")
    kwargs = {"z": {"inner": a, "n": 3}, "a": torch.float16}
    _, leaves, tree = flatten_call(args, kwargs)
    assert rebuild_call(tree, leaves) == (args, kwargs)  # the same objects, by identity where tensors
    new = [torch.zeros(2), torch.zeros(3), Cache(), torch.ones(2)]
    (x, (y, two, (none, obj)), mode), kw = rebuild_call(tree, new)
    assert x is new[0] and y is new[1] and obj is new[2] and kw["z"]["inner"] is new[3]
    assert (two, none, mode, kw["z"]["n"], kw["a"]) == (2, None, "mode", 3, torch.float16)
    assert type(rebuild_call(tree, new)[0][1]) is list and list(kw) == ["a", "z"]


def test_leaf_names_are_python_identifiers_named_after_the_arguments():
    t = torch.zeros(1)
    _, leaves, tree = flatten_call((t, [t, t]), {"cache": Cache(), "past-kv": {"0": t, "a b": t}, "x": t})
    # arg0, arg1's items by index; keywords by name (sorted), a dict's items by key; other characters as "_"
    assert leaf_names(tree, len(leaves)) == ["arg0", "arg1_0", "arg1_1", "cache", "past_kv_0", "past_kv_a_b", "x"]
    _, leaves, tree = flatten_call((), {"1": t, "a_0": t, "a": [t]})
    assert leaf_names(tree, len(leaves)) == ["x_1", "a_0", "a_0_2"]  # no leading digit; a clash is numbered


def test_describe_call_says_dtypes_ranks_constants_and_object_types():
    _, leaves, tree = flatten_call((torch.zeros(2, 3, dtype=torch.bfloat16), None),
                                   {"cache": Cache(), "masks": (torch.zeros(4, dtype=torch.bool),), "n": 3})
    assert describe_call(tree, leaves) == "bf16[2d], None, cache=Cache, masks=(bool[1d]), n=3"
    assert describe_call(*flatten_call((), {})[2:], []) == "no arguments"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("offset", torch.full((4,), 0.5))
        self.scale = 2.0  # a plain attribute: lifted as a graph input by the family
        self.private = "not for the trace"

    def forward(self, x, bias=None, *, double=False):
        y = self.lin(x) * self.scale + self.offset
        if bias is not None:
            y = y + bias
        return y * 2 if double else y


def test_bound_root_runs_the_class_forward_with_constants_baked_and_leaves_as_inputs():
    torch.manual_seed(0)
    block, x, bias = Block(), torch.randn(3, 4), torch.randn(4)
    _, leaves, tree = flatten_call((x,), {"bias": bias, "double": True})
    names = leaf_names(tree, len(leaves))
    root = bound_root(block, Block, tree, names, lifted=(("", "scale"),), drop=("private",))
    assert isinstance(root, Block) and type(root) is not Block and "private" not in root.__dict__
    assert root.lin is block.lin and root.offset is block.offset  # the block's own parameters and buffers
    assert list(inspect.signature(root.forward).parameters) == ["arg0", "bias", "_fxamp_attr_scale"]
    expected = block(x, bias, double=True)
    assert torch.equal(root(x, bias, 3.0), (block.lin(x) * 3.0 + block.offset + bias) * 2)  # the lifted input
    assert block.scale == 2.0 and torch.equal(root(x, bias, 2.0), expected)  # set for the call only
    # torch.export: the lifted values are constants, not inputs
    const = bound_root(block, Block, tree, names, lifted=(("", "scale"),), values=(2.0,))
    assert list(inspect.signature(const.forward).parameters) == ["arg0", "bias"]
    assert torch.equal(const(x, bias), expected)


def test_bound_root_sets_a_submodules_lifted_attribute_and_leaves_the_blocks_hooks_to_its_real_call():
    block, x = Block(), torch.randn(2, 4)
    block.lin.gain = 1.0
    calls = []
    block.register_forward_pre_hook(lambda m, a: calls.append("pre"))
    block.register_forward_hook(lambda m, a, out: calls.append("post"))
    _, leaves, tree = flatten_call((x,), {})
    original = nn.Linear.forward

    class Gained(nn.Linear):
        def forward(self, x):
            return original(self, x) * self.gain

    block.lin.__class__ = Gained
    root = bound_root(block, Block, tree, leaf_names(tree, 1), lifted=(("lin", "gain"),))
    out = root(x, 3.0)
    assert calls == [] and block.lin.gain == 1.0  # no hook of the block ran; the attribute is back
    torch.testing.assert_close(out, block.lin(x) * 3.0 * block.scale + block.offset)
    block(x)
    assert calls == ["pre", "post"]  # the block itself still has them


def test_undo_point_puts_back_what_an_objects_method_rebound():
    cache, k = Cache(), torch.ones(1, 2)
    cache.history = history = {"steps": [1]}
    _, leaves, _ = flatten_call((k,), {"cache": cache, "n": 3})
    undo = undo_point(Block(), leaves)
    cache.update(k)  # rebinds keys, appends to seen
    history["steps"].append(2)  # containers inside the object change too
    history["new"] = True
    assert cache.keys.shape == (1, 2) and cache.seen == [2]
    assert undo() is True
    assert cache.keys.shape == (1, 0) and cache.seen == [] and cache.history is history and history == {"steps": [1]}
    assert undo_point(Block(), [])() is True  # nothing to undo: it succeeds


def test_undo_point_refuses_when_a_tensor_changed_in_place():
    block, k = Block(), torch.ones(1, 2)
    for change in ("the call's tensor", "the object's tensor", "the block's buffer"):
        cache = Cache(torch.zeros(1, 3))
        _, leaves, _ = flatten_call((k, cache), {})
        undo = undo_point(block, leaves)
        target = {"the call's tensor": k, "the object's tensor": cache.keys, "the block's buffer": block.offset}[change]
        with torch.no_grad():
            target.add_(1)  # a preallocated cache written in place, a batch norm's statistics: no way back
        assert undo() is False, change


def test_undo_point_walks_shared_and_cyclic_objects_once():
    a, b = Cache(), Cache()
    a.other, b.other = b, a  # a cycle
    _, leaves, _ = flatten_call((a, [a, b]), {})
    undo = undo_point(nn.Module(), leaves)
    a.keys, b.keys = torch.ones(1, 1), torch.ones(1, 2)
    b.other = None
    assert undo() and a.keys.shape == b.keys.shape == (1, 0) and b.other is a
