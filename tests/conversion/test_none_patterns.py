"""Optional inputs (``labels=None``) after a capture (issue 37): a graph per None pattern.

torch.fx traces every input as a value, so ``if labels is not None:`` takes the branch where labels are given:
the graph ``convert`` captured has no path for a call without them.  Such a call now captures once more with
torch.fx, ``labels`` traced as None (``fxamp.conversion.none_patterns``; a ``LazyConverted`` with
``frontend="fx"`` keys its graphs by (mode, None pattern)), on the same parameters.  Pinned here: both calls
against float32 and ``torch.autocast``, training through the loss path, one capture per pattern, O1/O2 and
bfloat16/float16, copies, pickles, ``torch.compile``, the report and ``state_dict``; the torch.export paths
(lazy, and from example inputs) in both orders; a Hugging Face GPT-2 with ``labels=``; and bool flags.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.conversion.lazy import LazyConverted, range_fallback
from fxamp.conversion.none_patterns import NonePatterns, none_patterns

pytestmark = pytest.mark.usefixtures("one_thread")

BF, F16 = torch.bfloat16, torch.float16


class Head(nn.Module):
    """Hugging Face's head convention: a loss only when labels are given, a mask only when one is."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)

    def forward(self, x, labels=None, mask=None):
        logits = self.fc2(F.gelu(self.norm(self.fc1(x))))
        if mask is not None:
            logits = logits.masked_fill(mask, -1e4)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits, labels)
        return logits, loss


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 16, generator=g)
    y = torch.randint(0, 8, (6,), generator=g)
    mask = torch.zeros(6, 8, dtype=torch.bool)
    mask[:, -1] = True
    return x, y, mask


def _sqnr(ref, out):
    ref, out = ref.detach().double(), out.detach().double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum().clamp_min(1e-300)))


def _like_autocast(model, amp, dtype, *args, **kwargs):
    """logits (and the loss, where given) as close to float32 as torch.autocast's, within 3 dB; float32 out."""
    with torch.no_grad():
        ref = model(*args, **kwargs)
        with torch.autocast("cpu", dtype=dtype):
            auto = model(*args, **kwargs)
        out = amp(*args, **kwargs)
    assert out[0].dtype == torch.float32
    assert _sqnr(ref[0], out[0]) >= _sqnr(ref[0], auto[0].float()) - 3
    if ref[1] is None:
        assert out[1] is None
    else:
        assert out[1].dtype == torch.float32 and out[1].shape == ()
        assert abs(float(out[1]) - float(ref[1])) <= max(3 * abs(float(auto[1]) - float(ref[1])), 0.02)
    return out


@pytest.mark.parametrize("policy", ["O1", "O2"])
@pytest.mark.parametrize("dtype", [BF, F16])
@pytest.mark.parametrize("first", ["with labels", "without"])
def test_fx_module_takes_calls_with_and_without_labels(policy, dtype, first):
    torch.manual_seed(0)
    model = Head().eval()
    amp = fxamp.convert(copy.deepcopy(model), policy, dtype=dtype)
    assert isinstance(amp.__dict__["_wrapped_call"], NonePatterns) and fxamp.conversion_info(amp).frontend == "fx"
    x, y, mask = _data()
    calls = [((x, y), {"mask": mask}), ((x,), {})]
    for args, kwargs in calls if first == "with labels" else calls[::-1]:
        _like_autocast(model, amp, dtype, *args, **kwargs)
        _like_autocast(model, amp, dtype, *args, **kwargs)  # the second call runs the cached graph
    assert none_patterns(amp)._fxamp_captures == 1  # (x): one capture, labels and mask None; (x, y, mask): convert's


