"""The new-user probe, training side: ``fxamp.MixedPrecisionOptimizer`` in the loops users write.

The oracle of a step: the inner optimizer's own step on float32 copies of the masters, given the gradients
the wrapper saw divided by the scale (``reference_step``).  fxamp steps the masters of torch's Adam, AdamW and
SGD with their fused CPU kernel, the same update up to float32 rounding, so the masters are compared to a
few ulps (``close``), the low-precision weights to the masters' rounding bit for bit; a skipped step is
compared bit for bit with what was there before.
"""
from __future__ import annotations

import copy
import math
import warnings
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp

from .runner import Cases, bitwise

cases = Cases("train")
BF16, FP16 = torch.bfloat16, torch.float16


# -- helpers ---------------------------------------------------------------------------------------------------


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


def batch(n: int = 4) -> Tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 8), torch.randn(n, 4)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), y)


def close(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], what: str = "masters",
          rtol: float = 2e-6, atol: float = 1e-7) -> None:
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        assert a[k].dtype == b[k].dtype, f"{what}[{k!r}]: dtype {a[k].dtype} against {b[k].dtype}"
        if not torch.allclose(a[k], b[k], rtol=rtol, atol=atol):
            err = (a[k].double() - b[k].double()).abs().max().item()
            raise AssertionError(f"{what}[{k!r}] differs by {err:.3g}")


def snapshot(model: nn.Module, opt: fxamp.MixedPrecisionOptimizer) -> Dict[str, Any]:
    """Everything a skipped step must leave as it was, cloned."""
    return copy.deepcopy({"weights": dict(model.state_dict()), "masters": [m.detach() for _, m in opt.master_pairs()],
                          "state": {i: dict(s) for i, s in enumerate(opt.state.values())}})


def fp32_of(opt: fxamp.MixedPrecisionOptimizer) -> Dict[str, torch.Tensor]:
    """``fp32_state_dict()``, cloned: its tensors are the masters themselves, which the step changes in place."""
    return {k: v.detach().clone() for k, v in opt.fp32_state_dict().items()}


def low_grads(model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def reference_step(original: nn.Module, start: Dict[str, torch.Tensor], grads: Dict[str, Optional[torch.Tensor]],
                   scale: float, make: Callable[[nn.Module], torch.optim.Optimizer],
                   steps: int = 1) -> Dict[str, torch.Tensor]:
    """``make``'s optimizer on a float32 copy of ``original`` (weights ``start``), gradients ``grads`` / ``scale``."""
    ref = copy.deepcopy(original).float()
    ref.load_state_dict(start)
    for n, p in ref.named_parameters():
        g = grads.get(n)
        p.grad = None if g is None else g.float() / scale
    inner = make(ref)
    for _ in range(steps):
        inner.step()
    return {k: v.detach().clone() for k, v in ref.state_dict().items()}


def low_match_masters(model: nn.Module, opt: fxamp.MixedPrecisionOptimizer) -> None:
    for low, master in opt.master_pairs():
        assert torch.equal(low, master.detach().to(low.dtype)), "a low-precision weight is not its master's rounding"


def one_step(make: Callable[[nn.Module], Any], *, dtype: torch.dtype = BF16, policy: str = "O2",
             model: Optional[nn.Module] = None, steps: int = 1, **wrapper: Any) -> fxamp.MixedPrecisionOptimizer:
    """``steps`` steps of ``make``'s optimizer through the wrapper on a converted ``mlp()``, each checked
    against the inner optimizer's own step on float32 copies of the masters."""
    original = model if model is not None else mlp()
    conv = fxamp.convert(original, policy, dtype=dtype)
    opt = fxamp.MixedPrecisionOptimizer(make(conv), model=conv, **wrapper)
    ref_opt, ref = None, copy.deepcopy(original).float()
    ref.load_state_dict(opt.fp32_state_dict())
    for _ in range(steps):
        x, y = batch()
        opt.zero_grad()
        opt.backward(loss_of(conv, x, y))
        grads, scale = low_grads(conv), opt.current_scale
        for n, p in ref.named_parameters():
            p.grad = None if grads[n] is None else grads[n].float() / scale
        ref_opt = ref_opt or make(ref)
        assert opt.step(), "a clean step was skipped"
        ref_opt.step()
        close(opt.fp32_state_dict(), {k: v.detach() for k, v in ref.state_dict().items()})
        low_match_masters(conv, opt)
    return opt


# -- every torch optimizer a user picks --------------------------------------------------------------------------

OPTIMIZERS: Dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2),
    "sgd_nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
    "sgd_maximize_dampening": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5, dampening=0.1,
                                                       maximize=True),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
    "adam_l2": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=0.1),
    "adamw_fused": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
    "adamw_fused_false": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=False),
    "adamw_foreach": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True),
    "adamw_amsgrad": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, amsgrad=True),
    "adamw_tensor_lr": lambda m: torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-2)),
    "rmsprop_centered": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2, momentum=0.9, centered=True),
    "adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1, lr_decay=0.01),
    "adamax": lambda m: torch.optim.Adamax(m.parameters(), lr=1e-2),
    "nadam": lambda m: torch.optim.NAdam(m.parameters(), lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1),
    "radam": lambda m: torch.optim.RAdam(m.parameters(), lr=1e-2),
    "adadelta": lambda m: torch.optim.Adadelta(m.parameters(), lr=1.0),
    "asgd": lambda m: torch.optim.ASGD(m.parameters(), lr=1e-2, t0=1),
    "rprop": lambda m: torch.optim.Rprop(m.parameters(), lr=1e-2),
}


def _optimizer_case(name: str, make: Callable[[nn.Module], torch.optim.Optimizer]) -> None:
    def case() -> None:
        one_step(make, steps=2)  # two: the second reads the state the first made

    cases.add("works", name=f"o2_bf16_{name}_two_steps_like_torch")(case)


for _name, _make in OPTIMIZERS.items():
    _optimizer_case(_name, _make)


@cases.add("works")
def o2_fp16_adamw_dynamic_scale_divided_out():
    opt = one_step(OPTIMIZERS["adamw_fused"], dtype=FP16, steps=2)
    assert opt.current_scale == 2.0**16, f"the first clean steps changed the scale: {opt.current_scale}"


@cases.add("works")
def o1_adam_steps_float32_params_directly():
    opt = one_step(OPTIMIZERS["adam"], policy="O1", steps=2)
    assert not opt.master_pairs(), "O1 keeps float32 weights: no masters"


