"""In-place conversion, block by block: :func:`convert_blocks` (``fxamp.convert_``).

The user's model object stays; only its repeated layers ("blocks") and a few leaf modules around
them ("glue") are replaced, each by a converted module of a subclass of its own class that holds
the same children, parameters, buffers, attributes and hooks::

    convert_blocks(model, policy, options, blocks)
      ├─ find_blocks: user globs ("model.layers.*"), else the repeated children of every nn.ModuleList
      │  and nn.Sequential (_repeated)
      ├─ glue: the leaf Linear/Embedding/convolution/norm modules outside blocks (module-level decisions)
      ├─ families: instances of one class with the same structure; plain attributes that differ between
      │  them (``layer_idx``) become graph inputs, so one capture serves every instance
      ├─ storage (O2/O3): storage.predict_storage over the whole model, re-bound once through the root
      │  (tied tensors stay tied), before any capture, so an optimizer can be built at once; a glue
      │  tensor that code around it reads directly (read_around) keeps float32
      ├─ each instance re-registered where the original was (same names: state_dict keys unchanged)
      └─ a root with ``save_pretrained`` and a ``config`` (a Hugging Face model) whose storage changed: its
         class becomes :func:`converted_root_class`'s subclass, which writes config.json's dtype right

    block(*args, **kwargs)      (the converted block's forward; hooks, checkpointing wrappers run as before)
      └─ its Family's run (``families.py``): a graph per call signature, captured at the first call,
         or the class's own forward where no front end can capture the call; a block whose submodules
         got or lost a hook since conversion first moves to the family of its hooked submodules

A block's graph reads its tensors through ``self`` (``self.mlp._modules['fc']._parameters['weight']``),
never through the capture's copy, so the graph of one instance runs any instance of its family.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import inspect
import itertools
import types
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.nn.utils.parametrize import ParametrizationList

from .bytecode import calls_outside_forward, codes_of, passes_on, reads_values
from .calls import SIMPLE
from .capture.common import compiled_module, scripted_paths
from .capture.hooks import submodule_hooks
from .capture.modes import MODE_FLAG
from ..errors import FxampError
from .families import FAMILY, HOOKS, LIFTED, Family, OriginalDtypes, hook_watch
from .graph import keep_loaded_float32, rebind
from ..info import (INFO_ATTR, ConversionInfo, conversion_info, hold_origins, origins_for_copy, remember_origin,
                    watch_for_masters)
from .storage import is_norm, predict_storage
from .options import ConvertOptions
from ..policy import Policy
from .runtime import WeightCastCache

__all__ = ["convert_blocks", "find_blocks", "glue_modules", "converted_modules", "BLOCKS_FRONTEND",
           "is_converted_block", "family_of", "Family", "converted_root_class"]

#: ConversionInfo.frontend of a model converted in place
BLOCKS_FRONTEND = "blocks"
#: leaf modules outside blocks that get module-level decisions (and the policy's outputs)
_GLUE: Tuple[type, ...] = (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd)


def find_blocks(model: nn.Module, patterns: Optional[Sequence[str]] = None) -> List[str]:
    """Module paths of the blocks: those matching ``patterns`` (globs such as ``"model.layers.*"``), else
    the layers of every ``nn.ModuleList`` and the repeated children of every ``nn.Sequential`` (:func:`_repeated`;
    outermost only)."""
    paths = [p for p, _ in model.named_modules() if p]
    # TorchScript modules (torch.jit.script/trace) are no blocks: nothing can capture them (the whole model's
    # torch.fx capture calls them whole), nor what they hold
    scripted = scripted_paths(model)
    script_help = (f"convert the eager modules before torch.jit.script, or convert the whole model with "
                   f"fxamp.convert(frontend='fx'), which calls TorchScript modules whole, in float32")
    if patterns is not None:
        if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
            raise TypeError(f"blocks= takes a list of module path globs such as ['model.layers.*'], not {patterns!r}")
        found: List[str] = []
        for pattern in patterns:
            hits = [p for p in paths if fnmatch.fnmatchcase(p, pattern)]
            if not hits:
                raise ValueError(f"blocks={list(patterns)!r}: {pattern!r} matches no module of "
                                 f"{type(model).__name__}; some paths it has: {', '.join(paths[:6])}")
            found += [p for p in hits if p not in found]
        named = [p for p in found if any(_inside(p, q) for q in scripted)]
        if named:
            listed = ", ".join(map(repr, named[:4]))
            raise ValueError(f"blocks={list(patterns)!r} names TorchScript modules ({listed}), which fxamp cannot "
                             f"capture: {script_help}")
    else:
        found = []
        for path, m in model.named_modules():
            if any(_inside(path, b) for b in found) or any(_inside(path, q) for q in scripted):
                continue
            found += [f"{path}.{name}" if path else name for name in _repeated(m)]
        if not found and scripted:
            raise ValueError(f"fxamp.convert_ found no blocks in {type(model).__name__} but TorchScript modules "
                             f"({', '.join(map(repr, scripted[:4]))}), which fxamp cannot capture: {script_help}")
        if not found:
            raise ValueError(f"fxamp.convert_ found no blocks in {type(model).__name__} (no nn.ModuleList or "
                             f"nn.Sequential holds its layers): name them, e.g. blocks=['encoder.layers.*']")
    return [p for p in found if not any(q != p and _inside(p, q) for q in found)]  # outermost only


def _repeated(m: nn.Module) -> List[str]:
    """Names of the children of ``m`` that are blocks: in an ``nn.ModuleList``, every one (but a list of lists,
    searched into); in an ``nn.Sequential``, those of a class it holds two or more of
    that have children and parameters of their own (residual blocks, a ViT's ``blocks``, a ResNet stage's
    blocks; not the Linear and activation layers of an MLP written as a Sequential, which are glue)."""
    if isinstance(m, ParametrizationList):  # a weight's parametrizations are not layers (weight_norm's list of one)
        return []
    if isinstance(m, nn.ModuleList):
        # every layer of the stack: one layer (a small config), a hybrid's layers of several classes (Jamba's
        # attention and Mamba layers, one of each in a small config); a list of lists (PoolFormer's stages of
        # layers) is no layer, it has no forward to convert: the search goes on into it
        layered = lambda child: not isinstance(child, (nn.ModuleList, nn.ModuleDict))  # noqa: E731
        any_count = True
    elif isinstance(m, nn.Sequential):
        layered, any_count = (lambda child: bool(child._modules) and any(True for _ in child.parameters())), False
    else:
        return []
    # every entry, the same module repeated included (``nn.ModuleList([block] * 4)``: one block's weights
    # shared across depth), which children() would list once
    children = [_compiled_module(name, child) for name, child in m._modules.items() if child is not None]
    counts: Dict[type, int] = {}
    for _, child in children:
        counts[type(child)] = counts.get(type(child), 0) + 1
    first = {id(child): name for name, child in reversed(children)}  # a shared module: converted once, as named first
    return [name for name, child in children if first[id(child)] == name and (any_count or counts[type(child)] > 1)
            and layered(child) and not isinstance(child, torch.jit.ScriptModule)]  # (TorchScript: see find_blocks)


def glue_modules(model: nn.Module, blocks: Sequence[str]) -> List[str]:
    """Leaf modules outside ``blocks`` that get module-level decisions: linear, embedding, convolution, norms."""
    return [p for p, m in model.named_modules() if p and not any(_inside(p, b) for b in blocks)
            and not list(m.children()) and (isinstance(m, _GLUE) or is_norm(m)) and list(m.parameters())]


def read_around(model: nn.Module, glue: Sequence[str]) -> List[str]:
    """Names of the glue modules' tensors that code around them reads directly, not by calling the module:
    ``nn.MultiheadAttention`` passes ``self.out_proj.weight`` to its kernel, a head may compute
    ``x @ self.wte.weight.T``.  That code runs as written, on the dtype it finds: such a tensor keeps its
    float32 storage (the glue module's own graph casts it where it runs low).  Found in the bytecode of the
    methods of every module around the glue module (``<its name>.<tensor name>`` read in a row), as are the glue
    modules that code hands on as objects (Perceiver's decoder gets its embeddings: ``bytecode.passes_on``)."""
    modules = dict(model.named_modules())
    codes: Dict[type, List[types.CodeType]] = {}
    out: List[str] = []
    for path in glue:
        names = [n for n, _ in itertools.chain(modules[path].named_parameters(recurse=False),
                                               modules[path].named_buffers(recurse=False))]
        parts = path.split(".")
        for i in range(len(parts)):
            around = type(modules[".".join(parts[:i])])
            if around not in codes:
                codes[around] = codes_of(around, unwrap=True)
            # (self.pool.out_proj.weight; ``self.dense.weight`` further up is that module's own ``dense``)
            owner = i == len(parts) - 1
            if any(reads_values(code, parts[-1], n, owner) for code in codes[around] for n in names) or any(
                    passes_on(code, parts[-1], owner) for code in codes[around]):
                out += [f"{path}.{n}" for n in names]
                break
    return out


def _called_outside(families: List[Tuple[Family, List[str]]], modules: Dict[str, nn.Module],
                    saved: Dict[str, torch.dtype]) -> Tuple[str, ...]:
    """Warned notes on each block class with a method outside forward that calls a child whose tensors conversion
    stored low (:func:`bytecode.calls_outside_forward`): that call runs the child as written, on those tensors."""
    out: List[str] = []
    for cls, path in dict((f.cls, members[0]) for f, members in families if not f.glue).items():
        low = [name for name in modules[path]._modules if any(n.startswith(f"{path}.{name}.") for n in saved)]
        for method, child in calls_outside_forward(cls, low)[:1]:
            out.append(f"{cls.__name__}.{method} calls self.{child}(...) outside forward (a reversible layer's "
                       f"backward pass, say): that call runs {child!r} as written, on the low-precision tensors "
                       f"this policy stored, and where its input is float32 torch fails in it ('... must have the "
                       f"same dtype'). Convert with O1 (float32 weights), or leave {cls.__name__} out of blocks=")
            warnings.warn(f"fxamp.convert_: {out[-1]}", RuntimeWarning, stacklevel=5)
    return tuple(out)


def _compiled_module(name: str, child: nn.Module) -> Tuple[str, nn.Module]:
    """A layer ``torch.compile`` wrapped: its module is the block (``_orig_mod``), which the wrapper's call then
    compiles converted; the wrapper's own forward is not the layer's."""
    inner = compiled_module(child)
    return (name, child) if inner is None else (f"{name}._orig_mod", inner)


def _rebind_compiled(wrapper: nn.Module, path: str) -> None:
    """Have a ``torch.compile`` wrapper call the converted layer it now holds: it bound the original's ``__call__``
    when it was made (``OptimizedModule._initialize``), which would run the original forward on converted weights."""
    initialize = getattr(wrapper, "_initialize", None)
    if not callable(initialize):  # (a torch whose wrapper binds otherwise: say so rather than run the original)
        raise FxampError(f"fxamp.convert_: {path.rsplit('.', 1)[0]!r} is a torch.compile wrapper this torch cannot "
                         f"rebind to the converted layer: convert the model first, then compile it")
    initialize()


def _inside(path: str, block: str) -> bool:
    return path == block or path.startswith(block + ".")


def is_converted_block(module: nn.Module) -> bool:
    """Whether ``module`` is a block (or glue module) that :func:`convert_blocks` converted."""
    return FAMILY in module.__dict__


def family_of(module: nn.Module) -> "Family":
    """The :class:`Family` a converted block or glue module belongs to (its captured graphs, its instances)."""
    return module.__dict__[FAMILY]


def converted_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(path, module)`` of every converted block and glue module of an in-place converted model."""
    return [(p, m) for p, m in model.named_modules() if is_converted_block(m)]


# -- the converted classes -------------------------------------------------------------------------

def _converted_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return self.__dict__[FAMILY].run(self, args, kwargs)


def _self(module: nn.Module) -> nn.Module:
    return module


def _converted_apply(self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], *args: Any, **kwargs: Any) -> Any:
    """``nn.Module._apply`` (what ``.to()``, ``.half()``, ``.cuda()`` call), refusing a change of the floating
    dtypes conversion chose: the graphs cast per op for those, so ``.half()`` would break them deep in
    torch. Tried on empty tensors of the dtypes the module holds, before any tensor changes."""
    for dtype in {t.dtype for t in itertools.chain(self.parameters(), self.buffers()) if t.is_floating_point()}:
        try:
            new = fn(torch.empty(0, dtype=dtype)).dtype
        except Exception:  # a function only for real tensors (to_empty, share_memory_): not a dtype change
            continue
        if new != dtype:
            family = self.__dict__[FAMILY]
            raise FxampError(
                f"fxamp.convert_: {family.paths[0]!r} ({family.cls.__name__}) holds {str(dtype)[6:]} tensors that "
                f"this call (.half(), .float(), .to(dtype)...) would turn {str(new)[6:]}; the converted graphs cast "
                f"per op for the dtypes conversion chose ({family.policy}). "
                f"Convert the float32 model with the dtype you want instead (fxamp.convert_(model, policy, "
                f"dtype=...)); .to(device) is fine")
    # (not type(self): fully_shard swaps in a subclass of it)
    return super(converted_class(self.__dict__[FAMILY].cls), self)._apply(fn, *args, **kwargs)


def _rebuild_block(cls: type, state: Dict[str, Any], originals: Sequence[Tuple[torch.Tensor, torch.Tensor]] = ()
                   ) -> nn.Module:
    """Unpickling (and deep copies): an instance of ``cls``'s converted class with ``state``, whose low-precision
    parameters hold the copied float32 values ``originals`` (``fxamp.info.hold_origins``)."""
    new = converted_class(cls).__new__(converted_class(cls))
    new.__dict__.update(state)
    hold_origins(originals)
    return new


def _reduce_ex(self: nn.Module, protocol: Any) -> Any:
    # the float32 values state_dict gives (originals, or an optimizer's masters, which a copy of the model does
    # not reach) go along, so a copy's state_dict gives them too, not the low-precision weights widened
    return _rebuild_block, (self.__dict__[FAMILY].cls, self.__dict__, origins_for_copy(self.parameters()))


def _converted_load(self: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    """``load_state_dict``: a float32 value loaded into a low-precision weight is kept for its master."""
    keep_loaded_float32(self, state_dict, prefix)
    # (the converted class by name, not type(self): FSDP2's fully_shard subclasses it again)
    super(converted_class(self.__dict__[FAMILY].cls), self)._load_from_state_dict(state_dict, prefix, *args)


#: each original class's converted subclass, made once: every instance (and every copy or unpickled one)
#: of a class gets the same subclass, so ``type(a) is type(b)`` holds between converted blocks
_CLASSES: Dict[type, type] = {}


def converted_class(cls: type) -> type:
    """The subclass of ``cls`` whose forward runs its family's graphs: same name, same methods otherwise
    (``isinstance`` checks, Hugging Face's ``GradientCheckpointingLayer.__call__``, class-name lists hold)."""
    made = _CLASSES.get(cls)
    if made is None:
        made = type(cls.__name__, (cls,), {"forward": _converted_forward, "__reduce_ex__": _reduce_ex,
                                           "_apply": _converted_apply, "_load_from_state_dict": _converted_load,
                                           "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                           "_fxamp_converted": True,
                                           MODE_FLAG: property(_self, doc="the root's train/eval flag in a graph")})
        made.forward.__doc__ = cls.forward.__doc__
        _CLASSES[cls] = made
    return made


# -- the root of a Hugging Face model: config.json says the dtype of the weights written --------------

#: the class attribute of a converted root class that names the class it derives from
_ROOT_OF = "_fxamp_root_of"


def _save_pretrained(self: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    """The class's own ``save_pretrained``, then ``config.json``'s ``dtype`` set to that of the weights it wrote.

    transformers writes ``model.dtype`` there, the dtype of the first floating parameter: the bfloat16 storage
    of an embedding under O2, while ``state_dict`` gives the float32 originals (the masters once trained),
    and ``from_pretrained``'s default ``dtype="auto"`` would load them rounded.  ``model.dtype`` itself stays
    (the model computes in it).  ``push_to_hub=True`` is refused: it uploads config.json before the fix."""
    save = super(converted_root_class(getattr(type(self), _ROOT_OF)), self).save_pretrained
    try:
        signature = inspect.signature(save)
        bound = signature.bind(save_directory, *args, **kwargs).arguments
    except (TypeError, ValueError):
        return save(save_directory, *args, **kwargs)  # its own error for a wrong call
    given: Dict[str, Any] = {}
    for name, value in bound.items():
        given.update(value if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD else {name: value})
    if given.get("push_to_hub"):
        raise ValueError(f"{type(self).__name__}.save_pretrained(push_to_hub=True) of a model fxamp.convert_ converted "
                         f"would upload config.json before its dtype is set to that of the weights written: save, "
                         f"then upload the folder (huggingface_hub.upload_folder)")
    result = save(save_directory, *args, **kwargs)
    state = given.get("state_dict")
    written = next((v.dtype for v in (self.state_dict() if state is None else state).values()
                    if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
    config = self.config
    name = str(written).removeprefix("torch.")
    if written is not None and str(getattr(config, "dtype", None)).removeprefix("torch.") != name:
        config.dtype = name  # (as transformers writes it)
        if given.get("is_main_process", True):
            config.save_pretrained(save_directory)
    return result


def _rebuild_root(cls: type, state: Dict[str, Any]) -> nn.Module:
    """Unpickling (and deep copies) of a converted root: an instance of ``cls``'s converted root class."""
    new = converted_root_class(cls).__new__(converted_root_class(cls))
    new.__dict__.update(state)
    return new


def _reduce_root(self: nn.Module, protocol: Any) -> Any:
    return _rebuild_root, (getattr(type(self), _ROOT_OF), self.__dict__)


#: each root class's converted subclass, made once (as ``_CLASSES``): copies and unpickled models share it
_ROOT_CLASSES: Dict[type, type] = {}


def converted_root_class(cls: type) -> type:
    """The subclass of a Hugging Face model class (duck-typed: ``save_pretrained`` and a ``config``) whose
    ``save_pretrained`` writes the dtype of the weights it wrote into config.json: same name, module and
    methods otherwise, so ``isinstance``, ``config.architectures`` and ``from_pretrained`` of the folder hold."""
    made = _ROOT_CLASSES.get(cls)
    if made is None:
        made = type(cls.__name__, (cls,), {"save_pretrained": _save_pretrained, "__reduce_ex__": _reduce_root,
                                           "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                           _ROOT_OF: cls})
        _ROOT_CLASSES[cls] = made
    return made


def _saves_pretrained(model: nn.Module) -> bool:
    """Whether ``model`` saves like a Hugging Face model: ``save_pretrained``, and a ``config`` that saves too."""
    return callable(getattr(model, "save_pretrained", None)) and \
        callable(getattr(getattr(model, "config", None), "save_pretrained", None))


# -- the entry point -------------------------------------------------------------------------------

def _structure(m: nn.Module) -> Any:
    # which submodules have hooks of their own too: a capture keeps a hooked module as a call and may inline an
    # unhooked Linear, so an instance whose module has a hook cannot run a graph captured from one whose has none
    return (type(m), tuple((p, type(s)) for p, s in m.named_modules()),
            tuple((n, tuple(t.shape), t.dtype, isinstance(t, nn.Parameter))
                  for n, t in itertools.chain(m.named_parameters(), m.named_buffers())),
            tuple(path for path, _ in submodule_hooks(m)))


#: nn.Module's own attributes (its tables, hooks and flag): no instance's values to compare
_MODULE_OWN = frozenset(vars(nn.Module()))


def _attrs(m: nn.Module) -> Dict[Tuple[str, str], Any]:
    """The attributes of ``m``'s modules that instances of a family may differ in: a private one only when a plain
    value (``self._scale``: forward may read it; a private object is no value a graph holds)."""
    out = {}
    for path, sub in m.named_modules():
        for name, value in sub.__dict__.items():
            if name in _MODULE_OWN or name.startswith("_fxamp") or (name.startswith("_") and
                                                                     not isinstance(value, SIMPLE)):
                continue
            out[(path, name)] = value
    return out


def _families(model: nn.Module, paths: List[str], policy: Policy, options: ConvertOptions, glue: bool
              ) -> List[Tuple[Family, List[str]]]:
    """Group instances by class and structure; plain attributes that differ are lifted; other differing
    attributes (objects) split the group."""
    modules = dict(model.named_modules())
    groups: Dict[Any, List[str]] = {}
    rules = {p: _overrides_inside(p, options.module_overrides or {}) for p in paths}
    for p in paths:  # instances with other module_overrides inside them cannot share a graph
        groups.setdefault((_structure(modules[p]), tuple(sorted(rules[p].items(), key=str))), []).append(p)
    out = []
    for members in groups.values():
        own = dataclasses.replace(options, module_overrides=rules[members[0]] or None)
        attrs = [_attrs(modules[p]) for p in members]
        keys = set().union(*attrs)
        lifted, split = [], []
        for k in sorted(keys):
            values = [a.get(k, _MISSING) for a in attrs]
            if all(v is values[0] for v in values) or all(_same(v, values[0]) for v in values):
                continue
            if all(isinstance(v, (bool, int, float, str)) and type(v) is type(values[0]) for v in values):
                lifted.append(k)
            else:
                split.append(k)
        subgroups: Dict[Tuple[int, ...], List[str]] = {}
        for p, a in zip(members, attrs):
            subgroups.setdefault(tuple(id(a.get(k)) for k in split), []).append(p)
        for sub in subgroups.values():
            hooked = tuple(path for path, _ in submodule_hooks(modules[sub[0]]))  # (the same in each: _structure)
            out.append((Family(type(modules[sub[0]]), sub, policy, own, tuple(lifted), glue, hooked), sub))
    return out


_MISSING = object()


def _overrides_inside(path: str, overrides: Dict[str, Any]) -> Dict[str, Any]:
    """The user's ``module_overrides`` as the capture of the module at ``path`` names them: paths below it
    relative to it, and the closest override of it or of a module around it as ``""`` (its whole graph)."""
    out: Dict[str, Any] = {}
    around = [p for p in overrides if _inside(path, p) or p == ""]
    if around:
        out[""] = overrides[max(around, key=len)]
    for p, value in overrides.items():
        if p.startswith(path + "."):
            out[p[len(path) + 1:]] = value
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal plain values (tuples of them too: a norm's ``normalized_shape``)."""
    if type(a) is not type(b):
        return False
    if type(a) in (tuple, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return isinstance(a, SIMPLE) and bool(a == b)
    except Exception:  # pragma: no cover - an __eq__ that does not return a bool
        return False


def convert_blocks(model: nn.Module, policy: Policy, options: ConvertOptions,
                   blocks: Optional[Sequence[str]] = None, notes: Sequence[str] = (), *,
                   keep_originals: bool = True) -> nn.Module:
    """Convert ``model`` in place (see the module docstring); returns ``model``.

    keep_originals: O2/O3 hold the float32 tensors the low-precision parameters replace, until a
    ``MixedPrecisionOptimizer`` takes them as its masters (exact, no copy: ``fxamp.info.take_origin``).
    """
    if conversion_info(model) is not None or converted_modules(model):
        raise ValueError(f"fxamp.convert_: this {type(model).__name__} was already converted by fxamp; convert "
                         f"the original model once")
    names = {p for p, _ in model.named_modules()}
    for path in options.module_overrides or {}:
        if path not in names:
            raise ValueError(f"module_overrides: {path!r} is not a submodule of {type(model).__name__}; some "
                             f"paths it has: {', '.join(sorted(names - {''})[:6])}")
    block_paths = find_blocks(model, blocks)
    glue_paths = glue_modules(model, block_paths)
    families = _families(model, block_paths, policy, options, glue=False) + \
        _families(model, glue_paths, policy, options, glue=True)
    saved: Dict[str, torch.dtype] = {}  # name -> the dtype state_dict gives back (the original's)
    if policy.enabled:
        storage = predict_storage(model, policy, options.module_overrides)
        converted = block_paths + glue_paths
        tensors = dict(itertools.chain(model.named_parameters(remove_duplicate=False),
                                       model.named_buffers(remove_duplicate=False)))
        read = read_around(model, glue_paths)
        kept = {id(tensors[n]) for n in read}  # read as written: float32 stays
        low = {n: d for n, d in storage.items() if any(_inside(n.rpartition(".")[0], c) for c in converted)}
        storage = {n: d for n, d in low.items() if id(tensors[n]) not in kept}
        if any(d != torch.float32 for n, d in low.items() if n not in storage):
            notes = tuple(notes) + (f"kept float32 (code outside the converted modules reads them directly): "
                                    f"{', '.join(read)}",)
        changed = rebind(model, storage)
        if keep_originals:  # the float32 originals are the masters to be: held until an optimizer takes them
            for old, new in changed.values():
                remember_origin(new, old, hold=True)
        saved = {name: old.dtype for name, (old, _) in changed.items()}
        watch_for_masters(new for _, new in changed.values())
    modules = dict(model.named_modules())
    notes = tuple(notes) + _called_outside(families, modules, saved)
    parents = [(m, name, child) for _, m in model.named_modules(remove_duplicate=False)
               for name, child in m._modules.items()]
    for family, members in families:
        cls = converted_class(family.cls)
        for path in members:
            old = modules[path]
            new = cls.__new__(cls)
            new.__dict__ = dict(old.__dict__)
            for table in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
                new.__dict__[table] = type(old.__dict__[table])(old.__dict__[table])
            new.__dict__[FAMILY] = family
            new.__dict__[LIFTED] = tuple(getattr(old.get_submodule(p) if p else old, a) for p, a in family.lifted)
            new.__dict__["_fxamp_weight_cache"] = WeightCastCache()
            new.__dict__[HOOKS] = hook_watch(new, path)  # a hook its submodules get from now on: Family.run sees it
            own = {n[len(path) + 1:]: d for n, d in saved.items() if n.startswith(path + ".")}
            if own:  # state_dict (save_pretrained, torch.save of it) gives the original dtypes back
                new._register_state_dict_hook(OriginalDtypes(own))
            for parent, name, child in parents:
                if child is old:
                    parent._modules[name] = new
    for path in block_paths:
        if path.endswith("._orig_mod"):  # torch.compile's wrapper bound the layer it held when it was made
            _rebind_compiled(model.get_submodule(path[:-len("._orig_mod")]), path)
    if saved and _saves_pretrained(model) and not hasattr(type(model), _ROOT_OF):
        # low storage: transformers would write its dtype, not the saved weights', into config.json (torch's
        # fully_shard and parametrize swap in a subclass the same way)
        model.__class__ = converted_root_class(type(model))
    info = ConversionInfo(policy, BLOCKS_FRONTEND, tuple(notes) + (
        f"converted in place: {len(block_paths)} blocks in {sum(not f.glue for f, _ in families)} families, "
        f"{len(glue_paths)} glue modules; each family captures at its first call per call signature",))
    model.__dict__[INFO_ATTR] = info
    return model