def test_each_none_pattern_is_captured_once_and_all_given_runs_the_converted_graph():
    model = Head()
    amp = fxamp.convert(copy.deepcopy(model), "O2", dtype=BF)
    lazy = none_patterns(amp)
    x, y, mask = _data()
    amp(x, y, mask)
    amp(x, labels=y, mask=mask)
    assert lazy._fxamp_captures == 0  # every optional input given: the graph convert captured
    for call in [lambda: amp(x, y), lambda: amp(x), lambda: amp(x, mask=mask), lambda: amp(x, None, None),
                 lambda: amp(x, labels=None), lambda: amp(x, y, None), lambda: amp(x, None, mask)]:
        call()
    assert lazy._fxamp_captures == 3  # (mask None), (labels, mask None), (labels None): each once
    assert sorted(lazy._fxamp_cache) == sorted([(("any call", ("mask",)), None), (("any call", ("labels", "mask")), None),
                                                 (("any call", ("labels",)), None)])
    notes = fxamp.conversion_info(amp).notes
    assert sum("captured a graph with torch.fx for" in n for n in notes) == 3
    # the same parameter objects (O2: the bfloat16 storage), state_dict keys the original's
    assert [id(p) for p in lazy.parameters()] == [id(p) for p in amp.parameters()]
    assert {p.dtype for n, p in amp.named_parameters() if "fc" in n} == {BF}
    assert list(amp.state_dict()) == list(model.state_dict())
    assert [n.name for n in amp.graph.find_nodes(op="placeholder")] == ["x", "labels", "mask"]  # convert's graph
    assert "cross_entropy" in str(fxamp.report(amp))


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_training_through_the_loss_path_and_without_labels(policy):
    torch.manual_seed(0)
    model = Head()
    amp = fxamp.convert(copy.deepcopy(model), policy, dtype=BF)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(amp.parameters(), lr=0.1), model=amp)
    x, y, _ = _data()
    ref_logits, ref_loss = model(x, y)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, call in [("labels", lambda: amp(x, y)[1]), ("no labels", lambda: F.cross_entropy(amp(x)[0], y))]:
        opt.zero_grad()
        loss = call()
        assert loss.dtype == torch.float32 and abs(float(loss.detach()) - float(ref_loss.detach())) < 0.02, name
        opt.backward(loss)
        for n, p in amp.named_parameters():
            g = p.grad.double().flatten()
            cos = float(F.cosine_similarity(g, ref_grads[n].double().flatten(), dim=0))
            assert cos > 0.99, (name, n, cos)
    opt.step()  # the shared parameters move: both graphs see it
    with torch.no_grad():
        assert torch.equal(amp(x, y)[0], amp(x)[0])
    assert none_patterns(amp)._fxamp_captures == 2  # (mask None) and (labels, mask None)


