"""The lean masters' step: what runs of :mod:`fxamp.training.lean`'s per-tensor modes inside an ``optimizer.step()``.

:class:`LeanStep` is what the engine and its executors call (:class:`fxamp.training.executors.Lean`) around each
inner step, over one :class:`~fxamp.training.lean.Workspace` (the modes, terms, counts and calibration it reads and
advances): :meth:`LeanStep.enter` rebuilds each lean master's float32 value (weight, plus term) and decompresses its
state, the optimizer steps float32 tensors as ever, the engine rounds the masters into the weights, and
:meth:`LeanStep.leave` splits the value back (the term, or the stochastic rounding) and compresses the state: for a
run's masters together, through :class:`~fxamp.training.flat.Flat` (a ``_foreach`` call per role, one coding pass
per moment).  On a CPU a bfloat16 lean master with bfloat16 or 8-bit state under a stock Adam/AdamW skips the float32
value: fxamp's kernel (:mod:`fxamp.training.native`) steps it in one pass, on every path
(:meth:`LeanStep.step_native`), in a segmented step from the bfloat16 gradient where it is (:class:`LeanKernel`); a
lean master larger than :func:`piece_for` its device is stepped a slice at a time (:class:`LeanChunked`,
:meth:`LeanChunked.step_chunked`).  What is kept here from step to step (flat buffers, placeholders, a float32
master's own tensor) is a cache: the checkpoint is the workspace's.

A step past calibration runs no code of ``lean.py`` (``tests/test_layout.py`` traces it): the workspace's
``calibrating`` and step count are plain data this module reads and advances (:meth:`LeanStep.stepped`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor  # (imported by torch itself)

from . import native, quant
from .executors import FusedFor as _FusedFor, Multiplier, fusable, part_of, plain
from .flat import Flat, decode, encode, key as noise_key, round_stochastic_
from .lean import Choice, Workspace, placeholder, stochastic_round
from .plan import Run

__all__ = ["LeanStep", "LeanKernel", "LeanChunked", "PIECE", "ACCELERATOR_PIECE", "piece_for"]

#: elements per slice of a large lean master's chunked step: 1 MiB of float32, its transient memory a few of
#: these; a multiple of quant.CHUNK (measured, one thread, stochastic + int8, the same optimizer stepped with
#: each size in turn: 2^19 within 2% of 2^18 at GPT d768 L2 and L4; 2^16 25% slower; 2^20 slower before)
PIECE = 2 ** 18
#: the slice on an accelerator (64 MiB of float32; a multiple of quant.ACCELERATOR_CHUNK): a slice costs an
#: ``optimizer.step()`` and its kernel launches there, so at :data:`PIECE` a large tensor's step was launch-bound
ACCELERATOR_PIECE = 2 ** 24


def piece_for(device: torch.device) -> int:
    """Elements per slice of a large lean master's chunked step on ``device``."""
    return PIECE if device.type == "cpu" else ACCELERATOR_PIECE


