"""The check of a step: inf/NaN found per device (:class:`FoundInf`), and the one place the step's
overflow is decided (:func:`agree`): read on the host, or left on the device as a :class:`DeviceFlag`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from .distributed import all_reduce_overflow, all_reduce_overflow_on_device

__all__ = ["FoundInf", "DeviceFlag", "StepResult", "agree", "note_non_finite_"]


class FoundInf:
    """Divides gradients by the scale and notes any inf/NaN: one flag per device, read once at the end.

    ``inv_scale_on(device)`` gives ``1/scale`` there.  When the scale is 1 (``unit``) a single
    float32 CPU tensor is only read (a finite sum means finite elements), not read and rewritten.
    """

    __slots__ = ("inv_scale_on", "unit", "flags")

    def __init__(self, inv_scale_on: Callable[[torch.device], torch.Tensor], unit: bool = False) -> None:
        self.inv_scale_on = inv_scale_on
        self.unit = unit
        self.flags: Dict[torch.device, torch.Tensor] = {}

    def unscale_and_check_(self, tensors: List[torch.Tensor]) -> None:
        """Divide dense ``tensors`` (one device and dtype) by the scale in place, noting any inf/NaN."""
        if not tensors:
            return
        device = tensors[0].device
        flag = self.flag_on(device)
        t = tensors[0]
        if self.unit and len(tensors) == 1 and t.device.type == "cpu" and t.dtype == torch.float32 \
                and torch.isfinite(t.sum()):  # (on an accelerator this would wait for the device)
            return  # nothing to divide, nothing non-finite: an inf or NaN makes the sum inf or NaN
            # (a finite sum that overflows falls through to the exact kernel below)
        if not _fused_kernel_takes(t):
            note_non_finite_(flag, tensors)
            torch._foreach_mul_(tensors, self.inv_scale_on(device))
            return
        # GradScaler's fused kernel: checks each value before multiplying it by 1/scale
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, self.inv_scale_on(device))

    def check_(self, tensors: List[torch.Tensor]) -> None:
        """Note any inf/NaN in dense ``tensors`` (one device and dtype) without dividing them.

        On CPU their sums are read first (an inf or NaN makes a sum inf or NaN, so finite sums mean
        finite elements; half the time of the kernel, which also writes); a non-finite sum, which
        may be an overflow of finite values, falls through to the exact kernel, multiplying by 1.
        """
        if not tensors:
            return
        device = tensors[0].device
        if device.type == "cpu" and bool(torch.isfinite(torch.stack([t.sum() for t in tensors])).all()):
            return  # (on an accelerator this would wait for the device)
        if not _fused_kernel_takes(tensors[0]):
            note_non_finite_(self.flag_on(device), tensors)
            return
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, self.flag_on(device), torch.ones((), device=device))

    def flag_on(self, device: torch.device) -> torch.Tensor:
        """The flag of ``device`` (0.0 until an inf/NaN is found there): float32, 0-dim, on ``device``."""
        flag = self.flags.get(device)
        if flag is None:
            flag = self.flags[device] = torch.zeros((), dtype=torch.float32, device=device)
        return flag

    def found(self) -> torch.Tensor:
        """1.0 if any tensor held an inf/NaN, else 0.0: a float32 0-dim CPU tensor."""
        flags = [flag.to("cpu") for flag in self.flags.values()]
        if not flags:
            return torch.zeros((), dtype=torch.float32)
        return flags[0] if len(flags) == 1 else torch.stack(flags).amax()


class DeviceFlag:
    """An overflow decision left on a CUDA device: a float32 0-dim ``flag`` (1.0: an inf/NaN was found).

    Copied to pinned host memory without waiting; ``bool()`` (True: overflowed) waits for that copy
    alone, which follows the check on the stream, not for work queued after it.  This is how a
    step is decided without stopping the host: the inner optimizer skips on the device (its fused
    kernel reads ``flag``) and the host learns the outcome later, when it needs it.
    """

    __slots__ = ("flag", "_host", "_event", "_value")

    def __init__(self, flag: torch.Tensor) -> None:
        self.flag = flag
        self._event: Optional[Any] = None
        self._value: Optional[bool] = None
        if flag.device.type == "cuda":
            self._host = torch.empty((), dtype=flag.dtype, pin_memory=True)
            self._host.copy_(flag, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(flag.device))
        else:  # (a CPU flag: known at once; the tests run the deferred step this way)
            self._host = flag

    def ready(self) -> bool:
        """Whether the outcome is known without waiting."""
        return self._value is not None or self._event is None or self._event.query()

    def __bool__(self) -> bool:
        if self._value is None:
            if self._event is not None:
                self._event.synchronize()
            self._value = bool(self._host.item() != 0)
        return self._value

    def __repr__(self) -> str:
        return f"DeviceFlag({bool(self) if self.ready() else 'pending'})"


def _fused_kernel_takes(t: torch.Tensor) -> bool:
    """Whether ``torch._amp_foreach_non_finite_check_and_unscale_`` has a kernel for ``t``: on CPU every
    floating dtype; on CUDA (and other accelerators) float16, float32 and float64, not bfloat16."""
    return t.device.type == "cpu" or t.dtype in (torch.float16, torch.float32, torch.float64)


def note_non_finite_(flag: torch.Tensor, tensors: List[torch.Tensor]) -> None:
    """Set ``flag`` (a float32 0-dim tensor on the tensors' device) to 1 if any of ``tensors`` holds an
    inf or NaN, without waiting for the device.

    For dtypes the fused kernel lacks (bfloat16 on CUDA).  Exact: the 1-norms are summed in float64,
    where the sum of even a billion of the largest bfloat16/float16 values (3.4e38 each) is finite, so
    a norm is non-finite exactly when an element is.
    """
    try:
        norms = torch._foreach_norm(tensors, 1, dtype=torch.float64)
    except (TypeError, RuntimeError):  # pragma: no cover - torch without _foreach_norm's dtype
        norms = [t.abs().sum(dtype=torch.float64) for t in tensors]
    bad = torch.logical_not(torch.isfinite(torch.stack(list(norms)))).any().to(flag.dtype)
    torch.maximum(flag, bad, out=flag)


def agree(flags: FoundInf, device: Optional[torch.device], sync: bool, group: Optional[Any] = None
          ) -> Tuple[Union[bool, DeviceFlag], bool]:
    """The one place a step's overflow is decided: ``(verdict, local)``.

    ``device`` None: decided on the host, ``verdict`` a bool (the flags of every device read, and
    with ``sync`` the maximum over ``group``'s ranks), ``local`` whether this rank overflowed.
    Otherwise the flag stays on ``device`` (agreed there with ``sync``; :func:`reduces_on_device`
    must hold): ``verdict`` is a :class:`DeviceFlag` the host reads only when asked, ``local`` False.
    """
    if device is not None:
        flag = flags.flag_on(device)
        return DeviceFlag(all_reduce_overflow_on_device(flag, group) if sync else flag), False
    local = flags.found()
    found = all_reduce_overflow(local, group) if sync else local
    return bool(found.item()), bool(local.item())


class StepResult:
    """What ``step()`` returns when the overflow decision stayed on the GPU: truthy if it stepped.

    ``bool()`` waits for the check (not for the step): ignore it, and the host never waits.
    """

    __slots__ = ("_verdict",)

    def __init__(self, verdict: DeviceFlag) -> None:
        self._verdict = verdict

    def __bool__(self) -> bool:
        return not bool(self._verdict)

    def __eq__(self, other: object) -> bool:
        return bool(self) == other if isinstance(other, bool) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StepResult(stepped={bool(self)})" if self._verdict.ready() else "StepResult(pending)"
