"""Round trips give back the user's float32 weights (issue 37, item 3).

A model converted under O2 stores its weights in bfloat16; the float32 truth is the master an optimizer
steps (or, before one exists, the original).  ``opt.fp32_state_dict()``, the in-place model's own
``state_dict()`` and ``torch.save``/``torch.load`` of either must give that truth bitwise, loadable into
the unconverted model; Hugging Face ``save_pretrained`` is tested in ``tests/integrations/test_hf_blocks.py``.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp

pytestmark = pytest.mark.usefixtures("one_thread")

D, V = 16, 24
BF16 = torch.bfloat16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return x + self.fc(self.ln(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def make() -> Net:
    torch.manual_seed(0)
    return Net()


IDS = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(1))


def train(model, opt, steps=3):
    for _ in range(steps):
        opt.zero_grad()
        opt.backward(model(IDS))
        assert opt.step()


def masters_by_name(model, opt):
    name = {id(p): n for n, p in model.named_parameters()}
    return {name[id(low)]: m for low, m in opt.master_pairs()}


def assert_bitwise(got, want):
    assert set(want) <= set(got)
    for key, value in want.items():
        assert got[key].dtype == torch.float32 == value.dtype, key
        assert torch.equal(got[key], value), key


def reload_into_unconverted(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    fresh = Net()
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))  # strict: every key
    return fresh.state_dict()


def test_in_place_o2_fp32_state_dict_is_the_originals_then_the_masters():
    model = make()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    fxamp.convert_(model, "O2", dtype=BF16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model)
    assert_bitwise(opt.fp32_state_dict(), original)  # before any step: the user's float32 weights, not their rounding
    train(model, opt)
    masters = masters_by_name(model, opt)
    assert "layers.0.fc.weight" in masters and "emb.weight" in masters
    state = opt.fp32_state_dict()
    assert_bitwise(state, masters)
    assert_bitwise(reload_into_unconverted(state), masters)


def test_in_place_o2_state_dict_gives_the_originals_then_the_masters():
    """``model.state_dict()`` (``torch.save`` of it, ``save_pretrained``) of a model converted in place: float32,
    the originals while no optimizer holds them, then the masters; never their bfloat16 rounding."""
    model = make()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    fxamp.convert_(model, "O2", dtype=BF16)
    assert model.layers[0].fc.weight.dtype == BF16
    assert_bitwise(model.state_dict(), original)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model)
    train(model, opt)
    masters = masters_by_name(model, opt)
    assert not torch.equal(masters["layers.0.fc.weight"], original["layers.0.fc.weight"])
    assert_bitwise(model.state_dict(), masters)
    assert_bitwise(reload_into_unconverted(model.state_dict()), masters)
    # a float32 checkpoint loaded into the model since: the loaded float32 values are the truth now, not the stale
    # masters nor the loaded values' rounding
    other = {k: v + 1 for k, v in original.items()}
    model.load_state_dict(other)
    assert_bitwise(model.state_dict(), other)
    # the optimizer gone: its masters are freed; a float32 checkpoint loaded is still given as loaded ...
    model.load_state_dict(original)
    del opt, masters
    gc.collect()
    assert_bitwise(model.state_dict(), original)
    # ... until released (inference needs no float32 copy): then the weights come back widened
    assert fxamp.release_originals(model) == len(list(model.parameters())) - 4  # (the LayerNorms stay float32)
    assert torch.equal(model.state_dict()["layers.0.fc.weight"], original["layers.0.fc.weight"].to(BF16).float())


@pytest.mark.parametrize("how", ["convert", "convert lazy", "convert_"])
def test_o2_float32_checkpoint_loaded_into_the_converted_model_is_kept_for_the_masters(how):
    """issue 37: ``amp.load_state_dict(float32 checkpoint)`` kept only the bfloat16 rounding, so masters built
    afterwards started from it.  The loaded float32 values are kept as the weights' originals: the masters (an
    optimizer built after the load, or one built before, at its next step), ``fp32_state_dict``, the in-place
    model's ``state_dict`` and its copies give them bitwise; the user's checkpoint tensors are never stepped."""
    torch.manual_seed(5)
    checkpoint = {k: v.clone() for k, v in Net().state_dict().items()}
    kept = {k: v.clone() for k, v in checkpoint.items()}
    in_place = how == "convert_"
    amp = fxamp.convert_(make(), "O2", dtype=BF16) if in_place else fxamp.convert(
        make(), "O2", dtype=BF16, **({"frontend": "export"} if how == "convert lazy" else {}))
    amp.load_state_dict(checkpoint)
    assert amp.get_submodule("layers.0.fc").weight.dtype == BF16
    if in_place:
        assert_bitwise(amp.state_dict(), kept)
        assert_bitwise(copy.deepcopy(amp).state_dict(), kept)
        assert_bitwise(pickle.loads(pickle.dumps(amp)).state_dict(), kept)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp.parameters(), lr=1e-2), model=amp)
    assert_bitwise(opt.fp32_state_dict(), kept)
    train(amp, opt, steps=1)
    assert_bitwise(checkpoint, kept)  # the user's tensors did not become masters
    # a wrapper already built: a float32 checkpoint loaded now wins over the weights' rounding at the next step
    torch.manual_seed(7)
    later = Net().state_dict()
    amp.load_state_dict(later)
    for group in opt.param_groups:
        group["lr"] = 0.0
    train(amp, opt, steps=1)
    assert_bitwise(opt.fp32_state_dict(), later)
    assert not torch.equal(later["layers.0.fc.weight"].to(BF16).float(), later["layers.0.fc.weight"])


def test_in_place_o2_state_dict_with_lean_masters_gives_their_float32_value():
    model = make()
    fxamp.convert_(model, "O2", dtype=BF16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, masters="kahan")
    train(model, opt)
    exact = opt.fp32_state_dict()  # weight + kahan term
    state = model.state_dict()
    assert not torch.equal(exact["layers.0.fc.weight"], model.layers[0].fc.weight.float())  # the term counts
    assert_bitwise(state, {k: v for k, v in exact.items() if v.is_floating_point()})


def test_whole_model_o2_round_trip_into_the_unconverted_model():
    model = make()
    amp = fxamp.convert(model, "O2", dtype=BF16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp.parameters(), lr=1e-2), model=amp)
    assert_bitwise(opt.fp32_state_dict(), model.state_dict())  # masters from the exact originals
    train(amp, opt)
    masters = masters_by_name(amp, opt)
    assert "layers.0.fc.weight" in masters
    assert_bitwise(reload_into_unconverted(opt.fp32_state_dict()), masters)
    # the converted module's own state_dict holds its stored dtypes (docs/conversion.md): it round-trips into a
    # converted module, and the optimizer's state_dict restores the masters
    buf = io.BytesIO()
    torch.save({"model": amp.state_dict(), "opt": opt.state_dict()}, buf)
    amp2 = fxamp.convert(make(), "O2", dtype=BF16)
    opt2 = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp2.parameters(), lr=1e-2), model=amp2)
    saved = torch.load(io.BytesIO(buf.getvalue()))
    amp2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    assert_bitwise(opt2.fp32_state_dict(), opt.fp32_state_dict())


def _deepcopy(model):
    import copy

    return copy.deepcopy(model)


def _torch_save(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=False)


FRONTENDS = {"fx": {}, "lazy": {"frontend": "export"}, "export": {"frontend": "export", "example_inputs": (IDS,)}}


@pytest.mark.parametrize("frontend, copy_of", [("fx", _deepcopy), ("fx", _torch_save), ("lazy", _deepcopy),
                                               ("lazy", _torch_save), ("export", _deepcopy)])  # (export: no pickle)
def test_whole_model_o2_copy_after_kahan_training_gives_a_fresh_optimizer_the_trained_float32_values(frontend, copy_of):
    """Issue 37: a copy of a ``convert``ed O2 model trained with ``masters="kahan"``, given to a new optimizer with
    float32 masters, started from its bfloat16 weights widened; now from the Kahan pairs' values, bit for bit."""
    amp = fxamp.convert(make(), "O2", dtype=BF16, **FRONTENDS[frontend])
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp.parameters(), lr=1e-2), model=amp, masters="kahan")
    train(amp, opt, steps=2)
    exact = {k: v.clone() for k, v in opt.fp32_state_dict().items()}
    low = {n for n, p in amp.named_parameters() if p.dtype == BF16}
    assert "layers.0.fc.weight" in low
    assert not torch.equal(exact["layers.0.fc.weight"], amp.layers[0].fc.weight.float())  # the term counts
    copied = copy_of(amp)
    assert amp.state_dict()["head.weight"].dtype == BF16 == copied.state_dict()["head.weight"].dtype  # as stored
    fresh = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(copied.parameters(), lr=1e-2), model=copied)
    assert_bitwise(fresh.fp32_state_dict(), exact)
    train(amp, opt, steps=1)  # the original trains on: the copy's masters were taken when it was copied
    assert_bitwise(fresh.fp32_state_dict(), exact)


