"""What the in-place and lazy paths read from a module's bytecode before any graph exists
(``fxamp/conversion/bytecode.py``), and the storage rule built on it: an embedding table only a norm reads
stays float32 under O2 on every path, as whole-model conversion keeps it."""

from __future__ import annotations

import copy
from typing import Optional

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.conversion.bytecode import codes_of, feeds_only, passes_on, reads_values
from fxamp.conversion.storage import lookups_into_norms, predict_storage
from fxamp.policy import Policy


def _verdict(fn, child: str = "tok", into=("norm",)) -> Optional[bool]:
    return feeds_only(fn.__code__, child, into)


class Shapes:  # each method one way code can use ``self.tok``'s lookup
    def nested(self, ids):
        return self.drop(self.norm(self.tok(ids)))

    def through_a_local(self, ids, embeds=None):
        if (ids is None) ^ (embeds is not None):
            raise ValueError("one of them")
        if embeds is None:
            embeds = self.tok(ids)
        batch, length, _ = embeds.shape
        return self.norm(embeds), batch, length

    def summed_first(self, ids, pos):
        return self.norm(self.tok(ids) + self.pos(pos))

    def local_used_twice(self, ids):
        e = self.tok(ids)
        return self.norm(e) + e

    def returned(self, ids):
        return self.tok(ids)

    def norm_takes_more(self, ids):
        return self.norm(self.tok(ids), 0.5)

    def other_module(self, ids):
        return self.proj(self.tok(ids))

    def branch_in_arguments(self, ids, flag):
        return self.norm(self.tok(ids if flag else ids + 1))

    def weight_read(self, ids):
        return self.norm(torch.nn.functional.embedding(ids, self.tok.weight))

    def in_a_closure(self, ids):
        e = self.tok(ids)
        return (lambda: self.norm(e))()

    def unrelated(self, x):
        return self.norm(x)


@pytest.mark.parametrize("method,expected", [
    ("nested", True), ("through_a_local", True),
    ("summed_first", False), ("local_used_twice", False), ("returned", False), ("norm_takes_more", False),
    ("other_module", False), ("branch_in_arguments", False), ("weight_read", False), ("in_a_closure", False),
    ("unrelated", None),
])
def test_feeds_only_follows_a_lookup_into_the_norm_and_refuses_anything_else(method, expected):
    assert _verdict(getattr(Shapes, method)) is expected


def test_reads_values_tells_a_weights_values_from_its_shape():
    class Head(nn.Module):
        def forward(self, x):
            return x @ self.wte.weight.T

    class Shape(nn.Module):
        def forward(self, x):
            return x.new_zeros(self.wte.weight.shape)

    assert any(reads_values(c, "wte", "weight") for c in codes_of(Head))
    assert not any(reads_values(c, "wte", "weight") for c in codes_of(Shape))


# -- the storage rule on models --------------------------------------------------------------------------------

class Embeddings(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, ids):
        return self.norm(self.tok(ids))


class SummedEmbeddings(Embeddings):
    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(8, 16)

    def forward(self, ids):
        return self.norm(self.tok(ids) + self.pos(torch.arange(ids.shape[1])))


class Block(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)

    def forward(self, h):
        return h + self.fc(self.ln(h))


class Encoder(nn.Module):
    """ModernBERT's shape: a lookup straight into a norm; the head tied to the table when ``tied``."""

    def __init__(self, summed: bool = False, tied: bool = False):
        super().__init__()
        self.embeddings = SummedEmbeddings() if summed else Embeddings()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 50, bias=False)
        if tied:
            self.head.weight = self.embeddings.tok.weight

    def forward(self, ids):
        h = self.embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(seed))


def _table_dtypes(model: nn.Module, policy: str, dtype: torch.dtype) -> dict:
    """The table's storage dtype on each path: whole-model convert (torch.fx), the lazy path (torch.export at
    the first call) and convert_ (in place), each from a fresh copy of ``model``."""
    whole = fxamp.convert(copy.deepcopy(model), policy, dtype=dtype)
    lazy = fxamp.convert(copy.deepcopy(model), policy, dtype=dtype, frontend="export")
    lazy(_ids())
    in_place = fxamp.convert_(copy.deepcopy(model), policy, dtype=dtype)
    return {name: dict(m.named_parameters())["embeddings.tok.weight"].dtype
            for name, m in (("whole", whole), ("lazy", lazy), ("in_place", in_place))}


@pytest.mark.parametrize("tied", [False, True])
def test_o2_keeps_a_table_only_a_norm_reads_float32_on_every_path(tied):
    torch.manual_seed(0)
    model = Encoder(tied=tied)
    assert _table_dtypes(model, "O2", torch.bfloat16) == dict.fromkeys(("whole", "lazy", "in_place"), torch.float32)
    assert lookups_into_norms(model) == {id(model.embeddings.tok)}


def test_a_summed_lookup_and_o3_store_the_table_low_on_every_path():
    torch.manual_seed(0)
    low = dict.fromkeys(("whole", "lazy", "in_place"), torch.bfloat16)
    assert _table_dtypes(Encoder(summed=True), "O2", torch.bfloat16) == low  # (BERT, GPT-2: behind a sum)
    assert _table_dtypes(Encoder(), "O3", torch.bfloat16) == low  # nothing runs float32 to keep it for
    assert lookups_into_norms(Encoder(summed=True)) == set()


