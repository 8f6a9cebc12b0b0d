"""Capture fixes of issue 10: mode flags passed to wrapped functions, dtype-derived constants,
label checks inside forward, torch.nn transformers traced by torch.fx, which dims are dynamic,
and a quiet stderr when export fails."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# Losses that check label values inside forward (item 7)
# ---------------------------------------------------------------------------------------------


class CheckedLM(nn.Module):
    def __init__(self, vocab=10):
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, 8)
        self.out = nn.Linear(8, vocab)

    def forward(self, ids, labels=None):
        logits = self.out(self.emb(ids))
        if labels is None:
            return logits
        if labels.max() >= self.vocab:
            raise ValueError("labels out of range")
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_label_check_in_forward_says_compute_the_loss_outside():
    ids = torch.randint(0, 10, (2, 5))
    with pytest.raises(fxamp.TraceError) as info:
        fxamp.convert(CheckedLM(), "O1", example_inputs=(ids,), example_kwargs={"labels": ids})
    text = str(info.value)
    assert "that line checks the values of labels=" in text
    assert "Convert without labels= in example_kwargs" in text and "in float32" in text
    # the fix it names works
    amp = fxamp.convert(CheckedLM(), "O1", example_inputs=(ids,))
    loss = F.cross_entropy(amp(ids).float().flatten(0, 1), ids.flatten())
    assert torch.isfinite(loss)


# ---------------------------------------------------------------------------------------------
# A failed export stays off stderr
# ---------------------------------------------------------------------------------------------


def test_failed_export_keeps_stderr_quiet(capfd):
    capfd.readouterr()
    with pytest.raises(fxamp.TraceError, match="could not capture Linear"):
        fxamp.convert(nn.Linear(8, 8), "O1", frontend="export", example_inputs=(torch.randn(2, 5),))
    ids = torch.randint(0, 10, (2, 5))
    with pytest.raises(fxamp.TraceError):
        fxamp.convert(CheckedLM(), "O1", frontend="export", example_inputs=(ids,), example_kwargs={"labels": ids})
    out, err = capfd.readouterr()
    assert err == "" and out == ""