COPIES = [("fx", _deepcopy), ("fx", _torch_save), ("lazy", _deepcopy), ("lazy", _torch_save), ("export", _deepcopy),
          ("convert_", _deepcopy), ("convert_", _torch_save)]  # (an export-captured module does not pickle: torch's hooks)


@pytest.mark.parametrize("optimizer_first", [False, True], ids=["load-then-copy", "wrapper-load-copy"])
@pytest.mark.parametrize("frontend, copy_of", COPIES)
def test_o2_copy_after_a_float32_checkpoint_load_carries_the_loaded_values(frontend, copy_of, optimizer_first):
    """Issue 37: ``amp = convert(model, "O2")``, ``amp.load_state_dict(float32 checkpoint)``, then a copy of the whole
    module (deepcopy, ``torch.save``/``torch.load``) carried the user's original float32 values (``model`` still alive)
    or their rounding, not the loaded ones.  The copy now takes the loaded values along: a wrapper built on it starts
    its masters from them, and the in-place model's ``state_dict`` gives them, bit for bit; so does the original,
    also when its wrapper was built before the load (the load wins over its masters until the next step)."""
    torch.manual_seed(5)
    checkpoint = {k: v.clone() for k, v in Net().state_dict().items()}
    kept = {k: v.clone() for k, v in checkpoint.items()}
    model = make()  # the user's original, alive: its float32 values are not the checkpoint's
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if frontend == "convert_":
        amp = fxamp.convert_(model, "O2", dtype=BF16)
    else:
        amp = fxamp.convert(model, "O2", dtype=BF16, **FRONTENDS[frontend])
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp.parameters(), lr=1e-2), model=amp) \
        if optimizer_first else None
    amp.load_state_dict(checkpoint)
    assert not torch.equal(kept["layers.0.fc.weight"], before["layers.0.fc.weight"])
    assert not torch.equal(kept["layers.0.fc.weight"].to(BF16).float(), kept["layers.0.fc.weight"])  # not its rounding
    copied = copy_of(amp)
    if frontend == "convert_":
        assert_bitwise(copied.state_dict(), kept)
        assert_bitwise(amp.state_dict(), kept)
    else:  # a whole-model module's state_dict holds the stored dtypes (docs/conversion.md)
        assert copied.state_dict()["layers.0.fc.weight"].dtype == BF16
        assert torch.equal(copied.state_dict()["layers.0.fc.weight"], kept["layers.0.fc.weight"].to(BF16))
    fresh = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(copied.parameters(), lr=1e-2), model=copied)
    assert_bitwise(fresh.fp32_state_dict(), kept)
    assert_bitwise(copy_of(copied).state_dict() if frontend == "convert_" else kept, kept)
    train(copied, fresh, steps=1)  # the copy trains from the checkpoint; the original keeps the loaded values
    if opt is None:
        opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp.parameters(), lr=1e-2), model=amp)
        assert_bitwise(opt.fp32_state_dict(), kept)
    for group in opt.param_groups:
        group["lr"] = 0.0
    train(amp, opt, steps=1)  # (a wrapper built before the load takes the loaded values at its step)
    assert_bitwise(opt.fp32_state_dict(), kept)
    assert_bitwise(checkpoint, kept)  # the user's checkpoint tensors were never stepped
