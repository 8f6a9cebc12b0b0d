"""What a forward writes besides its result: a tensor it made from constants, a tensor it was given, a list it was
given.  Each is kept on every path (whole-model torch.fx and torch.export, lazy, in place), or the path refuses
it: never dropped, never run twice."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import fxamp


class Block(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(8, 8)

    def forward(self, x, state):
        y = self.lin(x + state[0])
        if self.kind == "list":  # the caller's list gets a new tensor
            state[0] = state[0] + 1.0
        elif self.kind == "setitem":  # RWKV's ``state[0][:, :, self.layer_id] = ...``
            state[0][:] = state[0] + 1.0
        else:
            state[0].add_(1.0)
        return y


class Model(nn.Module):
    """Each block reads the state the one before it left: block 0 adds 0, block 1 adds 1."""

    def __init__(self, kind: str):
        super().__init__()
        self.blocks = nn.ModuleList([Block(kind), Block(kind)])

    def forward(self, x):
        state = [torch.zeros(8)]
        for block in self.blocks:
            x = block(x, state)
        return x, state[0]


def convert(model, path):
    if path == "in-place":
        return fxamp.convert_(model, "O2", dtype="bfloat16")
    kw = dict(example_inputs=(torch.randn(2, 8),)) if path == "export" else {}
    return fxamp.convert(model, "O2", dtype="bfloat16", frontend={"fx": "fx", "lazy": "export"}.get(path, path), **kw)


@pytest.mark.parametrize("kind", ["list", "setitem", "add_"])
@pytest.mark.parametrize("path", ["auto", "export", "lazy", "in-place"])
def test_every_call_keeps_what_forward_writes(kind, path):
    torch.manual_seed(0)
    model, x = Model(kind).eval(), torch.randn(2, 8)
    ref, ref_state = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (in place, "list" runs as written: tested below)
        amp = convert(copy.deepcopy(model), path)
        for _ in range(3):  # the first call captures: it must not write twice
            with torch.no_grad():
                out, state = amp(x)
            assert torch.equal(state, ref_state), (state, ref_state)
            torch.testing.assert_close(out, ref, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("kind", ["setitem", "add_"])
def test_torch_fx_refuses_a_write_into_a_constant_it_read(kind):
    """torch.fx makes ``torch.zeros(8)`` a constant and runs the untraced ``state[0].add_(1)`` once, at trace time:
    both blocks would read 2.  frontend='fx' refuses, naming the line; 'auto' captures with torch.export."""
    with pytest.raises(fxamp.TraceError, match=r"writes in place into a tensor it made from constants .*"
                                               r"test_writes.py:\d+: `y = self.lin\(x \+ state\[0\]\)`"):
        fxamp.convert(Model(kind), "O2", dtype="bfloat16", frontend="fx")


class KeywordModel(Model):
    def forward(self, x):
        state = [torch.zeros(8)]
        for block in self.blocks:
            x = block(x, state=state)
        return x, state[0]


@pytest.mark.parametrize("model, given", [(Model("list"), "argument 1"), (KeywordModel("list"), "'state'")])
def test_a_block_that_changes_a_list_it_is_given_runs_as_written_and_says_why(model, given):
    amp = fxamp.convert_(copy.deepcopy(model), "O2", dtype="bfloat16")
    with pytest.warns(RuntimeWarning, match=rf"run\(s\) as written .*changes the list it is given as {given}"):
        _, state = amp(torch.randn(2, 8))
    assert torch.equal(state, torch.full((8,), 2.0))


class Rescaled(nn.Module):
    """RWKV's inference trick: the first eval call scales a weight in place and records it in a Python flag;
    train() scales it back at the next call.  A graph keeps the scaling but not the flag."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.rescaled = False

    def forward(self, x):
        if self.training == self.rescaled:
            with torch.no_grad():
                self.lin.weight.mul_(2.0 if self.training else 0.5)
            self.rescaled = not self.training
        return self.lin(x) * (2.0 if self.rescaled else 1.0)



