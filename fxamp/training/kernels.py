"""Step float32 masters in one pass that reads the low-precision gradient and writes the low-precision weight.

``MixedPrecisionOptimizer(..., compile_step=True)`` over a stock ``torch.optim.AdamW``, ``Adam`` or
``SGD``: instead of copying each low-precision gradient into a float32 buffer, stepping the inner
optimizer on it and copying the master back into the low-precision weight (three passes over
memory, 40 bytes per parameter for AdamW), one kernel reads each master's bfloat16/float16
gradient, divides it by the loss scale, updates the master and the optimizer state and writes the
rounded weight (28 bytes per parameter: what the inner optimizer alone moves for a float32 model).
The kernels are the inner optimizer's update written as pointwise torch and compiled with
``torch.compile`` (one graph for every size: ``dynamic=True``), the way torchao compiles its
low-bit optimizers; apex's ``FusedAdam(master_weights=True)`` is the same idea as a CUDA kernel.
A call steps :data:`CHUNK` masters (a loop each in one graph; the last call padded with scratch
tensors), so dynamo's guards and inductor's wrapper are paid once per 16 masters; what the calls
take but the gradients is planned at the first step and kept while the tensors stay the same.

The state stays the inner optimizer's (``exp_avg``, ``exp_avg_sq``, ``step``;
``momentum_buffer``), created as torch creates it, so ``state_dict()``, LR schedulers and
checkpoints do not see the difference.  Not bitwise torch's step: the compiler fuses and may
contract multiply-adds (the masters agree to a few float32 ulps, see tests/training/test_kernels.py).
The first step of each kind compiles (10-30 s on 2 CPU cores; inductor caches the kernel on disk).
Only where it pays: a model whose masters hold fewer than :data:`FUSED_MIN_TOTAL` elements (0.25 to
3 million, by optimizer) is stepped as without ``compile_step``, and nothing is compiled.

Where :class:`fxamp.MixedPrecisionOptimizer` keeps the overflow decision on the device (one CUDA
device, a fused inner optimizer: see its ``step``), the Adam kernel takes the flag and skips there
(everything written back as it was, the step counts not advanced, as torch's fused Adam does), and
the bias corrections are computed on the device from the step counts: the host never waits.
SGD's decision is read on the host.

A step's extra file with ``compile_step``: the compiled executor (:class:`Compiled`, what the engine gets from
:meth:`Kernels.executor`) calls :meth:`Kernels.step` for the runs.  Imported by the wrapper only when
``compile_step=True`` is asked for: it brings ``torch._dynamo``, which ``import fxamp`` does not.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .executors import Multiplier, fusable as fusable_master, step_runs
from .plan import Run, cut_runs

__all__ = ["fusable", "worth_fusing", "skips_on_device", "Kernels", "Compiled", "step_fused", "adam_rows", "KERNELS",
           "DistinctLengths", "CHUNK", "FUSED_MIN_NUMEL", "FUSED_MIN_TOTAL"]


def _adam_update(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # s: [scale (1/loss scale x clip factor, negated to maximize), L2 weight decay (Adam),
    #     decoupled decay factor 1 - lr*wd (AdamW), 1 - beta1, beta2, 1 - beta2, lr / bias_correction1,
    #     1 / sqrt(bias_correction2), eps]; the order of torch's _single_tensor_adam, but two forms
    #     that compile to less work: exp_avg + (g - exp_avg) * (1 - beta1) is lerp's own formula for
    #     a weight under 0.5 (inductor writes lerp with both of its branches and a select), and a
    #     multiplication by the reciprocal instead of a division (together 0.80 -> 0.72 ns per element
    #     on the EPYC; ATen's fused float32 AdamW: 0.60)
    g = grad.float() * s[0] + master * s[1]
    exp_avg_new = exp_avg + (g - exp_avg) * s[3]
    exp_avg_sq_new = exp_avg_sq * s[4] + g * g * s[5]
    denom = exp_avg_sq_new.sqrt() * s[7] + s[8]
    return master * s[2] - s[6] * (exp_avg_new / denom), exp_avg_new, exp_avg_sq_new


def _adam(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
          low: torch.Tensor, s: torch.Tensor) -> None:
    master_new, exp_avg_new, exp_avg_sq_new = _adam_update(master, grad, exp_avg, exp_avg_sq, s)
    master.copy_(master_new)
    exp_avg.copy_(exp_avg_new)
    exp_avg_sq.copy_(exp_avg_sq_new)
    low.copy_(master_new)


def _adam_skip(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               low: torch.Tensor, s: torch.Tensor, found: torch.Tensor) -> None:
    # found: 1.0 when a gradient overflowed and the decision stayed on the device: everything is
    # written back as it was (a kernel of its own: the selects cost ~9% on a CPU core, where the
    # host always decides)
    master_new, exp_avg_new, exp_avg_sq_new = _adam_update(master, grad, exp_avg, exp_avg_sq, s)
    skip = found > 0
    master.copy_(torch.where(skip, master, master_new))
    exp_avg.copy_(torch.where(skip, exp_avg, exp_avg_new))
    exp_avg_sq.copy_(torch.where(skip, exp_avg_sq, exp_avg_sq_new))
    low.copy_(torch.where(skip, low, master_new))


def _sgd_momentum(master: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, low: torch.Tensor,
                  s: torch.Tensor, nesterov: bool) -> None:
    # s: [scale, weight decay, momentum on the buffer (0 at the first step: the buffer starts as the
    #     gradient), weight of the gradient (1 - dampening; 1 at the first step), momentum, lr]
    g = grad.float() * s[0] + master * s[1]
    buf_new = buf * s[2] + g * s[3]
    update = g + buf_new * s[4] if nesterov else buf_new
    master_new = master - s[5] * update
    master.copy_(master_new)
    buf.copy_(buf_new)
    low.copy_(master_new)


def _sgd(master: torch.Tensor, grad: torch.Tensor, low: torch.Tensor, s: torch.Tensor) -> None:
    # s: [scale, weight decay, lr]
    g = grad.float() * s[0] + master * s[1]
    master_new = master - s[2] * g
    master.copy_(master_new)
    low.copy_(master_new)


# The kernels over many masters: one call steps CHUNK of them (dynamo unrolls the loop; inductor
# writes a loop per master into one graph), each master with its own row of scalars.  A function per
# kind, not one generic loop: dynamo caches graphs, and counts them against its recompile limit, per
# code object, so the kinds would share one limit.

def _adam_many(masters: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor],
               exp_avg_sqs: List[torch.Tensor], lows: List[torch.Tensor], rows: torch.Tensor) -> None:
    for k in range(len(masters)):
        _adam(masters[k], grads[k], exp_avgs[k], exp_avg_sqs[k], lows[k], rows[k])


def _adam_skip_many(masters: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor],
                    exp_avg_sqs: List[torch.Tensor], lows: List[torch.Tensor], rows: torch.Tensor,
                    found: torch.Tensor) -> None:
    for k in range(len(masters)):
        _adam_skip(masters[k], grads[k], exp_avgs[k], exp_avg_sqs[k], lows[k], rows[k], found)


def _sgd_momentum_many(masters: List[torch.Tensor], grads: List[torch.Tensor], bufs: List[torch.Tensor],
                       lows: List[torch.Tensor], rows: torch.Tensor, nesterov: bool) -> None:
    for k in range(len(masters)):
        _sgd_momentum(masters[k], grads[k], bufs[k], lows[k], rows[k], nesterov)


def _sgd_many(masters: List[torch.Tensor], grads: List[torch.Tensor], lows: List[torch.Tensor],
              rows: torch.Tensor) -> None:
    for k in range(len(masters)):
        _sgd(masters[k], grads[k], lows[k], rows[k])


#: masters stepped by one kernel call, padded with tiny scratch tensors to this count, so that one
#: graph serves every step: dynamo's guards and inductor's wrapper cost ~30-50 us a call whatever it
#: steps, which made 200 masters of 50 K elements in calls of one ~2x slower than in calls of 16
#: (measured on a 2-core EPYC: 17.5 vs 6.3 ms, SGD); 32 a call saves little more and compiles
#: ~3x longer (22 s cold, against 8 s)
CHUNK = 16

#: masters of fewer elements are stepped by the inner optimizer (gathered per group and device into
#: runs of a segment, see :func:`step_fused`): in a call of :data:`CHUNK` a master costs ~8 us of
#: guards, views and planning, which a pass over fewer elements does not save (12 bytes per element
#: less traffic, ~1 ns per element); the smallest masters are packed into one storage besides
#: (``fxamp.training.plan.CAT_NUMEL``, 1024), which a chunk cannot take.  (32768 when each master was a call
#: of its own, ~30 us; 4096 took ~1 ms off the ResNet-50's step of 30 ms on the EPYC.)
FUSED_MIN_NUMEL = 4096

#: per kind, and ``_fused`` when the inner optimizer is torch's fused one: the elements the kernels
#: must have to step (in masters of at least FUSED_MIN_NUMEL elements) for a step to use them; with
#: fewer, ``compile_step=True`` steps as without it, and nothing is compiled.  The fused path has
#: fixed costs, ~0.3-0.7 ms a step on a 2-core EPYC (a call of 16 masters ~75 us, the in-place
#: check, the kernels' scalars computed on the device), against what it saves: ~12 bytes of traffic
#: per element, and the inner optimizer's own passes, many for torch's default CPU loop over the
#: tensors, one for a fused optimizer.  ``python -m benchmarks.fused_crossover`` measures it; there,
#: compiled/plain crossed 1 at ~0.1 M elements (AdamW, loop or foreach), 0.5-1 M (SGD), 2-4 M
#: (fused AdamW and SGD); at 16 M it was 0.35x, 0.64x and 0.72x.  (A model this small does not
#: need the float32 gradients gone either: 4 bytes a parameter.)
FUSED_MIN_TOTAL: Dict[str, int] = {"adam": 256 * 1024, "sgd": 512 * 1024,
                                   "adam_fused": 3 * 1024 * 1024, "sgd_fused": 2 * 1024 * 1024}

_ADAM_KEYS = {"amsgrad": False, "capturable": False, "differentiable": False}
_SGD_KEYS = {"differentiable": False}


def _kind(optimizer: Any) -> Optional[str]:
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        return "adam"
    if type(optimizer) is torch.optim.SGD:
        return "sgd"
    return None


def fusable(optimizer: Any) -> Optional[str]:
    """Why the step of ``optimizer`` cannot be fused, or None when it can: exactly ``torch.optim.Adam``,
    ``AdamW`` or ``SGD`` (a subclass may change the update), and no option the kernels do not have
    (amsgrad, capturable, differentiable, complex or sparse gradients are stepped by the inner optimizer)."""
    kind = _kind(optimizer)
    if kind is None:
        return (f"{type(optimizer).__name__} is not torch.optim.Adam, AdamW or SGD, whose update the "
                f"compiled kernels implement")
    keys = _ADAM_KEYS if kind == "adam" else _SGD_KEYS
    for group in optimizer.param_groups:
        for key, value in keys.items():
            if bool(group.get(key, value)) != value:
                return f"{type(optimizer).__name__}({key}={group.get(key)!r}) is not fused"
        if torch.is_tensor(group.get("lr")) and group["lr"].requires_grad:
            return "a differentiable learning rate is not fused"
    return None


def worth_fusing(optimizer: Any, masters: Sequence[torch.Tensor]) -> bool:
    """Whether the kernels would step enough of ``masters`` (:data:`FUSED_MIN_TOTAL` elements, in
    masters of at least :data:`FUSED_MIN_NUMEL`) to be faster than the inner optimizer's step: against
    torch's fused kernel where the plain step runs it (:func:`_plain_is_fused`)."""
    key = _kind(optimizer) + ("_fused" if _plain_is_fused(optimizer, masters) else "")
    return sum(n for n in (m.numel() for m in masters) if _takes(n)) >= FUSED_MIN_TOTAL[key]


