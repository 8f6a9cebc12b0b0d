"""A plain value forward reads (``x / self.tau``) is a constant of the captured graph: setting the attribute after
converting must not be silently ignored.  Whole-model conversion refuses the call, naming the attribute and what
to do; in-place conversion captures the block again for its values now (``runtime/held_values.py``)."""

import copy
import functools
import io
import warnings

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.conversion.blocks import converted_modules
from fxamp.errors import FxampError


class Inner(nn.Module):
    def __init__(self, tau: float = 2.0):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.tau = tau  # a Gumbel temperature the loop anneals, say

    def forward(self, x):
        return self.lin(x) / self.tau


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.drop = nn.Dropout(0.0)
        self.head = nn.Linear(8, 4)
        self.scale = 1.0

    def forward(self, x):
        return self.head(self.drop(self.inner(x))) * self.scale


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    ref = Model()
    model = Model()
    model.load_state_dict(ref.state_dict())
    return ref.eval(), model.eval()


X = torch.randn(4, 8)


def _close(a, b):
    return torch.allclose(a.float(), b.float(), rtol=0.03, atol=0.03)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_plain_value_set_after_converting_is_refused_naming_it(frontend):
    ref, model = _pair()
    amp = fxamp.convert(model, "O1", example_inputs=(X,), frontend=frontend).eval()
    before = amp(X)
    assert _close(before, ref(X))
    amp.inner.tau = 4.0  # the graph holds 2.0: it would compute with it, silently
    with pytest.raises(FxampError, match=r"inner\.tau is 4\.0.*captured when it was 2\.0.*register_buffer"):
        amp(X)
    amp.inner.tau = 2.0  # (an equal value is no change)
    assert torch.equal(amp(X), before)
    amp.scale = 3.0  # the root's own attribute, set on the converted module
    with pytest.raises(FxampError, match=r"module's scale is 3\.0"):
        amp(X)
    amp.scale = 1
    with pytest.raises(FxampError, match="scale is 1"):  # (1 is not 1.0 to a graph that divides by it)
        amp(X)


def test_a_module_the_graph_calls_whole_reads_its_attributes_at_each_call():
    """torch.fx keeps ``nn.Dropout`` as a call: its ``p`` is read at run time, so a new rate is taken, not refused;
    torch.export inlines dropout with the rate it read, so there a new rate is refused."""
    _, model = _pair()
    amp = fxamp.convert(model, "O1", frontend="fx").train()
    assert any(n.op == "call_module" and n.target == "drop" for n in amp.graph.nodes)
    amp.drop.p = 1.0
    assert _close(amp(X), amp.head.bias.detach().expand(4, 4))  # every feature dropped: the head's bias alone
    _, model = _pair()
    exported = fxamp.convert(model, "O1", example_inputs=(X,), frontend="export").train()
    exported.drop.p = 1.0
    with pytest.raises(FxampError, match=r"drop\.p is 1\.0"):
        exported(X)