class Flagged(Rescaled):
    """The flag set in a method forward calls (RWKV's ``_rescale_layers``), where the scan of forward cannot see it."""

    def forward(self, x):
        if self.training == self.rescaled:
            self.rescale()
        return self.lin(x) * (2.0 if self.rescaled else 1.0)

    def rescale(self):
        with torch.no_grad():
            self.lin.weight.mul_(2.0 if self.training else 0.5)
        self.rescaled = not self.training


class Helper(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.seen = nn.Linear(8, 8), 0

    def forward(self, x):
        self.count(x)
        return self.lin(x)

    def count(self, x):  # (no ``self.seen = `` in forward: the scan of its source cannot see it)
        self.seen = self.seen + 1


@pytest.mark.parametrize("model, frontend", [(Helper(), "fx"), (Helper(), "export")])
def test_a_counter_set_in_code_forward_calls_is_named(model, frontend):
    """A count the graph does not read: the graph is the same at every count, so it is kept, with a warning that the
    count no longer moves (the scan of forward's source cannot see a helper method's assignment)."""
    kw = dict(example_inputs=(torch.randn(2, 8),)) if frontend == "export" else {}
    with pytest.warns(UserWarning, match=r"forward sets seen \(0 -> 1\) in code it calls: it ran once, "
                                         r"at capture .*every call runs as if seen were still 0.*convert_"):
        amp = fxamp.convert(model, "O1", dtype="bfloat16", frontend=frontend, **kw)
    x = torch.randn(2, 8)
    torch.testing.assert_close(amp(x), model.lin(x), atol=0.05, rtol=0.02)


class Scaled(Helper):
    """A count the graph reads: its value is baked into the graph as a constant."""

    def forward(self, x):
        self.count(x)
        return self.lin(x) * self.seen


@pytest.mark.parametrize("make", [Rescaled, Flagged, Scaled], ids=["set-in-forward", "set-in-helper", "read"])
@pytest.mark.parametrize("frontend", ["auto", "export", "lazy"])
def test_a_graph_that_depends_on_an_attribute_its_forward_changes_is_refused(make, frontend):
    """RWKV's first eval call rescales weights in place and sets layers_are_rescaled, which gates the rescale: a
    graph kept the rescale but not the flag and rescaled again at every call (the second call off by 0.55 at
    rescale_every=1).  The capture is taken again at the attribute's new value; the two graphs differ, so it is
    refused, naming the attribute and convert_."""
    model = make().eval()
    x = torch.randn(2, 8)
    name, old, new = ("seen", 0, 1) if isinstance(model, Scaled) else ("rescaled", False, True)
    match = (rf"forward sets {name} \({old} -> {new}\), and its graph depends on that value: the graph captured at "
             rf"{name}={old} is not the one at {new}, so .*fxamp.convert_")
    weight = model.lin.weight.detach().clone()
    with warnings.catch_warnings(), pytest.raises(fxamp.TraceError, match=match):
        warnings.simplefilter("ignore")
        if frontend == "lazy":  # captured at the first call
            fxamp.convert(model, "O1", dtype="bfloat16", frontend="export")(x)
        else:
            fxamp.convert(model, "O1", dtype="bfloat16", frontend=frontend, example_inputs=(x,))
    assert getattr(model, name) == old and torch.equal(model.lin.weight, weight)  # the user's model untouched


def test_in_place_the_module_that_sets_it_runs_as_written():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
            self.head = Rescaled()

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 8)
    ref = copy.deepcopy(model)
    amp = fxamp.convert_(model, "O1", dtype="bfloat16")
    for mode in ("eval", "eval", "train", "eval"):
        getattr(ref, mode)()
        getattr(amp, mode)()
        with torch.no_grad():
            torch.testing.assert_close(amp(x), ref(x), atol=0.05, rtol=0.02)


