"""The new-user probe, the lean CPU kernel (``masters="stochastic", state="int8"``; 8-bit decode with AVX-512
VBMI where the CPU has it) on odd sizes, zero-size parameters and frozen parameters mixed in.

The oracle: the same training on the eager path (the kernel switched off for the reference, as
``tests/training/test_native.py`` does), and torch's AdamW on float32 weights. The kernel is the eager lean
step up to float32 rounding, so a stochastically rounded weight may land one bfloat16 ulp apart where the
float32 value differs in its last bit: compared to one ulp, and the two runs' losses to 2%.
"""
from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Dict, Iterator, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.training import native

from .runner import Cases, bitwise

cases = Cases("lean")
BF16 = torch.bfloat16


@contextlib.contextmanager
def _eager_path() -> Iterator[None]:
    """The kernel off, for the reference run (``FXAMP_NATIVE=0``, as tests/training/test_native.py sets it)."""
    was = os.environ.get("FXAMP_NATIVE")
    os.environ["FXAMP_NATIVE"] = "0"
    try:
        yield
    finally:
        if was is None:
            del os.environ["FXAMP_NATIVE"]
        else:
            os.environ["FXAMP_NATIVE"] = was


@contextlib.contextmanager
def _kernel_calls(into: List[int]) -> Iterator[None]:
    real = native.lean_adam

    def counted(*a: Any, **k: Any) -> Any:
        into.append(1)
        return real(*a, **k)

    native.lean_adam = counted
    try:
        yield
    finally:
        native.lean_adam = real