def test_the_lazy_module_refuses_a_value_set_on_itself_or_a_child():
    _, model = _pair()
    amp = fxamp.convert(model, "O1", frontend="export")  # no example inputs: captures at the first call
    assert type(amp).__name__ != "GraphModule"
    amp(X)
    amp.scale = 2.0
    with pytest.raises(FxampError, match=r"scale is 2\.0"):
        amp(X)
    amp.scale = 1.0
    amp(X)
    amp.inner.tau = 0.5
    with pytest.raises(FxampError, match=r"inner\.tau is 0\.5"):
        amp(X)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_checks_its_own_modules(how):
    _, model = _pair()
    amp = fxamp.convert(model, "O2", dtype=torch.bfloat16).eval()
    if how == "deepcopy":
        other = copy.deepcopy(amp)
    else:
        buf = io.BytesIO()
        torch.save(amp, buf)
        buf.seek(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            other = torch.load(buf, weights_only=False)
    other.inner.tau = 3.0
    with pytest.raises(FxampError, match="inner.tau is 3.0"):
        other(X)
    amp(X)  # the original's tau is still 2.0
    other.inner.tau = 2.0
    assert torch.equal(other(X), amp(X))


def test_a_decorated_forward_is_read_through_its_decorator():
    """Hugging Face wraps forward in decorators (``functools.wraps``): the names it reads are the wrapped code's."""
    def logged(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)
        return wrapper

    class Decorated(Inner):
        @logged
        def forward(self, x):
            return self.lin(x) * self.gain

    torch.manual_seed(0)
    m = Decorated()
    m.gain = 0.5
    amp = fxamp.convert(m, "O1")
    amp(X)
    amp.gain = 2.0
    with pytest.raises(FxampError, match="gain is 2.0"):
        amp(X)


class Block(nn.Module):
    def __init__(self, i: int):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.tau = 2.0
        self._gain = float(i + 1)  # a private plain value that differs between blocks

    def forward(self, x):
        return x + self.lin(x) * self._gain / self.tau


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(i) for i in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _stacks():
    torch.manual_seed(0)
    ref = Stack()
    model = Stack()
    model.load_state_dict(ref.state_dict())
    return ref, model


def test_in_place_blocks_share_one_graph_and_each_computes_with_its_own_private_value():
    """Blocks that differ in a private plain value (``self._gain``) share a graph that takes it as an input: each
    computes with its own (the family once grouped them on public attributes only, and all ran the first's)."""
    ref, model = _stacks()
    fxamp.convert_(model, "O1")
    assert _close(model(X), ref(X))
    family = converted_modules(model)[0][1].__dict__["_fxamp_family"]
    assert family.captures == 1 and ("", "_gain") in family.lifted


def test_in_place_a_block_captures_again_for_a_value_set_after_converting():
    ref, model = _stacks()
    fxamp.convert_(model, "O1")
    model(X)
    family = converted_modules(model)[0][1].__dict__["_fxamp_family"]
    assert family.captures == 1
    for m in (model, ref):
        m.blocks[1].tau = 4.0
        m.blocks[2]._gain = -1.0  # (lifted: taken as the graph's input, no capture)
    assert _close(model(X), ref(X))
    assert family.captures == 2  # the block whose tau changed captured for 4.0
    for m in (model, ref):
        m.blocks[1].tau = 2.0
    assert _close(model(X), ref(X))
    model(X)
    assert family.captures == 2  # back to the first graph


# -- a block method outside forward that calls a child (reversible layers) -----------------------------------------

class Reversible(nn.Module):
    """Reformer's shape: a reversible layer whose autograd Function's backward recomputes ``self.ff`` through a
    method forward never runs (``backward_pass``)."""

    def __init__(self):
        super().__init__()
        self.ff = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.ff(x)

    def backward_pass(self, y):
        return y - self.ff(y)


class Helper(Reversible):
    def forward(self, x):
        return self.backward_pass(x)  # (reached from forward: converted with it)


@pytest.mark.parametrize("cls", [Reversible, Helper])
@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_convert_in_place_warns_of_a_child_called_outside_forward_on_low_weights(policy, cls):
    torch.manual_seed(0)
    model = nn.Sequential(cls(), cls())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fxamp.convert_(model, policy, dtype=torch.bfloat16)
    said = [str(w.message) for w in seen if "outside forward" in str(w.message)]
    if policy == "O2" and cls is Reversible:  # its ff holds bfloat16 weights: backward_pass(float32) fails in torch
        assert len(said) == 1 and "Reversible.backward_pass calls self.ff(...)" in said[0] and "O1" in said[0]
        with pytest.raises(RuntimeError, match="dtype"):
            model[0].backward_pass(X)
    else:  # O1 keeps float32 weights (the call runs float32); a helper forward runs is converted with it
        assert not said
        if policy == "O1":
            model[0].backward_pass(X)


class Recording(Inner):
    def forward(self, x):
        self.seen = True  # written by forward (noted at capture): not a value the graph holds
        return self.lin(x) / self.tau


def test_a_value_forward_writes_is_not_held():
    """RWKV's forward flips ``layers_are_rescaled`` itself: the graph read it before and after the write, so it has
    no one captured value to compare; the capture notes the write, and a later change is not refused."""
    torch.manual_seed(0)
    m = Recording()
    m.seen = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp = fxamp.convert(m, "O1", frontend="fx")
    amp(X)
    amp.seen = not amp.__dict__.get("seen", m.seen)  # (the user resets the flag, say)
    amp(X)
    amp.tau = 1.0
    with pytest.raises(FxampError, match="tau is 1.0"):
        amp(X)
