"""The lean step's tensors of a whole run at once: flat float32 buffers with a view per master, and the stochastic
rounding's noise, so that a step's ops do not grow with the number of parameter tensors (issue 39).

:class:`Flat` lays out a list of masters in one flat buffer per role (their float32 values, each float32 moment,
each moment's 8-bit codes and block scales), each master's region padded to whole 8-bit blocks
(:data:`~fxamp.training.quant.BLOCK`).  Its views are made once and kept; between steps each buffer's storage is
resized to nothing (:meth:`Flat.free`: the views stay valid, they hold no memory), so a lean master still keeps no
float32 copy between steps.  A step then moves every master's tensors with one ``torch._foreach_*`` call per role,
and codes the moments with one (de)quantization pass over the buffer (:func:`fxamp.training.quant.quantize` over
whole blocks: a master's last, partial block is padded with zeros, whose codes nobody reads; the same codes and
scales as the master's own quantization).

The stochastic rounding (:func:`round_stochastic_`) adds to each float32 value 16 bits of noise hashed from the
master's key for this step (:func:`key`: seed, the master's place among the wrapper's masters, its count of
roundings) and the element's row-major index, as the CPU kernel (``lean_kernel.c``) hashes it: a pure function of
those, so a step is bitwise resumable, the same whichever run, slice or order a master is stepped in, and the
kernel's bits for the same value; one hash over a buffer of many masters, no random stream read in order, no
host read.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor  # (imported by torch itself)

from . import native, quant

__all__ = ["key", "round_stochastic_", "Flat", "decode", "encode"]


def key(seed: int, index: int, count: int) -> int:
    """The stochastic rounding's key for the ``count``-th rounding of the master at ``index`` (63 bits): the CPU
    kernel's (:mod:`fxamp.training.native`), which hashes the same noise from it."""
    return (seed * 0x9E3779B1 + index * 0x85EBCA77 + count * 0xC2B2AE3D) % (2 ** 63 - 1)


def _i32(v: int) -> int:
    """``v`` modulo 2^32 as an int32 value."""
    v &= 0xFFFFFFFF
    return v - 2 ** 32 if v >= 2 ** 31 else v


#: murmur3's finalizer's multipliers, as int32
_C1, _C2 = _i32(0x85EBCA6B), _i32(0xC2B2AE35)


def _xorshift_(x: torch.Tensor, s: int, tmp: torch.Tensor) -> torch.Tensor:
    """``x ^= x >> s`` with a logical shift, on int32 (an arithmetic shift, its sign bits masked off); ``tmp``: a
    buffer of ``x``'s size (a new tensor per shift cost more than the shift on a CPU)."""
    return x.bitwise_xor_(torch.bitwise_right_shift(x, s, out=tmp).bitwise_and_((1 << (32 - s)) - 1))


def _mix32_(x: torch.Tensor, tmp: torch.Tensor, last: bool = True) -> torch.Tensor:
    """murmur3's 32-bit finalizer in place on int32 (products wrap as uint32's): lean_kernel.c's ``mix32``; without
    its ``last`` xorshift, which leaves the top 16 bits as they are (all the rounding reads)."""
    x = _xorshift_(_xorshift_(x, 16, tmp).mul_(_C1), 13, tmp).mul_(_C2)
    return _xorshift_(x, 16, tmp) if last else x


