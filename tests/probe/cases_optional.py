"""The new-user probe, inputs that default to None after a torch.fx capture (a graph per None pattern).

The oracle: the original float32 model on the same call, and ``torch.autocast`` (``like_autocast``); a call
leaving an input None and the same call passing None for it, positionally or by keyword, give the same bits.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp

from .runner import Cases, bitwise, like_autocast, sqnr

cases = Cases("optional")
F32, BF16 = torch.float32, torch.bfloat16


class TwoOptional(nn.Module):
    """``attention_mask`` and ``labels`` both optional, each changing what forward computes."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(16, 5)

    def forward(self, x, attention_mask=None, labels=None):
        h = self.drop(F.gelu(self.norm(self.emb(x))))
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1).to(h.dtype)
        logits = self.head(h).mean(1)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float(), labels)
        return {"logits": logits, "loss": loss}


def _inputs():
    x = torch.randn(3, 6, 8)
    mask = torch.ones(3, 6)
    mask[0, 4:] = 0
    return x, mask, torch.tensor([0, 3, 1])


PATTERNS = {"both": (True, True), "mask_only": (True, False), "labels_only": (False, True), "neither": (False, False)}


def _pattern_case(label: str, first: str) -> None:
    def case() -> None:
        model = TwoOptional()
        amp = fxamp.convert(model, "O2")
        x, mask, y = _inputs()
        # the first call is ``first``'s pattern, then this one: a graph per pattern, each as the original computes
        give = PATTERNS[first]
        amp(x, mask if give[0] else None, labels=y if give[1] else None)
        m, lab = (mask if PATTERNS[label][0] else None), (y if PATTERNS[label][1] else None)
        like_autocast(model, amp, x, m, labels=lab)
        out, ref = amp(x, m, labels=lab), model(x, m, labels=lab)
        assert (out["loss"] is None) == (ref["loss"] is None), f"loss {out['loss']} against {ref['loss']}"
        if ref["loss"] is not None:
            assert out["loss"].dtype == F32 and abs(out["loss"].item() - ref["loss"].item()) < 0.05 * abs(
                ref["loss"].item()) + 1e-2, f"loss {out['loss'].item()} against float32's {ref['loss'].item()}"

    cases.add("works", name=f"two_optional_{label}_after_{first}")(case)


for _label in PATTERNS:
    _pattern_case(_label, "both")
_pattern_case("both", "neither")
_pattern_case("labels_only", "mask_only")


@cases.add("works")
def none_positional_keyword_and_omitted_are_the_same_call():
    amp = fxamp.convert(TwoOptional(), "O2")
    x, mask, y = _inputs()
    amp(x, mask, y)
    with torch.no_grad():
        omitted = amp(x, labels=y)
        outs = [amp(x, None, y), amp(x, attention_mask=None, labels=y), amp(x, None, labels=y)]
    for out in outs:
        bitwise(out, omitted, "a None given against one left out")


@cases.add("works")
def gradients_in_every_pattern_like_float32():
    model = TwoOptional()
    amp = fxamp.convert(model, "O1")
    x, mask, y = _inputs()
    for label, (m, lab) in PATTERNS.items():
        args = (x, mask if m else None)
        kw = {"labels": y if lab else None}
        for mod in (model, amp):
            mod.zero_grad()
            out = mod(*args, **kw)
            (out["loss"] if lab else out["logits"].float().square().mean()).backward()
        for (n, p), q in zip(model.named_parameters(), amp.parameters()):
            assert q.grad is not None, f"{label}: {n} got no gradient"
            got = sqnr(p.grad, q.grad)
            assert got > 15, f"{label}: {n}'s gradient {got:.1f} dB against float32"


@cases.add("works")
def train_eval_switches_between_patterns_with_dropout():
    model = TwoOptional(dropout=0.5)
    amp = fxamp.convert(model, "O2")
    x, mask, y = _inputs()
    amp(x, mask, y)
    amp.eval()
    model.eval()
    with torch.no_grad():
        a, b = amp(x), amp(x)
    bitwise(a, b, "two eval calls")
    like_autocast(model, amp, x)
    amp.train()
    torch.manual_seed(3)
    t1 = amp(x, labels=y)
    t2 = amp(x, labels=y)
    assert not torch.equal(t1["logits"], t2["logits"]), "dropout did not run in train mode after an eval call"
    t1["loss"].backward()
    amp.eval()
    with torch.no_grad():
        bitwise(amp(x), a, "eval again after training calls")
    like_autocast(model, amp, x, mask, labels=y)