@cases.add("refused")
def lbfgs_step_with_a_closure():
    conv = fxamp.convert(mlp(), "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.LBFGS(conv.parameters(), lr=0.1), model=conv)
    x, y = batch()

    def closure():
        opt.zero_grad()
        loss = loss_of(conv, x, y)
        opt.backward(loss)
        return loss

    opt.step(closure)


@cases.add("refused")
def lbfgs_step_without_its_closure():
    conv = fxamp.convert(mlp(), "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.LBFGS(conv.parameters(), lr=0.1), model=conv)
    opt.backward(loss_of(conv, *batch()))
    opt.step()


@cases.add("either")
def sparse_embedding_gradients_sgd():
    original = nn.Sequential(nn.Embedding(10, 8, sparse=True), nn.Linear(8, 4))
    conv = fxamp.convert(original, "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv)
    before = fp32_of(opt)
    idx = torch.tensor([[1, 2], [2, 3]])
    opt.backward(conv(idx).float().pow(2).mean())
    assert opt.step()
    after = opt.fp32_state_dict()
    rows = after["0.weight"] != before["0.weight"]
    assert rows[[1, 2, 3]].any(dim=1).all() and not rows[[0, 4, 5, 6, 7, 8, 9]].any(), \
        "only the looked-up embedding rows may move"


@cases.add("either")
def sparse_adam_on_a_sparse_embedding():
    original = nn.Embedding(10, 8, sparse=True)
    conv = fxamp.convert(original, "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SparseAdam(list(conv.parameters()), lr=0.1), model=conv)
    before = fp32_of(opt)["weight"]
    opt.backward(conv(torch.tensor([1, 2])).float().sum())
    assert opt.step()
    moved = (opt.fp32_state_dict()["weight"] != before).any(dim=1)
    assert moved.tolist() == [i in (1, 2) for i in range(10)], "only the looked-up rows may move"


# -- parameter groups, frozen, missing and foreign parameters ---------------------------------------------------


@cases.add("works")
def param_groups_with_their_own_lr_and_weight_decay():
    def make(m):
        decay = [p for n, p in m.named_parameters() if n.endswith("weight") and p.dim() > 1]
        rest = [p for n, p in m.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.5, "lr": 0.05},
                                  {"params": rest, "weight_decay": 0.0}], lr=1e-3)
    one_step(make, steps=2)


@cases.add("works")
def add_param_group_later_through_the_wrapper():
    original = mlp()
    conv = fxamp.convert(original, "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.get_submodule("0").parameters(), lr=0.1), model=conv)
    opt.add_param_group({"params": list(conv.get_submodule("3").parameters()), "lr": 0.5})
    start = fp32_of(opt)
    opt.backward(loss_of(conv, *batch()))
    grads = low_grads(conv)
    assert opt.step()

    def make(m):
        return torch.optim.SGD([{"params": m[0].parameters()}, {"params": m[3].parameters(), "lr": 0.5}], lr=0.1)
    close(opt.fp32_state_dict(), reference_step(original, start, {k: v for k, v in grads.items()
                                                                  if not k.startswith("1.")}, 1.0, make))
    low_match_masters(conv, opt)


@cases.add("refused")
def add_param_group_on_the_inner_optimizer_is_refused_at_step():
    conv = fxamp.convert(mlp(), "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.get_submodule("0").parameters(), lr=0.1), model=conv)
    opt.optimizer.add_param_group({"params": list(conv.get_submodule("3").parameters())})
    opt.backward(loss_of(conv, *batch()))
    opt.step()


@cases.add("works")
def frozen_first_layer_in_the_optimizer_stays_bitwise():
    original = mlp()
    original[0].requires_grad_(False)
    conv = fxamp.convert(original, "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(conv.parameters(), lr=1e-2, weight_decay=0.1), model=conv)
    w0, b0 = conv.get_submodule("0").weight.clone(), conv.get_submodule("0").bias.clone()
    m0 = fp32_of(opt)["0.weight"]
    for _ in range(2):
        opt.zero_grad()
        opt.backward(loss_of(conv, *batch()))
        assert opt.step()
    bitwise([conv.get_submodule("0").weight, conv.get_submodule("0").bias], [w0, b0], "frozen weights")
    bitwise(opt.fp32_state_dict()["0.weight"], m0, "a frozen weight's float32 value")
    assert not conv.get_submodule("3").weight.equal(original[3].weight.to(BF16)), "the trainable layer did not move"


@cases.add("works")
def frozen_parameters_filtered_out_of_the_optimizer():
    original = mlp()
    original[0].requires_grad_(False)
    conv = fxamp.convert(original, "O2")
    opt = fxamp.MixedPrecisionOptimizer(
        torch.optim.AdamW(filter(lambda p: p.requires_grad, conv.parameters()), lr=1e-2), model=conv)
    w0 = conv.get_submodule("0").weight.clone()
    opt.backward(loss_of(conv, *batch()))
    assert opt.step()
    bitwise(conv.get_submodule("0").weight, w0, "frozen weight")
    sd = opt.fp32_state_dict()
    bitwise(sd["0.weight"], original[0].weight.detach(), "fp32_state_dict of a frozen weight (the original's)")


@cases.add("works")
def model_parameters_missing_from_the_optimizer_stay_put():
    original = mlp()
    conv = fxamp.convert(original, "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.get_submodule("3").parameters(), lr=0.1), model=conv)
    w0 = conv.get_submodule("0").weight.clone()
    start = fp32_of(opt)
    opt.backward(loss_of(conv, *batch()))
    grads = low_grads(conv)
    assert opt.step()
    bitwise(conv.get_submodule("0").weight, w0, "a weight the optimizer does not hold")
    ref = reference_step(original, start, {k: v for k, v in grads.items() if k.startswith("3.")}, 1.0,
                         lambda m: torch.optim.SGD(m[3].parameters(), lr=0.1))
    close(opt.fp32_state_dict(), ref)


@cases.add("works")
def optimizer_holds_another_modules_parameters_too():
    original, head = mlp(), nn.Linear(4, 2)
    conv = fxamp.convert(original, "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD([*conv.parameters(), *head.parameters()], lr=0.1), model=conv)
    h0 = head.weight.detach().clone()
    x, _ = batch()
    opt.backward(head(conv(x).float()).pow(2).mean())
    g = head.weight.grad.clone()
    assert opt.step()
    bitwise(head.weight.detach(), h0.add(g, alpha=-0.1), "a float32 parameter of another module")


@cases.add("refused")
def optimizer_of_another_model_is_refused():
    conv, other = fxamp.convert(mlp(), "O2"), mlp()
    fxamp.MixedPrecisionOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), model=conv)


@cases.add("refused")
def add_param_group_of_a_parameter_already_held():
    # torch's own add_param_group refuses a parameter already in a group, but the inner optimizer holds the
    # float32 master, not the bfloat16 weight the user passes again: the wrapper must see the duplicate
    conv = fxamp.convert(mlp(), "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv)
    opt.add_param_group({"params": [conv.get_submodule("0").weight], "lr": 0.5})


@cases.add("refused")
def a_parameter_twice_in_one_group():
    # torch only warns ("duplicate parameters") and steps it twice; two masters for one weight would each
    # take half a story: refused
    conv = fxamp.convert(mlp(), "O2")
    w = conv.get_submodule("0").weight
    fxamp.MixedPrecisionOptimizer(torch.optim.SGD([w, w, conv.get_submodule("0").bias], lr=0.1), model=conv)


class Tied(nn.Module):
    """A language model's tied input embedding and output head (GPT-2's ``lm_head.weight = wte.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 8)
        self.mix = nn.Linear(8, 8)  # (what reads the lookup runs low, so O2 stores the table low)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.norm(self.mix(self.emb(idx))))


@cases.add("works")
def tied_embedding_and_head_share_one_master():
    original = Tied()
    conv = fxamp.convert(original, "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(conv.parameters(), lr=1e-2), model=conv)
    assert len(opt.master_pairs()) == 3, f"{len(opt.master_pairs())} masters for the table, mix's weight and bias"
    start = fp32_of(opt)
    idx = torch.randint(0, 12, (2, 5))
    opt.backward(F.cross_entropy(conv(idx).float().flatten(0, 1), idx.flatten()))
    grads = low_grads(conv)
    assert opt.step()
    assert conv.get_submodule("emb").weight is conv.get_submodule("head").weight, "the tie broke"
    close(opt.fp32_state_dict(), reference_step(original, start, grads, 1.0,
                                                lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)))
    low_match_masters(conv, opt)


# -- the loop: accumulation, clipping, zero_grad, odd orders ----------------------------------------------------


@cases.add("works")
def gradient_accumulation_over_three_micro_batches_fp16():
    original = mlp()
    conv = fxamp.convert(original, "O2", dtype=FP16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1, momentum=0.9), model=conv)
    start = fp32_of(opt)
    for _ in range(3):
        opt.backward(loss_of(conv, *batch()) / 3)
    grads, scale = low_grads(conv), opt.current_scale
    assert opt.step()
    close(opt.fp32_state_dict(), reference_step(original, start, grads, scale,
                                                lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)))


def _clip_case(dtype: torch.dtype, how: str) -> None:
    def case() -> None:
        original = mlp()
        conv = fxamp.convert(original, "O2", dtype=dtype)
        opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv)
        start = fp32_of(opt)
        opt.backward(loss_of(conv, *batch()))
        grads, scale = low_grads(conv), opt.current_scale
        true = torch.cat([g.float().flatten() / scale for g in grads.values()]).norm()
        if how == "wrapper":
            norm = opt.clip_grad_norm_(0.05)
        else:  # torch's, on the masters' true gradients, after unscale_()
            opt.unscale_()
            norm = torch.nn.utils.clip_grad_norm_(opt.master_params(), 0.05)
        assert math.isclose(float(norm), float(true), rel_tol=1e-4), f"norm {float(norm)}, the true one {float(true)}"
        assert opt.step()
        assert float(true) > 0.1, "the gradients are too small to be clipped: the case proves nothing"
        factor = 0.05 / (float(true) + 1e-6)
        clipped = {k: v.float() * factor for k, v in grads.items()}
        close(opt.fp32_state_dict(), reference_step(original, start, clipped, scale,
                                                    lambda m: torch.optim.SGD(m.parameters(), lr=0.1)),
              rtol=1e-4, atol=1e-6)

    cases.add("works", name=f"clip_grad_norm_{how}_{'fp16' if dtype == FP16 else 'bf16'}")(case)


for _dtype in (BF16, FP16):
    for _how in ("wrapper", "torch_on_master_params_after_unscale"):
        _clip_case(_dtype, _how)


@cases.add("works")
def clip_grad_norm_inf_norm_type():
    conv = fxamp.convert(mlp(), "O2", dtype=FP16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv)
    opt.backward(loss_of(conv, *batch()))
    grads, scale = low_grads(conv), opt.current_scale
    true = max(g.float().abs().max().item() / scale for g in grads.values())
    norm = opt.clip_grad_norm_(1e-3, norm_type=float("inf"))
    assert math.isclose(float(norm), true, rel_tol=1e-4), f"inf-norm {float(norm)}, the true one {true}"
    assert opt.step()


@cases.add("works")
def torch_clip_on_the_model_under_bf16_without_scaling():
    # bfloat16's default scale is 1: the model's gradients are the true ones, and clipping them before
    # step() is what a user coming from plain torch writes; the masters must step the clipped gradients
    original = mlp()
    conv = fxamp.convert(original, "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv)
    start = fp32_of(opt)
    opt.backward(loss_of(conv, *batch()) * 10)
    torch.nn.utils.clip_grad_norm_(conv.parameters(), 0.1)
    grads = low_grads(conv)
    assert opt.step()
    close(opt.fp32_state_dict(), reference_step(original, start, grads, 1.0,
                                                lambda m: torch.optim.SGD(m.parameters(), lr=0.1)))


@cases.add("works")
def zero_grad_set_to_none_false_then_a_fresh_step():
    original = mlp()
    conv = fxamp.convert(original, "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv)
    opt.backward(loss_of(conv, *batch()))
    assert opt.step()
    opt.zero_grad(set_to_none=False)
    for p in conv.parameters():
        assert p.grad is not None and not p.grad.any(), "set_to_none=False leaves zero gradients"
    start = fp32_of(opt)
    opt.backward(loss_of(conv, *batch()))
    grads = low_grads(conv)
    assert opt.step()
    close(opt.fp32_state_dict(), reference_step(original, start, grads, 1.0,
                                                lambda m: torch.optim.SGD(m.parameters(), lr=0.1)))


@cases.add("either")
def step_without_backward_changes_nothing():
    conv = fxamp.convert(mlp(), "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(conv.parameters(), lr=1e-2), model=conv)
    before = snapshot(conv, opt)
    opt.step()  # torch's optimizer skips parameters without gradients: nothing to step
    bitwise(snapshot(conv, opt), before, "after a step with no gradient")


@cases.add("works")
def backward_twice_through_the_same_graph_is_torchs_error():
    from .runner import same_error

    def run(wrapped: bool):
        def call():
            model = mlp()
            loss = loss_of(model if not wrapped else fxamp.convert(model, "O2"), *batch())
            if wrapped:
                opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
                opt.backward(loss)
                opt.backward(loss)
            else:
                loss.backward()
                loss.backward()
        return call
    same_error(run(False), run(True))


@cases.add("works")
def backward_twice_with_retain_graph_accumulates():
    original = mlp()
    conv = fxamp.convert(original, "O2", dtype=FP16)
    # (a static 1024: twice the gradient at the default 65536 overflows float16, a skip, not this case)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv, loss_scale=1024)
    start = fp32_of(opt)
    loss = loss_of(conv, *batch())
    opt.backward(loss, retain_graph=True)
    opt.backward(loss)
    grads, scale = low_grads(conv), opt.current_scale
    assert opt.step()
    close(opt.fp32_state_dict(), reference_step(original, start, grads, scale,
                                                lambda m: torch.optim.SGD(m.parameters(), lr=0.1)))


@cases.add("either")
def step_twice_after_one_backward():
    conv = fxamp.convert(mlp(), "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv)
    opt.backward(loss_of(conv, *batch()))
    assert opt.step()
    opt.step()  # torch's SGD would step again with the same gradients; a refusal is fine too
    low_match_masters(conv, opt)


@cases.add("works")
def scale_loss_then_users_own_backward():
    original = mlp()
    conv = fxamp.convert(original, "O2", dtype=FP16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.Adam(conv.parameters(), lr=1e-2), model=conv)
    start = fp32_of(opt)
    opt.scale_loss(loss_of(conv, *batch())).backward()
    grads, scale = low_grads(conv), opt.current_scale
    assert scale > 1
    assert opt.step()
    close(opt.fp32_state_dict(), reference_step(original, start, grads, scale,
                                                lambda m: torch.optim.Adam(m.parameters(), lr=1e-2)))


@cases.add("refused")
def plain_loss_backward_under_fp16_then_step():
    # loss.backward() instead of opt.backward(loss): the gradients are unscaled, and the step divides them by
    # 65536; fxamp must say so rather than step a 65536 times smaller update
    conv = fxamp.convert(mlp(), "O2", dtype=FP16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv)
    loss_of(conv, *batch()).backward()
    opt.step()


@cases.add("refused")
def a_non_scalar_loss_is_refused():
    conv = fxamp.convert(mlp(), "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv)
    x, y = batch()
    opt.backward(F.mse_loss(conv(x).float(), y, reduction="none"))


@cases.add("refused")
def the_optimizer_class_not_an_instance():
    conv = fxamp.convert(mlp(), "O2")
    fxamp.MixedPrecisionOptimizer(torch.optim.AdamW, model=conv)


# -- learning-rate schedulers -------------------------------------------------------------------------------------


def _lrs(opt: fxamp.MixedPrecisionOptimizer):
    return [g["lr"] for g in opt.param_groups]


def _sched_case(name: str, build: Callable[[torch.optim.Optimizer], Any], lrs_after: Callable[[], list],
                on_wrapper: bool = False) -> None:
    def case() -> None:
        conv = fxamp.convert(mlp(), "O2")
        opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1, momentum=0.9), model=conv)
        sched = build(opt if on_wrapper else opt.optimizer)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for i in range(3):
                opt.zero_grad()
                loss = loss_of(conv, *batch())
                opt.backward(loss)
                assert opt.step()
                sched.step(loss.item()) if name == "plateau" else sched.step()
        told = [str(w.message) for w in seen if "lr_scheduler.step()" in str(w.message)]
        assert not told, f"torch warned about the order of a correct loop: {told[0][:120]}"
        got, want = _lrs(opt), lrs_after()
        assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(got, want)), f"lr {got}, expected {want}"

    cases.add("works", name=f"scheduler_{name}_on_{'the_wrapper' if on_wrapper else 'opt_optimizer'}")(case)


for _on in (False, True):
    _sched_case("steplr", lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5), lambda: [0.05], _on)
    _sched_case("lambdalr", lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1)), lambda: [0.025],
                _on)
    _sched_case("onecycle", lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10),
                lambda: [_onecycle_lr_after(3)], _on)
    _sched_case("plateau", lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=100), lambda: [0.1], _on)


def _onecycle_lr_after(n: int) -> float:
    p = nn.Parameter(torch.zeros(1))
    o = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    s = torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10)
    for _ in range(n):
        o.step()
        s.step()
    return o.param_groups[0]["lr"]


@cases.add("works")
def scheduler_stepped_before_the_optimizer_warns_as_torch_does():
    conv = fxamp.convert(mlp(), "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv)
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.backward(loss_of(conv, *batch()))
        sched.step()
        assert opt.step()
    assert any("lr_scheduler.step()" in str(w.message) for w in seen), "torch's order warning went missing"


@cases.add("works")
def scheduler_built_on_the_wrapper_itself():
    # what a user coming from plain torch writes: StepLR(opt), opt the wrapper (issue 37). The wrapper is a
    # torch.optim.Optimizer over the inner optimizer's own param_groups: the same numbers, bit for bit, as the
    # scheduler built on opt.optimizer, a float16 step skipped for an overflow included, with no order warning
    def run(on_wrapper: bool):
        torch.manual_seed(0)
        conv = fxamp.convert(mlp(), "O2", dtype=torch.float16)
        opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(conv.parameters(), lr=0.1), model=conv)
        sched = torch.optim.lr_scheduler.StepLR(opt if on_wrapper else opt.optimizer, step_size=1, gamma=0.5)
        lrs, stepped = [], []
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for i in range(4):
                opt.zero_grad()
                loss = loss_of(conv, *batch())
                opt.backward(loss * float("inf") if i == 2 else loss)
                stepped.append(bool(opt.step()))
                sched.step()
                lrs.append(opt.param_groups[0]["lr"])
        told = [str(w.message) for w in seen if "lr_scheduler.step()" in str(w.message)]
        assert not told, f"torch warned about the order of a correct loop: {told[0][:120]}"
        return lrs, stepped, fp32_of(opt), opt.current_scale

    lrs, stepped, masters, scale = run(True)
    assert lrs == [0.05, 0.025, 0.0125, 0.00625], f"lr {lrs}"
    assert stepped == [True, True, False, True], f"steps taken {stepped}"
    lrs_inner, _, masters_inner, scale_inner = run(False)
    assert lrs == lrs_inner and scale == scale_inner
    bitwise(masters, masters_inner, "masters, scheduler on the wrapper vs on opt.optimizer")


# -- loss_scale= in every spelling, under float16 and bfloat16 ----------------------------------------------------

SCALES = {  # spelling -> the first scale, per dtype (None: the dtype's default)
    "auto": ("auto", {FP16: 2.0**16, BF16: 1.0}),
    "dynamic": ("dynamic", {FP16: 2.0**16, BF16: 2.0**16}),
    "none": ("none", {FP16: 1.0, BF16: 1.0}),
    "static_str": ("static:1024", {FP16: 1024.0, BF16: 1024.0}),
    "int": (128, {FP16: 128.0, BF16: 128.0}),
    "float": (512.0, {FP16: 512.0, BF16: 512.0}),
    "config_dynamic": (fxamp.LossScaleConfig("dynamic", init_scale=2.0**10, growth_interval=1),
                       {FP16: 2.0**10, BF16: 2.0**10}),
    "config_parse_static": (fxamp.LossScaleConfig.parse("static:8"), {FP16: 8.0, BF16: 8.0}),
    "config_none": (fxamp.LossScaleConfig("none"), {FP16: 1.0, BF16: 1.0}),
    "enum_dynamic": ("DYNAMIC", {FP16: 2.0**16, BF16: 2.0**16}),
}


def _scale_case(label: str, option: Any, first: Dict[torch.dtype, float], dtype: torch.dtype) -> None:
    def case() -> None:
        opt = one_step(OPTIMIZERS["sgd_momentum"], dtype=dtype, steps=2, loss_scale=option)
        grows = isinstance(option, fxamp.LossScaleConfig) and option.growth_interval == 1
        want = first[dtype] * (4 if grows else 1)
        assert opt.current_scale == want, f"scale {opt.current_scale}, expected {want}"

    cases.add("either" if label == "enum_dynamic" else "works",
              name=f"loss_scale_{label}_{'fp16' if dtype == FP16 else 'bf16'}")(case)


for _label, (_option, _first) in SCALES.items():
    for _dtype in (FP16, BF16):
        _scale_case(_label, _option, _first, _dtype)

BAD_SCALES = {"None": None, "zero": 0, "negative": -8.0, "inf": float("inf"), "nan": float("nan"),
              "bool": True, "static_without_number": "static", "typo": "dynamc", "tensor": torch.tensor(1024.0),
              "string_number": "1024", "list": [1024]}


def _bad_scale_case(label: str, option: Any) -> None:
    def case() -> None:
        conv = fxamp.convert(mlp(), "O2", dtype=FP16)
        inner = torch.optim.SGD(conv.parameters(), lr=0.1)
        before = [p for g in inner.param_groups for p in g["params"]]
        try:
            fxamp.MixedPrecisionOptimizer(inner, model=conv, loss_scale=option)
        finally:
            after = [p for g in inner.param_groups for p in g["params"]]
            assert all(a is b for a, b in zip(before, after)), "a refused constructor changed the torch optimizer"

    # "1024" and a 0-d tensor are numbers a user may mean as a static scale: either answer is fine
    cases.add("either" if label in ("string_number", "tensor") else "refused", name=f"loss_scale_bad_{label}")(case)


for _label, _option in BAD_SCALES.items():
    _bad_scale_case(_label, _option)


# -- inf/NaN: the step skipped, nothing changed, the scale backed off ---------------------------------------------


def _skip_case(label: str, dtype: torch.dtype, inject: str, make_name: str) -> None:
    def case() -> None:
        conv = fxamp.convert(mlp(), "O2", dtype=dtype)
        opt = fxamp.MixedPrecisionOptimizer(OPTIMIZERS[make_name](conv), model=conv)
        opt.backward(loss_of(conv, *batch()))
        assert opt.step()  # state exists before the skip
        opt.zero_grad()
        before, scale = snapshot(conv, opt), opt.current_scale
        loss = loss_of(conv, *batch())
        if inject == "inf_loss":
            loss = loss * float("inf")
        elif inject == "nan_loss":
            loss = loss * float("nan")
        opt.backward(loss)
        if inject == "nan_grad":
            with torch.no_grad():
                conv.get_submodule("3").bias.grad[0] = float("nan")
        elif inject == "inf_grad_float32_param":
            with torch.no_grad():
                next(p for p in conv.parameters() if p.dtype == torch.float32).grad[0] = float("inf")
        assert opt.step() is False, "a step with an inf/NaN gradient ran"
        bitwise(snapshot(conv, opt), before, "after a skipped step")
        assert opt.skipped_steps == 1
        want = scale / 2 if scale > 1 else scale
        assert opt.current_scale == want, f"scale {opt.current_scale}, expected {want}"
        opt.zero_grad()
        opt.backward(loss_of(conv, *batch()))
        assert opt.step(), "the step after a skip did not run"

    cases.add("works", name=f"skip_{label}")(case)


for _dtype, _dn in ((FP16, "fp16"), (BF16, "bf16")):
    for _inject in ("inf_loss", "nan_loss", "nan_grad", "inf_grad_float32_param"):
        _skip_case(f"{_inject}_{_dn}_adamw", _dtype, _inject, "adamw_fused")
_skip_case("nan_grad_fp16_rmsprop", FP16, "nan_grad", "rmsprop_centered")
_skip_case("inf_loss_bf16_adagrad", BF16, "inf_loss", "adagrad")


@cases.add("works")
def skipped_step_with_a_shared_scheduler_keeps_lr_in_step():
    conv = fxamp.convert(mlp(), "O2", dtype=FP16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv)
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)
    opt.backward(loss_of(conv, *batch()) * float("inf"))
    assert opt.step() is False
    sched.step()  # the user steps the scheduler every iteration, as with GradScaler
    assert _lrs(opt) == [0.05]


@cases.add("works")
def fp16_gradient_underflow_rescued_by_the_scale():
    original = mlp()
    conv = fxamp.convert(original, "O2", dtype=FP16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=1e6), model=conv)
    x, y = batch()
    opt.backward(loss_of(conv, x, y) * 1e-9)  # true gradients ~1e-9: float16's zero without the scale
    assert opt.step()
    moved = [n for n, v in opt.fp32_state_dict().items() if not torch.equal(v, original.state_dict()[n])]
    assert len(moved) == len(original.state_dict()), f"only {moved} moved: the gradients underflowed"
    # the same without a scale: float16 flushes them, and the weights mostly stay
    conv2 = fxamp.convert(mlp(), "O2", dtype=FP16)
    opt2 = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv2.parameters(), lr=1e6), model=conv2, loss_scale="none")
    opt2.backward(loss_of(conv2, x, y) * 1e-9)
    g = conv2.get_submodule("0").weight.grad
    assert g is None or (g == 0).float().mean() > 0.5, "float16 did not underflow: the case proves nothing"


@cases.add("works")
def dynamic_scale_backs_off_to_a_workable_scale():
    conv = fxamp.convert(mlp(), "O2", dtype=FP16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=1e-3), model=conv,
                                        loss_scale=fxamp.LossScaleConfig("dynamic", init_scale=2.0**40,
                                                                         max_scale=2.0**40))
    stepped = []
    for _ in range(40):
        opt.zero_grad()
        opt.backward(loss_of(conv, *batch()))
        stepped.append(bool(opt.step()))
        if stepped[-1]:
            break
    assert stepped[-1], f"never stepped; scale {opt.current_scale}"
    assert opt.skipped_steps == len(stepped) - 1


# -- masters=, state=, precision= --------------------------------------------------------------------------------

LEAN = {  # (masters, state, precision) -> the masters' tolerance against a float32 step (None: within a bf16 ulp)
    "masters_fp32": ({"masters": "fp32"}, 2e-6),
    "masters_kahan": ({"masters": "kahan"}, 2e-5),
    "masters_kahan_state_bf16": ({"masters": "kahan", "state": "bf16"}, None),
    "masters_stochastic": ({"masters": "stochastic"}, None),
    "state_int8": ({"state": "int8"}, None),
    "state_bf16_spelled_torch_dtype": ({"state": torch.bfloat16}, None),
    "masters_float32_spelled_long": ({"masters": "float32"}, 2e-6),
    "precision_lean": ({"precision": "lean"}, 2e-6),  # "auto" calibrates with float32 masters and state first
    "precision_leanconfig": ({"precision": fxamp.LeanConfig("kahan", "int8")}, None),
    "masters_auto_state_auto": ({"masters": "auto", "state": "auto"}, 2e-6),
}


def _lean_case(label: str, options: Dict[str, Any], rtol: Optional[float]) -> None:
    def case() -> None:
        original = mlp()
        conv = fxamp.convert(original, "O2")
        opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(conv.parameters(), lr=1e-2), model=conv, **options)
        start = fp32_of(opt)
        if options.get("masters") in (None, "fp32", "float32") and not isinstance(options.get("precision"),
                                                                                   fxamp.LeanConfig):
            # float32 masters start from the original's exact weights (kahan's weight + term carries ~16
            # bits, stochastic's is the bfloat16 weight: neither can)
            bitwise(start, {k: v.detach() for k, v in original.state_dict().items()}, "masters before a step")
        opt.backward(loss_of(conv, *batch()))
        grads = low_grads(conv)
        assert opt.step()
        ref = reference_step(original, start, grads, 1.0, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
        got = opt.fp32_state_dict()
        if rtol is not None:
            close(got, ref, rtol=rtol, atol=1e-6)
        else:  # the weight within a bfloat16 ulp of the float32 step, and moved
            for k in ref:
                ulp = ref[k].abs().clamp_min(1e-30) * 2.0**-7
                assert ((got[k] - ref[k]).abs() <= ulp + 1e-6).all(), f"{k}: more than a bfloat16 ulp off"
        for (low, _), name in zip(opt.master_pairs(), ("0.weight",)):
            assert not torch.equal(low, original.state_dict()[name].to(BF16)), "the weight did not move"

    cases.add("works", name=f"lean_{label}")(case)


for _label, (_options, _rtol) in LEAN.items():
    _lean_case(_label, _options, _rtol)

LEAN_BAD = {
    "precision_beside_masters": dict(precision="lean", masters="kahan"),
    "stochastic_masters_under_fp16": dict(masters="stochastic"),
    "int8_state_with_rmsprop": dict(state="int8"),
    "unknown_masters": dict(masters="fp8"),
    "unknown_precision_preset": dict(precision="tiny"),
    "lean_with_compile_step": dict(masters="kahan", compile_step=True),
    "state_as_a_dtype_object_float16": dict(state=torch.float16),
}


def _lean_bad_case(label: str, options: Dict[str, Any]) -> None:
    def case() -> None:
        conv = fxamp.convert(mlp(), "O2", dtype=FP16 if "fp16" in label else BF16)
        inner = (torch.optim.RMSprop if "rmsprop" in label else torch.optim.AdamW)(conv.parameters(), lr=1e-2)
        fxamp.MixedPrecisionOptimizer(inner, model=conv, **options)

    # float16 state is a dtype too: "either" (a refusal must say so; working must keep the numbers)
    cases.add("either" if label.startswith("state_as") else "refused", name=f"lean_bad_{label}")(case)


for _label, _options in LEAN_BAD.items():
    _lean_bad_case(_label, _options)


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.conv(x).mean((2, 3)))


def _lean_layout_case(masters: str, layout: str) -> None:
    def case() -> None:
        x, y = torch.randn(2, 3, 6, 6), torch.randn(2, 4)
        results = []
        for strided in (False, True):
            torch.manual_seed(0)
            original = Conv()
            if strided and layout == "channels_last":
                original = original.to(memory_format=torch.channels_last)
                x_in = x.contiguous(memory_format=torch.channels_last)
            elif strided:  # the Linear's weight stored transposed, as some checkpoint converters leave it
                original.fc.weight = nn.Parameter(original.fc.weight.detach().t().contiguous().t())
                x_in = x
            else:
                x_in = x
            conv = fxamp.convert(original, "O2")
            opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(conv.parameters(), lr=1e-2), model=conv,
                                                masters=masters, state="int8")
            for _ in range(2):
                opt.zero_grad()
                opt.backward(F.mse_loss(conv(x_in).float(), y))
                assert opt.step()
            results.append({k: v.contiguous() for k, v in opt.fp32_state_dict().items()})
        bitwise(results[1], results[0], f"{layout} against row-major")

    cases.add("works", name=f"lean_{masters}_{layout}_same_bits_as_row_major")(case)


for _masters in ("kahan", "stochastic"):
    for _layout in ("channels_last", "transposed"):
        _lean_layout_case(_masters, _layout)


# -- what users do to the model and the optimizer between steps ----------------------------------------------------


def _late_write_case(name: str, write: Callable[[nn.Module, nn.Module], None], options: Dict[str, Any]) -> None:
    def case() -> None:
        # the pretrained weights loaded (or a layer re-initialised) after the optimizer was built, as torch
        # users do: the next step must start from them, not write the old masters back over them
        original = mlp()
        conv = fxamp.convert(original, "O2")
        opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv, **options)
        opt.backward(loss_of(conv, *batch()))
        assert opt.step()
        opt.zero_grad()
        other = mlp()
        masters, lows = fp32_of(opt), {k: v.clone() for k, v in conv.state_dict().items()}
        write(conv, other)
        # what the step starts from: each weight written, else (untouched) its master
        start = {k: v.float().clone() if not torch.equal(v, lows[k]) else masters[k]
                 for k, v in conv.state_dict().items()}
        opt.backward(loss_of(conv, *batch()))
        grads = low_grads(conv)
        assert opt.step()
        ref = reference_step(original, start, grads, 1.0, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
        got = fp32_of(opt)
        for k in ref:  # the weights stepped from what was written (the lean modes to a bfloat16 ulp)
            ulp = ref[k].abs() * 2.0**-7 + 1e-6
            assert ((got[k] - ref[k]).abs() <= ulp).all(), f"{k}: the step did not start from the written weights"

    cases.add("works", name=f"weights_written_after_the_wrapper_{name}")(case)


def _load(conv: nn.Module, other: nn.Module) -> None:
    conv.load_state_dict(other.state_dict())


def _reinit(conv: nn.Module, other: nn.Module) -> None:
    with torch.no_grad():
        nn.init.zeros_(conv.get_submodule("0").weight)
        conv.get_submodule("3").weight.copy_(other[3].weight)


_late_write_case("load_state_dict", _load, {})
_late_write_case("load_state_dict_kahan", _load, {"masters": "kahan"})
_late_write_case("load_state_dict_stochastic", _load, {"masters": "stochastic"})
_late_write_case("nn_init_in_place", _reinit, {})


@cases.add("works")
def weights_written_back_as_they_were_keep_their_masters():
    # an EMA swap: the user copies other weights in for an evaluation, then the same ones back: the float32
    # masters must survive (not be replaced by their bfloat16 rounding)
    conv = fxamp.convert(mlp(), "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv)
    opt.backward(loss_of(conv, *batch()))
    assert opt.step()
    masters = fp32_of(opt)
    keep = {n: p.detach().clone() for n, p in conv.named_parameters()}
    with torch.no_grad():
        for p in conv.parameters():
            p.zero_()
        for n, p in conv.named_parameters():
            p.copy_(keep[n])
    opt.zero_grad()
    opt.backward(loss_of(conv, *batch()) * 0)  # a zero gradient: SGD leaves every weight where it is
    assert opt.step()
    bitwise(fp32_of(opt), masters, "masters after the weights were written back")


@cases.add("refused")
def optimizer_built_on_the_model_before_conversion():
    # torch habit: optimizer = AdamW(model.parameters()) first, then the model converted; the optimizer holds
    # the float32 originals (and the norms, shared under O2), so its steps would train those
    original = mlp()
    inner = torch.optim.AdamW(original.parameters(), lr=1e-2)
    conv = fxamp.convert(original, "O2")
    opt = fxamp.MixedPrecisionOptimizer(inner, model=conv)
    opt.backward(loss_of(conv, *batch()))
    opt.step()


@cases.add("works")
def initialize_adopts_the_optimizer_built_before_conversion():
    original = mlp()
    inner = torch.optim.SGD(original.parameters(), lr=0.1)
    conv, opt = fxamp.initialize(original, inner, "O2")
    start = fp32_of(opt)
    opt.backward(loss_of(conv, *batch()))
    grads = low_grads(conv)
    assert opt.step()
    close(fp32_of(opt), reference_step(mlp(), start, grads, 1.0, lambda m: torch.optim.SGD(m.parameters(), lr=0.1)))


@cases.add("refused")
def another_wrappers_own_scaler_as_loss_scale():
    conv = fxamp.convert(mlp(), "O2", dtype=FP16)
    mats = [p for p in conv.parameters() if p.dim() == 2]
    rest = [p for p in conv.parameters() if p.dim() != 2]
    first = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(mats, lr=0.1), model=conv)
    fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(rest, lr=1e-3), model=conv, loss_scale=first.scaler)


def _two_optimizers_case(dtype: torch.dtype) -> None:
    def case() -> None:
        # Muon on the matrices, AdamW on the rest (Muon takes 2-D parameters only), one shared scaler
        from fxamp.training.loss_scale import LossScaler

        original = mlp()
        conv = fxamp.convert(original, "O2", dtype=dtype)
        scaler = LossScaler(fxamp.LossScaleConfig("dynamic" if dtype == FP16 else "none"))

        def muon(m):
            return torch.optim.Muon([p for p in m.parameters() if p.dim() == 2], lr=0.02)

        def adamw(m):
            return torch.optim.AdamW([p for p in m.parameters() if p.dim() != 2], lr=1e-2)
        a = fxamp.MixedPrecisionOptimizer(muon(conv), model=conv, loss_scale=scaler)
        b = fxamp.MixedPrecisionOptimizer(adamw(conv), model=conv, loss_scale=scaler)
        start = {**fp32_of(a), **fp32_of(b)}
        a.backward(loss_of(conv, *batch()))
        grads, scale = low_grads(conv), scaler.scale
        assert a.step() and b.step()
        scaler.update()
        ref = {}
        for make in (muon, adamw):
            stepped = reference_step(original, start, grads, scale, make)
            held = {n for n, p in zip(original.state_dict(), original.parameters())
                    if any(p is q for g in make(original).param_groups for q in g["params"])}
            ref.update({k: v for k, v in stepped.items() if k in held})
        got = {**fp32_of(a), **fp32_of(b)}
        close({k: got[k] for k in ref}, ref, rtol=1e-5, atol=1e-6)

    cases.add("works", name=f"muon_and_adamw_sharing_a_scaler_{'fp16' if dtype == FP16 else 'bf16'}")(case)


for _dtype in (FP16, BF16):
    _two_optimizers_case(_dtype)


@cases.add("works")
def adafactor_two_steps_like_torch():
    one_step(lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-2), steps=2)


@cases.add("works")
def o3_adamw_masters_for_the_norms_too():
    opt = one_step(OPTIMIZERS["adamw_fused"], policy="O3", steps=2)
    assert len(opt.master_pairs()) == 6, f"{len(opt.master_pairs())} masters under O3 (norms stored low too)"


@cases.add("works")
def no_model_given_fp16_scales_dynamically():
    conv = fxamp.convert(mlp(), "O2", dtype=FP16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1))
    assert opt.current_scale == 2.0**16


@cases.add("works")
def lr_changed_by_hand_between_steps():
    one_step(lambda m: _HandLR(torch.optim.SGD(m.parameters(), lr=0.1)), steps=2)


class _HandLR:
    """What ``one_step`` builds for both sides: the optimizer, its lr halved by hand before every step."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        self.param_groups, self.state = inner.param_groups, inner.state

    def step(self, closure=None):
        for g in self.param_groups:
            g["lr"] = g["lr"] / 2
        return self.inner.step()

    def zero_grad(self, set_to_none: bool = True):
        self.inner.zero_grad(set_to_none)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, sd):
        self.inner.load_state_dict(sd)


@cases.add("works")
def model_zero_grad_instead_of_the_wrappers():
    original = mlp()
    conv = fxamp.convert(original, "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv)
    for _ in range(2):
        conv.zero_grad()
        start = fp32_of(opt)
        opt.backward(loss_of(conv, *batch()))
        grads = low_grads(conv)
        assert opt.step()
        close(fp32_of(opt), reference_step(original, start, grads, 1.0,
                                           lambda m: torch.optim.SGD(m.parameters(), lr=0.1)))


@cases.add("works")
def step_post_hook_runs_once_per_step_and_not_on_a_skip():
    conv = fxamp.convert(mlp(), "O2", dtype=FP16)
    inner = torch.optim.SGD(conv.parameters(), lr=0.1)
    calls = []
    inner.register_step_post_hook(lambda o, a, k: calls.append(1))
    opt = fxamp.MixedPrecisionOptimizer(inner, model=conv)
    opt.backward(loss_of(conv, *batch()))
    assert opt.step()
    opt.zero_grad()
    opt.backward(loss_of(conv, *batch()) * float("inf"))
    assert opt.step() is False
    assert calls == [1], f"the post hook ran {len(calls)} times for one step and one skip"


@cases.add("works")
def clip_error_if_nonfinite_raises_then_the_loop_goes_on():
    # torch's own clip_grad_norm_ raises on a non-finite norm when asked to; after it the user's zero_grad
    # starts the next iteration cleanly
    conv = fxamp.convert(mlp(), "O2", dtype=FP16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv)
    opt.backward(loss_of(conv, *batch()) * float("inf"))
    try:
        opt.clip_grad_norm_(1.0, error_if_nonfinite=True)
    except RuntimeError as e:
        assert "non-finite" in str(e), str(e)
    else:
        raise AssertionError("error_if_nonfinite=True and an inf norm: nothing raised")
    opt.zero_grad()
    opt.backward(loss_of(conv, *batch()))
    assert opt.step()


@cases.add("refused")
def unscale_twice_in_one_step():
    conv = fxamp.convert(mlp(), "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv)
    opt.backward(loss_of(conv, *batch()))
    opt.unscale_()
    opt.unscale_()


@cases.add("works")
def clip_twice_in_one_step_clips_once_more():
    conv = fxamp.convert(mlp(), "O2", dtype=FP16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv)
    opt.backward(loss_of(conv, *batch()))
    first = float(opt.clip_grad_norm_(0.01))
    second = float(opt.clip_grad_norm_(0.01))
    assert first > 0.01 and abs(second - 0.01) < 1e-4, f"norms {first}, then {second}: the second sees the clipped"
    assert opt.step()


# -- odd but legal models and optimizer options ---------------------------------------------------------------------


class _Unused(nn.Module):
    """A layer defined but not called (a head kept for later): its parameters get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.spare = nn.Linear(8, 4)
        self.empty = nn.Linear(8, 0)  # a zero-size parameter (a config with no extra classes)

    def forward(self, x):
        return self.a(x) + self.empty(x).sum()


class _Temperature(nn.Module):
    """A learnable scalar (CLIP's logit scale) beside a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.t = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.a(x) * self.t


@cases.add("works")
def unused_and_zero_size_parameters_adamw_weight_decay():
    one_step(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), model=_Unused(), steps=2)


@cases.add("works")
def a_learnable_scalar_o2():
    one_step(OPTIMIZERS["adamw_fused"], model=_Temperature(), steps=2)


@cases.add("works")
def a_learnable_scalar_o3():
    one_step(OPTIMIZERS["adamw_fused"], model=_Temperature(), policy="O3", steps=2)


@cases.add("works")
def adam_with_tensor_lr_and_betas():
    one_step(lambda m: torch.optim.Adam(m.parameters(), lr=torch.tensor(1e-2),
                                        betas=(torch.tensor(0.9), torch.tensor(0.999))), steps=2)


@cases.add("works")
def lr_zero_changes_no_bit():
    conv = fxamp.convert(mlp(), "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.0, momentum=0.9), model=conv)
    before, masters = {k: v.clone() for k, v in conv.state_dict().items()}, fp32_of(opt)
    opt.backward(loss_of(conv, *batch()))
    assert opt.step()
    bitwise(dict(conv.state_dict()), before, "weights after an lr=0 step")
    bitwise(fp32_of(opt), masters, "masters after an lr=0 step")


def _torch_says_the_same(make: Callable[[Any], torch.optim.Optimizer]) -> None:
    from .runner import same_error

    def plain():
        model = mlp()
        opt = make(model.parameters())
        loss_of(model, *batch()).backward()
        opt.step()

    def wrapped():
        conv = fxamp.convert(mlp(), "O2")
        opt = fxamp.MixedPrecisionOptimizer(make(conv.parameters()), model=conv)
        opt.backward(loss_of(conv, *batch()))
        opt.step()
    same_error(plain, wrapped)


@cases.add("works")
def adam_capturable_on_a_cpu_is_torchs_error():
    _torch_says_the_same(lambda ps: torch.optim.Adam(ps, lr=1e-2, capturable=True))


@cases.add("works")
def sgd_differentiable_outside_no_grad_is_torchs_error():
    _torch_says_the_same(lambda ps: torch.optim.SGD(ps, lr=1e-2, differentiable=True))


@cases.add("works")
def embedding_bag_mean_o2():
    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e = nn.EmbeddingBag(10, 8, mode="mean")
            self.l = nn.Linear(8, 4)

        def forward(self, x):
            return self.l(self.e(x))

    torch.manual_seed(0)
    x = torch.randint(0, 10, (3, 4))
    original = Bag()
    conv = fxamp.convert(original, "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.Adam(conv.parameters(), lr=1e-2), model=conv)
    start = fp32_of(opt)
    opt.backward(conv(x).float().pow(2).mean())
    grads = low_grads(conv)
    assert opt.step()
    close(fp32_of(opt), reference_step(original, start, grads, 1.0, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2)))


@cases.add("works")
def timm_style_cnn_sgd_nesterov_weight_decay_fp16():
    original = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(4, 2))
    conv = fxamp.convert(original, "O2", dtype=FP16)

    def make(m):
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    opt = fxamp.MixedPrecisionOptimizer(make(conv), model=conv, loss_scale=256)
    start = fp32_of(opt)
    opt.backward(conv(torch.randn(2, 3, 6, 6)).float().pow(2).mean())
    grads, scale = low_grads(conv), opt.current_scale
    assert opt.step()
    ref = reference_step(original, start, grads, scale, make)
    close({k: v for k, v in fp32_of(opt).items() if "running" not in k and "batches" not in k},
          {k: v for k, v in ref.items() if "running" not in k and "batches" not in k})


# -- a model large enough for the segmented step (16 MiB of float32 masters: docs/training.md, "Memory") -----------


def _large() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 2048), nn.LayerNorm(2048), nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 4))


def _segmented_run(make: Callable[[nn.Module], Any], dtype: torch.dtype, clip: Optional[float], **wrapper: Any):
    original = _large()
    conv = fxamp.convert(original, "O2", dtype=dtype)
    opt = fxamp.MixedPrecisionOptimizer(make(conv), model=conv, **wrapper)
    ref = copy.deepcopy(original)
    ref.load_state_dict(opt.fp32_state_dict())
    ref_opt = make(ref)
    for _ in range(2):
        opt.zero_grad()
        opt.backward(loss_of(conv, *batch(2)))
        grads, scale = low_grads(conv), opt.current_scale
        for n, p in ref.named_parameters():
            p.grad = grads[n].float() / scale
        if clip is not None:
            got, want = float(opt.clip_grad_norm_(clip)), float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip))
            assert math.isclose(got, want, rel_tol=1e-5), f"norm {got}, torch's {want}"
        assert opt.step()
        ref_opt.step()
        close(fp32_of(opt), {k: v.detach() for k, v in ref.state_dict().items()}, rtol=1e-4, atol=1e-6)
    assert opt.plan.runs is not None, "the step was not segmented: the case proves nothing about that path"
    return conv, opt


@cases.add("works")
def segmented_adamw_param_groups_then_a_late_load():
    def make(m):
        return torch.optim.AdamW([{"params": [p for p in m.parameters() if p.dim() == 2], "weight_decay": 0.1},
                                  {"params": [p for p in m.parameters() if p.dim() != 2], "lr": 1e-2}], lr=1e-3)
    conv, opt = _segmented_run(make, BF16, None)
    other = _large()
    conv.load_state_dict(other.state_dict())
    loaded = {k: v.clone() for k, v in conv.state_dict().items()}
    for group in opt.param_groups:  # (Adam's moments would move a weight even on a zero gradient)
        group["lr"] = 0.0
    opt.zero_grad()
    opt.backward(loss_of(conv, *batch(2)))
    assert opt.step()
    bitwise(dict(conv.state_dict()), loaded, "the loaded weights after an lr=0 segmented step")


@cases.add("works")
def segmented_sgd_clipped_fp16_then_a_skip():
    conv, opt = _segmented_run(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), FP16, 0.01,
                               loss_scale=256)
    opt.zero_grad()
    before = snapshot(conv, opt)
    opt.backward(loss_of(conv, *batch(2)))
    with torch.no_grad():
        conv.get_submodule("2").weight.grad[3, 3] = float("nan")
    assert opt.step() is False
    bitwise(snapshot(conv, opt), before, "after a skipped segmented step")


@cases.add("works")
def torch_clip_on_the_model_under_fp16_clips_the_scaled_gradients():
    # issue 37: torch.nn.utils.clip_grad_norm_(model.parameters(), c) between opt.backward() and opt.step() under
    # float16 clips the *scaled* gradients (norm x 1024): the step then moves the weights by a gradient of norm
    # c / 1024 (GradScaler users meet the same unless they unscale_() first). fxamp cannot undo it but says so:
    # a RuntimeWarning at the step naming the fix (opt.clip_grad_norm_(c), or opt.unscale_() first).
    conv = fxamp.convert(mlp(), "O2", dtype=FP16)
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), model=conv, loss_scale=1024)
    opt.backward(loss_of(conv, *batch()))
    torch.nn.utils.clip_grad_norm_(conv.parameters(), 1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert opt.step()
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("changed between backward() and step() while multiplied by the loss scale" in m
               and "opt.clip_grad_norm_(max_norm)" in m and "opt.unscale_() first" in m for m in said), \
        f"no warning of the clip of scaled gradients: {said}"