class EMACodebook(nn.Module):
    """A VQ-VAE's quantizer: the codebook is an exponential moving average its training call updates in place under
    torch.no_grad(), a region whose outputs nothing reads."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("codebook", torch.randn(4, 8))
        self.register_buffer("avg", torch.randn(4, 8))

    def forward(self, x):
        z = self.lin(x)
        idx = (z @ self.codebook.t()).argmax(-1)
        onehot = torch.nn.functional.one_hot(idx, 4).to(z.dtype)
        q = onehot @ self.codebook
        if self.training:  # (after the lookup: nothing reads what the region writes)
            with torch.no_grad():
                self.avg.mul_(0.5).add_(onehot.t() @ z, alpha=0.5)
                self.codebook.copy_(self.avg)
        return z + (q - z).detach()


@pytest.mark.parametrize("frontend", ["export", "auto"])
@pytest.mark.parametrize("policy", ["O0", "O2"])
def test_a_no_grad_region_that_writes_buffers_is_kept(frontend, policy):
    """torch.export keeps the region as a higher-order op whose outputs nothing reads, and dead-code elimination
    removed it: the codebook never moved (a VQ-VAE's training lost 0.31 of float32's loss in 4 steps). 'auto': torch.fx
    captures eval mode only (training mode writes a buffer it reads), so torch.export captures both."""
    torch.manual_seed(0)
    model, x = EMACodebook(), torch.randn(6, 8)
    ref, first = copy.deepcopy(model), model.codebook.clone()
    amp = fxamp.convert(model, policy, dtype="bfloat16", example_inputs=(x,), frontend=frontend)
    for mode in ("train", "train", "eval"):
        getattr(ref, mode)(), getattr(amp, mode)()
        with torch.no_grad():
            amp(x), ref(x)
        got = dict(amp.named_buffers())
        for name, expected in ref.named_buffers():
            torch.testing.assert_close(got[name].float(), expected, atol=0.05, rtol=0.02)
    assert not torch.equal(ref.codebook, first)  # (it moved: the comparison above can fail)


def test_a_capture_with_torch_export_leaves_the_users_model_its_values():
    """forward stores its batch size on the root (``self.last_rows = x.shape[0]``): torch.export puts back what the
    module it traces sets, but fxamp traced a copy whose forward was bound to the user's model, which kept a SymInt
    of the finished trace (``s77``) in place of its int."""
    class Rows(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.last_rows = 0

        def forward(self, x):
            self.last_rows = x.shape[0]
            return self.lin(x)

    x = torch.randn(4, 8)
    model = Rows()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp = fxamp.convert(model, "O1", example_inputs=(x,), frontend="export")
    assert type(model.last_rows) is int and model.last_rows == 0
    assert torch.allclose(amp(x), model(x), atol=0.05)


class Carried(nn.Module):
    """A recurrent cell that keeps its last output in a plain attribute and adds it at the next call (RecurrentGemma's
    ``conv1d_state`` and ``recurrent_states``, written as the library writes them)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.state = None

    def forward(self, x):
        if self.state is not None:
            x = x + self.state
        y = self.lin(x)
        self.state = y.detach()
        return y


class Rotary(nn.Module):
    """A table a helper fills when a longer sequence comes, which forward reads after it: no state between calls."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.table = torch.zeros(0, 8)

    def _fill(self, n):
        self.table = torch.arange(n, dtype=torch.float32)[:, None].expand(n, 8) / 8

    def forward(self, x):
        self._fill(x.shape[1])
        return self.lin(x + self.table[:x.shape[1]])


class Grown(nn.Module):
    """A table grown when a longer sequence comes: forward reads its size, not its values, before the write."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.table = torch.zeros(2, 8)

    def forward(self, x):
        if self.table.shape[0] < x.shape[1]:
            self.table = torch.arange(x.shape[1], dtype=torch.float32)[:, None].expand(-1, 8) / 8
        return self.lin(x + self.table[:x.shape[1]])


