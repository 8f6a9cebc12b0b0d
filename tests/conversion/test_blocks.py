"""In-place conversion, block by block (``fxamp.convert_``, ``conversion/blocks.py``).

A small transformer-like model (embedding, a ModuleList of blocks that differ in a plain attribute,
final norm, head, loss in the root's Python) is converted in place and checked against the whole-model
conversion (``fxamp.convert``): the same per-op decisions and bitwise the same outputs and gradients;
the user's object, class, attributes, hooks and ``state_dict`` keys kept; one capture per block
family; bad input refused in one line.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.conversion.op_lists import Category
from fxamp.conversion.blocks import converted_modules, family_of, find_blocks

pytestmark = pytest.mark.usefixtures("one_thread")

D, V = 16, 40


class Block(nn.Module):
    def __init__(self, index: int):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)
        self.drop = nn.Dropout(0.0)
        self.index = index  # differs per instance: lifted into a graph input, not baked in

    def forward(self, x, scale=None):
        h = self.drop(self.fc2(F.gelu(self.fc1(self.ln(x)))))
        if scale is not None:
            h = h * scale
        return x + h * (1.0 + 0.1 * self.index)

    def describe(self) -> str:  # a user method: must survive conversion
        return f"block {self.index}"


class Net(nn.Module):
    def __init__(self, layers: int = 4):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block(i) for i in range(layers))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)
        self.config = {"layers": layers}

    def forward(self, ids, labels=None):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        if labels is None:
            return logits
        return logits, F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def make(layers: int = 4) -> Net:
    torch.manual_seed(0)
    return Net(layers)


def ids(b: int = 2, s: int = 5) -> torch.Tensor:
    return torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(1))


def families(model):
    return list({id(family_of(m)): family_of(m) for _, m in converted_modules(model)}.values())


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_same_outputs_and_gradients_as_whole_model_conversion(policy):
    whole = fxamp.convert(make(), policy, dtype=torch.bfloat16)
    model = make()
    assert fxamp.convert_(model, policy, dtype=torch.bfloat16) is model
    x = ids()
    a_logits, a_loss = whole(x, x)
    b_logits, b_loss = model(x, x)
    assert b_logits.dtype == torch.float32 and b_loss.dtype == torch.float32
    assert torch.equal(a_logits, b_logits) and torch.equal(a_loss, b_loss)
    a_loss.backward()
    b_loss.backward()
    grads = dict(model.named_parameters())
    for name, p in whole.named_parameters():
        assert grads[name].dtype == p.dtype, name  # the same storage
        assert torch.equal(grads[name].grad, p.grad), name


def same_index(model):
    for layer in model.layers:  # no attribute differs: none lifted, the blocks' ops are the model's
        layer.index = 1
    return model


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_per_op_decisions_inside_blocks_are_the_whole_model_ones(policy):
    x = ids()
    model = same_index(make())
    fxamp.convert_(model, policy, dtype=torch.bfloat16)
    model(x)
    whole = fxamp.report(same_index(make()), policy=policy, dtype=torch.bfloat16)
    block = fxamp.report(model)

    # the ops that feed a block's output: the whole-model graph sees their readers (the next block's
    # float32 norm and residual add) and casts their inputs to float32; inside the block the reader is the
    # graph output, so they follow their inputs, and type promotion computes them in float32 all the same
    ((graph,),) = family_of(model.layers[0]).graphs.values()
    feeding = {f"layers.0/{n.name}" for n in graph.gm.graph.find_nodes(op="output")[0].all_input_nodes}

    def ops(rows, prefix, skip=()):
        return [(r.op.split(": ")[-1], r.category, r.compute) for r in rows
                if r.is_op and (r.module == prefix or r.module.startswith(prefix + ".")) and r.node not in skip]
    for prefix in ("layers.0", "norm", "head"):
        got = ops(block.rows, prefix, feeding)
        expected = ops(whole.rows, prefix)
        if prefix == "layers.0":
            assert len(feeding) == 1 and expected[-1] == ("operator.add", Category.CONDITIONAL, "float32")
            expected = expected[:-1]
            last = next(r for r in block.rows if r.node in feeding)
            assert "float32" in last.input_dtypes and last.compute == "as input"
        if prefix != "layers.0":  # a glue norm is traced into (F.layer_norm), the whole model calls the module
            got, expected = [g[1:] for g in got], [e[1:] for e in expected]
        assert got == expected and got, prefix
    glue = [r for r in block.rows if r.module.startswith(("emb", "norm", "head"))]
    assert glue and all(r.source == "module-level" and r.reason.startswith("module-level:") for r in glue)
    assert all(r.source != "module-level" for r in block.rows if r.module.startswith("layers."))
    head = next(r for r in block.rows if r.module == "head" and r.is_op)
    assert head.compute == "bfloat16"  # the head low; its output comes back float32 (the policy's)
    out = next(r for r in block.rows if r.node == "head/output")
    assert out.compute == "float32"


def test_one_capture_per_block_family_whatever_the_depth():
    model = make(layers=8)
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    x = ids()
    model(x)
    model.train()
    model(x)  # torch.fx captured both modes in one graph
    model(ids(3, 7))  # other sizes: the same graph
    blocks = [f for f in families(model) if not f.glue]
    assert len(blocks) == 1 and blocks[0].captures == 1 and len(blocks[0].paths) == 8
    assert blocks[0].lifted == (("", "index"),)
    model.layers[0](torch.randn(2, 3, D), scale=torch.tensor(2.0))  # another call signature: one more capture
    model.layers[5](torch.randn(2, 3, D), scale=torch.tensor(2.0))  # and the same for every instance
    assert blocks[0].captures == 2


def test_the_users_object_class_methods_attributes_and_hooks_stay():
    model = make()
    calls = []
    model.register_forward_hook(lambda m, a, o: calls.append("root"))
    model.layers[1].register_forward_pre_hook(lambda m, a: calls.append("block"))
    keys = list(model.state_dict())
    layer_list = model.layers
    fxamp.convert_(model, "O2", dtype=torch.bfloat16)
    assert type(model) is Net and model.config == {"layers": 4} and model.layers is layer_list
    assert list(model.state_dict()) == keys
    block = model.layers[2]
    assert isinstance(block, Block) and type(block).__name__ == "Block" and block.describe() == "block 2"
    model(ids())
    assert calls == ["block", "root"]
    assert fxamp.conversion_info(model).frontend == "blocks"


def test_o2_storage_is_chosen_at_once_and_an_optimizer_can_be_built_before_the_first_call():
    model = make()
    fxamp.convert_(model, "O2", dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["layers.0.fc1.weight"] == torch.bfloat16 and dtypes["layers.0.ln.weight"] == torch.float32
    assert dtypes["emb.weight"] == dtypes["head.weight"] == torch.bfloat16
    params = list(model.parameters())
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(params, lr=0.1), model=model)
    x = ids()
    _, loss = model(x, x)
    opt.backward(loss)
    opt.step()
    assert all(a is b for a, b in zip(params, model.parameters()))  # no parameter re-bound after the optimizer


def test_lifted_attribute_is_each_instances_own():
    model, ref = make(), make()
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    h = torch.randn(2, 3, D)
    for i in range(4):
        expected = ref.layers[i](h)
        assert (model.layers[i](h) - expected).abs().max() < 0.05, i  # index i's scaling, not block 0's
    assert (model.layers[3](h) - ref.layers[0](h)).abs().max() > 0.1


def test_deepcopy_and_pickling_keep_a_working_converted_model():
    model = make()
    fxamp.convert_(model, "O2", dtype=torch.bfloat16)
    x = ids()
    expected = model(x)
    for copied in (copy.deepcopy(model), _pickled(model)):
        assert type(copied.layers[0]).__name__ == "Block"
        assert torch.equal(copied(x), expected)
        assert copied.layers[0].fc1.weight is not model.layers[0].fc1.weight


def _pickled(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIES = {"deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m)), "torch.save": _pickled}


@pytest.mark.parametrize("masters", ["fp32", "kahan"])
@pytest.mark.parametrize("how", COPIES)
def test_copies_state_dict_gives_the_same_float32_originals_and_masters_bitwise(how, masters):
    """Issue 37: a copy of an O2 model converted in place (deepcopy, pickle, torch.save/torch.load of the model)
    gives the original's state_dict bit for bit: the float32 originals before an optimizer took them, the masters
    after it stepped (values at the time of the copy, which the copy holds: the optimizer is not copied), not the
    bfloat16 weights widened.  An optimizer built on the copy takes those values as its masters.  (A Kahan master's
    value, the weight plus its term, need not round to the weight.)"""
    model = make()
    fxamp.convert_(model, "O2", dtype=torch.bfloat16)
    x = ids()
    state = model.state_dict()
    low = {n: p for n, p in model.named_parameters() if p.dtype == torch.bfloat16}
    assert all(not torch.equal(state[n], p.float()) for n, p in low.items())  # not the rounding: a copy can lose it
    same_state(COPIES[how](model), state)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model,
                                        precision=fxamp.LeanConfig(masters, "fp32"))
    for _ in range(2):
        opt.zero_grad()
        _, loss = model(x, x)
        opt.backward(loss)
        assert opt.step()
    state = {k: v.clone() for k, v in model.state_dict().items()}  # (state_dict, as torch's, aliases the tensors)
    exact = {k: v.clone() for k, v in opt.fp32_state_dict().items()}
    assert all(torch.equal(state[n], exact[n]) and not torch.equal(state[n], p.float()) for n, p in low.items())
    copied = COPIES[how](model)
    same_state(copied, state)
    assert torch.equal(copied(x, x)[1], model(x, x)[1])
    opt.zero_grad()
    _, loss = model(x, x)
    opt.backward(loss)
    opt.step()  # the original trains on; the copy keeps the values it was copied with
    same_state(copied, state)
    assert not torch.equal(model.state_dict()["head.weight"], state["head.weight"])
    stale = COPIES[how](model)  # a weight changed in the copy since: given as it is now
    with torch.no_grad():
        stale.head.weight.data = torch.zeros_like(stale.head.weight)  # (.data = keeps the version counter)
        stale.layers[0].fc1.weight.add_(1.0)
    got = stale.state_dict()
    assert {"head.weight", "layers.0.fc1.weight"} <= set(low)
    assert torch.equal(got["head.weight"], torch.zeros(V, D))
    assert torch.equal(got["layers.0.fc1.weight"], stale.layers[0].fc1.weight.float())
    again = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(copied.parameters(), lr=0.0), model=copied,
                                          precision=fxamp.LeanConfig(masters, "fp32"))
    assert all(torch.equal(again.fp32_state_dict()[n], exact[n]) for n in low)  # the copy's masters: exact


def same_state(copied, state):
    got = copied.state_dict()
    assert list(got) == list(state)
    for key, value in state.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_copies_of_a_model_without_originals_give_its_widened_weights():
    model = make()
    fxamp.convert_(model, "O2", dtype=torch.bfloat16, keep_originals=False)  # nothing float32 to keep: as the model
    state = model.state_dict()
    assert torch.equal(state["head.weight"], model.head.weight.float())
    for how in COPIES.values():
        same_state(how(model), state)


def test_whole_model_o2_copies_give_the_same_state_dict_its_storage():
    """``fxamp.convert`` (O2) owns low-precision copies: its state_dict gives them as stored (docs/conversion.md),
    and so do its copies."""
    amp = fxamp.convert(make(), "O2", dtype=torch.bfloat16)
    state = amp.state_dict()
    assert state["head.weight"].dtype == torch.bfloat16 and state["norm.weight"].dtype == torch.float32
    for how in COPIES.values():
        same_state(how(amp), state)


def test_blocks_named_by_glob():
    model = make()
    assert find_blocks(model, ["layers.*"]) == [f"layers.{i}" for i in range(4)]
    fxamp.convert_(model, "O1", dtype=torch.bfloat16, blocks=["layers.[0-1]"])
    converted = [p for p, m in converted_modules(model) if p.startswith("layers")]
    assert converted == ["layers.0", "layers.1"] + [f"layers.{i}.{m}" for i in (2, 3) for m in ("ln", "fc1", "fc2")]
    assert family_of(model.layers[3].fc1).glue  # outside the named blocks: glue
    assert torch.allclose(model(ids()), make()(ids()), atol=0.1)


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_half_on_a_model_converted_in_place_is_one_clear_line_and_changes_nothing(policy):
    model = make()
    fxamp.convert_(model, policy, dtype=torch.bfloat16)
    x = ids()
    out = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(fxamp.FxampError, match=r"'emb' \(Embedding\) holds .* would turn float16.*dtype=\.\.\.\)"):
        model.half()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert {p.dtype for p in model.parameters()} == ({torch.float32} if policy == "O1" else
                                                     {torch.float32, torch.bfloat16})
    model.to("cpu")  # a device move is fine; so is .float() where every tensor is float32 already
    if policy == "O1":
        model.float()
    assert torch.equal(model(x), out)


def test_a_parent_that_checkpoints_each_block_keeps_it():
    """``checkpoint(layer, x)`` in the parent's forward (the parent runs as written): the block's capture,
    made inside that call, is not mistaken for a checkpoint region of its own; the saving holds."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(Net):
        def forward(self, ids):
            h = self.emb(ids)
            for layer in self.layers:
                h = checkpoint(layer, h, use_reentrant=False)
            return self.head(self.norm(h))

    def saved_bytes(model):
        total = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: total.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            out = model(ids())
        out.float().sum().backward()
        return out, sum(total)

    torch.manual_seed(0)
    ref = Checkpointed(4).train()
    model, plain = copy.deepcopy(ref), make().train()  # the same weights, without the checkpoint calls
    for m in (model, plain):
        fxamp.convert_(m, "O1", dtype=torch.bfloat16)
    out, ours = saved_bytes(model)
    assert torch.allclose(out, ref(ids()), atol=0.05, rtol=0.05)
    assert ours < 0.7 * saved_bytes(plain)[1]


