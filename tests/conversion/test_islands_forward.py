"""Float32 islands (issue 40): a loss island's forward in row chunks (its upcast deferred to the chunks):
no float32 tensor of the logits' size in forward, the same loss and gradients bit for bit, the override."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.conversion.graph import DECISION
from tests.conversion.test_islands import BF16, LM, Head, allocations, data, head_data, head_grads, same  # noqa: F401


@pytest.mark.parametrize("shift", [False, True])
def test_the_chunked_forward_holds_no_float32_tensor_of_the_logits_size(monkeypatch, shift):
    """Forward of the loss island: the float32 upcast and log-probabilities (8 bytes a logit, what made the step's
    peak at GPT-2 small's 8 x 1024 tokens) exist one chunk at a time; recompute off, both whole."""
    from fxamp.conversion.runtime import recompute

    torch.manual_seed(0)
    vocab = 512
    model = Head(d=16, vocab=vocab, shift_logits=shift)
    h, labels = head_data(None, b=4, s=64, vocab=vocab)
    full32 = 4 * 64 * vocab * 4
    monkeypatch.setattr(recompute, "CHUNK_BYTES", full32 // 16)
    on = fxamp.convert(model, "O1", dtype=BF16)
    assert next(n.meta[DECISION].recompute for n in on.graph.nodes if n.name == "cross_entropy").forward_chunked
    assert any(n.target is recompute.island_loss for n in on.graph.nodes)
    peak, largest = allocations(lambda: on(h, labels))
    off_peak, off_largest = allocations(lambda: fxamp.convert(model, "O1", dtype=BF16, recompute_islands=False)(h, labels))
    assert largest < full32 and off_largest >= full32
    # the bf16 logits (shifted: and their bf16 slice), a few chunks; off: the logits, their upcast, log-probabilities
    assert peak <= (2 if shift else 1) * full32 // 2 + 6 * full32 // 16 and off_peak >= 2 * full32


@pytest.mark.parametrize("ignore_index,ignored", [(-100, "some"), (0, "some"), (-100, "all"), (7, "none")])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_chunked_forward_is_bitwise_the_whole_loss(monkeypatch, ignore_index, ignored, reduction):
    """The chunks' loss is the whole cross-entropy's bit for bit: its mean and sum are reduced by nll_loss itself,
    whatever ignore_index is (0 too: the reduction's column then is 1), all rows ignored (NaN) or none."""
    from fxamp.conversion.runtime import recompute

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 64)

        def forward(self, h, labels):
            return F.cross_entropy(self.fc(h).float().view(-1, 64), labels.view(-1), ignore_index=ignore_index,
                                   reduction=reduction)

    torch.manual_seed(0)
    model = Loss()
    h, labels = head_data(None)
    labels = labels.clamp(min=1)
    if ignored == "some":
        labels[0, :3] = ignore_index
        labels[1, 2] = 0 if ignore_index != 0 else 5
    elif ignored == "all":
        labels.fill_(ignore_index)
    monkeypatch.setattr(recompute, "CHUNK_BYTES", 4 * 64 * 5)  # 21 rows, chunks of 5
    on = fxamp.convert(model, "O1", dtype=BF16)
    assert any(n.target is recompute.island_loss for n in on.graph.nodes)
    weights = torch.rand(21)
    ref = head_grads(fxamp.convert(model, "O1", dtype=BF16, recompute_islands=False), h, labels, weights)
    got = head_grads(on, h, labels, weights)
    if ignored == "all" and reduction == "mean":
        assert got[0].isnan() and ref[0].isnan()
        got, ref = (got[0].nan_to_num(), got[1]), (ref[0].nan_to_num(), ref[1])
    assert same(got, ref)


def test_an_island_returning_its_upcast_runs_its_forward_whole(data):
    """The issue's GPT returns the float32 logits too: they exist whole anyway, so only the backward is chunked."""
    torch.manual_seed(0)
    on = fxamp.convert(LM(), "O1", dtype=BF16)
    choice = next(n.meta[DECISION].recompute for n in on.graph.nodes if n.name == "cross_entropy")
    assert choice.chosen and choice.chunked and not choice.forward_chunked
    assert "its backward runs in chunks of rows" in choice.reason


def test_whole_forward_keeps_one_islands_forward_as_written(monkeypatch):
    """The override value "whole_forward": the island is still recomputed (backward in chunks), its forward whole."""
    from fxamp.conversion.runtime import recompute

    torch.manual_seed(0)
    model = Head(vocab=512)
    h, labels = head_data(None, b=4, s=64, vocab=512)
    amp = fxamp.convert(model, "O1", dtype=BF16, node_overrides={"cross_entropy": "whole_forward"})
    choice = next(n.meta[DECISION].recompute for n in amp.graph.nodes if n.name == "cross_entropy")
    assert choice.chosen and choice.chunked and not choice.forward_chunked
    assert "its forward whole: whole_forward for node 'cross_entropy', override" in choice.reason
    assert not any(n.target in (recompute.island_loss, recompute.island_upcast) for n in amp.graph.nodes)
    assert allocations(lambda: amp(h, labels))[1] >= 4 * 64 * 512 * 4  # the float32 logits, whole
    monkeypatch.setattr(recompute, "CHUNK_BYTES", 4 * 512 * 7)
    chunked = fxamp.convert(model, "O1", dtype=BF16)
    assert same(head_grads(amp, h, labels), head_grads(chunked, h, labels))


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_a_chunked_loss_island_survives_pickle_and_deepcopy_bitwise(policy):
    """torch.fx re-traces a GraphModule's code when it unpickles it: the island's deferred upcast and chunked loss
    stay calls (fxamp's tracer autowraps them), and the copy's loss and gradients are the original's bit for bit."""
    import copy
    import io

    from fxamp.conversion.runtime import recompute

    torch.manual_seed(0)
    model = Head(d=16, vocab=128)
    h, labels = head_data(None, b=3, s=16, vocab=128)
    amp = fxamp.convert(model, policy, dtype=BF16)
    assert any(n.target is recompute.island_upcast for n in amp.graph.nodes)
    buf = io.BytesIO()
    torch.save(amp, buf)
    buf.seek(0)
    for other in (copy.deepcopy(amp), torch.load(buf, weights_only=False)):
        assert any(n.target is recompute.island_loss for n in other.graph.nodes)
        for m in (amp, other):
            m.zero_grad(set_to_none=True)
        a, b = amp(h, labels), other(h, labels)
        a.backward()
        b.backward()
        assert torch.equal(a, b)
        for (name, p), q in zip(amp.named_parameters(), other.parameters()):
            assert torch.equal(p.grad, q.grad), name
