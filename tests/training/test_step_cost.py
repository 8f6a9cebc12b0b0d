"""A step of constant cost (issue 39): the ops ``step()`` dispatches (kernel launches on a GPU) do not grow with
the number of parameter tensors and stay within 4x GradScaler + fused AdamW's; at most 2 host reads a step.

Counted with :mod:`dispatch_count` around ``opt.step()`` after warm-up, on MLPs of 18 and 66 parameter tensors
(the plain step), and on parameters of a fixed total size cut into 16 or 64 tensors (the segmented step: its
ops grow with the runs, i.e. with the bytes, not with the tensors).
"""

import pytest
import torch
import torch.nn as nn

import fxamp
from dispatch_count import count, mlp, set_grads
from fxamp import MixedPrecisionOptimizer
from fxamp.training import native
from fxamp.training.loss_scale import LossScaler

pytestmark = pytest.mark.usefixtures("one_thread")

BF16 = torch.bfloat16
SIZES = (18, 66)


def _gradscaler_fused_adamw(tensors):
    model = mlp(tensors)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(4, 16)

    def prepare():
        opt.zero_grad()
        scaler.scale(model(x).sum()).backward()

    def step():
        scaler.step(opt)
        scaler.update()

    return count(step, prepare)


@pytest.fixture(scope="module")
def limit():
    """4x the ops of GradScaler + torch's fused AdamW (float32), itself constant in the number of tensors."""
    reference = [_gradscaler_fused_adamw(n) for n in SIZES]
    assert reference[0].ops == reference[1].ops and reference[0].host_reads == 0, reference
    return 4 * reference[0].ops


INNERS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "AdamW-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "AdamW-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "SGD-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, weight_decay=1e-4),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-3),
}


def _o2_step(tensors, inner, loss_scale):
    model = fxamp.convert(mlp(tensors), "O2", dtype=BF16)
    opt = MixedPrecisionOptimizer(INNERS[inner](model.parameters()), model=model, loss_scale=loss_scale)
    x = torch.randn(4, 16, dtype=BF16)

    def prepare():
        opt.zero_grad()
        opt.backward(model(x).float().sum())

    return count(lambda: opt.step(), prepare)


@pytest.mark.parametrize("loss_scale", ["dynamic", "none"])
@pytest.mark.parametrize("inner", list(INNERS))
def test_the_o2_step_costs_the_same_at_18_and_66_tensors(inner, loss_scale, limit):
    small, large = (_o2_step(n, inner, loss_scale) for n in SIZES)
    assert small.by_op == large.by_op, (small, large)
    assert small.ops <= limit, small
    assert small.host_reads <= 2, small


def _overflowing_step(tensors, inner):
    model = fxamp.convert(mlp(tensors), "O2", dtype=BF16)
    opt = MixedPrecisionOptimizer(INNERS[inner](model.parameters()), model=model, loss_scale="dynamic")
    x = torch.randn(4, 16, dtype=BF16)
    poison = [False]

    def prepare():
        opt.zero_grad()
        opt.backward(model(x).float().sum())
        if poison[0]:
            list(model.parameters())[-2].grad.view(-1)[0] = float("inf")  # the last weight

    count(lambda: opt.step(), prepare)
    before = [t.clone() for t in [*model.parameters(), *opt.master_params()]]
    state = [v.clone() for s in opt.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    poison[0] = True
    counted = count(lambda: opt.step(), prepare, warmup=0)
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, [*model.parameters(), *opt.master_params()]))
    assert all(torch.equal(a, b) for a, b in zip(state, [v for s in opt.optimizer.state.values()
                                                         for v in s.values() if torch.is_tensor(v)]))
    return counted


@pytest.mark.parametrize("inner", ["AdamW", "SGD-momentum"])
def test_an_overflowing_step_costs_the_same_at_18_and_66_tensors_and_changes_nothing(inner, limit):
    small, large = (_overflowing_step(n, inner) for n in SIZES)
    assert small.by_op == large.by_op, (small, large)
    assert small.ops <= limit, small
    assert small.host_reads <= 2, small  # the check's, and the scale's (it backs off)