def test_in_place_output_is_as_close_to_float32_as_whole_model_conversion():
    """The error it fixes: the in-place table rounded to bfloat16 before its float32 norm (ModernBERT 55 dB
    in place against 66 dB whole-model and autocast)."""
    torch.manual_seed(0)
    model = Encoder().eval()
    with torch.no_grad():
        nn.init.normal_(model.embeddings.tok.weight, std=0.02)  # small values: the norm amplifies their rounding
        ref = model(_ids())
        whole = fxamp.convert(model, "O2", dtype=torch.bfloat16).eval()(_ids())
        in_place = fxamp.convert_(copy.deepcopy(model), "O2", dtype=torch.bfloat16).eval()(_ids())
    err = lambda out: (out.float() - ref).norm() / ref.norm()  # noqa: E731
    assert err(in_place) <= err(whole) * 1.01, (err(in_place), err(whole))


def test_a_parent_above_that_names_the_table_keeps_the_default():
    class Wrapper(nn.Module):  # code above the parent reaches the layer itself: not followed
        def __init__(self):
            super().__init__()
            self.encoder = Encoder()

        def forward(self, ids):
            return self.encoder(ids) + self.encoder.embeddings.tok(ids).sum()

    model = Wrapper()
    assert lookups_into_norms(model) == set()
    assert predict_storage(model, Policy.parse("O2", torch.bfloat16))["encoder.embeddings.tok.weight"] \
        == torch.bfloat16


class Transform(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, h):
        return self.norm(self.dense(h))


class Head(nn.Module):
    """MobileBERT's prediction head: its own ``dense.weight`` read directly, beside a ``transform.dense``."""

    def __init__(self):
        super().__init__()
        self.transform = Transform()
        self.dense = nn.Linear(16, 16)

    def forward(self, h):
        return self.transform(h) @ torch.cat([self.dense.weight, self.dense.weight], dim=0).T


def test_a_weight_read_through_self_is_the_readers_own_child_not_a_deeper_namesake():
    assert any(reads_values(c, "dense", "weight") for c in codes_of(Head))
    assert not any(reads_values(c, "dense", "weight", owner=False) for c in codes_of(Head))

    class Aliased(nn.Module):  # through another object: whose it is cannot be told, so it counts
        def forward(self, h):
            t = self.transform
            return h @ t.dense.weight

    assert any(reads_values(c, "dense", "weight", owner=False) for c in codes_of(Aliased))


def test_in_place_keeps_float32_only_the_weight_code_reads_directly():
    class WithHead(Encoder):
        def __init__(self):
            super().__init__()
            self.head = Head()

    torch.manual_seed(0)
    model = WithHead()
    ref = copy.deepcopy(model)
    fxamp.convert_(model, "O2", dtype=torch.bfloat16)
    assert model.head.dense.weight.dtype == torch.float32  # read by the head's own code: as written
    assert model.head.transform.dense.weight.dtype == torch.bfloat16  # only called: a glue layer like any other
    x = _ids()
    assert (model(x).float() - ref(x)).norm() / ref(x).norm() < 0.02


def test_passes_on_tells_a_module_handed_on_from_one_called_or_read():
    class Hands(nn.Module):
        def forward(self, h):
            return decode(h, embedding_layer=self.embeddings.tok)  # the module itself: its tensors may be read

    class Calls(nn.Module):
        def forward(self, h):
            if self.embeddings.tok is None:  # (a None test)
                return h
            return self.embeddings.tok(h) + self.embeddings.tok.weight.shape[0]

    assert any(passes_on(c, "tok") for c in codes_of(Hands))
    assert not any(passes_on(c, "tok") for c in codes_of(Calls))
    # self.tok from a module further up is that module's own child, not the glue module's
    assert not any(passes_on(c, "embeddings", owner=False) for c in codes_of(Hands))


def decode(h, embedding_layer):
    return h @ embedding_layer.weight.T


def _logged(fn):
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


class Decoder(nn.Module):
    def forward(self, h, embedding_layer):
        return h @ embedding_layer.weight.T  # (Perceiver's PerceiverEmbeddingDecoder)


class MaskedLM(nn.Module):
    """Perceiver's masked LM: the decoder gets the input embedding module and multiplies by its weight."""

    def __init__(self):
        super().__init__()
        self.embeddings = SummedEmbeddings()  # (a summed lookup: O2 stores its table low unless read as written)
        self.layers = nn.ModuleList([Block(), Block()])
        self.decoder = Decoder()

    @_logged  # (Hugging Face decorates forward: the reads are the wrapped code's)
    def forward(self, ids):
        h = self.embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return self.decoder(h, embedding_layer=self.embeddings.tok)


def test_in_place_keeps_float32_a_glue_module_that_code_hands_on():
    """convert_ stored the table bfloat16 and the decoder, run as written, failed at the first call ("expected m1
    and m2 to have the same dtype"): the module handed to it keeps its float32 storage."""
    torch.manual_seed(0)
    model = MaskedLM()
    ref = copy.deepcopy(model)
    fxamp.convert_(model, "O2", dtype=torch.bfloat16)
    assert model.embeddings.tok.weight.dtype == torch.float32
    assert model.layers[0].fc.weight.dtype == torch.bfloat16
    x = _ids()
    assert (model(x).float() - ref(x)).norm() / ref(x).norm() < 0.02
