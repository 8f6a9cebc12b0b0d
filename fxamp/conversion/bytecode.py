"""What a module's own code does with its children's tensors and calls, read from its bytecode.

The in-place and lazy paths decide where each tensor is stored before any graph exists (an optimizer is
built on the parameters first), so two questions about the code around a leaf module are answered from
the bytecode of the methods its parent's ``forward`` may run (:func:`codes_of`):

- :func:`reads_values`: does the code read ``<child>.<tensor>`` itself (``x @ self.wte.weight.T``,
  ``nn.MultiheadAttention`` passing ``self.out_proj.weight`` to its kernel)?  Such a tensor runs as written.
- :func:`feeds_only`: does every call of ``self.<child>(...)`` hand its result straight to a call of one
  of some sibling modules, and to nothing else (``self.norm(self.tok_embeddings(ids))``;
  ``e = self.word_embeddings(ids)``, then only ``e.shape`` and ``self.word_embeddings_layernorm(e)``)?

Both answer "no" to anything they cannot follow (a jump inside a call's arguments, a closure, a call with
other arguments): the caller then keeps its default.
"""

from __future__ import annotations

import dis
import functools
import sys
import types
from typing import Collection, List, Optional, Tuple

import torch
import torch.nn as nn

__all__ = ["codes_of", "reads_values", "passes_on", "calls_outside_forward", "feeds_only", "function_calls", "METADATA",
           "stores_after_read", "reads_value_before"]

#: what a read of a tensor's metadata goes on to: no use of its values, whatever its dtype
METADATA = ("shape", "size", "dtype", "device", "ndim", "dim", "numel", "nelement", "is_cuda", "requires_grad")

_LOADS = ("LOAD_ATTR", "LOAD_METHOD")
#: a local's plain load (3.12 adds the checked form, 3.14 the borrowed one)
_LOCAL_LOADS = ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW")
#: a test of a local against None (``if inputs_embeds is None:``): no use of its values
_NONE_TESTS = ("POP_JUMP_FORWARD_IF_NONE", "POP_JUMP_FORWARD_IF_NOT_NONE", "POP_JUMP_BACKWARD_IF_NONE",
               "POP_JUMP_BACKWARD_IF_NOT_NONE", "POP_JUMP_IF_NONE", "POP_JUMP_IF_NOT_NONE")


def codes_of(cls: type, unwrap: bool = False) -> List[types.CodeType]:
    """The code ``cls``'s forward may run: ``forward``, the methods of ``cls`` it names (and those they name),
    and the functions nested in them; nn.Module's and torch.nn containers' own methods left out.

    unwrap: also the functions a method's decorators wrap (``__wrapped__``: Hugging Face decorates forward), and
    properties' getters; without it a decorated method is its wrapper's code (which the pattern readers here
    answer "no" for)."""
    methods = {k: _method_codes(v, unwrap) for c in reversed(cls.__mro__) if c not in (nn.Module, object)
               and c.__module__ != nn.Sequential.__module__ for k, v in vars(c).items()}
    found = list(methods.get("forward", ()))
    out: List[types.CodeType] = []
    while found:
        code = found.pop()
        if code in out:
            continue
        out.append(code)
        found += [c for c in code.co_consts if isinstance(c, types.CodeType)]
        found += [c for n in code.co_names for c in methods.get(n, ())]
    return out


def _method_codes(value: object, unwrap: bool) -> List[types.CodeType]:
    if not unwrap:
        code = getattr(value, "__code__", None)
        return [code] if isinstance(code, types.CodeType) else []
    out = []
    for f in (value, getattr(value, "__func__", None), getattr(value, "fget", None)):
        depth = 0
        while f is not None and depth < 8:  # (a decorator's wrapper, then what it wraps)
            code = getattr(f, "__code__", None)
            if isinstance(code, types.CodeType):
                out.append(code)
            f, depth = getattr(f, "__wrapped__", None), depth + 1
    return out


def _instructions(code: types.CodeType) -> List[dis.Instruction]:
    return [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "EXTENDED_ARG")]


def reads_values(code: types.CodeType, attr: str, name: str, owner: bool = True) -> bool:
    """Whether ``code`` reads the values of ``<something>.<attr>.<name>`` (not only its shape or dtype).

    owner: whether the module whose method ``code`` is holds the child ``attr``; where it does not (a module
    further up), ``self.<attr>.<name>`` is another module's tensor (its own child of that name) and does not count.
    """
    if attr not in code.co_names or name not in code.co_names:  # (most code: no disassembly needed)
        return False
    ins = [i for i in _instructions(code) if i.opname != "PRECALL"]
    me = code.co_varnames[0] if code.co_argcount else None
    return any(a.opname == "LOAD_ATTR" and a.argval == attr and b.opname in _LOADS and b.argval == name
               and not (c.opname in _LOADS and c.argval in METADATA)
               and (owner or not (k >= 1 and ins[k - 1].opname in _LOCAL_LOADS and ins[k - 1].argval == me))
               for k, (a, b, c) in enumerate(zip(ins, ins[1:], ins[2:] + [ins[-1]])))