def _segmented_step(tensors, inner, monkeypatch, total=2 ** 14, segment=2 ** 12):
    """bfloat16 parameters of ``total`` elements in ``tensors`` tensors, stepped in runs of ``segment`` elements."""

    monkeypatch.setattr("fxamp.training.plan.RELEASE_MIN_BYTES", 0)
    monkeypatch.setattr("fxamp.training.plan.SEGMENT_NUMEL", segment)
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(total // tensors).to(BF16)) for _ in range(tensors)]
    opt = MixedPrecisionOptimizer(INNERS[inner](params), loss_scale="dynamic")
    token = torch.zeros((), requires_grad=True)

    def prepare():
        set_grads(params)
        opt.scale_loss(token)  # (the gradients are set: this marks them scaled)

    counted = count(lambda: opt.step(), prepare)
    assert opt.plan.runs is not None and len(opt.plan.runs) == total // segment  # it was segmented
    return counted


@pytest.mark.parametrize("inner", ["AdamW", "SGD-momentum"])
def test_the_segmented_step_costs_the_same_at_16_and_64_tensors_of_the_same_size(inner, monkeypatch, limit):
    small, large = (_segmented_step(n, inner, monkeypatch) for n in (16, 64))
    assert small.by_op == large.by_op, (small, large)
    assert small.ops <= 4 * 16, small  # 4 runs: a few ops each
    assert small.host_reads <= 2, small


# -- the accelerator's step, run on a CPU: fake CUDA tensors (FakeTensorMode), where any host read raises ---------

@pytest.fixture
def fake_cuda(monkeypatch):
    """A FakeTensorMode whose tensors say "cuda" (no memory, no kernels run: each op is dispatched and its shape
    computed), so the step takes its accelerator path: the overflow flag stays on the device and the inner
    optimizer's fused kernel skips there.  A host read of a fake tensor raises.  The loss scaler is real (its
    scale lives on the host): built outside the mode, with a growth interval the test never reaches, so the
    scale never moves; the check's verdict, which a fake tensor cannot give, reads as no overflow."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxamp.training.step import DeviceFlag

    monkeypatch.setattr(DeviceFlag, "__bool__", lambda self: False)
    scaler = LossScaler(fxamp.LossScaleConfig("dynamic", growth_interval=10 ** 6))
    return FakeTensorMode(allow_non_fake_inputs=True), scaler


def _accelerator_step(fake_cuda, inner, tensors, numel, transposed=False, **lean):
    from fxamp.training.step import StepResult

    mode, scaler = fake_cuda
    with mode:
        params = [nn.Parameter(torch.randn(16, numel // 16, device="cuda").to(BF16).t() if transposed else
                               torch.randn(numel, device="cuda").to(BF16)) for _ in range(tensors)]
        opt = MixedPrecisionOptimizer(inner(params), loss_scale=scaler, **lean)
    token = torch.zeros((), requires_grad=True)  # (a real CPU loss: the scale's copy on the device is made in step())

    results = []

    def prepare():
        with mode:
            if results:
                scaler.update()  # (a shared scaler: the caller's update, after the step)
            for p in params:
                p.grad = torch.randn_like(p)
        opt.scale_loss(token)

    def step():
        with mode:
            results.append(opt.step())

    counted = count(step, prepare)
    assert len(results) == 4 and all(isinstance(r, StepResult) for r in results)  # decided on the device
    return counted.by_op, opt


FUSED_INNERS = {"AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
                "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True, weight_decay=1e-2)}
ON_FAKE_CUDA = pytest.mark.skipif(torch.cuda.is_available(),
                                  reason="fake CUDA tensors stand in for a GPU's (tests/test_cuda.py has a real one)")


@ON_FAKE_CUDA
@pytest.mark.parametrize("inner", list(FUSED_INNERS))
def test_the_accelerator_step_reads_nothing_on_the_host_and_costs_the_same_at_18_and_66_tensors(inner, fake_cuda,
                                                                                                 limit):
    (small, _), (large, _) = (_accelerator_step(fake_cuda, FUSED_INNERS[inner], n, 256) for n in SIZES)
    assert small == large, (small, large)
    assert sum(small.values()) <= limit, small
    assert "aten._local_scalar_dense.default" not in small  # (a fake tensor's would have raised anyway)


@ON_FAKE_CUDA
def test_the_segmented_accelerator_step_costs_the_same_at_16_and_64_tensors_of_the_same_size(fake_cuda,
                                                                                             monkeypatch):

    monkeypatch.setattr("fxamp.training.plan.RELEASE_MIN_BYTES", 0)
    monkeypatch.setattr("fxamp.training.plan.ACCELERATOR_SEGMENT_NUMEL", 2 ** 12)
    (small, opt), (large, _) = (_accelerator_step(fake_cuda, FUSED_INNERS["AdamW"], n, 2 ** 14 // n) for n in (16, 64))
    assert len(opt.plan.runs) == 4  # segmented: 4 runs
    assert small == large, (small, large)
    assert sum(small.values()) <= 4 * 16, small
    assert "aten._local_scalar_dense.default" not in small


# -- the lean modes (masters= and state=): every combination, on the CPU and on the accelerator's path ------------

LEAN = [("kahan", "fp32"), ("stochastic", "fp32"), ("fp32", "bf16"), ("kahan", "bf16"), ("stochastic", "bf16"),
        ("fp32", "int8"), ("kahan", "int8"), ("stochastic", "int8"), ("auto", "auto")]
#: 8-bit state coded by eager ops (an accelerator's, or a CPU's without fxamp's kernel; on a CPU the kernel codes a
#: run's states where they are, around one ``_foreach_log2_``): about 15 elementwise ops per moment to code (block
#: scales, log2, bias, clamp, sign, the integer cast) and 3 to decode (the byte as an index, a table lookup, a
#: scale), one set over all of a run's masters on kept views of its flat buffers, and 4 ``_foreach`` copies of codes
#: and scales in and out: a float32 master's step with 8-bit state at the limit on the accelerator's path (52 ops, 82
#: before), 4 over it on a CPU (the uint8 cast through int16, two host-side tables' copies fewer)
EAGER_8BIT = 1.1
#: the stochastic rounding by eager ops (an accelerator's; on a CPU the kernel rounds, dispatching nothing): its noise
#: is the CPU kernel's hash (two murmur3 finalizers, each logical shift an arithmetic shift and a mask in int32),
#: about 30 elementwise ops over a run's values (a slice's: 64 MiB on an accelerator), plus a handful to spread the
#: masters' keys over their elements: constant in the number of tensors, a few ops over 4x the reference: pinned
#: at 1.25x the limit
EAGER_ROUNDING = 1.25
#: both by eager ops (stochastic masters with 8-bit state): 96 ops on the accelerator's path (123 before)
EAGER_BOTH = 1.9


def _bound(inner, masters, state, limit, on_cpu=True):
    """The ops a lean step may take: the limit, or the pinned bounds above where eager ops code the 8-bit state or
    round stochastically (on a CPU fxamp's kernel does both)."""
    kernel = on_cpu and native.kernel() is not None
    coded = state in ("int8", "auto") and not kernel
    rounded = masters in ("stochastic", "auto") and not kernel
    if coded and rounded:
        return EAGER_BOTH * limit
    if coded:
        return (EAGER_8BIT if on_cpu else 1) * limit
    return (EAGER_ROUNDING if rounded else 1) * limit


def _lean_step(tensors, inner, masters, state):
    model = fxamp.convert(mlp(tensors), "O2", dtype=BF16)
    opt = MixedPrecisionOptimizer(INNERS[inner](model.parameters()), model=model, loss_scale="dynamic",
                                  masters=masters, state=state)
    x = torch.randn(4, 16, dtype=BF16)

    def prepare():
        opt.zero_grad()
        opt.backward(model(x).float().sum())

    # ("auto" calibrates per tensor in its first steps, the one exception: counted after them)
    counted = count(lambda: opt.step(), prepare, warmup=3 if masters != "auto" else 6)
    if masters != "fp32":
        assert {opt.precision_of(m).master for _, m in opt.master_pairs()} != {"fp32"}  # lean masters were stepped
    return counted


@pytest.mark.parametrize("masters,state", LEAN, ids=[f"{m}-{s}" for m, s in LEAN])
@pytest.mark.parametrize("inner", ["AdamW", "SGD-momentum"])
def test_the_lean_step_costs_the_same_at_18_and_66_tensors(inner, masters, state, limit):
    """A run's lean masters are moved together (training/flat.py: a ``_foreach`` call per role, one (de)coding pass
    per moment, one hash for the stochastic rounding), or stepped by the CPU kernel without a view per master."""
    small, large = (_lean_step(n, inner, masters, state) for n in SIZES)
    assert small.by_op == large.by_op, (small, large)
    assert small.ops <= _bound(inner, masters, state, limit), small
    assert small.host_reads <= 2, small


@pytest.mark.skipif(native.kernel() is None, reason=f"no CPU kernel here: {native.unavailable_reason()}")
@pytest.mark.parametrize("masters", ["fp32", "kahan", "stochastic"])
@pytest.mark.parametrize("inner", ["AdamW", "SGD-momentum"])
def test_8bit_state_costs_at_most_one_op_more_than_float32_state_on_a_cpu(inner, masters):
    """fxamp's CPU kernel decodes and codes a run's 8-bit states where they are (a pointer each: no copy in or out,
    no op per moment), around one ``_foreach_log2_`` (torch's log2, for the eager code's bits): the step with int8
    state dispatches at most one op more than with float32 state, at 18 and 66 tensors (82 ops at both before)."""
    for n in SIZES:
        int8, fp32 = _lean_step(n, inner, masters, "int8"), _lean_step(n, inner, masters, "fp32")
        assert int8.ops <= fp32.ops + 1, (int8, fp32)
        assert int8.host_reads <= 2, int8


def _params_step(tensors, masters, state, transposed):
    """A plain AdamW step of ``tensors`` bfloat16 16x16 weights, stored transposed (their float32 masters and
    gradients too) or row-major."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(16, 16).to(BF16).t() if transposed else torch.randn(16, 16).to(BF16))
              for _ in range(tensors)]
    opt = MixedPrecisionOptimizer(INNERS["AdamW"](params), loss_scale="dynamic", masters=masters, state=state)
    token = torch.zeros((), requires_grad=True)

    def prepare():
        set_grads(params)
        opt.scale_loss(token)

    counted = count(lambda: opt.step(), prepare, warmup=3 if masters != "auto" else 6)  # (auto: after calibrating)
    if transposed:
        assert all(not m.is_contiguous() for _, m in opt.master_pairs()) if masters == "fp32" else True
    return counted


@pytest.mark.parametrize("masters,state", [("fp32", "int8"), ("fp32", "bf16")])
def test_masters_stored_transposed_cost_the_same_at_18_and_66_tensors(masters, state, limit):
    """A float32 master whose layout is not row-major (a transpose, channels_last: its gradient's too) is moved with
    the others, by value (its values and gradient copied into row-major flat buffers, the values copied back): a
    few ops more than row-major masters, whatever their number (they were stepped one at a time)."""
    small, large = (_params_step(n, masters, state, transposed=True) for n in SIZES)
    assert small.by_op == large.by_op, (small, large)
    assert small.ops <= _params_step(18, masters, state, transposed=False).ops + 3, small
    assert small.ops <= _bound("AdamW", masters, state, limit) + 3, small
    assert small.host_reads <= 2, small


@pytest.mark.parametrize("masters,state", [("kahan", "fp32"), ("stochastic", "int8")])
def test_the_segmented_lean_step_costs_the_same_at_16_and_64_tensors_of_the_same_size(masters, state, monkeypatch,
                                                                                      limit):

    monkeypatch.setattr("fxamp.training.plan.RELEASE_MIN_BYTES", 0)
    monkeypatch.setattr("fxamp.training.plan.SEGMENT_NUMEL", 2 ** 12)
    counts = []
    for tensors in (16, 64):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(2 ** 14 // tensors).to(BF16)) for _ in range(tensors)]
        opt = MixedPrecisionOptimizer(INNERS["SGD-momentum"](params), loss_scale="dynamic", masters=masters,
                                      state=state)
        token = torch.zeros((), requires_grad=True)

        def prepare():
            set_grads(params)
            opt.scale_loss(token)

        counts.append(count(lambda: opt.step(), prepare))
        assert len(opt.plan.runs) == 4  # segmented: 4 runs
    small, large = counts
    assert small.by_op == large.by_op, (small, large)
    assert small.host_reads <= 2, small


@ON_FAKE_CUDA
@pytest.mark.parametrize("masters,state", [("kahan", "fp32"), ("stochastic", "fp32"), ("kahan", "bf16"),
                                           ("fp32", "int8"), ("stochastic", "int8")])
def test_the_lean_accelerator_step_reads_nothing_on_the_host_and_costs_the_same_at_18_and_66_tensors(
        masters, state, fake_cuda, limit):
    """No host read decides a path (the stochastic rounding's NaNs and infinities are kept by construction), and
    the flat buffers' memory is taken and given back through their storage (their views are kept)."""
    inner = FUSED_INNERS["AdamW"]
    (small, opt), (large, _) = (_accelerator_step(fake_cuda, inner, n, 256, masters=masters, state=state)
                                for n in SIZES)
    assert small == large, (small, large)
    assert sum(small.values()) <= _bound("AdamW", masters, state, limit, on_cpu=False), small
    assert "aten._local_scalar_dense.default" not in small
    assert all(m.stride() == (0,) for _, m in opt.master_pairs()) if masters != "fp32" else True  # placeholders


# -- the check of a segmented step's large gradients (FoundInf.check_) --------------------------------------------

@pytest.mark.skipif(native.kernel() is None, reason=f"no CPU kernel here: {native.unavailable_reason()}")
@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
def test_the_check_of_large_gradients_costs_the_same_at_2_and_8_tensors_and_finds_every_non_finite(dtype):
    """FoundInf.check_ reads gradients of SUM_NUMEL elements on with one kernel call over all of them (it summed each
    before: an op per tensor); +inf, -inf or NaN anywhere sets the flag (then the exact kernel runs), finite values
    (the largest too) do not."""
    from dispatch_count import DispatchCount

    from fxamp.training.executors import SUM_NUMEL, FoundInf

    def check(tensors):
        flags = FoundInf(lambda device: torch.ones(()))
        with DispatchCount() as counted:
            flags.check_(tensors)
        return counted, float(flags.found())

    g = torch.Generator().manual_seed(0)
    counts = []
    for k in (2, 8):
        tensors = [torch.randn(SUM_NUMEL + 7 * i, generator=g).to(dtype) for i in range(k)]
        tensors[-1][5] = torch.finfo(dtype).max
        counted, found = check(tensors)
        assert found == 0.0
        counts.append(counted.by_op)
        for bad in (float("inf"), -float("inf"), float("nan")):
            tensors[k // 2][SUM_NUMEL - 1] = bad
            assert check(tensors)[1] == 1.0, bad
            tensors[k // 2][SUM_NUMEL - 1] = 0.0
    assert counts[0] == counts[1], counts


@ON_FAKE_CUDA
@pytest.mark.parametrize("state", ["int8", "bf16"])
def test_transposed_float32_masters_on_the_accelerator_move_with_the_others(state, fake_cuda, limit):
    """On the accelerator's path too, float32 masters stored transposed are moved by value with the others (three
    ``_foreach`` copies more than row-major ones, whatever their number), without a host read."""
    inner = FUSED_INNERS["AdamW"]
    (small, opt), (large, _) = (_accelerator_step(fake_cuda, inner, n, 256, transposed=True, masters="fp32",
                                                  state=state) for n in SIZES)
    row_major, _ = _accelerator_step(fake_cuda, inner, 18, 256, masters="fp32", state=state)
    assert all(not m.is_contiguous() for _, m in opt.master_pairs())
    assert small == large, (small, large)
    assert sum(small.values()) <= sum(row_major.values()) + 3, (small, row_major)
    assert "aten._local_scalar_dense.default" not in small


@ON_FAKE_CUDA
def test_the_accelerators_stochastic_rounding_scans_one_dimension_at_a_time():
    """The eager rounding of a slice holding several masters spreads their keys over its elements with a prefix sum:
    on a GPU torch scans a whole 1-D tensor with one device-wide scan, but a (3, m) tensor along its last dim a row
    per thread block: 3 blocks over 16 M elements, 22 ms a slice on an H200 (70% of a lean step there; 190 ms a
    step at GPT-2 small before, 60 after).  Every scan is 1-D, and the bits are the CPU's (test_native.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from fxamp.training import flat

    scans = []

    class Scans(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.cumsum, torch.ops.aten.cumsum_):
                scans.append(args[0].dim())
            return func(*args, **(kwargs or {}))

    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(3000, device="cuda")
        with Scans():
            flat.round_stochastic_(x, [(1000, flat.key(1, 2, 3), 0), (2000, flat.key(4, 5, 6), 17)])
    assert scans and all(d == 1 for d in scans), scans


@ON_FAKE_CUDA
@pytest.mark.parametrize("masters,state", [("fp32", "fp32"), ("stochastic", "int8")])
def test_the_accelerators_gradient_segment_holds_no_memory_between_steps(masters, state, fake_cuda, monkeypatch):
    """A segmented step's float32 gradient segment (128 MiB on an accelerator) is given back after each step, its
    views kept: on an H200 the allocator counted it after every step (GPT-2 small: 7.4 bytes a parameter with
    stochastic masters and 8-bit state against the 6.04 the lean table lists; with it given back, 6.0 on fake
    CUDA at that size).  The next steps take it again and cost what they cost (the counts above)."""
    monkeypatch.setattr("fxamp.training.plan.RELEASE_MIN_BYTES", 0)
    monkeypatch.setattr("fxamp.training.plan.ACCELERATOR_SEGMENT_NUMEL", 2 ** 12)
    by_op, opt = _accelerator_step(fake_cuda, FUSED_INNERS["AdamW"], 18, 256, masters=masters, state=state)
    segments = opt.plan.segments
    assert segments.flats and segments.views  # (the step went through the segment, and its views are kept)
    assert all(f.untyped_storage().nbytes() == 0 for f in segments.flats.values())