@cases.add("works")
def o2_storage_shared_by_every_patterns_graph():
    # the patterns' graphs share one set of parameters: a step through the wrapper moves what every pattern reads
    model = TwoOptional()
    amp = fxamp.convert(model, "O2")
    x, mask, y = _inputs()
    amp(x, mask, y)
    amp(x)
    params = {n: p.data_ptr() for n, p in amp.named_parameters()}
    assert amp.get_parameter("emb.weight").dtype == BF16
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(amp.parameters(), lr=0.5), model=amp)
    before = amp(x)["logits"].detach().clone()
    opt.backward(amp(x, labels=y)["loss"])
    assert opt.step()
    assert {n: p.data_ptr() for n, p in amp.named_parameters()} == params, "a pattern's graph holds its own copy"
    after = amp(x)["logits"]
    assert not torch.equal(before, after), "the pattern without labels did not see the step"
    ref = copy.deepcopy(model)
    ref.load_state_dict(opt.fp32_state_dict())
    like_autocast(ref, amp, x)


@cases.add("works", slow=True)
def torch_compile_eager_backend_across_patterns():
    model = TwoOptional()
    amp = fxamp.convert(model, "O2")
    x, mask, y = _inputs()
    compiled = torch.compile(amp, backend="eager")
    for m, lab in PATTERNS.values():
        args = (x, mask if m else None)
        kw = {"labels": y if lab else None}
        with torch.no_grad():
            bitwise(compiled(*args, **kw), amp(*args, **kw), "compiled against eager")


@cases.add("works")
def required_input_passed_as_none_is_the_originals_error():
    from .runner import same_error

    model = TwoOptional()
    amp = fxamp.convert(model, "O2")
    x, mask, y = _inputs()
    amp(x, mask, y)
    same_error(lambda: model(None, mask, y), lambda: amp(None, mask, y))


@cases.add("works")
def deepcopy_after_two_patterns_keeps_them():
    model = TwoOptional()
    amp = fxamp.convert(model, "O2")
    x, mask, y = _inputs()
    amp(x, mask, y)
    amp(x)
    twin = copy.deepcopy(amp)
    with torch.no_grad():
        for m, lab in PATTERNS.values():
            args = (x, mask if m else None)
            kw = {"labels": y if lab else None}
            bitwise(twin(*args, **kw), amp(*args, **kw), "the copy against the original")


def _hf(kind: str):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "bert":
        cfg = tf.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=32, max_position_embeddings=16, num_labels=3)
        return tf.BertForSequenceClassification(cfg).eval(), torch.tensor([0, 2])
    if kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0)
        return tf.GPT2LMHeadModel(cfg).eval(), None
    cfg = tf.T5Config(vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
                      decoder_start_token_id=0)
    return tf.T5ForConditionalGeneration(cfg).eval(), None


def _hf_case(kind: str) -> None:
    def case() -> None:
        model, cls_labels = _hf(kind)
        ids = torch.randint(1, 50, (2, 7))
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[1, 5:] = 0
        labels = cls_labels if cls_labels is not None else torch.randint(1, 50, (2, 7))
        amp = fxamp.convert(model, "O1")
        calls = [dict(input_ids=ids, attention_mask=mask, labels=labels), dict(input_ids=ids, labels=labels),
                 dict(input_ids=ids, attention_mask=mask)]
        if kind == "t5":
            calls[-1]["decoder_input_ids"] = ids[:, :4]
        for kw in calls:
            with torch.no_grad():
                ref, out = model(**kw), amp(**kw)
            assert (out.loss is None) == (ref.loss is None), f"{sorted(kw)}: loss {out.loss} against {ref.loss}"
            if ref.loss is not None:
                assert abs(out.loss.item() - ref.loss.item()) < 0.05 * abs(ref.loss.item()) + 1e-2, (
                    f"{sorted(kw)}: loss {out.loss.item()} against float32's {ref.loss.item()}")
            like_autocast(model, amp, **kw)

    cases.add("either", name=f"hf_{kind}_from_config_labels_and_mask_patterns", slow=kind != "bert")(case)


for _kind in ("bert", "gpt2", "t5"):
    _hf_case(_kind)


@cases.add("works")
def torch_save_load_after_two_patterns_then_inference_mode():
    import io

    amp = fxamp.convert(TwoOptional(), "O2")
    x, mask, y = _inputs()
    amp(x, mask, y)
    amp(x)
    buf = io.BytesIO()
    torch.save(amp, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    calls = [((x,), {}), ((x, mask), {}), ((x,), {"labels": y}), ((x, mask, y), {})]
    with torch.no_grad():
        for args, kw in calls:
            bitwise(loaded(*args, **kw), amp(*args, **kw), "the loaded model against the saved one")
    with torch.inference_mode():
        for args, kw in calls:
            bitwise(loaded(*args, **kw), amp(*args, **kw), "under inference_mode")


@cases.add("works")
def state_dict_after_patterns_into_a_fresh_conversion():
    amp = fxamp.convert(TwoOptional(), "O2")
    x, mask, y = _inputs()
    amp(x, mask, y)
    amp(x, labels=y)
    fresh = fxamp.convert(TwoOptional(), "O2")
    fresh.load_state_dict(amp.state_dict())
    with torch.no_grad():
        bitwise(fresh(x), amp(x), "no mask, no labels")
        bitwise(fresh(x, labels=y), amp(x, labels=y), "labels only")
