"""``torch.distributed.checkpoint``'s own idiom with the wrapper (issue 37, item 8).

``dcp.save({"model": model, "optim": opt})`` then ``dcp.load`` into fresh objects calls ``opt.state_dict()``
(what DCP loads into) and ``opt.load_state_dict()``: the run resumes bitwise, the loss scale included, in one
process (O1, O2; 2 gloo processes with ``fxamp.shard``: ``tests/training/test_fsdp2.py``, in its one spawn).
What it cannot fill is refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp

dcp = pytest.importorskip("torch.distributed.checkpoint")
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]  # (DCP's note: one process)

D, V = 16, 24


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
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1).float(), ids.flatten())


class Unused(Net):
    """A parameter no loss reaches (XLNet's mask_emb, used only with a permutation mask): it never has state."""

    def __init__(self):
        super().__init__()
        self.mask_emb = nn.Parameter(torch.randn(D))


def fresh(policy="O1", net=Net, **kw):
    torch.manual_seed(0)
    model = fxamp.convert_(net(), policy, dtype=torch.float16)
    scale = fxamp.LossScaleConfig("dynamic", init_scale=2.0**10, growth_interval=2)  # the scale moves
    return model, fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model,
                                                loss_scale=scale, **kw)


def train(model, opt, steps):
    losses = []
    for step in steps:
        ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        loss = model(ids)
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    return losses


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def resume(path, before, after, **kw):
    """Train ``before`` steps, ``dcp.save`` model and optimizer, train ``after`` more; fresh objects ``dcp.load``
    and train the same ``after``: (continued, resumed) losses, weights and scales."""
    model, opt = fresh(**kw)
    train(model, opt, range(before))
    dcp.save({"model": model, "optim": opt}, checkpoint_id=path)
    continued = train(model, opt, range(before, before + after))
    model2, opt2 = fresh(**kw)
    dcp.load({"model": model2, "optim": opt2}, checkpoint_id=path)
    resumed = train(model2, opt2, range(before, before + after))
    return (continued, weights(model), opt.current_scale), (resumed, weights(model2), opt2.current_scale)


def assert_same(a, b):
    (la, wa, sa), (lb, wb, sb) = a, b
    assert la == lb and sa == sb
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_dcp_of_model_and_optimizer_resumes_bitwise(policy, tmp_path):
    continued, resumed = resume(str(tmp_path), 3, 3, policy=policy)
    assert continued[2] > 2.0**10  # (grew: the scaler's state is in the checkpoint)
    assert_same(continued, resumed)


def test_dcp_checkpoint_before_the_first_step_resumes_as_a_fresh_run(tmp_path):
    """A fresh optimizer's state_dict() holds zeros to load into, marked as not real: the optimizer itself is
    unchanged by it, and loading it gives a fresh optimizer (Adam's first step, not its second)."""
    model, opt = fresh("O2")
    state = opt.state_dict()
    assert state["stateful"] == [] and len(state["optimizer"]["state"]) > 0 and not opt.optimizer.state
    assert all(p.grad is None for p in opt.master_params())
    continued, resumed = resume(str(tmp_path), 0, 2, policy="O2")
    assert_same(continued, resumed)


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_a_parameter_without_state_saved_with_gradients_pending_resumes_bitwise(policy, tmp_path):
    """Saved between step() and zero_grad(): the zeros for the state a parameter without gradients lacks were not
    made (the zero step would have stepped the pending gradients), the checkpoint had no entry for it, and dcp.load
    into a fresh optimizer, whose state_dict() has one, failed ("Missing key in checkpoint state_dict"). The
    pending gradients are set aside for that step and put back."""
    model, opt = fresh(policy, net=Unused)
    train(model, opt, range(2))
    grads = [p.grad for p in opt.master_params()]
    assert any(g is not None for g in grads)
    state = opt.state_dict()
    assert len(state["optimizer"]["state"]) == len(grads) > len(state["stateful"])
    assert all(p.grad is g for p, g in zip(opt.master_params(), grads))  # (put back, the same tensors)
    assert len(opt.optimizer.state) == len(state["stateful"])  # (the zeros were taken out again)
    continued, resumed = resume(str(tmp_path), 2, 2, policy=policy, net=Unused)
    assert_same(continued, resumed)


def test_what_dcp_cannot_fill_is_refused(tmp_path):
    """Lean state is compressed: a fresh optimizer has no tensors of its layout for DCP to load into."""
    model, opt = fresh("O2", state="bf16")
    train(model, opt, range(2))
    dcp.save({"optim": opt}, checkpoint_id=str(tmp_path))
    _, opt2 = fresh("O2", state="bf16")
    with pytest.raises(ValueError, match=r"arrived without it for \d+ .* fxamp.sharded_state_dict\(model, opt\)"):
        dcp.load({"optim": opt2}, checkpoint_id=str(tmp_path))
    assert not opt2.optimizer.state  # nothing changed


@pytest.mark.parametrize("policy", ["O1", "O2"])
@pytest.mark.parametrize("trained", [False, True])
def test_get_state_dict_of_the_wrapper_says_what_to_use(policy, trained):
    """The wrapper is a ``torch.optim.Optimizer`` (for LR schedulers), which sends torch's get_state_dict and
    set_state_dict down their optimizer path: they would step a fresh optimizer at learning rate 0 to make state and
    read torch's layout keyed by the model's parameters (the masters are not).  Refused in one line before they
    touch anything: the groups' learning rates, the gradients, the state and the scale are as they were."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict, set_state_dict

    model, opt = fresh(policy)
    if trained:
        train(model, opt, range(2))
    before = (fxamp_state(opt), [g["lr"] for g in opt.param_groups], [p.grad for p in opt.master_params()])
    refusal = r"^torch's get_state_dict/set_state_dict cannot take a MixedPrecisionOptimizer .*fxamp.sharded_state_dict\(model, opt\)[^\n]*$"
    with pytest.raises(TypeError, match=refusal):
        get_state_dict(model, opt)
    with pytest.raises(TypeError, match=refusal):
        get_optimizer_state_dict(model, [opt])
    with pytest.raises(TypeError, match=refusal):
        set_state_dict(model, opt, model_state_dict={}, optim_state_dict={"state": {}, "param_groups": []})
    after = (fxamp_state(opt), [g["lr"] for g in opt.param_groups], [p.grad for p in opt.master_params()])
    assert before[1:] == after[1:] and str(before[0]) == str(after[0])
    assert all(torch.equal(a, b) for a, b in zip(tensors(before[0]), tensors(after[0])))


def fxamp_state(opt):
    return {"scale": opt.current_scale, "skipped": opt.skipped_steps, "stage": opt.stage,
            "state": {i: dict(s) for i, s in enumerate(opt.optimizer.state.values())}}


def tensors(state):
    return [v for s in state["state"].values() for v in s.values() if torch.is_tensor(v)]
