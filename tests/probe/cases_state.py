"""The new-user probe, state side: saving, loading and resuming a converted model and its optimizer wrapper.

The oracle of a resume: the same run without the interruption, bit for bit (weights, masters, optimizer
state, the loss scale and the skip count).  Of a round trip: the user's float32 weights back, bit for bit.
"""
from __future__ import annotations

import copy
import io
import os
import tempfile
from typing import Any, Callable, List, Sequence, Tuple

import torch
import torch.nn as nn

import fxamp

from .cases_train import BF16, FP16, fp32_of, loss_of, low_match_masters
from .runner import Cases, bitwise

cases = Cases("state")

Batches = List[Tuple[torch.Tensor, torch.Tensor]]


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 4))


def batches(n: int) -> Batches:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


def train(model: nn.Module, opt: fxamp.MixedPrecisionOptimizer, data: Batches, inject: Sequence[int] = (),
          sched: Any = None) -> None:
    """A step per batch; an inf loss at the steps of ``inject`` (a skip)."""
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = loss_of(model, x, y)
        opt.backward(loss * float("inf") if i in inject else loss)
        opt.step()
        if sched is not None:
            sched.step()


def build(make: Callable[[nn.Module], Any], dtype: torch.dtype = BF16, init: int = 0, **wrapper: Any):
    original = net(init)
    conv = fxamp.convert(original, "O2", dtype=dtype)
    return original, conv, fxamp.MixedPrecisionOptimizer(make(conv), model=conv, **wrapper)


def same_run(a: Tuple[nn.Module, fxamp.MixedPrecisionOptimizer], b: Tuple[nn.Module, fxamp.MixedPrecisionOptimizer]):
    (ma, oa), (mb, ob) = a, b
    bitwise(mb.state_dict(), ma.state_dict(), "the model's state_dict")
    bitwise(fp32_of(ob), fp32_of(oa), "fp32_state_dict")
    bitwise(ob.state_dict()["optimizer"]["state"], oa.state_dict()["optimizer"]["state"], "optimizer state")
    bitwise([ob.current_scale, ob.skipped_steps], [oa.current_scale, oa.skipped_steps], "scale and skips")
    if not ob.precision.lean:  # (a lean master's value is the weight plus a term, which may pass half an ulp)
        low_match_masters(mb, ob)