def test_a_weights_parametrizations_are_not_blocks():
    """weight_norm keeps its parametrization in a ModuleList of one: not a layer list (wav2vec2's
    positional convolution)."""
    model = make()
    torch.nn.utils.parametrizations.weight_norm(model.head)
    assert find_blocks(model) == [f"layers.{i}" for i in range(4)]


def test_bad_input_is_one_clear_line():
    with pytest.raises(ValueError, match=r"found no blocks in Sequential .*blocks=\['encoder.layers.\*'\]"):
        fxamp.convert_(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), "O1")
    with pytest.raises(ValueError, match=r"'decoder\.\*' matches no module of Net; some paths it has: emb"):
        fxamp.convert_(make(), "O1", blocks=["decoder.*"])
    with pytest.raises(TypeError, match=r"blocks= takes a list of module path globs"):
        fxamp.convert_(make(), "O1", blocks="layers.*")
    model = make()
    fxamp.convert_(model, "O1")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"this Net was already converted by fxamp"):
        fxamp.convert_(model, "O2")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())  # nothing lost
    with pytest.raises(ValueError, match="already converted"):
        fxamp.convert_(fxamp.convert(make(), "O1"), "O1")


class Log:
    """An opaque object a block is given: its method must run once per block call, never during a retry."""

    def __init__(self):
        self.calls = []

    def add(self, h):
        self.calls.append(h.shape[1])
        return h * 2