def test_copies_pickles_and_eval_keep_every_pattern():
    model = Head()
    amp = fxamp.convert(copy.deepcopy(model), "O2", dtype=BF)
    x, y, mask = _data()
    with torch.no_grad():
        want = amp(x), amp(x, y, mask)
        copied = copy.deepcopy(amp)
        buf = io.BytesIO()
        torch.save(amp, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        for other in (copied, loaded):
            lazy = none_patterns(other)
            assert lazy is not None and lazy is not none_patterns(amp)
            assert [id(p) for p in lazy.parameters()] == [id(p) for p in other.parameters()]  # its own, shared
            got = other(x), other(x, y, mask)
            assert torch.equal(got[0][0], want[0][0]) and got[0][1] is None
            assert torch.equal(got[1][0], want[1][0]) and torch.equal(got[1][1], want[1][1])
        amp.eval()
        assert torch.equal(amp(x)[0], want[0][0])  # no dropout: the same graph serves eval mode


def _local_head():
    class LocalHead(Head):  # defined in a function: pickle cannot find the class by name
        pass

    return LocalHead()


def test_a_pickle_that_cannot_take_the_original_refuses_the_none_call_in_one_line():
    amp = fxamp.convert(_local_head(), "O1", dtype=BF)
    x, y, _ = _data()
    assert amp(x)[1] is None
    buf = io.BytesIO()
    torch.save(amp, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded(x, y, torch.zeros(6, 8, dtype=torch.bool))[1].dtype == torch.float32
    with pytest.raises(fxamp.FxampError, match=r"captured by torch\.fx.*this call has labels=None, mask=None.*"
                                               r"Pass labels, or convert with frontend='export'"):
        loaded(x)


def test_torch_compile_runs_both_patterns():
    torch._dynamo.reset()
    model = Head().eval()
    amp = fxamp.convert(copy.deepcopy(model), "O1", dtype=BF)
    x, y, mask = _data()
    with torch.no_grad():
        want = amp(x, y, mask), amp(x)
        compiled = torch.compile(amp, backend="eager")
        got = compiled(x, y, mask), compiled(x)
    assert torch.equal(got[0][0], want[0][0]) and torch.equal(got[0][1], want[0][1])
    assert torch.equal(got[1][0], want[1][0]) and got[1][1] is None


# ---------------------------------------------------------------------------------------------
# A graph per (mode, None pattern): a model whose two modes capture different graphs
# ---------------------------------------------------------------------------------------------


class DropPathHead(Head):
    """Stochastic depth (a branch on self.training): ``convert`` returns a LazyConverted(frontend='fx')."""

    def forward(self, x, labels=None):
        h = self.fc1(x)
        if self.training:
            h = h * h.new_empty((h.shape[0], 1)).bernoulli_(0.5) * 2.0  # timm's stochastic depth
        logits = self.fc2(self.norm(h))
        return logits, (F.cross_entropy(logits, labels) if labels is not None else None)


def test_a_graph_per_mode_and_none_pattern():
    torch.manual_seed(0)
    model = DropPathHead().eval()
    amp = fxamp.convert(copy.deepcopy(model), "O2", dtype=BF)
    assert isinstance(amp, LazyConverted) and fxamp.conversion_info(amp).frontend == "fx"
    x, y, _ = _data()
    _like_autocast(model, amp, BF, x)  # eval, labels None: captured now
    _like_autocast(model, amp, BF, x, y)  # eval, labels given: convert's graph
    assert amp._fxamp_captures == 2
    amp.train()
    model.train()
    for call in [(x,), (x, y), (x,), (x, y)]:
        torch.manual_seed(3)
        out = amp(*call)
        torch.manual_seed(3)
        ref = model(*call)
        dropped = (out[0] - model.fc2.bias.to(BF).float()).abs().max(1).values < 1e-6
        assert torch.equal(dropped, (ref[0] - model.fc2.bias).abs().max(1).values < 1e-6)  # the same rows dropped
        assert (out[1] is None) == (len(call) == 1)
    assert amp._fxamp_captures == 4  # (eval, train) x (labels given, None): each once
    assert {d for d in fxamp.conversion_info(amp).signatures} == {
        "(any arguments) (eval mode)", "(any arguments, labels None) (eval mode)",
        "(any arguments) (training mode)", "(any arguments, labels None) (training mode)"}


# ---------------------------------------------------------------------------------------------
# torch.export: lazily, and from example inputs, in both orders
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("first", ["with labels", "without"])
def test_lazy_export_takes_both_calls_in_either_order(first):
    model = Head().eval()
    amp = fxamp.convert(copy.deepcopy(model), "O1", dtype=BF, frontend="export")
    x, y, _ = _data()
    calls = [(x, y), (x,)] if first == "with labels" else [(x,), (x, y)]
    for call in calls + calls:
        _like_autocast(model, amp, BF, *call)
    assert amp._fxamp_captures == 2


@pytest.mark.parametrize("policy", ["O1", "O2"])
@pytest.mark.parametrize("frontend", ["auto", "export"])
@pytest.mark.parametrize("example", ["with labels", "without"])
def test_convert_from_example_inputs_captures_the_other_call_once(policy, frontend, example):
    # "auto": torch.fx traces it (example inputs unused): a graph per None pattern; "export": the other
    # signature is captured with torch.export on the same tensors (lazy.RangeFallback)
    model = Head().eval()
    x, y, _ = _data()
    inputs = (x, y) if example == "with labels" else (x,)
    amp = fxamp.convert(copy.deepcopy(model), policy, dtype=BF, example_inputs=inputs, frontend=frontend)
    assert fxamp.conversion_info(amp).frontend == ("fx" if frontend == "auto" else "export")
    other = (x,) if example == "with labels" else (x, y)
    for call in [inputs, other, inputs, other]:
        _like_autocast(model, amp, BF, *call)
    if frontend == "export":
        assert range_fallback(amp)._fxamp_captures == 1
        assert "the call's inputs are not the example inputs'" in fxamp.conversion_info(amp).notes[-1]
    else:  # (x): labels and mask None; (x, y): mask None
        assert none_patterns(amp)._fxamp_captures == 2


# ---------------------------------------------------------------------------------------------
# Bool flags: torch.fx refuses a branch on one, so torch.export captures once per value
# ---------------------------------------------------------------------------------------------


class Flagged(Head):
    """``return_dict``/``use_cache``-style flags, branched on as Hugging Face models do."""

    def forward(self, x, labels=None, return_dict=True, scale_logits=False):
        logits = self.fc2(F.gelu(self.norm(self.fc1(x))))
        if scale_logits:
            logits = logits * 2
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        if not return_dict:
            return logits, loss
        return {"logits": logits, "loss": loss}


def test_a_bool_flag_branched_on_captures_once_per_value():
    model = Flagged().eval()
    amp = fxamp.convert(copy.deepcopy(model), "O1", dtype=BF)
    assert isinstance(amp, LazyConverted) and fxamp.conversion_info(amp).frontend == "export"  # torch.fx refused `if scale_logits:`
    x, y, _ = _data()
    for kwargs in [{}, {"return_dict": False}, {"scale_logits": True}, {"labels": y, "return_dict": False}]:
        with torch.no_grad():
            out, ref = amp(x, **kwargs), model(x, **kwargs)
        assert type(out) is type(ref)
        out, ref = (out["logits"], out["loss"]) if isinstance(out, dict) else out, \
            (ref["logits"], ref["loss"]) if isinstance(ref, dict) else ref
        assert _sqnr(ref[0], out[0]) > 25 and (out[1] is None) == (ref[1] is None)
    assert amp._fxamp_captures == 4


# ---------------------------------------------------------------------------------------------
# A Hugging Face model with labels= (random weights from a tiny config)
# ---------------------------------------------------------------------------------------------


def _gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def _hf_like_autocast(model, amp, dtype, ids, **kwargs):
    with torch.no_grad():
        ref = model(ids, **kwargs)
        with torch.autocast("cpu", dtype=dtype):
            auto = model(ids, **kwargs)
        out = amp(ids, **kwargs)
    assert out.logits.dtype == torch.float32
    assert _sqnr(ref.logits, out.logits) >= _sqnr(ref.logits, auto.logits.float()) - 3
    if "labels" in kwargs:
        assert out.loss.dtype == torch.float32
        assert abs(float(out.loss) - float(ref.loss)) <= max(3 * abs(float(auto.loss) - float(ref.loss)), 0.02)
    else:
        assert out.loss is None


@pytest.mark.parametrize("policy, dtype, example", [("O1", BF, False), ("O2", F16, True)])
def test_hugging_face_gpt2_converted_with_labels_then_called_without(policy, dtype, example):
    model = _gpt2()
    ids = torch.randint(0, 96, (2, 12))
    if example:  # from example inputs with labels: the call without them captures once, on the same tensors
        amp = fxamp.convert(copy.deepcopy(model), policy, dtype=dtype, example_inputs=(ids,),
                            example_kwargs={"labels": ids})
    else:  # torch.fx cannot trace GPT-2: captured at the first call, with labels
        amp = fxamp.convert(copy.deepcopy(model), policy, dtype=dtype)
    _hf_like_autocast(model, amp, dtype, ids, labels=ids)
    _hf_like_autocast(model, amp, dtype, ids)
    _hf_like_autocast(model, amp, dtype, ids, labels=ids)
    lazy = range_fallback(amp) if example else amp
    assert lazy._fxamp_captures == (1 if example else 2)  # each signature once
    assert list(amp.state_dict()) == list(model.state_dict())


def test_a_flag_left_at_its_default_is_not_the_example_inputs_value():
    # the example gave return_dict=False: a call that leaves it out means forward's True (a dict), as the original;
    # it was filled in with the example's False (a tuple) before.  Another value captures once more
    model = Flagged().eval()
    x, y, _ = _data()
    amp = fxamp.convert(copy.deepcopy(model), "O1", dtype=BF, example_inputs=(x,), example_kwargs={"return_dict": False},
                        frontend="export")
    for kwargs in [{"return_dict": False}, {}, {"return_dict": True}, {"labels": y, "return_dict": False}, {}]:
        with torch.no_grad():
            out, ref = amp(x, **kwargs), model(x, **kwargs)
        assert type(out) is type(ref), kwargs
        out, ref = (out["logits"], out["loss"]) if isinstance(out, dict) else out, \
            (ref["logits"], ref["loss"]) if isinstance(ref, dict) else ref
        assert _sqnr(ref[0], out[0]) > 25 and (out[1] is None) == (ref[1] is None)
    assert range_fallback(amp)._fxamp_captures == 3  # (x), (x, return_dict=True), (x, labels, return_dict=False)


class IdentityFlag(nn.Module):
    """``if double is True:``: torch.fx would test its proxy (never True) and keep one branch for every call."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x, double=False):
        y = self.fc(x)
        if double is True:
            y = y * 2
        return y


def test_an_identity_test_on_a_flag_is_refused_by_torch_fx_and_captured_per_value_by_torch_export():
    model = IdentityFlag().eval()
    with pytest.raises(fxamp.TraceError, match=r"tests the input 'double' by identity \(`if double is True:`, line \d+\)"
                                               r".*Capture it with torch.export"):
        fxamp.convert(model, "O1", dtype=BF, frontend="fx")
    amp = fxamp.convert(copy.deepcopy(model), "O1", dtype=BF)  # auto: captured with torch.export at each value
    x = _data()[0]
    with torch.no_grad():
        for kwargs in [{}, {"double": True}, {"double": False}]:
            ref, out = model(x, **kwargs), amp(x, **kwargs)
            assert _sqnr(ref, out) > 25, kwargs
    assert fxamp.conversion_info(amp).frontend == "export"


class SeparateHeads(nn.Module):
    """A head only the call without labels reads: torch.fx's first graph has none of its parameters."""

    def __init__(self):
        super().__init__()
        self.body, self.train_head, self.infer_head = nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, x, labels=None):
        h = F.relu(self.body(x))
        if labels is None:
            return self.infer_head(h), None
        logits = self.train_head(h)
        return logits, F.cross_entropy(logits, labels)


def test_o2_a_parameter_only_the_none_graph_reads_is_the_converted_modules_never_the_originals():
    model = SeparateHeads().eval()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    amp = fxamp.convert(model, "O2", dtype=BF)
    x, y, _ = _data()
    _like_autocast(model, amp, BF, x, y)
    _like_autocast(model, amp, BF, x)
    lazy = none_patterns(amp)
    head = lazy.get_submodule("infer_head").weight
    assert head is amp.get_submodule("infer_head").weight and head is not model.infer_head.weight
    # (float32: O2 stores low what convert's graph reads; the None graph casts this one where it computes)
    with torch.no_grad():
        head.mul_(0)  # training the converted module changes the original model nowhere
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())