def passes_on(code: types.CodeType, attr: str, owner: bool = True) -> bool:
    """Whether ``code`` hands the module ``<something>.<attr>`` itself on (an argument, a local, a return value:
    ``decoder(h, embedding_layer=self.embeddings)``, Perceiver's, whose callee multiplies by its ``weight``), rather
    than calling it, reading one of its attributes or testing it against None: whoever gets it may read its
    tensors' values.  ``owner`` as for :func:`reads_values`."""
    if attr not in code.co_names:
        return False
    ins = [i for i in _instructions(code) if i.opname != "PRECALL"]
    me = code.co_varnames[0] if code.co_argcount else None
    for k, a in enumerate(ins):
        if a.opname != "LOAD_ATTR" or a.argval != attr or k + 1 >= len(ins):
            continue
        if not owner and k >= 1 and ins[k - 1].opname in _LOCAL_LOADS and ins[k - 1].argval == me:
            continue  # (self.<attr> of a module further up: its own child of that name)
        b = ins[k + 1]
        if b.opname in _LOADS or b.opname in _NONE_TESTS or (b.opname == "LOAD_CONST" and b.argval is None):
            continue
        return True
    return False


@functools.lru_cache(maxsize=4096)
def stores_after_read(code: types.CodeType) -> Tuple[str, ...]:
    """The names ``code`` stores on its first argument (``self.<name> = ...``) after reading that attribute's value
    earlier in the function (:func:`reads_value_before`): state a call leaves for the next one."""
    if not code.co_argcount or "STORE_ATTR" not in {dis.opname[op] for op in code.co_code[::2]}:
        return ()
    me = code.co_varnames[0]
    ins = _instructions(code)
    return tuple(dict.fromkeys(
        b.argval for a, b in zip(ins, ins[1:]) if b.opname == "STORE_ATTR" and a.opname in _LOCAL_LOADS
        and a.argval == me and reads_value_before(code, b.argval, b.offset)))


def reads_value_before(code: types.CodeType, name: str, offset: int) -> bool:
    """Whether ``code`` reads the value of ``<something>.<name>`` at an instruction before ``offset``: not its
    shape, dtype or device, nor a test against None (``if self.table.size(0) < n:`` before a table grows)."""
    ins = [i for i in _instructions(code) if i.opname != "PRECALL"]
    for k, a in enumerate(ins):
        if a.offset >= offset:
            return False
        if a.opname in _LOADS and a.argval == name and not _no_value_use(ins, k + 1):
            return True
    return False


def _no_value_use(ins: List[dis.Instruction], n: int) -> bool:
    """What ``ins[n]`` does with the value just loaded reads no tensor data: a metadata read or a None test."""
    if n >= len(ins):
        return False
    b = ins[n]
    return (b.opname in _LOADS and b.argval in METADATA) or b.opname in _NONE_TESTS or (
        b.opname == "LOAD_CONST" and b.argval is None and n + 1 < len(ins) and ins[n + 1].opname == "IS_OP")


def calls_outside_forward(cls: type, children: Collection[str]) -> List[Tuple[str, str]]:
    """``(method, child)`` for each method of ``cls`` that forward does not run (:func:`codes_of`) and that calls one
    of its ``children`` itself (``self.feed_forward(h)``: Reformer's ``backward_pass``, which its reversible autograd
    Function's backward calls): that call runs the child as written, outside any converted graph."""
    reached = set(codes_of(cls, unwrap=True))
    out: List[Tuple[str, str]] = []
    for c in cls.__mro__:
        if c in (nn.Module, object) or c.__module__.startswith("torch."):
            continue
        for name, value in vars(c).items():
            code = getattr(value, "__code__", None)
            if (name.startswith("__") or name == "forward" or not isinstance(code, types.CodeType) or code in reached
                    or not code.co_argcount or next(k for k in cls.__mro__ if name in vars(k)) is not c):
                continue  # (a method a subclass overrides is not the instance's)
            ins = _instructions(code)
            me = code.co_varnames[0]
            for k in range(1, len(ins)):
                a, b = ins[k - 1], ins[k]
                if (a.opname in _LOCAL_LOADS and a.argval == me and b.opname in _LOADS and b.argval in children
                        and (b.opname == "LOAD_METHOD" or _call_end(ins, k) is not None)):
                    out.append((name, b.argval))
                    break
    return list(dict.fromkeys(out))


def feeds_only(code: types.CodeType, child: str, into: Collection[str]) -> Optional[bool]:
    """Whether every use of ``self.<child>`` in ``code`` is a call whose result only ever becomes the one argument
    of a call ``self.<n>(...)``, ``n`` in ``into`` (directly, or through a local that is otherwise only tested
    against None or asked for its metadata); None when ``code`` does not name ``child``."""
    if child not in code.co_names:
        return None
    if code.co_argcount == 0:
        return False
    me = code.co_varnames[0]
    ins = _instructions(code)
    sites = [k for k, i in enumerate(ins) if i.opname in _LOADS and i.argval == child]
    return all(_self_load(ins, k, me, (child,)) and _result_feeds(ins, k, me, into) for k in sites)