class ShapeBlock(nn.Module):
    """What plain torch.fx cannot trace: a shape unpacked and branched on, an object's method."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x, log=None):
        h = self.fc(x).view(*x.shape[:-1], 2, -1).flatten(-2)
        if x.shape[1] > 1:  # taken as the call takes it, and guarded
            h = h.softmax(-1)
        if log is not None:
            h = log.add(h)
        return x + h


class ShapeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(ShapeBlock() for _ in range(3))

    def forward(self, x, log=None):
        for layer in self.layers:
            x = layer(x, log)
        return x


def test_shapes_branches_and_objects_are_captured_with_the_calls_values():
    torch.manual_seed(0)
    ref = ShapeNet()
    model = copy.deepcopy(ref)
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    (family,) = families(model)
    log, ref_log = Log(), Log()
    for s in (4, 1, 5, 1):  # a prefill-like call, a decode-like one, and each again
        x = torch.randn(2, s, D)
        got = model(x, log)
        assert torch.allclose(got, ref(x, ref_log), atol=0.05, rtol=0.05), s
    assert family.captures == 2  # the branch on x.shape[1] > 1: two variants, each reused
    assert log.calls == ref_log.calls  # the object's method ran once per block call: none during a retry
    graphs = [g for variants in family.graphs.values() for g in variants]
    assert {g.frontend for g in graphs} == {"fx"}
    assert all("guard" in g.gm.code for g in graphs)


class Layer:
    def __init__(self):
        self.keys = None  # a data attribute named as torch.fx's Proxy.keys method (a KV cache layer's)


class Cache:
    """Kept like Hugging Face's encoder-decoder cache: a method that changes it, a flag read after it,
    tensors stored in the converted block's low dtype."""

    def __init__(self):
        self.layer, self.is_updated, self.steps = Layer(), {}, 0

    def update(self, h):
        self.steps += 1
        return h


class CachedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.kv = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x, cache, limit=None):
        h = cache.update(self.fc(x))  # a side effect: guards after it are late
        if cache.is_updated.get(0):  # state read after the effect (not changed by it): checked early too
            kv = cache.layer.keys
        else:
            kv = self.kv(x)[:, :1]  # stored as the block computes it: bfloat16
            cache.layer.keys, cache.is_updated[0] = kv, True
            cache._filled_at = x.shape[1]  # a private attribute is the object's too, not the proxy's
        if limit is not None and cache.steps > limit:  # state the effect changed: only the late guard sees it
            h = h * 2
        return x + (h * kv).softmax(-1)


class CachedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(CachedBlock() for _ in range(2))

    def forward(self, x, cache, limit=None):
        return self.layers[1](self.layers[0](x, cache, limit), cache, limit)


def test_state_an_object_reads_after_its_method_ran_picks_the_variant_before_anything_changes():
    """A flag read after the cache's method ran (T5's and Whisper's cross-attention ``is_updated``) is
    checked at the top of the graph as well, so a decode step takes its own variant; the cached tensor
    (low precision, behind an attribute named ``keys``) is traced in float32. State that the method
    itself changed before the branch read it is refused in one line, naming what to do."""
    torch.manual_seed(0)
    ref = CachedNet()
    model = copy.deepcopy(ref)
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    cache, ref_cache = Cache(), Cache()
    for _ in range(3):  # the first call fills the flag and the keys; the others read them
        x = torch.randn(2, 3, D)
        got = model(x, cache)
        assert torch.allclose(got, ref(x, ref_cache), atol=0.03, rtol=0.03)
    assert cache.layer.keys.dtype == torch.bfloat16 and cache.steps == ref_cache.steps == 6  # no retry re-ran it
    assert cache._filled_at == ref_cache._filled_at == 3
    (family,) = families(model)
    assert family.captures == 2
    with pytest.raises(fxamp.FxampError, match="use_cache=False"):
        for _ in range(3):
            model(torch.randn(2, 3, D), Cache(), limit=1)  # steps > 1 turns true after the first layer's update