def test_export_from_example_inputs_takes_an_explicit_none_as_the_input_left_out():
    # labels=None where the example gave a tensor was torch's "Expected input at *args[1] to be a tensor"
    model = Head().eval()
    x, y, _ = _data()
    amp = fxamp.convert(copy.deepcopy(model), "O1", dtype=BF, example_inputs=(x, y), frontend="export")
    for args, kwargs in [((x, None), {}), ((x,), {"labels": None}), ((x, y, None), {}), ((x, y), {"mask": None})]:
        _like_autocast(model, amp, BF, *args, **kwargs)


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_root_hooks_run_once_per_call_with_and_without_labels(policy):
    """The root's hooks (registered on the converted module) run once per call on both paths: the graph convert
    captured, and the None pattern's graph (its LazyConverted holds them too; the call runs one of the two)."""
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 5)

        def forward(self, x, labels=None):
            y = self.lin(x)
            return y, (F.cross_entropy(y, labels) if labels is not None else None)

    torch.manual_seed(0)
    model, calls = Head(), []
    model.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    model.register_forward_hook(lambda m, args, out: calls.append("post"))
    amp = fxamp.convert(model, policy, frontend="fx")
    assert calls == []
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 3])
    for args in [(x, y), (x,), (x,), (x, y)]:
        amp(*args)
    assert calls == ["pre", "post"] * 4