class Odd(nn.Module):
    """One weight of ``n`` elements (``rows`` x ``cols``), a frozen Linear and a zero-size weight, as asked."""

    def __init__(self, rows: int, cols: int, frozen: bool = False, zero_size: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(cols, rows, bias=False)
        self.frozen = nn.Linear(rows, rows) if frozen else None
        if frozen:
            self.frozen.requires_grad_(False)
        self.empty = nn.Parameter(torch.zeros(0, cols)) if zero_size else None

    def forward(self, x):
        h = self.lin(x)
        if self.frozen is not None:
            h = self.frozen(h)
        if self.empty is not None:
            h = h + F.linear(x, self.empty).sum()
        return h


def _run(rows: int, cols: int, steps: int, options: Dict[str, Any], representable: bool = False, **kw: Any
         ) -> Tuple[nn.Module, fxamp.MixedPrecisionOptimizer, List[float], Dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Odd(rows, cols, **kw)
    if representable:  # (weights bfloat16 holds exactly: a stochastic master starts where a float32 one does)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(BF16).float())
    start = copy.deepcopy(model.state_dict())
    amp = fxamp.convert(model, "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp.parameters(), lr=1e-2), model=amp, seed=1, **options)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, cols, generator=g), torch.randn(4, rows, generator=g)) for _ in range(2)]
    losses = []
    for i in range(steps):
        x, y = data[i % 2]
        opt.zero_grad()
        loss = F.mse_loss(amp(x).float(), y)
        opt.backward(loss)
        assert opt.step(), f"step {i} was skipped"
        losses.append(loss.item())
    return amp, opt, losses, start


def _within_an_ulp(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype == BF16, f"{what}: {a.dtype} against {b.dtype}"
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    far = (ia - ib).abs() > 1
    assert not far.any(), f"{what}: {int(far.sum())} of {a.numel()} weights more than a bfloat16 ulp apart"


def _kernel_vs_eager(rows: int, cols: int, options: Dict[str, Any], steps: int = 4, **kw: Any) -> None:
    calls: List[int] = []
    with _kernel_calls(calls):
        fast, fast_opt, fast_losses, start = _run(rows, cols, steps, options, **kw)
    with _eager_path():
        eager, _, eager_losses, _ = _run(rows, cols, steps, options, **kw)
    assert calls, "the kernel stepped nothing (it steps from the second step on)"
    _within_an_ulp(fast.get_parameter("lin.weight"), eager.get_parameter("lin.weight"), "lin.weight")
    assert abs(fast_losses[-1] - eager_losses[-1]) <= 0.02 * abs(eager_losses[-1]) + 1e-6, (
        f"loss {fast_losses[-1]} with the kernel, {eager_losses[-1]} on the eager path")
    assert fast_losses[2] < fast_losses[0] or rows * cols == 1, f"losses {fast_losses}: no learning (same batch)"
    w0 = start["lin.weight"].to(BF16)
    assert not torch.equal(fast.get_parameter("lin.weight"), w0), "the weight did not move"
    if kw.get("frozen"):
        for name in ("frozen.weight", "frozen.bias"):
            bitwise(fast.get_parameter(name), start[name].to(fast.get_parameter(name).dtype), f"frozen {name}")
    if kw.get("zero_size"):
        assert fast.get_parameter("empty").shape == (0, cols)
    fast_opt.zero_grad()


SIZES = {1: (1, 1), 7: (1, 7), 63: (7, 9), 65: (5, 13), 1023: (31, 33)}


def _size_case(n: int, masters: str, state: str) -> None:
    rows, cols = SIZES[n]
    cases.add("works", name=f"{masters}_{state}_kernel_vs_eager_{n}_elements")(
        lambda: _kernel_vs_eager(rows, cols, {"masters": masters, "state": state}))


for _n in SIZES:
    _size_case(_n, "stochastic", "int8")
_size_case(65, "kahan", "int8")
_size_case(1023, "stochastic", "bf16")


@cases.add("works")
def stochastic_int8_with_frozen_parameters_in_the_optimizer():
    _kernel_vs_eager(7, 9, {"masters": "stochastic", "state": "int8"}, frozen=True)


@cases.add("either")
def stochastic_int8_with_a_zero_size_parameter():
    _kernel_vs_eager(5, 13, {"masters": "stochastic", "state": "int8"}, zero_size=True)


@cases.add("either")
def stochastic_int8_frozen_and_zero_size_together_at_1023():
    _kernel_vs_eager(31, 33, {"masters": "stochastic", "state": "int8"}, frozen=True, zero_size=True)


@cases.add("works")
def stochastic_int8_first_step_is_float32_adamws_within_an_ulp_on_1023_elements():
    # from the same weights (bfloat16 values) and batch, the gradients are the same: the lean step is the float32 masters' step
    # (torch's AdamW, checked against torch in cases_train) rounded stochastically, within a bfloat16 ulp
    for state in ("int8", "bf16"):
        lean, _, _, _ = _run(31, 33, 1, {"masters": "stochastic", "state": state}, representable=True)
        full, full_opt, _, _ = _run(31, 33, 1, {}, representable=True)
        got, want = lean.get_parameter("lin.weight"), full_opt.fp32_state_dict()["lin.weight"]
        down = want.to(BF16)  # (the nearest; the stochastic rounding picks it or its neighbour)
        _within_an_ulp(got, down, f"lin.weight, {state} state")
        moved = (got.float() - want).abs() <= (want.abs() * 2.0 ** -7 + 1e-30)
        assert moved.all(), f"{state} state: {int((~moved).sum())} weights more than an ulp from the float32 step"


@cases.add("works")
def lean_state_dict_resume_on_odd_sizes_bitwise():
    # a checkpoint after 2 steps into a fresh wrapper: the next 2 steps are the uninterrupted run's, bit for bit
    a, a_opt, _, _ = _run(7, 9, 4, {"masters": "stochastic", "state": "int8"}, frozen=True)
    b, b_opt, _, _ = _run(7, 9, 2, {"masters": "stochastic", "state": "int8"}, frozen=True)
    saved = copy.deepcopy((b.state_dict(), b_opt.state_dict()))
    torch.manual_seed(0)
    c = fxamp.convert(Odd(7, 9, frozen=True), "O2")
    c_opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(c.parameters(), lr=1e-2), model=c, seed=1,
                                          masters="stochastic", state="int8")
    c.load_state_dict(saved[0])
    c_opt.load_state_dict(saved[1])
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 9, generator=g), torch.randn(4, 7, generator=g)) for _ in range(2)]
    for i in (2, 3):
        x, y = data[i % 2]
        c_opt.zero_grad()
        c_opt.backward(F.mse_loss(c(x).float(), y))
        assert c_opt.step()
    bitwise(dict(c.state_dict()), dict(a.state_dict()), "the resumed run's weights")