class GrowingCache:
    """Rebinds its tensor at each update (as Hugging Face's DynamicCache does); ``in_place`` writes into a
    preallocated one instead (as a static cache does)."""

    def __init__(self, in_place=False):
        self.k, self.n, self.in_place = (torch.zeros(2, 16, D) if in_place else None), 0, in_place

    def update(self, h):
        if self.in_place:
            self.k[:, self.n:self.n + h.shape[1]].copy_(h)
        else:
            self.k = h if self.k is None else torch.cat([self.k, h], 1)
        self.n += h.shape[1]
        return self.k[:, :self.n]


class GrowBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x, cache):
        k = cache.update(self.fc(x))
        if k.shape[1] > 1:  # the shape of what the method returned: only a late guard can check it
            return x + k.mean(1, keepdim=True)
        return x + k


class GrowNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(GrowBlock() for _ in range(2))

    def forward(self, x, caches):
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cache)
        return x


def test_a_late_guard_that_fails_is_undone_and_the_call_captured_again_where_the_object_allows():
    """A prompt first, then a single token with a fresh cache: the graph captured at the prompt takes the
    other branch only after the cache's update ran. A cache that rebinds its tensors is put back as it was
    and the call captures its own variant (the update runs once); one written in place cannot be undone:
    one FxampError, naming what to do."""
    torch.manual_seed(0)
    ref = GrowNet()
    model = copy.deepcopy(ref)
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    for s in (3, 1, 1, 3):
        caches, ref_caches = [GrowingCache(), GrowingCache()], [GrowingCache(), GrowingCache()]
        x = torch.randn(2, s, D)
        assert torch.allclose(model(x, caches), ref(x, ref_caches), atol=0.03, rtol=0.03), s
        assert [c.n for c in caches] == [s, s] and caches[0].k.shape[1] == s  # updated once, not twice
    (family,) = families(model)
    assert family.captures == 2
    model = copy.deepcopy(ref)
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    model(torch.randn(2, 3, D), [GrowingCache(True), GrowingCache(True)])
    with pytest.raises(fxamp.FxampError, match="use_cache=False"):
        model(torch.randn(2, 1, D), [GrowingCache(True), GrowingCache(True)])