class LeanStep:
    """The step-time work of ``ws``'s lean masters (the module docstring): :class:`fxamp.training.executors.Lean`."""

    def __init__(self, ws: Workspace) -> None:
        self.ws = ws
        self._flats: Dict[tuple, Flat] = {}  # ids of masters moved together -> their flat buffers
        self._used: Dict[int, Flat] = {}  # the flats of the step in progress (freed by leave)
        self._saved: Dict[tuple, torch.Tensor] = {}  # (id(state), key) -> what _decode took from it
        self._holders: Dict[int, torch.Tensor] = {}  # id(master) -> its placeholder between steps
        self._homes: Dict[int, torch.Tensor] = {}  # id(master) -> its own tensor (a float32 master moved by value)
        self._grads: Dict[int, torch.Tensor] = {}  # id(master) -> its own gradient, while a row-major copy is bound
        self._old: Dict[int, torch.Tensor] = {}  # calibration: each master before the step (measured by leave)
        self._open: Optional[tuple] = None  # enter's groups of (master, choice), for leave
        self._multiplier: Optional[tuple] = None  # (a segmented step's 1/scale, its value read on the host)

    def step_native(self, optimizer: Any, masters: Sequence[torch.Tensor], split: bool = True,
                    grads: Optional[Sequence[torch.Tensor]] = None, multiplier: Optional[torch.Tensor] = None,
                    group: Optional[Dict[str, Any]] = None) -> List[torch.Tensor]:
        """Step the lean masters with 8-bit or bfloat16 state that the CPU kernel takes (:func:`native.eligible`;
        not unless ``split``: step hooks must see every parameter), their weights, terms and state final; the list
        of them.  From their float32 ``.grad``: then, until :meth:`leave`, each aliases its low weight, so the
        engine's refresh copies that onto itself.  Or from ``grads`` (one per master: the low-precision gradients
        where they are, times ``multiplier``, 1/scale or None for 1, as a segmented step unscales them): no float32
        gradient is made, and the caller leaves the masters it returns out of the rest of the step.  ``group``:
        every master's param group (a run's), else each is looked up."""
        if not split or self.ws.calibrating:
            return []
        group_of = {} if group is not None else {id(p): g for g in optimizer.param_groups for p in g["params"]}
        todo = []
        for i, m in enumerate(masters):
            choice, g = self.ws.choices.get(id(m)), group if group is not None else group_of.get(id(m))
            grad = m.grad if grads is None else grads[i]
            if choice is None or g is None or grad is None:
                continue
            low, state = self.ws.low_of[id(m)], optimizer.state.get(m, {})
            if self._by_kernel(optimizer, g, choice, low, state):
                todo.append((m, choice, g, grad, low, state))
        if not todo:
            return []
        mul = 1.0 if multiplier is None else self._on_host(multiplier)
        counts = [st["step"] for *_, st in todo]
        steps = torch.stack(counts).tolist()  # (every step count in one read, not one read per master)
        hyper: Dict[int, Dict[str, Any]] = {}  # (a tensor lr: read once per group)
        with torch.no_grad():
            for (m, choice, g, grad, low, state), step in zip(todo, steps):
                if id(g) not in hyper:
                    hyper[id(g)] = native.hyperparameters(optimizer, g)
                native.adam_step(state, low, choice.term, grad.contiguous(), self._key_for(m, choice), choice.state,
                                 hyper[id(g)], step=step + 1, grad_mul=mul)
                if grads is None:
                    m.data = low
            torch._foreach_add_(counts, 1)
        return [m for m, *_ in todo]

    def _on_host(self, multiplier: torch.Tensor) -> float:
        """``float(multiplier)``, read once for the runs of a segmented step that share the tensor (1/scale)."""
        if self._multiplier is None or self._multiplier[0] is not multiplier:
            self._multiplier = (multiplier, float(multiplier))
        return self._multiplier[1]

    @staticmethod
    def _by_kernel(optimizer: Any, group: Dict[str, Any], choice: Choice, low: torch.Tensor,
                   state: Dict[str, Any]) -> bool:
        """Whether fxamp's CPU kernel steps this lean master (a lean master with lean state it can take)."""
        return choice.master != "fp32" and choice.state != "fp32" and \
            native.eligible(optimizer, group, low, state, choice.state) and plain(low)  # (plain last: t.data, a detach)

    def _key_for(self, m: torch.Tensor, choice: Choice) -> Optional[int]:
        """The stochastic rounding's key for this step of ``m`` (None for kahan); its count advanced."""
        if choice.master != "stochastic":
            return None
        choice.count += 1
        return noise_key(self.ws.seed, self.ws.index[id(m)], choice.count - 1)

    def enter(self, masters: Sequence[torch.Tensor], skip: Sequence[torch.Tensor] = ()) -> None:
        """Before ``optimizer.step()`` on ``masters``: float32 values and state for the lean ones (not ``skip``'s).

        The plain masters of one device are moved together, a ``_foreach`` call per role over their
        :class:`~fxamp.training.flat.Flat` (their values: weight, plus term; each moment decoded in one pass), every
        one row-major, whatever its strides: a float32 master whose gradient is not row-major (channels_last, a
        transpose: its own layout) is stepped as a row-major copy of its values, from a row-major copy of its
        gradient (torch's fused Adam reads value, gradient and moments in memory order), both bound for the step
        and put back by :meth:`leave`; any other (a tensor subclass, a sparse gradient) on its own."""
        skip_ids = {id(m) for m in skip}
        entries = [(m, c) for m, c in ((m, self.ws.choices.get(id(m))) for m in masters)
                   if c is not None and id(m) not in skip_ids]
        groups: Dict[torch.device, List[Any]] = {}
        rest = []
        for m, c in entries:
            g = m.grad
            if (isinstance(m, FakeTensor) or plain(m)) and (g is None or g.layout == torch.strided):
                groups.setdefault(m.device, []).append((m, c))
            else:
                rest.append((m, c))
        opened = []  # per group: (its masters, those moved by value, how many of these are lean)
        state = self.ws.optimizer.state
        with torch.no_grad():
            for group in groups.values():
                lean = [(m, c) for m, c in group if c.master != "fp32"]
                strided = [(m, c) for m, c in group if c.master == "fp32" and _strided_grad(m)]
                moved = lean + strided
                opened.append((group, moved, len(lean)))
                if moved:
                    flat = self._flat([m for m, _ in moved])
                    views = flat.take("value")[1]
                    if lean:
                        torch._foreach_copy_(views[:len(lean)], [self.ws.low_of[id(m)] for m, _ in lean])
                    kahan = [i for i, (_, c) in enumerate(lean) if c.master == "kahan"]
                    if kahan:  # (float32 arithmetic: the term's values are exact in it)
                        torch._foreach_add_([views[i] for i in kahan],
                                            _widened(flat, [lean[i][1].term for i in kahan], kahan))
                    if strided:
                        torch._foreach_copy_(views[len(lean):], [self._home(m) for m, _ in strided])
                    regrad = [i for i, (m, _) in enumerate(moved) if _strided_grad(m)]
                    if regrad:  # (row-major copies of the gradients, by value; the masters' own bound back by leave)
                        grads = flat.take("grad")[1]
                        torch._foreach_copy_([grads[i] for i in regrad], [moved[i][0].grad for i in regrad])
                        for i in regrad:
                            self._grads[id(moved[i][0])] = moved[i][0].grad
                            moved[i][0].grad = grads[i]
                    for (m, _), v in zip(moved, views):
                        m.data = v
                for mode in ("bf16", "int8"):
                    coded = [(m, state[m]) for m, c in group if c.state == mode and state.get(m)]
                    if coded:
                        decode(self._flat([m for m, _ in coded]), mode, [st for _, st in coded], self._saved)
            self._open = (opened, rest)
            for m, c in rest:
                if c.master != "fp32":
                    m.data = self.ws.value(m, m.grad)
                if c.state != "fp32" and state.get(m):
                    quant.decompress(state[m])
            for m, _ in entries:
                if m in state:
                    quant.conform(state[m], m)  # (decoded row-major; the value may not be)
                if self.ws.calibrating:
                    self._old[id(m)] = m.detach().clone()

    def leave(self, masters: Sequence[torch.Tensor], skip: Sequence[torch.Tensor] = ()) -> None:
        """After the step and the refresh (the weights hold the round-to-nearest of the new values):
        the term, or the stochastic rounding; compressed state; placeholders again (``skip``: stepped by
        :meth:`step_native`, only their placeholders)."""
        for m in skip:
            if id(m) in self.ws.choices:
                m.data = self._holder(m)
        groups, rest = self._open if self._open is not None else ([], [])
        self._open = None
        state = self.ws.optimizer.state
        with torch.no_grad():
            if self.ws.calibrating:
                for m, c in [e for group, *_ in groups for e in group] + rest:
                    old = self._old.pop(id(m), None)
                    if old is not None:
                        self.ws.measure(m, old, c)
            for group, moved, nlean in groups:
                if moved:
                    self._split(moved, nlean)
                for mode in ("bf16", "int8"):
                    coded = [(m, state[m]) for m, c in group if c.state == mode and state.get(m)]
                    if coded:
                        encode(self._flat([m for m, _ in coded]), mode, [st for _, st in coded], self._saved)
            for m, c in rest:
                low = self.ws.low_of[id(m)]
                if c.master == "kahan":
                    c.term.copy_(m.detach() - low.float())
                elif c.master == "stochastic":
                    stochastic_round(m.detach(), low, noise_key(self.ws.seed, self.ws.index[id(m)], c.count))
                    c.count += 1
                if c.master != "fp32":
                    m.data = self._holder(m)
                if c.state != "fp32" and state.get(m):
                    quant.compress(state[m], c.state)
        for flat in self._used.values():
            flat.free()
        self._used.clear()
        self._saved.clear()

    def _flat(self, masters: List[torch.Tensor]) -> Flat:
        """The :class:`~fxamp.training.flat.Flat` of ``masters`` (made at the first step that moves them together)."""
        k = tuple(id(m) for m in masters)
        flat = self._flats.get(k)
        if flat is None:
            flat = self._flats[k] = Flat(masters)
        self._used[id(flat)] = flat
        return flat

    def _holder(self, master: torch.Tensor) -> torch.Tensor:
        """``master``'s placeholder between steps (made once: binding it dispatches nothing)."""
        held = self._holders.get(id(master))
        if held is None or held.shape != master.shape:
            held = self._holders[id(master)] = placeholder(master)
        return held

    def _split(self, moved: List[Any], nlean: int) -> None:
        """Write back the stepped values of ``moved`` (masters and choices, bound to a flat's views; the first
        ``nlean`` lean, the others float32 masters stepped by value): the float32 masters' values into their own
        tensors, Kahan's terms, the stochastic roundings into the weights (one hash over the buffer); each master
        bound back to its own tensor or placeholder, and its own gradient."""
        flat = self._flat([m for m, _ in moved])
        buffer, views = flat.take("value")
        lean = moved[:nlean]
        homes = [self._homes[id(m)] for m, _ in moved[nlean:]]
        if homes:  # (first: the stochastic rounding below rounds the whole buffer)
            torch._foreach_copy_(homes, views[nlean:])
        lows = [self.ws.low_of[id(m)] for m, _ in lean]
        kahan = [i for i, (_, c) in enumerate(lean) if c.master == "kahan"]
        if kahan:  # term = value - weight (the weight: the value's round-to-nearest, from the refresh)
            torch._foreach_sub_([views[i] for i in kahan], _widened(flat, [lows[i] for i in kahan], kahan))
            torch._foreach_copy_([lean[i][1].term for i in kahan], [views[i] for i in kahan])
        rounded = [i for i, (_, c) in enumerate(lean) if c.master == "stochastic"]
        if rounded:
            keys = [0] * len(moved)
            for i in rounded:
                m, c = lean[i]
                keys[i] = noise_key(self.ws.seed, self.ws.index[id(m)], c.count)
                c.count += 1
            round_stochastic_(buffer, flat.segments(keys))
            torch._foreach_copy_([lows[i] for i in rounded], [views[i] for i in rounded])
        for m, _ in lean:
            m.data = self._holder(m)
        for (m, _), home in zip(moved[nlean:], homes):
            m.data = home
        for m, _ in moved:
            grad = self._grads.pop(id(m), None)
            if grad is not None:
                m.grad = grad

    def _home(self, master: torch.Tensor) -> torch.Tensor:
        """``master``'s own tensor (a float32 master stepped by value binds a flat's view meanwhile), kept from step
        to step while it is the master's (taking it afresh is an op per master)."""
        home = self._homes.get(id(master))
        if home is None or home.untyped_storage()._cdata != master.untyped_storage()._cdata \
                or home.storage_offset() != master.storage_offset() or home.shape != master.shape \
                or home.stride() != master.stride() or home.dtype != master.dtype:
            home = self._homes[id(master)] = master.detach()
        return home

    def chunks(self, run: Run, optimizer: Any) -> bool:
        """Whether a segmented step steps ``run`` a slice at a time (:meth:`LeanChunked.step_chunked`): one lean
        master larger than :func:`piece_for` its device, of a stock elementwise optimizer (Adam, AdamW, SGD), not
        calibrating."""
        if len(run.pairs) != 1 or self.ws.calibrating or not quant.compressible(optimizer):
            return False
        low, master = run.pairs[0]
        choice = self.ws.choices.get(id(master))  # (the workspace's lean(), read here: no call into lean.py)
        return choice is not None and choice.master != "fp32" and low.numel() > piece_for(low.device)

    def executors(self) -> tuple:
        """The executors a segmented step offers each run to first (:class:`LeanKernel`, :class:`LeanChunked`)."""
        return LeanKernel(self), LeanChunked(self)

    def stepped(self) -> None:
        """One step done (not skipped): the workspace's count advanced; after its last calibration step, every
        ``"auto"`` decided (:meth:`~fxamp.training.lean.Workspace.calibrated`)."""
        ws = self.ws
        ws.steps += 1
        if ws.calibrating and ws.steps >= ws.config.calibration_steps:
            ws.calibrated()

