"""Writes ``old_paths.pt``: converted modules pickled by fxamp before the conversion stages became folders.

Their generated code and pickles name ``fxamp.conversion.runtime`` (a module then), ``fxamp.conversion.recompute``,
``fxamp.conversion.float8`` and ``fxamp.conversion.debug``; ``test_old_paths.py`` loads them with today's fxamp.
Made with the fxamp of commit 81eebb0 on the path: ``PYTHONPATH=<that checkout> python make_old_paths.py``.
"""

import pathlib

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp


class Attend(nn.Module):
    """SDPA with dropout (the attention call), casts and cached weight casts (O1), an upcast loss (an island)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.head = nn.Linear(32, 16, bias=False)

    def forward(self, x, y):
        q = self.fc(x).view(2, 4, 2, 16).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.25)
        logits = self.head(a.transpose(1, 2).reshape(2, 4, 32)).float()
        return F.cross_entropy(logits.view(-1, 16), y.view(-1)), logits


class Dense(nn.Module):
    """A float8 matmul, O2's storage check, and the overflow monitor."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        return self.fc(x).relu()


def outputs(model, inputs):
    torch.manual_seed(1)
    out = model(*inputs)
    loss = out[0] if isinstance(out, tuple) else out.float().square().mean()
    loss.backward()
    return out, [p.grad.clone() for p in model.parameters()]


def main():
    torch.manual_seed(0)
    attend = fxamp.convert(Attend(), "O1", dtype=torch.bfloat16, node_overrides={"cross_entropy": "recompute"})
    dense = fxamp.convert(Dense(), "O2,float8=tensorwise:always", debug_overflow="record")
    saved = {}
    for name, model, inputs in (("attend", attend, (torch.randn(2, 4, 16), torch.randint(0, 16, (2, 4)))),
                                ("dense", dense, (torch.randn(4, 32),))):
        saved[name] = {"model": model, "inputs": inputs}
        saved[name]["outputs"], saved[name]["grads"] = outputs(model, inputs)
        model.zero_grad(set_to_none=True)
    torch.save(saved, pathlib.Path(__file__).with_name("old_paths.pt"))


if __name__ == "__main__":
    main()