def _plain_is_fused(optimizer: Any, masters: Sequence[torch.Tensor]) -> bool:
    """Whether the plain step steps ``masters`` with torch's fused kernel: the optimizer was built fused, or
    (on a CPU) the engine steps a stock Adam/AdamW/SGD's masters with ``fused=True``
    (:func:`fxamp.training.executors.step_inner`)."""
    groups = optimizer.param_groups
    if all(g.get("fused") for g in groups):
        return True
    ids = {id(m) for m in masters}
    return bool(ids) and all(fusable_master(optimizer, g, p) for g in groups for p in g["params"] if id(p) in ids)


def _takes(numel: int, min_numel: Optional[int] = None) -> bool:
    """Whether a master of ``numel`` elements is long enough for the kernels: ``min_numel`` (default
    :data:`FUSED_MIN_NUMEL`), and never 0 or 1, lengths dynamo specializes (a graph each)."""
    return numel >= max(FUSED_MIN_NUMEL if min_numel is None else min_numel, 2)


def skips_on_device(optimizer: Any) -> bool:
    """Whether the kernels of ``optimizer``'s kind take an overflow flag decided on the device (Adam,
    AdamW); SGD's first momentum step cannot be told from a skipped one without state, so its
    decision is read on the host."""
    return _kind(optimizer) == "adam"