# -- the lean executors (:class:`fxamp.training.executors.Executor`): what a segmented step offers a run to first

class _LeanExecutor:
    """An executor over one :class:`LeanStep`."""

    __slots__ = ("lean",)

    def __init__(self, lean: LeanStep) -> None:
        self.lean = lean


class LeanKernel(_LeanExecutor):
    """Lean masters the CPU kernel takes (:meth:`LeanStep.step_native`), stepped from their
    low-precision gradients where they are, times the multiplier: no float32 gradient.  The rest are left."""

    __slots__ = ()

    def step(self, optimizer: Any, runs: Sequence[Run], multiplier: Multiplier) -> List[Run]:
        left = []
        for run in runs:
            masters = [m for _, m in run.pairs]
            device = masters[0].device
            done = {id(m) for m in self.lean.step_native(optimizer, masters, grads=[low.grad for low, _ in run.pairs],
                                                         multiplier=None if multiplier is None else multiplier(device),
                                                         group=optimizer.param_groups[run.group])}
            if not done:
                left.append(run)
            elif len(done) < len(masters):
                left.append(part_of(run, [i for i, m in enumerate(masters) if id(m) not in done]))
        return left


class LeanChunked(_LeanExecutor):
    """A run of one large lean master (:meth:`LeanStep.chunks`) stepped a slice at a time (:meth:`step_chunked`);
    other runs are left.  Every group but the run's holds no parameter during the call
    (:class:`~fxamp.training.executors.Segmented` empties them)."""

    __slots__ = ()

    def step(self, optimizer: Any, runs: Sequence[Run], multiplier: Multiplier) -> List[Run]:
        left = []
        for run in runs:
            if self.lean.chunks(run, optimizer):
                self.step_chunked(optimizer, run, multiplier)
            else:
                left.append(run)
        return left

    def step_chunked(self, optimizer: Any, run: Run, inv_scale_on: Multiplier) -> None:
        """Step one large lean master :func:`piece_for` elements at a time: each slice's float32 value, gradient
        and state are built, stepped as a parameter of its own, and written back (weight, term, compressed
        state), so the step's transient memory is a slice's, not the tensor's.  Bitwise the whole step: the
        optimizer is elementwise, the slices are whole 8-bit blocks, the rounding's noise follows the row-major
        index."""
        ws = self.lean.ws
        low, master = run.pairs[0]
        choice, group = ws.choices[id(master)], optimizer.param_groups[run.group]
        state, n = optimizer.state.get(master, {}), low.numel()
        # slices of every tensor's row-major order (the 8-bit blocks' and the rounding's noise): a weight of other
        # strides (channels_last, a transpose) is stepped in a row-major copy, copied back after
        flat, grad, copied = low.detach().reshape(-1), low.grad.reshape(-1), not low.is_contiguous()
        quant.conform(state, low, row_major=True)
        term = None if choice.term is None else choice.term.view(-1)
        inv = None if inv_scale_on is None else inv_scale_on(low.device)
        fused = _FusedFor([group] if fusable(optimizer, group, low) else [])
        rounding = None  # the stochastic rounding's key: slice after slice, the elements' row-major places
        if choice.master == "stochastic":
            rounding = noise_key(ws.seed, ws.index[id(master)], choice.count)
            choice.count += 1
        # the stepped state is written over the old, a slice after that slice was read (no second copy of
        # the state: its tensors of the mode's dtype are reused; "step" and the like are the last slice's)
        new: Dict[str, Any] = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0
                               and (choice.state == "int8" or not k.endswith(".absmax"))}
        # one float32 buffer each for the value, the gradient and each decompressed moment, reused slice after slice
        # (a slice's store_slice() is done before the next slice is read)
        size = piece_for(low.device)
        value_buf, grad_buf = (torch.empty(min(n, size), dtype=torch.float32, device=low.device) for _ in range(2))
        buffers: Dict[str, torch.Tensor] = {}
        try:
            for start in range(0, n, size):
                sl = slice(start, start + size)
                m = min(n, start + size) - start
                with torch.no_grad():
                    value = value_buf[:m].copy_(flat[sl])
                    if term is not None:
                        value.add_(term[sl])  # (float32 arithmetic: the term's bfloat16 values are exact in it)
                    g = grad_buf[:m].copy_(grad[sl])
                    if inv is not None:
                        g.mul_(inv)
                piece = torch.nn.Parameter(value)
                piece.grad = g
                optimizer.state[piece] = quant.slice_state(state, sl, n, buffers) if state else {}
                group["params"] = [piece]
                with fused:
                    optimizer.step()
                with torch.no_grad():
                    if rounding is not None:
                        round_stochastic_(piece.detach(), [(m, rounding, start)])
                        flat[sl].copy_(piece)
                    else:
                        flat[sl].copy_(piece)
                        term[sl].copy_(piece.sub_(flat[sl]))  # (the stepped value is not needed after)
                    quant.store_slice(new, optimizer.state.pop(piece), sl, n, master.shape, choice.state)
        finally:
            group["params"] = [master]
        optimizer.state[master] = new
        if copied:
            low.detach().copy_(flat.view(low.shape))



def _strided_grad(m: torch.Tensor) -> bool:
    """Whether ``m``'s gradient is there and not row-major (a float32 master's own layout: channels_last, a transpose)."""
    return m.grad is not None and not m.grad.is_contiguous()


def _widened(flat: Flat, tensors: List[torch.Tensor], idx: List[int]) -> List[torch.Tensor]:
    """``tensors`` (bfloat16/float16, of ``flat``'s masters ``idx``) as an operand of a float32 ``_foreach`` op: as
    they are on a CPU (the op widens them as it reads); elsewhere copied into float32 first (a ``_foreach`` op over
    lists of two dtypes leaves the multi-tensor kernel there, for a launch per tensor)."""
    if tensors[0].device.type == "cpu":
        return tensors
    views = flat.take("widened")[1]
    out = [views[i] for i in idx]
    torch._foreach_copy_(out, tensors)
    return out
