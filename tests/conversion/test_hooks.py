"""Hooks on submodules, and global module hooks, registered before a capture (fxamp/conversion/capture/hooks.py).

torch.fx keeps a module with hooks as a call, so they run at every call; torch.export would trace them in (their
side effects run once, at capture), so a capture by torch.export is refused in one line naming the module and the
hook kind, at ``convert`` or, for a hook added to a lazily capturing module before its first call, there;
``convert_`` runs a block that only torch.export could capture as written, its hooks with it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.errors import TraceError

pytestmark = pytest.mark.usefixtures("one_thread")


class Inner(nn.Module):
    """A module of the user's own (not torch.nn): torch.fx traces through it unless it has hooks."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x)) + x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.head = Inner(), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.inner(x))


class Frozen(Net):
    """torch.fx refuses its no_grad region: only torch.export captures it."""

    def forward(self, x):
        with torch.no_grad():
            x = x * 2
        return self.head(self.inner(x))


REFUSED = r"torch.export would trace the hooks on 'inner' \(forward hook\) into the graph"


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_fx_keeps_a_hooked_module_of_the_users_as_a_call(policy):
    # was: torch.fx traced through Inner, so its hooks ran once, at capture, and never again
    torch.manual_seed(0)
    model, seen, grads = Net(), [], []
    model.inner.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    model.inner.register_full_backward_hook(lambda m, gi, go: grads.append(go[0].shape))
    x = torch.randn(3, 8)
    ref = model(x)
    seen.clear()
    with pytest.warns(UserWarning, match=r"leaf module 'inner' \(Inner\) runs whole in float32 .*it has hooks"):
        amp = fxamp.convert(model, policy)
    out = amp(x)
    out.float().sum().backward()
    amp(x)
    assert len(seen) == 2 and grads == [torch.Size([3, 8])]
    assert torch.allclose(out.float(), ref, atol=5e-2), (out.float() - ref).abs().max()


def test_export_refuses_a_submodule_hook_naming_module_and_kind():
    model = Net()
    model.inner.register_forward_hook(lambda m, i, o: None)
    model.head.register_forward_pre_hook(lambda m, a: None)
    with pytest.raises(TraceError, match=REFUSED[:-len(r" into the graph")] + r", 'head' \(forward pre-hook\)"):
        fxamp.convert(model, "O1", frontend="export", example_inputs=(torch.randn(2, 8),))


@pytest.mark.parametrize("inputs", [True, False])
def test_auto_refuses_at_convert_when_only_export_can_capture(inputs):
    # was: converted (at once, or lazily at the first call) with the hook's side effect run once, at capture
    model, seen = Frozen(), []
    model.inner.register_forward_hook(lambda m, i, o: seen.append(1))
    kwargs = {"example_inputs": (torch.randn(2, 8),)} if inputs else {}
    with pytest.raises(TraceError, match=r"torch.fx could not trace the model .*no_grad.*" + REFUSED):
        fxamp.convert(model, "O1", **kwargs)
    assert not seen  # refused before anything ran


@pytest.mark.parametrize("kind", ["forward", "pre", "backward"])
def test_a_hook_added_before_the_first_call_of_a_lazy_module_is_refused_there(kind):
    model = Net()
    amp = fxamp.convert(model, "O1", frontend="export")  # captures at its first call
    register = {"forward": lambda m: m.register_forward_hook(lambda *a: None),
                "pre": lambda m: m.register_forward_pre_hook(lambda *a: None),
                "backward": lambda m: m.register_full_backward_hook(lambda *a: None)}[kind]
    register(model.inner)
    with pytest.raises(TraceError, match=r"torch.export would trace the hooks on 'inner' \(.*hook\)"):
        amp(torch.randn(2, 8))


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_global_module_hook_is_refused(frontend):
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        with pytest.raises(TraceError, match=r"register_module_forward_hook registered a global module hook: "
                                             r"torch\.(fx|export) traces through modules"):
            fxamp.convert(Net(), "O1", frontend=frontend, example_inputs=(torch.randn(2, 8),))
    finally:
        handle.remove()
    fxamp.convert(Net(), "O1", frontend=frontend, example_inputs=(torch.randn(2, 8),))  # removed: converts