class Stash(nn.Module):
    """The last attention kept for a look after the call, never read by forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        self.last = y.detach()
        return y


def _convert(model, path, x):
    if path == "in-place":
        return fxamp.convert_(nn.Sequential(model, copy.deepcopy(model)), "O1", dtype=torch.bfloat16)
    if path == "lazy":
        return fxamp.convert(model, "O1", dtype=torch.bfloat16, frontend="export")
    return fxamp.convert(model, "O1", dtype=torch.bfloat16, frontend=path, example_inputs=(x,))


@pytest.mark.parametrize("path", ["fx", "export", "lazy"])
def test_a_tensor_kept_between_calls_in_a_plain_attribute_is_refused_whole(path):
    """The graph read self.state once (None) and never writes it: every call after the first ran without the state
    (0.53 off at the second call). Refused, naming the attribute; the user's model holds no torch.fx proxy."""
    model, x = Carried(), torch.randn(2, 4, 8)
    with pytest.raises(fxamp.TraceError, match=r"Carried's forward keeps a tensor in self.state from one call to the "
                                               r"next.*convert in place \(fxamp.convert_\)"):
        _convert(model, path, x)(x)
    assert model.state is None or type(model.state) is torch.Tensor


def test_in_place_a_block_that_keeps_a_tensor_between_calls_runs_as_written():
    torch.manual_seed(0)
    ref = nn.Sequential(Carried(), Carried())
    x = torch.randn(2, 4, 8)
    with pytest.warns(RuntimeWarning, match=r"run.s. as written.*keeps a tensor in self.state between calls.*give "
                                            r"convert_ finer blocks \(blocks=\[...\] globs under '0'\) that leave "
                                            r"out the block itself"):
        amp = fxamp.convert_(copy.deepcopy(ref), "O1", dtype=torch.bfloat16)
        first = amp(x)
    for out in [first] + [amp(x) for _ in range(2)]:
        assert torch.equal(out, ref(x))  # (as written: float32, the state carried as the model carries it)
    assert all(type(m.state) is torch.Tensor for m in amp)


@pytest.mark.parametrize("make,path", [(m, p) for m in (Rotary, Grown, Stash) for p in ("fx", "export", "in-place")
                                       if (m, p) != (Grown, "fx")])  # (torch.fx cannot branch on a shape)
def test_a_table_filled_before_its_read_or_a_stash_is_not_refused_and_leaves_no_proxy(make, path):
    """Neither reads a value an earlier call left. The trace's writes are undone: under torch.fx they were proxies,
    left in the user's module (a child: the whole-model capture traces a shallow copy of the root only)."""
    torch.manual_seed(0)
    model, x = make(), torch.randn(2, 4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the stash is noted: it ran once, at capture)
        amp = _convert(model if path == "in-place" else nn.Sequential(model), path, x)
        amp(x)  # (in place: the capture)
        assert all(type(v) is torch.Tensor for k, v in vars(model).items() if k in ("table", "last"))
        for n in (4, 6):
            y = torch.randn(2, n, 8)
            want = (nn.Sequential(model, model) if path == "in-place" else model)(y)
            assert rel_err(amp(y), want) < 1e-2


def rel_err(a, b):
    return float((a.float() - b).norm() / b.norm())


class CountedStash(Stash):
    """A counter (a plain attribute forward sets, so the capture is taken again at its new value) and a stash."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


@pytest.mark.parametrize("path", ["fx", "export"])
def test_the_second_trace_of_a_written_attribute_leaves_no_proxy_either(path):
    """The counter's check traces forward again at calls=1, which writes the stash again: a torch.fx proxy (export: a
    fake tensor) left there reached the user's next call."""
    model, x = CountedStash(), torch.randn(2, 4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the counter and the stash are noted)
        amp = _convert(nn.Sequential(model), path, x)
    assert "last" not in vars(model) or type(model.last) is torch.Tensor, type(model.last)
    assert rel_err(amp(x), model(x)) < 1e-2