#: the update functions by name, each compiled at its first call (:class:`Kernels`); a ``_many`` one steps
#: :data:`CHUNK` masters a call
KERNELS: Dict[str, Callable[..., None]] = {
    "adam": _adam, "adam_skip": _adam_skip, "sgd_momentum": _sgd_momentum, "sgd": _sgd,
    "adam_many": _adam_many, "adam_skip_many": _adam_skip_many, "sgd_momentum_many": _sgd_momentum_many,
    "sgd_many": _sgd_many}

#: what torch.compile raises when it cannot compile a call (dynamo, inductor and the C++ compiler behind
#: it, the recompile limit); anything else is the kernel's own error and is raised
_COMPILE_ERRORS = tuple(c for c in (getattr(torch._dynamo.exc, "TorchDynamoException", None),
                                    getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", None)) if c is not None)


class Kernels:
    """The kernels of one wrapper's ``optimizer`` (a :func:`fusable` one), compiled at their first call
    (``torch.compile``, ``dynamic=True``), the scratch tensors that pad a call to :data:`CHUNK` masters,
    and the calls' kept plans.  :meth:`step` is the executor of a step's runs.

    Where compiling fails (no C++ compiler for inductor, or dynamo's recompile limit reached by a
    new dtype or layout) that call runs the same function eagerly, after one warning per kernel: the
    same update, at the cost of one pass over memory per operation.  A failure is raised while
    compiling, before the kernel writes anything."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self._compiled: Dict[str, Callable[..., None]] = {}
        self._warned: set = set()
        self._pads: Dict[Tuple[Any, ...], List[Tuple[torch.Tensor, ...]]] = {}
        self._plans: Dict[Tuple[Any, ...], Any] = {}

    @property
    def compiled(self) -> Tuple[str, ...]:
        """The names (:data:`KERNELS`) of the kernels compiled so far, sorted; () until a step used them."""
        return tuple(sorted(self._compiled))

    @property
    def skips_on_device(self) -> bool:
        """:func:`skips_on_device` of the optimizer."""
        return skips_on_device(self.optimizer)

    def worth(self, masters: Sequence[torch.Tensor]) -> bool:
        """:func:`worth_fusing` of the optimizer and ``masters``."""
        return worth_fusing(self.optimizer, masters)

    def step(self, runs: Sequence[Run], scale_on: Optional[Callable[[torch.device], torch.Tensor]],
             fallback: Callable[[Sequence[Run]], None], *, segment_numel: int,
             found: Optional[torch.Tensor] = None) -> None:
        """:func:`step_fused` of the optimizer with these kernels: what the compiled executor (:class:`Compiled`)
        calls."""
        step_fused(self.optimizer, self, runs, scale_on, fallback, segment_numel=segment_numel, found=found)

    def executor(self, segment_numel: int, found: Optional[torch.Tensor] = None) -> Compiled:
        """The step's executor with these kernels (:class:`Compiled`)."""
        return Compiled(self, segment_numel, found)

    def scratch(self) -> List[torch.Tensor]:
        """The scratch tensors that pad calls (:meth:`pad`): never a master, nothing reads what they hold."""
        return [t for pads in self._pads.values() for pad in pads for t in pad]

    def kept_tensors(self) -> List[torch.Tensor]:
        """The tensors the kept plans (:meth:`plan`) hold: views of the masters, their optimizer state and
        the low-precision weights, kept between steps (not the gradients, new every step)."""
        return [t for _, (_, chunks) in self._plans.values()
                for _, columns, _, _ in chunks for column in columns if column for t in column]

    def __call__(self, name: str) -> Callable[..., None]:
        compiled = self._compiled.get(name)
        if compiled is None:
            # size_asserts: inductor's wrapper re-checks every input's sizes and strides, which
            # dynamo's guards have just checked: ~30 of a call's ~105 us over 16 masters (EPYC)
            compiled = self._compiled[name] = torch.compile(
                KERNELS[name], dynamic=True, fullgraph=True,
                options={"cpp.dynamic_threads": True, "size_asserts": False})
        raw = KERNELS[name]

        def call(*args: Any) -> None:
            try:
                with DistinctLengths():
                    compiled(*args)
            except _COMPILE_ERRORS as e:
                if name not in self._warned:
                    self._warned.add(name)
                    first = str(e).splitlines()[0] if str(e) else ""
                    warnings.warn(f"fxamp compile_step: torch.compile could not compile the {name} step "
                                  f"({type(e).__name__}: {first}); stepping with the same update run "
                                  f"eagerly (slower)", RuntimeWarning, stacklevel=4)
                raw(*args)

        return call

    def plan(self, slot: Tuple[Any, ...], key: Tuple[Any, ...], make: Callable[[], Any]) -> Any:
        """The plan (:func:`_launch`'s) of ``slot`` (a kind and the first master of a group: one a step),
        made anew when the step's ``key`` changed (a checkpoint loaded, a parameter's ``.data``
        replaced): the old one goes at once, or its views would keep the replaced tensors alive."""
        kept = self._plans.get(slot)
        if kept is not None and kept[0] == key:
            return kept[1]
        if len(self._plans) >= 64:  # (slots that no longer come: groups changed)
            self._plans.clear()
        plan = make()
        self._plans[slot] = (key, plan)
        return plan

    def pad(self, like: Sequence[torch.Tensor], count: int) -> List[Tuple[torch.Tensor, ...]]:
        """``count`` tuples of zeros of two elements with the dtypes and device of ``like`` (one master's
        tensors): distinct tensors (dynamo guards that a call's inputs do not alias), kept and reused;
        views, as the masters' 1-D views are (dynamo guards a view's base: a pad that is not a view
        would compile a second graph)."""
        key = (like[0].device,) + tuple(t.dtype for t in like)
        pads = self._pads.get(key)
        if pads is None:
            pads = self._pads[key] = [tuple(torch.zeros(2, dtype=t.dtype, device=t.device).view(-1)
                                            for t in like) for _ in range(CHUNK - 1)]
        return pads[:count]


class Compiled:
    """``compile_step=True``'s executor (:class:`fxamp.training.executors.Executor`): the runs' masters stepped by
    :meth:`Kernels.step`, one pass from the low-precision gradient to the low weight; what its kernels do not take
    through :func:`~fxamp.training.executors.step_runs`.  ``found``: the overflow flag of a step decided on the
    device (the kernels skip there)."""

    __slots__ = ("kernels", "segment_numel", "found")

    def __init__(self, kernels: "Kernels", segment_numel: int, found: Optional[torch.Tensor] = None) -> None:
        self.kernels, self.segment_numel, self.found = kernels, segment_numel, found

    def step(self, optimizer: Any, runs: Sequence[Run], multiplier: Multiplier) -> List[Run]:
        self.kernels.step(runs, multiplier, partial(step_runs, optimizer, inv_scale_on=multiplier),
                          segment_numel=self.segment_numel, found=self.found)
        return []


class DistinctLengths:
    """While a kernel may compile: every master's length its own symbol.  Dynamo's default gives equal
    lengths one symbol and guards that they stay equal, so calls over masters of other equal lengths
    would compile again, up to the recompile limit (torch's own message names this setting).  Set and
    restored around each call (~4 us; ``config.patch`` costs ~25 us)."""

    __slots__ = ("old",)

    def __enter__(self) -> None:
        self.old = _SHAPES_CONFIG.use_duck_shape
        _SHAPES_CONFIG.use_duck_shape = False

    def __exit__(self, *exc: Any) -> None:
        _SHAPES_CONFIG.use_duck_shape = self.old


_SHAPES_CONFIG = torch.fx.experimental._config


def _contiguous(tensors: Sequence[torch.Tensor]) -> bool:
    return all(t.is_contiguous() for t in tensors)


def _own_storage(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether each tensor starts its storage: dynamo specializes a storage offset of 0 against others (a
    graph each), and masters packed into one storage would alias in a call (a slower graph)."""
    return all(t.storage_offset() == 0 for t in tensors)


def _launch(kernels: Kernels, name: str, items: Sequence[Tuple[torch.Tensor, ...]], table: torch.Tensor,
            extra: Tuple[Any, ...] = ()) -> None:
    """Step each master of ``items`` (its kernel's tensors: the master, its gradient, its state, its
    low-precision weight; parameters as they are, not detached) with kernel ``name``, row ``i`` of
    ``table`` its scalars, ``extra`` the kernel's last arguments.

    Contiguous ones as 1-D views, :data:`CHUNK` a call (``name + "_many"``; one graph for every size),
    the last call of each kind padded with scratch tensors; a gradient laid out otherwise than its
    master (channels_last from a compiled convolution, say) is read where it is, in the same single
    pass, by a call of its own (``name``; a graph per layout), as is a tensor that does not start its
    storage (a packed small master, when ``FUSED_MIN_NUMEL`` lets those in).

    The calls but for the gradients are planned once and kept while the step's tensors are the same
    objects at the same addresses, laid out alike (:meth:`Kernels.plan`): views cost ~1.3 us each,
    and a 200-master step took 2.5 ms of them and of these checks when they were made every step."""
    key = tuple(_signature(item) for item in items)
    singles, chunks = kernels.plan((name, id(items[0][0])), key, lambda: _plan(kernels, items, table.device))
    for i in singles:
        tensors = tuple(t if j == 1 else t.detach() for j, t in enumerate(items[i]))
        if _contiguous(tensors):
            tensors = tuple(t.view(-1) for t in tensors)
        # (a row of its own: a view's storage offset would be a guard, and a graph per offset)
        kernels(name)(*tensors, table[i].clone(), *extra)
    many = kernels(name + "_many")
    for idx, columns, pad_grads, index in chunks:
        args = list(columns)
        args[1] = [items[i][1].view(-1) for i in idx] + pad_grads
        many(*args, table[index], *extra)  # (indexing makes a new tensor: no storage offset)


def _signature(item: Tuple[torch.Tensor, ...]) -> Tuple[Any, ...]:
    """What a plan depends on: each tensor's identity, address and layout but the gradient's (a new tensor
    every step), whose dtype and layout."""
    return tuple((t.dtype, t.is_contiguous(), t.storage_offset() == 0) if j == 1
                 else (id(t), t.data_ptr(), t.is_contiguous()) for j, t in enumerate(item))


def _plan(kernels: Kernels, items: Sequence[Tuple[torch.Tensor, ...]], device: torch.device
          ) -> Tuple[List[int], List[Tuple[List[int], List[Any], List[torch.Tensor], torch.Tensor]]]:
    """The masters stepped alone, and per chunk: its masters, the kernel's arguments (1-D views; the
    gradients' column left for each step), the pads' gradients, the rows of the table it takes."""
    singles: List[int] = []
    groups: Dict[Tuple[torch.dtype, ...], List[int]] = {}
    for i, tensors in enumerate(items):
        if _contiguous(tensors) and _own_storage(tensors):
            groups.setdefault(tuple(t.dtype for t in tensors), []).append(i)
        else:
            singles.append(i)
    chunks = []
    for members in groups.values():
        for start in range(0, len(members), CHUNK):
            idx = members[start:start + CHUNK]
            pads = kernels.pad(items[idx[0]], CHUNK - len(idx))
            views = [tuple(t.detach().view(-1) for t in items[i]) for i in idx] + pads
            columns: List[Any] = [list(column) for column in zip(*views)]
            pad_grads = columns[1][len(idx):]
            columns[1] = None
            index = torch.tensor(idx + [idx[0]] * len(pads), device=device)
            chunks.append((idx, columns, pad_grads, index))
    return singles, chunks


def _fits(master: torch.Tensor, low: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether the kernel can step this pair: a strided real gradient of the master's shape and device."""
    return (grad.layout == torch.strided and not master.is_complex() and grad.device == master.device
            and grad.shape == master.shape == low.shape)


def adam_rows(group: Dict[str, Any], steps: Sequence[torch.Tensor], scale: torch.Tensor,
               decoupled: bool) -> torch.Tensor:
    """The kernel's scalars (see :func:`_adam`) for each of ``steps``, as rows of a float32 tensor on
    ``scale``'s device, computed there in float64: the host reads neither the step counts nor the
    scale (on a GPU it does not wait), and the host- and device-decided steps get the same numbers."""
    device = scale.device
    lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    sign = -1.0 if group.get("maximize", False) else 1.0
    same = all(t.device == steps[0].device for t in steps)
    step = (torch.stack(list(steps)) if same else torch.stack([t.to(device) for t in steps])).to(device, torch.float64)
    rows = torch.tensor([[0.0, 0.0 if decoupled else wd, 1 - lr * wd if decoupled else 1.0, 1 - beta1, beta2,
                          1 - beta2, 0.0, 0.0, eps]], dtype=torch.float64, device=device).repeat(len(steps), 1)
    rows[:, 0] = scale.to(torch.float64) * sign
    rows[:, 6] = lr / (1 - torch.pow(beta1, step))
    rows[:, 7] = (1 - torch.pow(beta2, step)).rsqrt()
    return rows.float()


def _step_adam(optimizer: Any, group: Dict[str, Any], pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]],
               scale: torch.Tensor, found: Optional[torch.Tensor], kernels: Kernels) -> None:
    decoupled = type(optimizer) is torch.optim.AdamW or bool(group.get("decoupled_weight_decay", False))
    fused_step_dtype = group.get("fused") or group.get("capturable")
    states, steps = [], []
    for _, master in pairs:
        state = optimizer.state[master]
        if not state:  # as torch's Adam._init_group
            state["step"] = (torch.zeros((), dtype=torch.float32, device=master.device) if fused_step_dtype
                             else torch.tensor(0.0, dtype=torch.float32))
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        states.append(state)
        steps.append(state["step"])
    torch._foreach_add_(steps, 1)
    table = adam_rows(group, steps, scale, decoupled)
    items = [(master, low.grad, state["exp_avg"], state["exp_avg_sq"], low)
             for (low, master), state in zip(pairs, states)]
    if found is None:
        _launch(kernels, "adam", items, table)
        return
    _launch(kernels, "adam_skip", items, table, (found,))
    torch._foreach_sub_(steps, [found.to(t.device) for t in steps])  # as torch's fused Adam: a skip is not counted


def _step_sgd(optimizer: Any, group: Dict[str, Any], pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]],
              scale: torch.Tensor, found: Optional[torch.Tensor], kernels: Kernels) -> None:
    scale = float(scale)  # (SGD's step is always decided on the host: see step_fused)
    lr, wd, momentum = float(group["lr"]), float(group["weight_decay"]), float(group["momentum"])
    sign = -1.0 if group.get("maximize", False) else 1.0
    device = pairs[0][1].device
    if momentum == 0:
        table = torch.tensor([[sign * scale, wd, lr]], dtype=torch.float32, device=device).expand(len(pairs), 3)
        _launch(kernels, "sgd", [(master, low.grad, low) for low, master in pairs], table)
        return
    nesterov, dampening = bool(group["nesterov"]), float(group["dampening"])
    later = [sign * scale, wd, momentum, 1 - dampening, momentum, lr]
    first = [sign * scale, wd, 0.0, 1.0, momentum, lr]  # torch's first step: the buffer is the gradient itself
    items, rows = [], []
    for low, master in pairs:
        state = optimizer.state[master]
        buf = state.get("momentum_buffer")
        rows.append(later if buf is not None else first)
        if buf is None:
            buf = state["momentum_buffer"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        items.append((master, low.grad, buf, low))
    _launch(kernels, "sgd_momentum", items, torch.tensor(rows, dtype=torch.float32, device=device), (nesterov,))


def step_fused(optimizer: Any, kernels: Kernels, runs: Sequence[Run],
               scale_on: Optional[Callable[[torch.device], torch.Tensor]], fallback: Callable[[Sequence[Run]], None], min_numel: Optional[int] = None,
               *, segment_numel: int, found: Optional[torch.Tensor] = None) -> None:
    """Step ``runs`` (:func:`~fxamp.training.plan.plan_runs`): the masters of each run with the compiled
    kernel of ``optimizer``'s kind, from their low-precision gradients times ``scale_on(device)``
    (None: 1); the float32 parameters, masters of fewer than ``min_numel`` elements (default
    :data:`FUSED_MIN_NUMEL`) and pairs the kernel cannot step (a sparse or complex gradient) through
    one call of ``fallback`` (:func:`~fxamp.training.executors.step_runs`), the masters of each group
    and device gathered into runs of at most ``segment_numel`` elements (each run is one inner
    ``optimizer.step()``, ~0.2 ms of Python).  Each parameter is stepped once, from its own gradient
    and state, so the order does not matter.

    ``found``: the overflow flag of a step decided on the device (Adam and AdamW only; ``fallback``
    runs the inner optimizer with the same flag): the kernels skip there, writing everything back
    as it was, and the step counts are not advanced, as torch's fused Adam does.  None: the host
    decided that this step runs."""
    kind = _kind(optimizer)
    groups = optimizer.param_groups
    scales: Dict[torch.device, torch.Tensor] = {}
    flags: Dict[torch.device, torch.Tensor] = {}
    slow: List[Run] = []
    # per (group, device): the scalars of a group are computed once a step, not once a run
    rest: Dict[Tuple[int, torch.device], List[Tuple[torch.Tensor, torch.Tensor]]] = {}
    fast: Dict[Tuple[int, torch.device], List[Tuple[torch.Tensor, torch.Tensor]]] = {}
    for run in runs:
        if run.own:
            slow.append(run)
            continue
        for low, master in run.pairs:
            if low.grad is None:
                master.grad = None
            elif _takes(master.numel(), min_numel) and _fits(master, low, low.grad):
                fast.setdefault((run.group, master.device), []).append((low, master))
            else:
                rest.setdefault((run.group, master.device), []).append((low, master))
    for (group, _), pairs in rest.items():
        slow.extend(cut_runs(group, pairs, segment_numel))
    if slow:
        fallback(slow)
    step = _step_adam if kind == "adam" else _step_sgd
    with torch.no_grad():
        for (group, device), pairs in fast.items():
            if device not in scales:
                scales[device] = (torch.ones((), device=device) if scale_on is None
                                  else scale_on(device).to(device=device, dtype=torch.float32).reshape(()))
                if found is not None:
                    flags[device] = found.to(device=device, dtype=torch.float32)
            step(optimizer, groups[group], pairs, scales[device], flags.get(device), kernels)