def _self_load(ins: List[dis.Instruction], k: int, me: str, names: Collection[str]) -> bool:
    """``ins[k]`` loads ``<me>.<one of names>`` straight from the local ``me``."""
    return (k >= 1 and ins[k].opname in _LOADS and ins[k].argval in names
            and ins[k - 1].opname in _LOCAL_LOADS and ins[k - 1].argval == me)


def _result_feeds(ins: List[dis.Instruction], k: int, me: str, into: Collection[str]) -> bool:
    end = _call_end(ins, k)
    if end is None:
        return False
    if _sole_argument(ins, k - 1, end, me, into):
        return True
    after = _next(ins, end)
    if after is None or ins[after].opname != "STORE_FAST":
        return False
    local = ins[after].argval
    uses = [j for j, i in enumerate(ins) if j != after and ("FAST" in i.opname or "DEREF" in i.opname
                                                            or "CLOSURE" in i.opname)
            and (i.argval == local or (isinstance(i.argval, tuple) and local in i.argval))]
    return all(_harmless(ins, j, me, into) for j in uses)


def _harmless(ins: List[dis.Instruction], j: int, me: str, into: Collection[str]) -> bool:
    """``ins[j]`` stores or deletes the local, or loads it to test it against None, ask for its metadata, or
    hand it to ``into``; anything else (a closure's cell, a superinstruction of two locals) is not followed."""
    if ins[j].opname in ("STORE_FAST", "DELETE_FAST"):
        return True
    if ins[j].opname not in _LOCAL_LOADS:
        return False
    n = _next(ins, j)
    if n is not None and (ins[n].opname in _NONE_TESTS or (ins[n].opname in _LOADS and ins[n].argval in METADATA)):
        return True
    if n is not None and n + 1 < len(ins) and ins[n].opname == "LOAD_CONST" and ins[n].argval is None \
            and ins[n + 1].opname == "IS_OP":  # (``(input_ids is None) ^ (inputs_embeds is not None)``)
        return True
    return _sole_argument(ins, j, j, me, into)


def _sole_argument(ins: List[dis.Instruction], first: int, last: int, me: str, into: Collection[str]) -> bool:
    """The value ``ins[first..last]`` pushes is the one positional argument of a call of ``<me>.<n>``."""
    n = _next(ins, last)
    return _self_load(ins, first - 1, me, into) and n is not None and ins[n].opname == "CALL" and ins[n].arg == 1


def _next(ins: List[dis.Instruction], k: int) -> Optional[int]:
    """The index of the instruction after ``ins[k]``, past a PRECALL (3.11's half of a call)."""
    for j in range(k + 1, len(ins)):
        if ins[j].opname != "PRECALL":
            return j
    return None


def _call_end(ins: List[dis.Instruction], k: int) -> Optional[int]:
    """The index of the call that consumes the callable ``ins[k - 1: k + 1]`` loads; None where the arguments
    jump (a conditional expression), return, or the call is not a plain CALL."""
    depth = 0
    for j in range(k - 1, len(ins)):
        i = ins[j]
        if j > k and ("JUMP" in i.opname or i.opname.startswith(("RETURN", "RAISE", "YIELD"))):
            return None
        try:
            depth += dis.stack_effect(i.opcode, i.arg if i.opcode >= dis.HAVE_ARGUMENT else None, jump=False)
        except ValueError:
            return None
        if j > k and depth == 1:
            return j if i.opname == "CALL" else None
    return None


@functools.lru_cache(maxsize=1024)
def function_calls(cls: type) -> Tuple[Tuple[type, str], ...]:
    """``(Function, "file:line")`` of each custom ``torch.autograd.Function`` (defined outside torch and fxamp)
    whose ``apply`` the code ``cls``'s forward may run names by its global name (``STE.apply(x)``), there or in a
    module-level function that code calls; a branch may skip it (RWKV's CUDA kernel)."""
    module = sys.modules.get(cls.__module__)
    todo = [(code, vars(module) if module is not None else {}, 0) for code in codes_of(cls)]
    seen, out = set(), []
    while todo:
        code, names, depth = todo.pop()
        if code in seen:
            continue
        seen.add(code)
        ins = _instructions(code)
        for k, i in enumerate(ins):
            if i.opname != "LOAD_GLOBAL":
                continue
            value = names.get(i.argval)
            if (isinstance(value, type) and issubclass(value, torch.autograd.Function) and k + 1 < len(ins)
                    and ins[k + 1].opname in _LOADS and ins[k + 1].argval == "apply"
                    and not value.__module__.startswith(("torch.", "fxamp."))):
                line = i.positions.lineno if i.positions is not None else code.co_firstlineno
                out.append((value, f"{code.co_filename}:{line}"))
            elif isinstance(value, types.FunctionType) and depth < 2:
                todo.append((value.__code__, value.__globals__, depth + 1))
                todo += [(c, value.__globals__, depth + 1) for c in value.__code__.co_consts
                         if isinstance(c, types.CodeType)]
    return tuple(out)