class BiasCache(nn.Module):
    """LeViT's attention (Hugging Face's and timm's): an eval call caches the attention biases, gathered from a
    parameter, in a dict keyed by device; ``train()`` empties it."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.biases = nn.Parameter(torch.randn(2, 7) * 0.5)
        self.register_buffer("idxs", torch.randint(0, 7, (4, 4)), persistent=False)
        self.cache = {}

    @torch.no_grad()
    def train(self, mode=True):
        super().train(mode)
        if mode and self.cache:
            self.cache = {}
        return self

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 4).permute(2, 0, 3, 1, 4)
        if self.training:
            bias = self.biases[:, self.idxs]
        else:
            key = str(x.device)
            if key not in self.cache:
                self.cache[key] = self.biases[:, self.idxs]
            bias = self.cache[key]
        return ((q @ k.transpose(-2, -1) * 0.5 + bias).softmax(-1) @ v).transpose(1, 2).flatten(2)


@pytest.mark.parametrize("path", ["fx", "export", "in-place"])
def test_a_cache_an_eval_call_fills_holds_no_proxy_and_eval_after_a_step_reads_the_stepped_parameter(path):
    """The trace's write into the dict is undone (torch.fx left a proxy there, keyed by a proxy; in place, the first
    mode's capture left one that the eval capture read: a node of another graph), and the eval graph gathers the
    biases from the parameter at every call: after a step that moves only them, eval follows (not the first call's)."""
    torch.manual_seed(0)
    model, x = nn.Sequential(BiasCache(), nn.Linear(8, 8), BiasCache()), torch.randn(2, 4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp = (fxamp.convert_(model, "O1", dtype=torch.bfloat16) if path == "in-place" else
               fxamp.convert(model, "O1", dtype=torch.bfloat16, frontend=path, example_inputs=(x,)))
        amp.train()
        biases = [p for name, p in amp.named_parameters() if name.endswith("biases")]
        opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(biases, lr=5.0), model=amp)
        opt.backward(amp(x).float().pow(2).sum())  # (in place: the training mode's capture)
        opt.step()
        amp.eval()
        with torch.no_grad():
            got = amp(x).float()  # (in place: the eval mode's capture)
    assert all(type(v) is torch.Tensor for m in model[::2] for v in list(m.cache.values()) + list(m.cache)
               if not isinstance(v, str)), [m.cache for m in model[::2]]
    torch.manual_seed(0)
    first = nn.Sequential(BiasCache(), nn.Linear(8, 8), BiasCache()).eval()  # (the weights before the step)
    stepped = copy.deepcopy(first)
    stepped.load_state_dict(opt.fp32_state_dict())
    with torch.no_grad():
        want, stale = stepped(x), first(x)
    assert rel_err(want, stale) > 0.05  # (the step moved the output: a graph holding the first biases is seen)
    assert rel_err(got, want) < 1e-2, (rel_err(got, want), rel_err(got, stale))


class DictStash(nn.Module):
    """The last output kept for a look after the call, in a dict made anew at each call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.last = {}

    def forward(self, x):
        y = self.lin(x)
        self.last = {"out": y.detach()}
        return y


@pytest.mark.parametrize("path", ["fx", "export"])
def test_a_new_dict_a_trace_sets_holding_a_proxy_is_put_back(path):
    """Not the dict the module had, filled (LeViT's cache, above), but a new one set in its place: the trace's
    proxy (export: fake tensor) in it reached the user's next look at the stash."""
    model, x = DictStash(), torch.randn(2, 4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the stash is noted)
        amp = _convert(nn.Sequential(model), path, x)
    assert model.last == {}, model.last
    assert rel_err(amp(x), model(x)) < 1e-2 and type(model.last["out"]) is torch.Tensor