def _small(values: List[int], dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """A small tensor of host ``values`` on ``like``'s device; to an accelerator from pinned memory, without waiting
    (a copy from pageable memory would make the host wait for the device)."""
    if like.device.type == "cpu" or isinstance(like, FakeTensor):
        return torch.tensor(values, dtype=dtype, device=like.device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(like.device, non_blocking=True)


def round_stochastic_(x: torch.Tensor, segments: Sequence[Tuple[int, int, int]]) -> None:
    """Round the float32 values of ``x`` (1-D, contiguous) to bfloat16 values in place, stochastically: up with
    probability the dropped bits' fraction.

    ``segments``: ``(count, key, first)`` for consecutive stretches of ``x`` (covering it, in order): the stretch's
    elements are elements ``first, first + 1, ...`` (row-major) of the master of :func:`key` ``key``.  Element j's
    16 bits of noise are the CPU kernel's (``lean_kernel.c``): ``mix32(mix32(j ^ k0) ^ k1) >> 16`` (murmur3's
    finalizer; k0, k1 the key's low and high 32 bits), added to the float32 bits, the low 16 bits dropped; so the
    kernel and this rounding give the same bits for the same value.  On a CPU the kernel's own pass does it
    (:func:`fxamp.training.native.round_stochastic_`: no op dispatched); elsewhere int32 arithmetic, a slice of
    :func:`~fxamp.training.quant.chunk_for` elements at a time, a few dozen ops per slice whatever the number of
    masters in it.  An infinity stays infinite (the noise does not reach its exponent), a NaN is written as NaN
    (noise added to a payload in its low bits could carry into the exponent)."""
    n = x.numel()
    if x.device.type == "cpu" and type(x) is torch.Tensor and native.round_stochastic_(x, segments):
        return  # (the CPU kernel: one pass, the same bits)
    chunk = quant.chunk_for(x.device)
    bits_all = x.view(torch.int32)
    where = [0]
    for count, _, first in segments:
        where.append(where[-1] + count)
        assert first + count <= 2 ** 32, "a master of 2^32 elements or more"  # (the kernel's j is 32 bits too)
    assert where[-1] == n, (where[-1], n)
    s = 0
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        words = []  # per stretch in the slice: (j - its place in the slice, k0, k1), and its length
        counts = []
        while s < len(segments) and where[s] < start + m:  # the stretches overlapping [start, start + m)
            count, k, first = segments[s]
            lo, hi = max(where[s], start), min(where[s + 1], start + m)
            if hi > lo:  # element j = first + (lo - where[s]) + i sits at place lo - start + i of the slice
                words.append((_i32(first + lo - where[s] - (lo - start)), _i32(k), _i32(k >> 32)))
                counts.append(hi - lo)
            if where[s + 1] > start + m:
                break
            s += 1
        if start == 0:  # the slice's hash and a buffer for its shifts (made once, reused by the next slices)
            z = torch.empty(m, dtype=torch.int32, device=x.device)
            tmp = torch.empty(m, dtype=torch.int32, device=x.device)
        if len(words) == 1:
            offset, k0, k1 = words[0]
        else:
            # each stretch's three words, element by element: their steps at the stretches' starts, summed along
            # (int32 sums wrap: each word is its stretch's exactly; a gather of them ran 10x slower on a CPU)
            starts, steps, before, place = [], [], (0, 0, 0), 0
            for word, count in zip(words, counts):
                starts.append(place)
                steps.append([_i32(a - b) for a, b in zip(word, before)])
                before, place = word, place + count
            delta = torch.zeros(3, m, dtype=torch.int32, device=x.device)
            delta.view(-1).index_put_((_small([r * m + at for r in range(3) for at in starts], torch.int64, x),),
                                      _small([step[r] for r in range(3) for step in steps], torch.int32, x))
            # a 1-D scan per word: a GPU scans a whole 1-D tensor with one device-wide scan, but a (3, m) one along
            # dim 1 a row per thread block (3 blocks: 22 ms a slice of 16 M on an H200, 70% of a lean step)
            offset, k0, k1 = (row.cumsum_(0) for row in delta.unbind(0))
        u, w = (z, tmp) if m == z.numel() else (z.narrow(0, 0, m), tmp.narrow(0, 0, m))
        _mix32_(torch.arange(0, m, out=u).add_(offset).bitwise_xor_(k0), w).bitwise_xor_(k1)
        noise = _mix32_(u, w, last=False).bitwise_right_shift_(16).bitwise_and_(0xFFFF)
        # (narrow, not x[a:b]: Python indexing of an accelerator's tensor wants its runtime, a fake one's too)
        part, bits = (x, bits_all) if m == n else (x.narrow(0, start, m), bits_all.narrow(0, start, m))
        nan = torch.isnan(part)
        bits.add_(noise).bitwise_and_(-65536)  # (int32 arithmetic wraps as the kernel's uint32)
        part.masked_fill_(nan, float("nan"))


def _layout(masters: Sequence[torch.Tensor]) -> Tuple[List[int], int]:
    """Each master's offset in a flat buffer (regions padded to whole 8-bit blocks), and the buffer's size."""
    offsets, total = [], 0
    for m in masters:
        offsets.append(total)
        total += -(-m.numel() // quant.BLOCK) * quant.BLOCK
    return offsets, total


class Flat:
    """Flat buffers for a fixed list of ``masters`` (one device), a view per master in each, kept from step to step.

    A buffer is named by its role (``"value"``, a moment's key, ``key + ".codes"``, ``key + ".absmax"``) and made at
    its first use; :meth:`take` gives it memory and its views, :meth:`free` takes the memory back (the views stay,
    holding none).  Every view is row-major (the 8-bit blocks' order, the stochastic rounding's; torch's fused
    kernels read a parameter and its gradient in memory order: the masters moved here have row-major gradients)."""

    def __init__(self, masters: Sequence[torch.Tensor]) -> None:
        self.shapes = [m.shape for m in masters]
        self.numels = [m.numel() for m in masters]
        self.device = masters[0].device
        self.offsets, self.total = _layout(masters)
        self.buffers: Dict[str, Tuple[torch.Tensor, List[torch.Tensor]]] = {}
        self.views: Dict[Tuple[str, str], torch.Tensor] = {}  # (role, name) -> a kept view of the whole buffer
        #: the stretches of each master's last block past its elements (zeroed before a quantization)
        self.pads: Optional[List[Tuple[int, int]]] = None  # (offset, length)

    def take(self, role: str, dtype: torch.dtype = torch.float32, per_block: int = 0
             ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """The buffer of ``role`` with memory, and its views (per master; for ``".absmax"`` one scale per block);
        ``per_block``: a buffer of that many values per block, without views (its size fixed by the role)."""
        entry = self.buffers.get(role)
        scales = role.endswith(".absmax")
        size = self.total // quant.BLOCK * (per_block or 1) if scales or per_block else self.total
        if entry is None:
            flat = torch.empty(size, dtype=dtype, device=self.device)
            if per_block:
                views = []
            elif scales:
                views = [flat.narrow(0, o // quant.BLOCK, -(-n // quant.BLOCK))
                         for o, n in zip(self.offsets, self.numels)]
            else:
                views = [flat.narrow(0, o, n).view(shape)
                         for o, n, shape in zip(self.offsets, self.numels, self.shapes)]
            entry = self.buffers[role] = (flat, views)
        else:
            storage = entry[0].untyped_storage()
            nbytes = size * entry[0].element_size()
            if storage.nbytes() < nbytes:  # (freed after the last step: the views see the new memory)
                storage.resize_(nbytes)
        return entry

    def kept(self, role: str, dtype: torch.dtype, name: str, make: Any) -> torch.Tensor:
        """A view of the buffer of ``role`` (with memory), made by ``make`` at the first call and kept (``name``:
        which view): the whole buffer as blocks, say, without a view op per step."""
        flat = self.take(role, dtype)[0]
        view = self.views.get((role, name))
        if view is None:
            view = self.views[(role, name)] = make(flat)
        return view

    def free(self) -> None:
        """Take every buffer's memory back (the views stay: they hold none until the next :meth:`take`)."""
        for flat, _ in self.buffers.values():
            flat.untyped_storage().resize_(0)  # (a ".pads" entry: its buffer's, again: nothing left to free)

    def zero_pads(self, role: str) -> None:
        """Zero the padding of every master's last block in the float32 buffer of ``role`` (views kept)."""
        if self.pads is None:
            self.pads = [(o + n, -(-n // quant.BLOCK) * quant.BLOCK - n) for o, n in zip(self.offsets, self.numels)
                         if n % quant.BLOCK]
        if self.pads:
            flat = self.take(role)[0]
            views = self.buffers.get(role + ".pads")
            if views is None:
                views = self.buffers[role + ".pads"] = (flat, [flat.narrow(0, o, k) for o, k in self.pads])
            torch._foreach_zero_(views[1])

    def segments(self, keys: Sequence[int]) -> List[Tuple[int, int, int]]:
        """:func:`round_stochastic_`'s stretches of the ``"value"`` buffer, each master's noise from ``keys``."""
        out, end = [], 0
        for o, n, k in zip(self.offsets, self.numels, keys):
            if o > end:
                out.append((o - end, 0, 0))  # (padding: rounded, never read)
            out.append((n, k, 0))
            end = o + n
        if self.total > end:
            out.append((self.total - end, 0, 0))
        return out


def decode(flat: Flat, mode: str, states: List[Dict[str, Any]], saved: Dict[tuple, torch.Tensor]) -> None:
    """Decompress ``states`` (the optimizer's per master of ``flat``, in ``mode``: ``"bf16"`` or ``"int8"``) into
    ``flat``'s float32 moment buffers, a ``_foreach`` copy and one decoding pass per moment (on a CPU one kernel call
    reading each state's own codes: no op dispatched); each state's moments become views of them.  What a state held is put in ``saved`` (``(id(state), key)``), for :func:`encode` to
    write over."""
    for key in quant.SIGNED + quant.UNSIGNED:
        idx = [i for i, st in enumerate(states) if torch.is_tensor(st.get(key))]
        if not idx:
            continue
        moment, views = flat.take(key)
        coded = [i for i in idx if key + ".absmax" in states[i]] if mode == "int8" else []
        if coded:
            signed = key in quant.SIGNED
            codes_in = [states[i][key] for i in coded]
            scales = [states[i].pop(key + ".absmax") for i in coded]
            for i, scale in zip(coded, scales):
                saved[(id(states[i]), key + ".absmax")] = scale
            if _by_kernel(moment, codes_in, torch.int8 if signed else torch.uint8, scales,
                          [flat.numels[i] for i in coded]):
                tables = quant.code_constants()[0]  # (signed, unsigned)
                native.decode(codes_in, scales, tables[0 if signed else 1], moment, [flat.offsets[i] for i in coded])
            else:
                dtype = torch.int8 if signed else torch.uint8
                codes, code_views = flat.take(key + ".codes", dtype)
                absmax, absmax_views = flat.take(key + ".absmax")
                # (codes cast to float by a loader that knew nothing of them are integers still: copied exactly)
                torch._foreach_copy_([code_views[i] for i in coded], codes_in)
                torch._foreach_copy_([absmax_views[i] for i in coded], scales)
                if flat.total <= quant.chunk_for(flat.device):  # (one slice: the same ops on kept views)
                    quant.dequantize_blocks(flat.kept(key + ".codes", dtype, "bytes", lambda t: t.view(torch.uint8)),
                                            signed, moment, flat.kept(key, torch.float32, "blocks", _blocks),
                                            flat.kept(key + ".absmax", torch.float32, "column", _column))
                else:
                    quant.dequantize(codes, absmax, signed, out=moment)
        taken = set(coded)
        rest = [i for i in idx if i not in taken]  # bfloat16 moments (or float32 ones)
        if rest:
            torch._foreach_copy_([views[i] for i in rest], [states[i][key] for i in rest])
        for i in idx:
            saved[(id(states[i]), key)] = states[i][key]
            states[i][key] = views[i]


def encode(flat: Flat, mode: str, states: List[Dict[str, Any]], saved: Dict[tuple, torch.Tensor]) -> None:
    """Compress the float32 moments of ``states`` (per master of ``flat``) into ``mode``, in ``flat``'s buffers: one
    quantization pass per moment, a ``_foreach`` copy out; into the tensors :func:`decode` took (``saved``) where
    they fit, as :func:`fxamp.training.quant.compress` would make them (the same codes and scales).  On a CPU fxamp's
    kernel reads and writes each state's own codes (no copy), around one ``_foreach_log2_`` for every moment."""
    by_kernel = []
    for key in quant.SIGNED + quant.UNSIGNED:
        idx = [i for i, st in enumerate(states) if torch.is_tensor(st.get(key)) and st[key].dtype == torch.float32]
        if not idx:
            continue
        moment, views = flat.take(key)
        moved = [i for i in idx if states[i][key] is not views[i]]  # (made by the step: its first)
        if moved:
            torch._foreach_copy_([views[i] for i in moved], [states[i][key] for i in moved])
        signed = key in quant.SIGNED
        dtype = torch.bfloat16 if mode == "bf16" else torch.int8 if signed else torch.uint8
        dest = [_reuse(saved, states[i], key, views[i].shape, dtype, views[i].device) for i in idx]
        if mode == "bf16":
            torch._foreach_copy_(dest, [views[i] for i in idx])
        else:
            scales = [_reuse(saved, states[i], key + ".absmax", (-(-flat.numels[i] // quant.BLOCK),), torch.float32,
                             views[i].device) for i in idx]
            if _by_kernel(moment, dest, dtype, scales, [flat.numels[i] for i in idx]):
                by_kernel.append((moment, idx, dest, scales, signed))
            else:
                flat.zero_pads(key)  # (a partial last block: its padding must not raise the block's scale)
                codes, code_views = flat.take(key + ".codes", dtype)
                absmax, absmax_views = flat.take(key + ".absmax")
                if flat.total <= quant.chunk_for(flat.device):  # (one slice: the same ops on kept views)
                    quant.quantize_blocks(flat.kept(key, torch.float32, "blocks", _blocks), signed,
                                          flat.kept(key + ".codes", dtype, "blocks", _blocks), absmax,
                                          flat.kept(key + ".absmax", torch.float32, "column", _column))
                else:
                    quant.quantize(moment, signed, out=codes, absmax_out=absmax)
                torch._foreach_copy_(dest, [code_views[i] for i in idx])
                torch._foreach_copy_(scales, [absmax_views[i] for i in idx])
            for i, scale in zip(idx, scales):
                states[i][key + ".absmax"] = scale
        for i, d in zip(idx, dest):
            states[i][key] = d
    if by_kernel:
        _encode_by_kernel(flat, by_kernel)


def _blocks(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1, quant.BLOCK)


def _column(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1, 1)


def _by_kernel(moment: torch.Tensor, codes: List[torch.Tensor], dtype: torch.dtype, scales: List[torch.Tensor],
               numels: List[int]) -> bool:
    """Whether fxamp's CPU kernel codes ``moment`` (a flat's float32 buffer) to and from ``codes`` of ``dtype`` and
    their ``scales``, where they are (each a plain contiguous CPU tensor of its master's size, ``numels``: a pointer
    each)."""
    return (moment.device.type == "cpu" and type(moment) is torch.Tensor and native.kernel() is not None
            and all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.is_contiguous()
                    for t in (*codes, *scales))
            and all(c.dtype == dtype and c.numel() == n for c, n in zip(codes, numels))
            and all(a.dtype == torch.float32 and a.numel() == -(-n // quant.BLOCK) for a, n in zip(scales, numels)))


def _encode_by_kernel(flat: Flat, moments: List[Tuple[torch.Tensor, List[int], List[torch.Tensor], List[torch.Tensor],
                                                      bool]]) -> None:
    """8-bit codes of ``moments`` (per moment: its float32 buffer, the masters coded, their codes and scales) by the
    CPU kernel's two passes around one ``_foreach_log2_`` (torch's log2: the eager code's bits), the buffers
    overwritten (the step is done with them)."""
    nb = flat.total // quant.BLOCK
    blocks = flat.take(f"log2.blocks.{len(moments)}", per_block=len(moments))[0]
    plan = []
    for j, (moment, idx, codes, scales, signed) in enumerate(moments):
        offsets, block_offsets = [flat.offsets[i] for i in idx], [j * nb + flat.offsets[i] // quant.BLOCK for i in idx]
        native.encode_magnitudes(moment, offsets, scales, codes, signed, blocks, block_offsets)
        plan.append((moment, offsets, scales, codes, signed, block_offsets))
    torch._foreach_log2_([m for m, *_ in moments] + [blocks])
    k_signed, top_signed, k_unsigned, top_unsigned = quant.code_constants()[1]
    for moment, offsets, scales, codes, signed, block_offsets in plan:
        native.encode_codes(moment, offsets, scales, codes, signed, blocks, block_offsets,
                            *((k_signed, top_signed) if signed else (k_unsigned, top_unsigned)))


def _reuse(saved: Dict[tuple, torch.Tensor], state: Dict[str, Any], key: str, shape: torch.Size,
           dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What ``state[key]`` held before :func:`decode` when it has ``shape``, ``dtype`` and row-major strides,
    else a new tensor."""
    old = saved.get((id(state), key))
    if old is not None and old.dtype == dtype and old.shape == shape and old.device == device and old.is_contiguous():
        return old
    return torch.empty(shape, dtype=dtype, device=device)