def test_report_before_a_call_names_the_families_and_takes_no_options():
    model = make()
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    rep = fxamp.report(model)
    assert not rep.rows and any("'layers.0' (shared by layers.0, layers.1, layers.2, layers.3): not called yet" in n
                                for n in rep.notes)
    with pytest.raises(ValueError, match=r"converted in place \(fxamp.convert_\).*pass the model alone"):
        fxamp.report(model, example_inputs=ids())


def test_torch_compile_traces_the_converted_model_as_one_graph():
    """The per-call Python of a converted block (signature, graph lookup) is traceable by dynamo."""
    model = make()
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    x = ids()
    model(x)  # the blocks capture first
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0


def test_module_overrides_reach_the_blocks_they_name():
    model = make()
    fxamp.convert_(model, "O1", dtype=torch.bfloat16, module_overrides={"layers.2.fc1": "unsafe", "head": "unsafe"})
    x = ids()
    model(x)
    rows = fxamp.report(model).rows
    fc1 = {r.module: r.compute for r in rows if r.is_op and r.module.endswith("fc1")}
    assert fc1 == {"layers.0.fc1": "bfloat16", "layers.2.fc1": "float32"}  # layer 2 is a family of its own
    assert {len(family_of(model.layers[i]).paths) for i in range(4)} == {3, 1}
    head = next(r for r in rows if r.is_op and r.module == "head")
    assert head.compute == "float32" and head.source == "module-level"
    with pytest.raises(ValueError, match=r"module_overrides: 'layers.9' is not a submodule of Net"):
        fxamp.convert_(make(), "O1", module_overrides={"layers.9": "unsafe"})


def test_o2_in_place_masters_are_the_original_float32_tensors_not_copies():
    """Issue 27: fine-tuning starts from the exact float32 weights, and they are the masters (no copy)."""
    model = make()
    originals = {n: p for n, p in model.named_parameters()}
    exact = {n: p.detach().clone() for n, p in originals.items()}
    fxamp.convert_(model, "O2", dtype=torch.bfloat16)
    assert fxamp.info.held_origins(model.parameters()) > 0
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model=model)
    masters = {n: m for n, (low, m) in zip([n for n, p in model.named_parameters() if p.dtype == torch.bfloat16],
                                          opt.master_pairs())}
    assert masters and fxamp.info.held_origins(model.parameters()) == 0  # handed over
    for name, master in masters.items():
        assert master.dtype == torch.float32 and torch.equal(master, exact[name]), name  # not rounded
        assert master.data_ptr() == originals[name].data_ptr(), name  # the original's storage itself
    x = ids()
    _, loss = model(x, x)
    opt.backward(loss)
    opt.step()  # lr 0: the weights are the rounding of the exact originals still
    assert torch.equal(model.layers[0].fc1.weight, exact["layers.0.fc1.weight"].bfloat16())


def test_in_place_originals_can_be_freed_for_inference():
    model = make()
    fxamp.convert_(model, "O2", dtype=torch.bfloat16, keep_originals=False)
    assert fxamp.info.held_origins(model.parameters()) == 0
    model = make()
    fxamp.convert_(model, "O2", dtype=torch.bfloat16)
    held = fxamp.info.held_origins(model.parameters())
    assert held > 0 and fxamp.release_originals(model) == held
    assert fxamp.info.held_origins(model.parameters()) == 0
    with pytest.raises(TypeError, match="keep_originals must be True or False"):
        fxamp.convert_(make(), "O2", keep_originals="yes")