def test_pure_hooks_of_torch_and_library_hooks_do_not_refuse():
    model = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # weight_norm's deprecation
        torch.nn.utils.weight_norm(model.inner.lin)  # a forward pre-hook recomputing the weight: tensor math
    x = torch.randn(2, 8)
    amp = fxamp.convert(model, "O0", frontend="export", example_inputs=(x,))
    torch.testing.assert_close(amp(x), model(x))


class Blk(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        with torch.no_grad():  # torch.fx, and torch.fx on the call's values, refuse it: torch.export would take it
            y = self.lin(x)
        return self.norm(y) + x


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Blk(), Blk()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_convert_in_place_runs_a_block_with_hooked_modules_as_written():
    # was: the block was captured with torch.export, the hook on layers.0.lin traced in and never run again
    model, seen = Stack(), []
    model.layers[0].lin.register_forward_hook(lambda m, i, o: seen.append(1))
    fxamp.convert_(model, "O1")
    x = torch.randn(2, 8)
    with pytest.warns(RuntimeWarning, match="run\\(s\\) as written .*hooks on 'lin'"):
        model(x)
    seen.clear()
    model(x)
    model(x)
    assert seen == [1, 1]


def test_a_transformers_model_called_with_output_hidden_states_still_converts():
    # transformers may install output-recording hooks on its layers at such a call: they act within the model's
    # own call (its forward returns what they record), so they are not a reason to refuse a torch.export capture
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 50, (1, 6))
    model(ids, output_hidden_states=True)
    amp = fxamp.convert(model, "O0", frontend="export", example_inputs=(ids,))
    torch.testing.assert_close(amp(ids).logits, model(ids).logits)


class Branchy(nn.Module):
    """Plain torch.fx cannot branch on a shape: convert_ captures it with torch.fx on the call's values (concrete.py)."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.lin(x))
        if x.shape[1] > 1:
            h = h * 2
        return self.out(h) + x


class Plain(Branchy):
    def forward(self, x):
        return self.out(torch.relu(self.lin(x))) * 2 + x


class Blocks(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.layers = nn.ModuleList([block(), block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def calls(model, x, ref):
    """3 training calls with backward, 3 eval calls under no_grad, each against ``ref``; the warnings raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.train()
        for _ in range(3):
            out = model(x.clone().requires_grad_())
            out.float().sum().backward()
            torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
        model.eval()
        with torch.no_grad():
            for _ in range(3):
                torch.testing.assert_close(model(x).float(), ref, atol=3e-2, rtol=3e-2)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("hooked", [0, 1])
@pytest.mark.parametrize("block", [Branchy, Plain])
def test_convert_in_place_runs_a_hooked_module_in_a_block_once_per_call(block, hooked):
    # was: Branchy: the capture on the call's values called layers.0.lin to get its value, so its hook ran once
    # more, at capture; Plain (torch.fx) with the hook on layers.1.lin: layers.1 ran the graph captured from
    # layers.0, whose unhooked Linear was inlined, and its hook never ran
    torch.manual_seed(0)
    model, counts = Blocks(block), []
    model.layers[hooked].lin.register_forward_pre_hook(lambda m, args: counts.append("pre"))
    model.layers[hooked].lin.register_forward_hook(lambda m, args, out: counts.append("post"))
    x = torch.randn(2, 3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x).float()
    counts.clear()
    fxamp.convert_(model, "O1", dtype=torch.bfloat16)
    said = calls(model, x, ref)
    assert counts == ["pre", "post"] * 6
    written = [s for s in said if "as written" in s]
    if block is Branchy:  # no front end may call the hooked module at capture: that block runs as written, named
        assert len(written) == 1 and f"block 'layers.{hooked}' (Branchy) run(s) as written" in written[0]
        assert "hooks on 'lin' (forward pre-hook, forward hook)" in written[0]
    else:  # torch.fx keeps it a call: both blocks converted, each family with its own graph
        assert written == []