def via_torch_save(obj: Any) -> Any:
    """``torch.save`` then ``torch.load`` with its default (``weights_only=True`` since torch 2.6)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


ADAMW = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)  # noqa: E731
SGD_M = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731


def _resume_case(name: str, make: Callable[[nn.Module], Any], *, dtype: torch.dtype = BF16,
                 inject: Sequence[int] = (), save: Callable[[Any], Any] = copy.deepcopy, stop: int = 2,
                 optimizer_first: bool = False, **wrapper: Any) -> None:
    def case() -> None:
        data = batches(4)
        _, a, oa = build(make, dtype, **wrapper)
        train(a, oa, data, inject)
        _, b, ob = build(make, dtype, **wrapper)
        train(b, ob, data[:stop], inject)
        model_sd, opt_sd = save(b.state_dict()), save(ob.state_dict())
        del b, ob
        _, c, oc = build(make, dtype, init=1, **wrapper)  # other weights: the load must replace every one
        if optimizer_first:
            oc.load_state_dict(opt_sd)
            c.load_state_dict(model_sd)
        else:
            c.load_state_dict(model_sd)
            oc.load_state_dict(opt_sd)
        train(c, oc, data[stop:], [i - stop for i in inject if i >= stop])
        same_run((a, oa), (c, oc))

    cases.add("works", name=f"resume_{name}_bitwise")(case)


_resume_case("adamw_bf16", ADAMW)
_resume_case("adamw_bf16_optimizer_loaded_before_the_model", ADAMW, optimizer_first=True)
_resume_case("sgd_momentum_fp16_dynamic_growing_scale", SGD_M, dtype=FP16,
             loss_scale=fxamp.LossScaleConfig("dynamic", init_scale=256.0, growth_interval=1))
_resume_case("adamw_fp16_through_torch_save_weights_only", ADAMW, dtype=FP16, save=via_torch_save)
_resume_case("adamw_bf16_through_torch_save_weights_only", ADAMW, save=via_torch_save)
_resume_case("right_after_a_skipped_step_fp16", ADAMW, dtype=FP16, inject=(1,))
_resume_case("skip_right_after_the_resume_fp16", ADAMW, dtype=FP16, inject=(2,))
_resume_case("kahan_int8", ADAMW, masters="kahan", state="int8")
_resume_case("stochastic_bf16_state", ADAMW, masters="stochastic", state="bf16", seed=7)
_resume_case("precision_lean_auto_mid_calibration", ADAMW, precision="lean")
_resume_case("lean_kahan_through_torch_save_weights_only", ADAMW, masters="kahan", state="int8", save=via_torch_save)
_resume_case("rmsprop_bf16_static_scale", lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2, momentum=0.5),
             loss_scale="static:64")
_resume_case("adagrad_bf16_after_one_step", lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1), stop=1)
_resume_case("before_any_step", ADAMW, stop=0)


@cases.add("works")
def resume_with_param_groups_and_a_scheduler():
    def make(m):
        return torch.optim.AdamW([{"params": [p for p in m.parameters() if p.dim() > 1], "weight_decay": 0.1},
                                  {"params": [p for p in m.parameters() if p.dim() <= 1], "weight_decay": 0.0,
                                   "lr": 3e-3}], lr=1e-2)

    def sched(opt):
        return torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)

    data = batches(4)
    _, a, oa = build(make)
    train(a, oa, data, sched=sched(oa))
    _, b, ob = build(make)
    sb = sched(ob)
    train(b, ob, data[:2], sched=sb)
    ckpt = via_torch_save({"model": b.state_dict(), "opt": ob.state_dict(), "sched": sb.state_dict()})
    _, c, oc = build(make, init=1)
    sc = sched(oc)
    c.load_state_dict(ckpt["model"])
    oc.load_state_dict(ckpt["opt"])
    sc.load_state_dict(ckpt["sched"])
    train(c, oc, data[2:], sched=sc)
    same_run((a, oa), (c, oc))
    bitwise([g["lr"] for g in oc.param_groups], [g["lr"] for g in oa.param_groups], "learning rates")


@cases.add("works")
def resume_after_add_param_group_into_a_wrapper_built_with_both_groups():
    def staged(m):
        return torch.optim.SGD(m.get_submodule("0").parameters(), lr=0.1, momentum=0.9)

    def whole(m):
        return torch.optim.SGD([{"params": m.get_submodule("0").parameters()},
                                {"params": [*m.get_submodule("1").parameters(), *m.get_submodule("3").parameters()],
                                 "lr": 0.05}], lr=0.1, momentum=0.9)

    data = batches(3)
    _, a, oa = build(staged)
    oa.add_param_group({"params": [*a.get_submodule("1").parameters(), *a.get_submodule("3").parameters()],
                        "lr": 0.05})
    train(a, oa, data[:2])
    sd = copy.deepcopy(oa.state_dict())
    msd = copy.deepcopy(a.state_dict())
    train(a, oa, data[2:])
    _, c, oc = build(whole, init=1)
    c.load_state_dict(msd)
    oc.load_state_dict(sd)
    train(c, oc, data[2:])
    same_run((a, oa), (c, oc))


@cases.add("works")
def load_the_same_checkpoint_twice():
    data = batches(3)
    _, a, oa = build(ADAMW)
    train(a, oa, data[:2])
    msd, sd = copy.deepcopy(a.state_dict()), copy.deepcopy(oa.state_dict())
    train(a, oa, data[2:])
    _, c, oc = build(ADAMW, init=1)
    for _ in range(2):
        c.load_state_dict(msd)
        oc.load_state_dict(sd)
    train(c, oc, data[2:])
    same_run((a, oa), (c, oc))


@cases.add("either")
def checkpoint_taken_mid_accumulation():
    # the optimizer's state_dict() between two backward() calls of one step: the gradients are not part of a
    # checkpoint (as with torch's optimizers); resuming redoes the step's micro-batches. Refusing is fine too.
    # (The model's state_dict is the one from before the micro-batches: theirs updated BatchNorm's running
    # stats, which redoing them would count twice; that is the user's loop, not the optimizer's.)
    data = batches(4)
    _, a, oa = build(ADAMW, FP16)
    train(a, oa, data[:1])
    msd, sd = copy.deepcopy(a.state_dict()), None
    oa.zero_grad()
    for i, (x, y) in enumerate(data[1:3]):
        oa.backward(loss_of(a, x, y) / 2)
        if i == 0:
            sd = copy.deepcopy(oa.state_dict())
    assert oa.step()
    _, c, oc = build(ADAMW, FP16, init=1)
    c.load_state_dict(msd)
    oc.load_state_dict(sd)
    oc.zero_grad()
    for x, y in data[1:3]:
        oc.backward(loss_of(c, x, y) / 2)
    assert oc.step()
    same_run((a, oa), (c, oc))


@cases.add("refused")
def load_a_checkpoint_of_another_model_shape():
    _, a, oa = build(ADAMW)
    train(a, oa, batches(1))
    other = fxamp.convert(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)), "O2")
    fxamp.MixedPrecisionOptimizer(ADAMW(other), model=other).load_state_dict(oa.state_dict())


@cases.add("either")
def load_a_plain_torch_optimizers_state_dict():
    # a user resuming float32 training's checkpoint (torch.optim.AdamW.state_dict()) into the wrapper: its
    # state must reach the masters in float32, or be refused
    original = net()
    plain = ADAMW(original)
    original.train()
    for x, y in batches(2):
        plain.zero_grad()
        loss_of(original, x, y).backward()
        plain.step()
    conv = fxamp.convert(original, "O2")
    opt = fxamp.MixedPrecisionOptimizer(ADAMW(conv), model=conv)
    opt.load_state_dict(plain.state_dict())
    for m, p in zip(opt.master_params(), original.parameters()):
        bitwise(opt.state[m]["exp_avg"], plain.state[p]["exp_avg"], "exp_avg")


@cases.add("works")
def load_the_wrappers_state_dict_into_the_inner_torch_optimizer():
    # the inner optimizer's own load_state_dict given the wrapper's checkpoint: torch's method, torch's error,
    # as a plain torch optimizer given that dict answers
    from .runner import same_error

    _, a, oa = build(ADAMW)
    train(a, oa, batches(1))
    sd = oa.state_dict()
    _, c, oc = build(ADAMW, init=1)
    same_error(lambda: ADAMW(net()).load_state_dict(sd), lambda: oc.optimizer.load_state_dict(sd))


@cases.add("either")
def kahan_checkpoint_into_a_float32_masters_wrapper():
    data = batches(3)
    _, a, oa = build(ADAMW, masters="kahan")
    train(a, oa, data[:2])
    _, c, oc = build(ADAMW, init=1)
    c.load_state_dict(a.state_dict())
    oc.load_state_dict(oa.state_dict())
    bitwise(fp32_of(oc), fp32_of(oa), "the masters' float32 values")


@cases.add("either")
def float32_checkpoint_into_a_kahan_wrapper():
    data = batches(3)
    _, a, oa = build(ADAMW)
    train(a, oa, data[:2])
    _, c, oc = build(ADAMW, init=1, masters="kahan")
    c.load_state_dict(a.state_dict())
    oc.load_state_dict(oa.state_dict())
    for k, v in fp32_of(oa).items():  # kahan carries ~16 bits beside the weight: a float32 master, within that
        assert torch.allclose(fp32_of(oc)[k], v, rtol=2.0**-15, atol=1e-7), f"{k}: the master did not arrive"


@cases.add("refused")
def load_a_model_state_dict_as_the_optimizers():
    _, a, oa = build(ADAMW)
    oa.load_state_dict(a.state_dict())


# -- round trips with the user's float32 model -------------------------------------------------------------------


@cases.add("works")
def fp32_state_dict_before_a_step_is_the_originals():
    original, conv, opt = build(ADAMW)
    bitwise(opt.fp32_state_dict(), {k: v.detach() for k, v in original.state_dict().items()}, "fp32_state_dict")


@cases.add("works")
def fp32_state_dict_into_the_unconverted_model_strict():
    original, conv, opt = build(ADAMW, FP16)
    train(conv, opt, batches(2))
    fresh = net(seed=3)
    fresh.load_state_dict(opt.fp32_state_dict(), strict=True)
    masters = {k: v for k, v in fp32_of(opt).items()}
    bitwise({k: v.detach() for k, v in fresh.state_dict().items()}, masters, "the unconverted model's state")
    assert all(p.dtype == torch.float32 for p in fresh.parameters())


@cases.add("works")
def converted_o2_state_dict_keys_are_the_originals():
    original, conv, _ = build(ADAMW)
    assert list(conv.state_dict()) == list(original.state_dict()), "state_dict keys changed"


@cases.add("works")
def converted_o2_state_dict_into_the_unconverted_model():
    # the converted module's own state_dict (what a user saves without reading the docs) loads into the float32
    # model; its values are the weights the converted model computes with (bfloat16 widened) or the originals
    original, conv, _ = build(ADAMW)
    fresh = net(seed=3)
    fresh.load_state_dict(conv.state_dict(), strict=True)
    for k, v in fresh.state_dict().items():
        exact, stored = original.state_dict()[k], conv.state_dict()[k]
        assert torch.equal(v, exact) or torch.equal(v, stored.to(v.dtype)), f"{k}: neither the original nor stored"


@cases.add("works")
def original_float32_checkpoint_into_the_converted_model():
    original, conv, _ = build(ADAMW)
    trained = net(seed=5)
    conv.load_state_dict(trained.state_dict())
    for name, p in conv.named_parameters():
        assert p.dtype == dict(fxamp.convert(net(), "O2").named_parameters())[name].dtype, f"{name}'s dtype changed"
    x = batches(1)[0][0]
    conv.eval(), trained.eval()
    expect = fxamp.convert(trained, "O2").eval()
    bitwise(conv(x), expect(x), "outputs after loading the float32 checkpoint")
    # an optimizer built now takes the loaded weights' float32 values, or their rounding widened
    opt = fxamp.MixedPrecisionOptimizer(ADAMW(conv), model=conv)
    for k, v in fp32_of(opt).items():
        assert torch.equal(v, trained.state_dict()[k]) or torch.equal(v, conv.state_dict()[k].float()), k


@cases.add("works")
def eval_calls_change_no_buffer_after_training():
    _, conv, opt = build(ADAMW)
    train(conv, opt, batches(2))
    conv.eval()
    before = copy.deepcopy(dict(conv.state_dict()))
    with torch.no_grad():
        conv(batches(1)[0][0])
    bitwise(dict(conv.state_dict()), before, "state after an eval call")
    conv.train()
    conv(batches(1)[0][0])
    assert not torch.equal(conv.state_dict()["1.running_mean"], before["1.running_mean"]), \
        "a train-mode call did not update the running stats: train() did not switch back"


@cases.add("works")
def torch_save_whole_converted_model_and_optimizer_together():
    data = batches(3)
    _, a, oa = build(ADAMW, FP16)
    train(a, oa, data)
    _, b, ob = build(ADAMW, FP16)
    train(b, ob, data[:2])
    buf = io.BytesIO()
    torch.save({"model": b, "opt": ob}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    c, oc = loaded["model"], loaded["opt"]
    train(c, oc, data[2:])
    same_run((a, oa), (c, oc))


@cases.add("works")
def pickle_whole_converted_model_and_optimizer_together():
    # a plain pickle (multiprocessing, a copy by hand) wrote the step plan's gradient views as separate tensors:
    # the copy stepped stale gradients, silently; it plans its step again now
    import pickle

    data = batches(3)
    _, a, oa = build(ADAMW, FP16)
    train(a, oa, data)
    _, b, ob = build(ADAMW, FP16)
    train(b, ob, data[:2])
    c, oc = pickle.loads(pickle.dumps((b, ob)))
    train(c, oc, data[2:])
    same_run((a, oa), (c, oc))


@cases.add("refused")
def deepcopy_of_a_lean_optimizer():
    # its workspace frees its buffers between steps and keys its state by the masters' ids: a KeyError, a storage
    # error or a corrupted heap before; refused in one line, saying to save its state_dict
    _, b, ob = build(ADAMW, masters="kahan", state="int8")
    train(b, ob, batches(1))
    copy.deepcopy((b, ob))


@cases.add("works")
def torch_save_whole_converted_model_default_weights_only():
    # torch.load's weights_only=True default refuses any pickled module, the user's float32 one as well
    from .runner import same_error

    def save_load(model):
        def call():
            buf = io.BytesIO()
            torch.save(model, buf)
            buf.seek(0)
            torch.load(buf)
        return call

    original, conv, _ = build(ADAMW)
    same_error(save_load(original), save_load(conv))


@cases.add("works")
def deepcopy_of_the_converted_model_keeps_outputs():
    _, conv, opt = build(ADAMW)
    train(conv, opt, batches(1))
    twin = copy.deepcopy(conv).eval()
    conv.eval()
    x = batches(1)[0][0]
    bitwise(twin(x), conv(x), "a deep copy's outputs")


# -- convert_ and Hugging Face -----------------------------------------------------------------------------------


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(self.norm(x))


@cases.add("works")
def convert_in_place_o2_state_dict_resume_bitwise():
    data = batches(3)

    def built(seed):
        model = fxamp.convert_(copy.deepcopy(_stack(seed)), "O2")
        return model, fxamp.MixedPrecisionOptimizer(ADAMW(model), model=model)

    a, oa = built(0)
    train(a, oa, data)
    b, ob = built(0)
    train(b, ob, data[:2])
    msd, sd = via_torch_save(b.state_dict()), via_torch_save(ob.state_dict())
    assert all(v.dtype == torch.float32 for v in msd.values() if v.is_floating_point()), \
        "convert_'s state_dict gives float32 values"
    c, oc = built(1)
    c.load_state_dict(msd)
    oc.load_state_dict(sd)
    train(c, oc, data[2:])
    same_run((a, oa), (c, oc))


def _stack(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Stack()


@cases.add("works")
def convert_in_place_o2_state_dict_into_the_unconverted_model():
    original = _stack(0)
    keep = {k: v.clone() for k, v in original.state_dict().items()}
    model = fxamp.convert_(original, "O2")
    fresh = _stack(4)
    fresh.load_state_dict(model.state_dict(), strict=True)
    bitwise({k: v for k, v in fresh.state_dict().items()}, keep, "the user's float32 weights back")


def _tiny_hf(kind: str):
    import transformers

    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel, cfg
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=64, max_position_embeddings=16,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM, cfg


def _hf_case(kind: str, steps: int) -> None:
    def case() -> None:
        cls, cfg = _tiny_hf(kind)
        torch.manual_seed(0)
        model = cls(cfg)
        exact = {k: v.clone() for k, v in model.state_dict().items()}
        model = fxamp.convert_(model, "O2")
        opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model)
        ids = torch.randint(0, 64, (2, 6))
        for _ in range(steps):
            opt.backward(model(input_ids=ids, labels=ids).loss)
            assert opt.step()
        # the masters (after a step) or, before any, the pretrained float32 weights themselves
        masters = fp32_of(opt) if steps else {k: v for k, v in exact.items() if k in fp32_of(opt)}
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            back = cls.from_pretrained(tmp)
            # a from_pretrained that follows config.json's dtype: float32 (what the weights written are)
            assert all(p.dtype == torch.float32 for p in back.parameters()), "from_pretrained gave low weights"
        sd = back.state_dict()
        for k, v in masters.items():
            if k in sd:
                bitwise(sd[k], v, f"{k} after save_pretrained/from_pretrained")
        missing = [k for k in masters if k not in sd and not k.endswith("lm_head.weight")]
        assert not missing, f"save_pretrained lost {missing[:3]}"

    when = "after_a_step" if steps else "before_any_step"
    cases.add("works", name=f"hf_{kind}_convert_in_place_save_pretrained_from_pretrained_{when}")(case)


_hf_case("gpt2", 1)
_hf_case("llama", 0)


# -- torch.distributed.checkpoint ---------------------------------------------------------------------------------


def _dcp_resume(world_of_one: bool) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    data = batches(3)
    _, a, oa = build(ADAMW, FP16)
    train(a, oa, data)
    _, b, ob = build(ADAMW, FP16)
    train(b, ob, data[:2])
    started = False
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if world_of_one and not dist.is_initialized():
                dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0,
                                        world_size=1)
                started = True
            dcp.save({"model": b, "optim": ob}, checkpoint_id=os.path.join(tmp, "ckpt"))
            _, c, oc = build(ADAMW, FP16, init=1)
            dcp.load({"model": c, "optim": oc}, checkpoint_id=os.path.join(tmp, "ckpt"))
        finally:
            if started:
                dist.destroy_process_group()
    train(c, oc, data[2:])
    same_run((a, oa), (c, oc))


@cases.add("works")
def dcp_save_load_without_a_process_group():
    _dcp_resume(False)


@cases.add("works")
def dcp_save_load_in_a_gloo_world_of_one():
    _dcp_resume(True)


@cases.add("either")  # (it covers O0/O1 and fxamp.shard; a refusal naming opt.state_dict() is the answer)
def sharded_state_dict_without_sharding():
    import torch.distributed.checkpoint as dcp

    data = batches(3)
    _, a, oa = build(ADAMW, FP16)
    train(a, oa, data)
    _, b, ob = build(ADAMW, FP16)
    train(b, ob, data[:2])
    with tempfile.TemporaryDirectory() as tmp:
        dcp.save(fxamp.sharded_state_dict(b, ob), checkpoint_id=tmp)
        _, c, oc = build(ADAMW, FP16, init=1)
        state = fxamp.sharded_state_dict(c, oc)
        dcp.load(state, checkpoint_id=tmp)
        fxamp.load_sharded_state_dict(c, oc, state)
    train(c, oc, data[2:])
    same_run((a, oa), (c, oc))


@cases.add("refused")
def torch_get_state_dict_of_the_wrapper():
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _, conv, opt = build(ADAMW)
    get_state_dict(conv, opt)




# -- checkpoints across changed setups ------------------------------------------------------------------------------


@cases.add("works")
def the_checkpoints_learning_rate_wins_as_torchs_does():
    _, a, oa = build(ADAMW)
    train(a, oa, batches(1))
    _, c, oc = build(lambda m: torch.optim.AdamW(m.parameters(), lr=1.0), init=1)
    oc.load_state_dict(oa.state_dict())
    assert [g["lr"] for g in oc.param_groups] == [1e-2]


def _across_case(name: str, first: Tuple[str, torch.dtype], then: Tuple[str, torch.dtype],
                 make: Callable[[nn.Module], Any] = ADAMW, make_then: Callable[[nn.Module], Any] = ADAMW) -> None:
    def case() -> None:
        # a run resumed under another policy, dtype or param-group layout: the float32 values carried over
        # (where the masters match), or refused in one line before anything changed
        a = fxamp.convert(net(0), first[0], dtype=first[1])
        oa = fxamp.MixedPrecisionOptimizer(make(a), model=a)
        train(a, oa, batches(2))
        c = fxamp.convert(net(1), then[0], dtype=then[1])
        oc = fxamp.MixedPrecisionOptimizer(make_then(c), model=c)
        c.load_state_dict(a.state_dict())
        before = (fp32_of(oc), copy.deepcopy(oc.optimizer.state_dict()), oc.current_scale)
        try:
            oc.load_state_dict(oa.state_dict())
        except Exception:  # refused: nothing changed
            bitwise((fp32_of(oc), oc.optimizer.state_dict(), oc.current_scale), before, "after a refused load")
            raise
        bitwise(fp32_of(oc), fp32_of(oa), "the float32 values carried over")

    cases.add("either", name=f"checkpoint_{name}")(case)


def _two_groups(m: nn.Module) -> torch.optim.Optimizer:
    ps = list(m.parameters())
    return torch.optim.AdamW([{"params": ps[:2]}, {"params": ps[2:]}], lr=1e-2)


_across_case("o2_into_o1", ("O2", BF16), ("O1", BF16))
_across_case("o1_into_o2", ("O1", BF16), ("O2", BF16))
_across_case("fp16_into_bf16", ("O2", FP16), ("O2", BF16))
_across_case("one_group_into_two", ("O2", BF16), ("O2", BF16), make_then=_two_groups)
_across_case("two_groups_into_one", ("O2", BF16), ("O2", BF16), make=_two_groups)


@cases.add("works")
def lean_wrapper_refusing_a_checkpoint_of_other_groups_changes_nothing():
    _, a, oa = build(ADAMW, masters="kahan", state="int8")
    train(a, oa, batches(2))
    _, c, oc = build(_two_groups, masters="stochastic", state="bf16", init=1)
    train(c, oc, batches(1))
    before = (fp32_of(oc), [oc.precision_of(m).master for m in oc.master_params() if oc.precision_of(m)])
    try:
        oc.load_state_dict(oa.state_dict())
    except ValueError as e:
        assert "param groups" in str(e), str(e)
    else:
        raise AssertionError("a checkpoint of one param group loaded into two")
    after = (fp32_of(oc), [oc.precision_of(m).master for m in oc.master_params() if oc.precision_of(m)])
    bitwise(after, before, "a refused load")


@cases.add("works")
def float32_checkpoint_loaded_into_the_converted_model_then_fine_tuned():
    # issue 37: a float32 checkpoint loaded into an O2 model (convert or convert_) is kept as the weights' float32
    # originals, so a MixedPrecisionOptimizer built afterwards starts its masters from the checkpoint's exact values,
    # not their bfloat16 rounding (it did before: issue 28's "O2 departure"); fine-tuning then moves them
    for make in (lambda m: fxamp.convert(m, "O2"), lambda m: fxamp.convert_(m, "O2")):
        pretrained = _stack(5)
        exact = {k: v.clone() for k, v in pretrained.state_dict().items()}
        model = make(_stack(0))
        model.load_state_dict(pretrained.state_dict())
        opt = fxamp.MixedPrecisionOptimizer(ADAMW(model), model=model)
        got = fp32_of(opt)
        bitwise({k: got[k] for k in exact}, exact, "the masters (the checkpoint's float32 values)")
        train(model, opt, batches(2))
        low_match_masters(model, opt)
        bitwise(pretrained.state_dict(), exact, "the user's checkpoint (never stepped)")


# -- a rollback in the same objects (a loss spike: back to the last good checkpoint, the same batches again) --------


def _rollback_case(name: str, dtype: torch.dtype, optimizer_first: bool, **wrapper: Any) -> None:
    def case() -> None:
        data = batches(4)
        _, a, oa = build(ADAMW, dtype, **wrapper)
        train(a, oa, data[:2])
        msd, sd = copy.deepcopy(a.state_dict()), copy.deepcopy(oa.state_dict())
        train(a, oa, data[2:3])
        good = (copy.deepcopy(dict(a.state_dict())), fp32_of(oa), oa.current_scale)
        train(a, oa, data[3:] + data[:1], inject=[1])  # a step, then the spike (an overflow), then the rollback
        if optimizer_first:
            oa.load_state_dict(sd)
            a.load_state_dict(msd)
        else:
            a.load_state_dict(msd)
            oa.load_state_dict(sd)
        train(a, oa, data[2:3])
        bitwise((dict(a.state_dict()), fp32_of(oa), oa.current_scale), good, "the step redone after the rollback")

    cases.add("works", name=f"rollback_in_place_{name}")(case)


_rollback_case("adamw_fp16", FP16, False)
_rollback_case("kahan_int8_optimizer_loaded_first", BF16, True, masters="kahan", state="int8")
_rollback_case("precision_lean", BF16, False, precision="lean")
